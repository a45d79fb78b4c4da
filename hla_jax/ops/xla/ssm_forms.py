"""The recurrent and scan forms of the first-order state-space core (docs/math.md#loglinear):
Mamba-2, Gated DeltaNet and their log-linear versions.

A token's transition is ``A_t = a_t`` (Mamba-2, stored as ``[..., 1, 1]``) or
``A_t = a_t (I − β_t k_t k_tᵀ)`` (Gated DeltaNet, ``[..., d, d]``), and it writes
``X_t = k_t β_t v_tᵀ`` (β = 1 for Mamba-2).  Then

    plain:      o_t = q_tᵀ Σ_{s≤t} (A_t ⋯ A_{s+1}) X_s
    log-linear: o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) X_s,  ℓ(t,s) = bit_length(t XOR s)

The serial recurrence and the token-level scan share one algebra (``xla.ssm``), the level split
switched off with ``lam=None``; the chunked forms are separate (``xla.la_chunked``,
``xla.gdn_chunked``, ``xla.loglinear_blocks``, ``xla.loglinear_gdn_blocks``,
``xla.loglinear_chunked``).

Packed documents (docs/math.md#packed-documents, ``segment_ids: [B,T]`` int): the transition of
a document's first token is zero (``g = -inf``, so no state crosses a start) and the log-linear
levels count from it, ``ℓ(t,s) = bit_length((t−t0) XOR (s−t0))``.  States: plain
``[B,H,d,dv]``; log-linear ``LevelState(H: [L,B,H,d,dv], t: [B])``, the level states and each
row's position.

Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``, ``lam: [B,T,H,L]`` with
``L ≥ fenwick.num_levels(T)``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.core import fenwick
from hla_jax.core.documents import doc_positions, doc_starts
from hla_jax.core.state import state_dtype
from hla_jax.ops import common
from hla_jax.ops.spec import gate
from hla_jax.ops.xla.ssm import cast, cast_state, combine, init_state, readout, reset, step, token_summaries

__all__ = ["recurrent", "recurrent_form", "scan", "scan_form"]


# --------------------------------------------------------------------------- forms


def recurrent(q, k, v, g, beta=None, lam=None, initial_state=None, segment_ids=None):
    """Serial recurrence: ``lax.scan`` of ``step`` over time (the decode path), from
    ``initial_state`` (``init_state``'s layout; None: zeros).  ``segment_ids [B,T]``: the state
    is reset at each document start (``g = -inf``, and the level position restarts at 0).
    Returns ``(outputs, final state)``."""
    dt = state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = cast(dt, q, k, v, g, beta, lam)
    B, _, H, d = q.shape
    g = reset(g, segment_ids)
    levels = None if lam is None else lam.shape[-1]
    starts = None if lam is None or segment_ids is None else doc_starts(segment_ids)

    def body(state, start, *x):
        if start is not None:
            state = state._replace(t=jnp.where(start, 0, state.t))
        return step(state, *x)

    state0 = (init_state(B, H, d, v.shape[-1], levels, dt) if initial_state is None
              else cast_state(initial_state, dt))
    return common.scan_time(body, state0, starts, q, k, v, g, beta, lam)


def _segmented_states(A, X, reset, axis=1):
    """Inclusive prefix states ``H_t = A_t H_{t−1} + X_t`` along the time ``axis``, restarted
    where ``reset`` (shaped like the axes up to time, broadcasting) is True."""
    reset = jnp.asarray(reset)
    A = jnp.where(reset.reshape(reset.shape + (1,) * (A.ndim - axis - 1)), 0, A)
    return jax.lax.associative_scan(combine, (A, X), axis=axis)[1]


def scan(q, k, v, g, beta=None, lam=None, segment_ids=None):
    """Token-level associative scan with ``combine`` (docs/math.md#loglinear-scan).

    Plain: one scan, ``o_t = q_tᵀ H_t``.  Log-linear: level 0 is the token itself; for level
    ℓ ≥ 1 the bucket of query t (present when bit ℓ−1 of its position p is 1) is the aligned
    block ``[b, b + 2^{ℓ−1})``, ``b = (p >> ℓ) << ℓ``: a segmented scan per level, restarted
    at positions that are multiples of ``2^ℓ`` and fed only by the left half of each ``2^ℓ``
    block, carries the block's state through ``A_{e+1} … A_t`` to its readers in the right half
    (the levels stacked on a leading axis: one scan for all of them).  Positions count from the
    row's start, or with ``segment_ids [B,T]`` from each document's (a start restarts every
    level; ``g = -inf`` there cuts the earlier documents off).
    Memory O(T·d·dv) per level, plus O(T·d²) per level for Gated DeltaNet's transitions: use
    the chunked form for long sequences.
    """
    dt = state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = cast(dt, q, k, v, g, beta, lam)
    T = q.shape[1]
    A, X = token_summaries(k, v, reset(g, segment_ids), beta)
    if lam is None:
        return readout(_segmented_states(A, X, np.zeros(T, bool)), q)
    pos = (jnp.broadcast_to(jnp.arange(T), q.shape[:2]) if segment_ids is None
           else doc_positions(segment_ids))
    levels = fenwick.num_levels(T)
    lev = jnp.arange(1, levels)[:, None, None]
    left = (((pos >> (lev - 1)) & 1) == 0)[..., None, None]     # [ℓ, B, T, 1, 1]
    blocks = _segmented_states(A[None], jnp.where(left[..., None], X[None], 0),
                               (pos & ((1 << lev) - 1)) == 0, axis=2)
    lam_l = jnp.moveaxis(lam[..., 1:levels], -1, 0)[..., None]    # [ℓ, B, T, H, 1]
    return lam[..., 0:1] * readout(X, q) + jnp.sum(
        jnp.where(left, 0, lam_l) * readout(blocks, q[None]), axis=0)


def recurrent_form(c):
    """``recurrent`` as a form of any operator of the core (``ops.spec``: a ``Call`` in,
    ``(o, final_state)`` out)."""
    return recurrent(c.q, c.k, c.v, gate(c, False), c.beta, c.lam, c.initial_state, c.segment_ids)


def scan_form(c):
    """``scan`` as a form of any operator of the core; ``(o, None)``."""
    return scan(c.q, c.k, c.v, gate(c, False), c.beta, c.lam, c.segment_ids), None
