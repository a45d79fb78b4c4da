"""``loglinear_mamba2_pallas``: log-linear Mamba-2 (docs/math.md#loglinear) through Pallas kernels,
differentiable.

Same semantics as ``ops.loglinear_mamba2``: ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s`` with
``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay ``[B,T,H]`` (or ``[H]``),
``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``; returns ``[B,T,H,dv]`` float32.

Design: the block form of ``ops.loglinear_blocks``, with no walk over chunks at all.  Chunk level
``j`` is "the left half of each aligned block of ``2^(j+1)`` chunks writes a state ``H_j``, the
right half reads it", with per-token weights ``lw`` (``token_weights``: decays and λ, plain JAX,
exact, its autodiff carries ``dlw`` into ``dg`` and ``dλ``).  Kernels (``loglinear_triton.py``,
``loglinear_tpu.py``; the chunk math in ``loglinear_chunk.py``), all parallel over chunks:

- forward: ``half_states`` per level (``H_j``, left halves), then one program per chunk reads
  its intra-chunk levels (``(QKᵀ ∘ Γ ∘ Λ) V``) and the states of the levels whose right half
  holds it;
- backward (``jax.custom_vjp``, residuals: the inputs and ``H_j``): ``half_states`` of ``q, dO``
  on the right halves gives ``dH_j``, then one program per chunk computes its ``dq, dk, dv``,
  ``db`` (the chunk-local log-decay, whose autodiff gives the rest of ``dg``), the intra ``dλ``
  and ``dlw``, reading ``H_j`` where the chunk reads and ``dH_j`` where it writes.

O(T·c·d + T·d·dv·log(T/c)) work, every state in HBM once per level (``N`` states of ``d×dv`` in
all, in the input dtype).  Packed documents (``segment_ids``) run on a buffer of ``2T`` tokens in
which each document starts on an aligned block of its own (``packed``); a row that continues a
``LevelState`` runs at its offset on a buffer of up to ``3T`` tokens, and one first-order pass
reads the state and forms the final state (``from_state``, for both log-linear operators:
``ops.<op>(impl="pallas", initial_state=…)``).
Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (Triton lowering) takes bf16 and float32 (``experiments/kernels/check_kernels_gpu.py``
checks both; float32 at ``d >= 128`` with tiles of 32, ``wrap.F32_GPU_TILE``); the TPU path
(Mosaic) passes the Mosaic lowering but has never run on TPU hardware: the tests run it in
interpret mode.  Inputs other than all-bf16 run in float32; ``d`` is
zero-padded to a power of two >= 16, ``dv`` to a multiple of the value tiles, ``T`` to a
multiple of ``chunk_size`` (a power of two >= 16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.block_levels import token_weights
from hla_jax.core.checks import check_gate, check_lam, check_qkv, check_segment_ids
from hla_jax.core.documents import doc_positions
from hla_jax.core.layout import aligned_layout, heads_first
from hla_jax.core.state import LevelState
from hla_jax.kernels.loglinear import loglinear_tpu, loglinear_triton
from hla_jax.kernels.wrap import backend_choice, chunk_gate, launch, pad, pow2_at_least

BACKENDS = {"triton": loglinear_triton, "tpu": loglinear_tpu}


class Config(NamedTuple):
    """Static kernel settings: chunk, value tile of the forward and of the backward, warps,
    interpret mode, backend ("triton" | "tpu")."""
    c: int
    bv: int
    bv_bwd: int
    num_warps: int = 8
    interpret: bool = False
    backend: str = "triton"


def levels_first(lam, Tp: int, Ln: int):
    """``lam [B,T,H,L] -> [B,H,Ln,Tp]`` float32: zero-padded (or cut) to ``Ln`` levels and ``Tp``
    tokens, one contiguous row per level."""
    lam = lam.astype(jnp.float32)[..., :Ln]
    lam = jnp.pad(lam, ((0, 0), (0, Tp - lam.shape[1]), (0, 0), (0, Ln - lam.shape[-1])))
    return jnp.transpose(lam, (0, 2, 3, 1))


def _states(x, y, lw, side: int, cfg: Config):
    """``half_states`` of every level: ``H_j`` (``x, y = k, v``, ``side=0``) or ``dH_j``
    (``q, dO``, ``side=1``)."""
    mod = BACKENDS[cfg.backend]
    return [mod.half_states(x, y, lw, j=j, side=side, c=cfg.c, bv=cfg.bv, num_warps=cfg.num_warps,
                            interpret=cfg.interpret) for j in range(lw.shape[2])]


def _forward(q, k, v, b, lam, lw, cfg):
    Hs = _states(k, v, lw, 0, cfg)
    o = BACKENDS[cfg.backend].forward(
        q, k, v, b, lam, lw, Hs, c=cfg.c, bv=cfg.bv, num_warps=cfg.num_warps,
        interpret=cfg.interpret)
    return o, Hs


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def loglinear_core(q, k, v, b, lam, lw, cfg: Config):
    """Log-linear Mamba-2 on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``
    (per-chunk cumulative log-decay), ``lam [B,H,lc+1,Tp]`` (the intra-chunk levels),
    ``lw [B,H,P,Tp]`` (``token_weights``) -> ``[B,Tp,H,dv]`` float32."""
    return _forward(q, k, v, b, lam, lw, cfg)[0]


def _core_fwd(q, k, v, b, lam, lw, cfg):
    o, Hs = _forward(q, k, v, b, lam, lw, cfg)
    return o, (q, k, v, b, lam, lw, Hs)


def _core_bwd(cfg, res, do):
    q, k, v, b, lam, lw, Hs = res
    do = do.astype(q.dtype)
    dHs = _states(q, do, lw, 1, cfg)
    dq, dk, dv, db, dlam, dlw = BACKENDS[cfg.backend].backward(
        q, k, v, b, lam, lw, Hs, dHs, do, c=cfg.c, bv=cfg.bv_bwd, num_warps=cfg.num_warps,
        interpret=cfg.interpret)
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype),
            db.sum(0), dlam.sum(0), dlw.sum(0))


loglinear_core.defvjp(_core_fwd, _core_bwd)


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


def loglinear_mamba2_pallas(q, k, v, g, lam, *, segment_ids=None, chunk_size=64, interpret=None,
                            block_v=128, block_v_bwd=128, num_warps=4, backend=None):
    """Log-linear Mamba-2 via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``segment_ids [B,T]`` int: packed documents (docs/math.md#packed-documents), each computed as if
    alone: the row
    is laid out in a buffer of ``2T`` tokens where each document starts on its own aligned
    block (``core.layout.aligned_layout``), so the kernels do up to twice the work.
    ``block_v`` / ``block_v_bwd`` (the value tiles of the forward and backward kernels, powers
    of two >= 16, at most ``dv`` rounded up to a power of two) and ``num_warps`` (Triton) tune
    the kernels; ``backend``: "triton" | "tpu" | None (the default device's: "tpu" on a TPU, else
    "triton").
    """
    name = "loglinear_mamba2_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=True)
    lam = check_lam(lam, B, T, H, name=name)
    segment_ids = check_segment_ids(segment_ids, B, T, name=name)
    return loglinear_mamba2_kernel(q, k, v, g, lam, segment_ids=segment_ids,
                                   chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                                   block_v_bwd=block_v_bwd, num_warps=num_warps, backend=backend)


def loglinear_mamba2_kernel(q, k, v, g, lam, *, segment_ids=None, chunk_size=64, interpret=None,
                            block_v=128, block_v_bwd=128, num_warps=4, backend=None):
    """``loglinear_mamba2_pallas`` on inputs it has checked (``g`` and per-token inputs
    ``[B,T,H]``): the ops' entry, which checks them itself."""
    name = "loglinear_mamba2_pallas"
    B, T, H, d = q.shape
    dv = v.shape[-1]
    backend = backend_choice(name, backend, tuple(BACKENDS), "triton")
    if segment_ids is not None:
        return packed(loglinear_mamba2_kernel, q, k, v, jnp.broadcast_to(g, (B, T, H)), (), lam,
                      segment_ids, chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                      block_v_bwd=block_v_bwd, num_warps=num_warps, backend=backend)
    c, Tp, dp, dt, interpret, backend, block_v, block_v_bwd = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        backend=backend, block_v_bwd=block_v_bwd)
    bv, bvb = (min(x, pow2_at_least(max(dv, 16))) for x in (block_v, block_v_bwd))
    dvp = -(-dv // max(bv, bvb)) * max(bv, bvb)
    lc, N = fenwick.chunk_log2(c), Tp // c
    lw = token_weights(heads_first(g, Tp, jnp.float32), heads_first(lam, Tp, jnp.float32), lc, N)
    if N == 1:  # no chunk level: one level of zero weights keeps every kernel input non-empty
        lw = jnp.zeros((B, H, 1, Tp), jnp.float32)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    o = loglinear_core(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c),
                       levels_first(lam, Tp, lc + 1), lw, Config(c, bv, bvb, num_warps, interpret,
                                                                 backend))
    return o[:, :T, :, :dv]
