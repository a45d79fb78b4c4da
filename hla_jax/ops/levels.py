"""The log-linear operators composed from their whole-row kernels, as ``chains`` composes the HLA
operators from the LA kernel: packed documents (``packed``) and a row that continues a
``LevelState`` (``from_state``).  XLA passes around a kernel ``entry(q, k, v, g, *extras, lam,
**kw)`` that computes whole rows with positions from 0 (``kernels.loglinear_mamba2_kernel``,
``kernels.loglinear_gated_deltanet_kernel``); ``extras`` are per-token ``[B,T,H]`` inputs (Gated
DeltaNet's ``beta``).

Levels (docs/math.md#loglinear): ``ℓ(t,s) = bit_length(t XOR s)`` on the positions the kernel
sees, so each composition places the row's tokens in a buffer where those are the true
positions (or corrects the one level where they are not).
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]``, ``lam: [B,T,H,L]``,
``segment_ids: [B,T]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.documents import doc_positions
from hla_jax.core.layout import aligned_layout
from hla_jax.core.state import LevelState


def packed(entry, q, k, v, g, extras, lam, segment_ids, **kw):
    """Packed documents through a log-linear kernel ``entry(q, k, v, g, *extras, lam, **kw)`` on
    ``aligned_layout``'s buffer: every document starts at a multiple of its length rounded up to
    a power of two (so the grid's levels are its own) behind a reset (``g = -inf``, which also
    clears every level state), the rest of the buffer is zeros; the outputs are gathered back.
    ``extras``: per-token ``[B,T,H]`` inputs (Gated DeltaNet's ``beta``)."""
    dest, Tb = aligned_layout(segment_ids)
    g = jnp.where(doc_positions(segment_ids)[..., None] == 0, -jnp.inf, g)
    L = fenwick.num_levels(Tb)
    lam = jnp.pad(lam, ((0, 0),) * 3 + ((0, max(0, L - lam.shape[-1])),))
    return on_buffer(entry, (q, k, v, g, *extras, lam), dest, Tb, **kw)


def on_buffer(entry, xs, dest, Tb: int, **kw):
    """``entry(*xs', **kw)`` with each ``[B,T,…]`` input placed at ``dest [B,T]`` in a buffer of
    ``Tb`` zeros (no key, an identity transition), its output gathered back to ``[B,T,…]``."""
    def spread(x):
        return jax.vmap(lambda d, x: jnp.zeros((Tb,) + x.shape[1:], x.dtype).at[d].set(x))(dest, x)

    o = entry(*(spread(x) for x in xs), **kw)
    return jnp.take_along_axis(o, dest[:, :, None, None], axis=1)


def from_state(entry, first_order, q, k, v, g, extras, lam, state, **kw):
    """A log-linear operator continuing ``state = LevelState(H0 [L,B,H,d,dv], t0 [B])``: returns
    ``(o [B,T,H,dv] float32, the LevelState after the row)``; token ``i`` is at ``P_i = t0 + i``.

    ``entry(q, k, v, g, *extras, lam, **kw)`` computes whole rows with positions from 0 (a
    log-linear kernel), ``first_order(q, k, v, g, *extras, initial_state, return_final_state=True)``
    the operator without levels (``ops.mamba2``, ``ops.gated_deltanet``); ``extras``: per-token
    ``[B,T,H]`` inputs (Gated DeltaNet's β).  ``o`` is the row's own pairs (``_row_pairs``) plus
    the state's keys: ``carry(H0, t0)`` holds them at levels ℓ of ``t0``, so at
    ``max(ℓ, bit_length(P_i XOR t0))`` of ``P_i`` (``fenwick.levels_at``).  One ``first_order``
    pass over the row, its values ``[0 | v by level]`` (``2L·dv`` columns) from the state
    ``[carry(H0) | 0]``, gives both what the state's levels read (``q_iᵀ A_i⋯A_0 H[ℓ]``, the
    outputs of the first ``L·dv`` columns, then weighted by λ) and the final state: those
    levels carried through the row and collapsed to the levels of ``e = P_{T−1}``, plus the
    row's keys at theirs, ``bit_length(e XOR P_i)``.  Requires ``t0 + T ≤ 2^(L−1)``, as the
    counter does.  ``state=None``: zeros at position 0 (``entry`` on the row itself)."""
    B, T, H, d = q.shape
    dv, L = v.shape[-1], lam.shape[-1]
    g = jnp.broadcast_to(g, (B, T, H)).astype(jnp.float32)
    if state is None:
        t0, Hc = jnp.zeros((B,), jnp.int32), None
        o = entry(q, k, v, g, *extras, lam, **kw)
    else:
        t0 = jnp.asarray(state.t, jnp.int32)
        Hc = fenwick.carry(jnp.asarray(state.H, jnp.float32), t0)
        o = _row_pairs(entry, q, k, v, g, extras, lam, t0, **kw)
    pos = t0[:, None] + jnp.arange(T, dtype=jnp.int32)
    e = pos[:, -1]
    by_level = fenwick.level(e[:, None], pos)[:, :, None, None, None] == jnp.arange(L)[:, None]
    values = jnp.where(by_level, v[:, :, :, None, :], 0).reshape(B, T, H, L * dv)
    start = jnp.zeros((B, H, d, L * dv), jnp.float32)
    if Hc is not None:
        values = jnp.concatenate([jnp.zeros_like(values), values], -1)
        start = jnp.concatenate([jnp.moveaxis(Hc, 0, 3).reshape(B, H, d, L * dv), start], -1)
    reads, end = first_order(q, k, values.astype(v.dtype), g, *extras, initial_state=start,
                             return_final_state=True)
    end = jnp.moveaxis(end.reshape(B, H, d, -1, dv), 3, 0)          # [L or 2L, B,H,d,dv]
    H_T = end[-L:]
    if Hc is not None:
        lev = jnp.broadcast_to(fenwick.levels_at(L, pos, t0[:, None])[:, :, None, :], (B, T, H, L))
        w = jnp.take_along_axis(lam.astype(jnp.float32), lev, axis=-1)
        o = o + jnp.einsum("bthl,bthlv->bthv", w,
                           reads[..., :L * dv].astype(jnp.float32).reshape(B, T, H, L, dv))
        H_T = H_T + fenwick.collapse(end[:L], fenwick.bit_length(e ^ t0))
    return o, LevelState(H_T, t0 + T)


def _row_pairs(entry, q, k, v, g, extras, lam, t0, **kw):
    """The row's own pairs at levels ``bit_length(P_i XOR P_j)``: ``entry`` on a buffer where
    token ``i`` sits at ``p + i``, ``p = t0 mod 2^K``, ``2^K ≥ T`` (zeros elsewhere: no key, an
    identity transition).  The buffer's levels are the true ones except for the pairs across
    ``2^K``, whose true level is ``K + bit_length(A XOR (A+1))``, ``A = t0 >> K``, not
    ``K + 1``; no other pair is at ``K + 1``, so the tokens past ``2^K`` take λ of the true
    level there."""
    B, T, H, _ = q.shape
    K = int(fenwick.bit_length(T - 1))
    half, L = 1 << K, lam.shape[-1]
    dest = (t0 & (half - 1))[:, None] + jnp.arange(T, dtype=jnp.int32)
    across = K + fenwick.bit_length((t0 >> K) ^ ((t0 >> K) + 1))
    lam_b = jnp.pad(lam, ((0, 0),) * 3 + ((0, max(0, K + 2 - L)),))
    true = jnp.take_along_axis(lam_b, jnp.broadcast_to(
        jnp.minimum(across, L - 1)[:, None, None, None], (B, T, H, 1)), axis=-1)[..., 0]
    lam_b = lam_b.at[..., K + 1].set(jnp.where((dest >= half)[..., None], true, lam_b[..., K + 1]))
    return on_buffer(entry, (q, k, v, g, *extras, lam_b), dest, half + T - 1, **kw)
