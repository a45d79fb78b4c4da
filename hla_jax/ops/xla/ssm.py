"""The state-space algebra of the first-order SSM core (``ops.families.loglinear``): a token's transition
``A_t`` (``a_t`` for Mamba-2, ``a_t (I − β_t k_t k_tᵀ)`` for Gated DeltaNet) and write
``X_t = k_t β_t v_tᵀ``, their associative ``combine``, the readout, and the decode state and step
(plain ``[B,H,d,dv]``; log-linear ``core.state.LevelState``), shared by the recurrent, scan and chunked
forms (``loglinear.py``, ``loglinear_chunked.py``).
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.documents import reset_gate
from hla_jax.core.state import LevelState
from hla_jax.ops import common


def mul(A, X, mm=common.mm):
    """``A X`` for a transition ``A``: ``[..., 1, 1]`` (scalar decay) or ``[..., d, d]`` (by
    ``mm``)."""
    if A.shape[-1] == 1:
        return A * X
    return mm(A, X)


def token_summaries(k, v, g, beta=None):
    """Per-token SSM pair ``(A_t, X_t)``, ``X_t = k_t β_t v_tᵀ: [..., d, dv]``.

    ``A_t = a_t`` as ``[..., 1, 1]`` (``beta=None``) or ``a_t (I − β_t k_t k_tᵀ): [..., d, d]``.
    ``k: [..., d]``, ``v: [..., dv]``, ``g, beta: [...]``.
    """
    a = jnp.exp(g)[..., None, None]
    if beta is None:
        return a, k[..., :, None] * v[..., None, :]
    kb = beta[..., None] * k
    eye = jnp.eye(k.shape[-1], dtype=k.dtype)
    return a * (eye - kb[..., :, None] * k[..., None, :]), kb[..., :, None] * v[..., None, :]


def combine(a, b, mm=common.mm):
    """SSM pair, ``a`` before ``b``: ``(A_a, H_a) ⊕ (A_b, H_b) = (A_b A_a, A_b H_a + H_b)``."""
    (A_a, H_a), (A_b, H_b) = a, b
    return mul(A_b, A_a, mm), mul(A_b, H_a, mm) + H_b


def readout(H, q, lam=None):
    """``o = qᵀ H`` (``H: [..., d, dv]``) or ``Σ_ℓ λ^ℓ qᵀ H[ℓ]`` (``H: [L, ..., d, dv]``,
    ``lam: [..., L]``)."""
    if lam is None:
        return common.ein("...d,...dv->...v", q, H)
    return common.ein("...l,...d,l...dv->...v", lam, q, H)


def init_state(B, H, d, dv, levels=None, dtype=jnp.float32):
    """Zero state: ``[B,H,d,dv]`` (plain) or ``LevelState(H=[levels,B,H,d,dv], t=[B])`` at
    position 0."""
    if levels is None:
        return jnp.zeros((B, H, d, dv), dtype)
    return LevelState(jnp.zeros((levels, B, H, d, dv), dtype), jnp.zeros((B,), jnp.int32))


def step(state, q, k, v, g, beta=None, lam=None):
    """One token; returns ``(o_t, new_state)``.

    ``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g, beta: [B,H]``, ``lam: [B,H,L]`` (None: plain).
    Log-linear (docs/math.md#loglinear), at each row's position ``t = state.t``: carry the binary counter,
    ``H[ℓ] ← A_t H[ℓ]`` for every ℓ, ``H[0] = k_t β_t v_tᵀ``, ``o_t = Σ_ℓ λ_t^ℓ H[ℓ]ᵀ q_t``,
    ``t ← t + 1``.  Plain (``state: [B,H,d,dv]``): ``H ← A_t H + k_t β_t v_tᵀ``.
    ``A_t H = a_t (H − β_t k_t (k_tᵀ H))`` is applied as a rank-one update (O(d·dv) per state).
    """
    H = state if lam is None else fenwick.carry(state.H, state.t)
    if beta is not None:
        kH = common.ein("...d,...dv->...v", k, H)
        H = H - beta[..., None, None] * k[..., :, None] * kH[..., None, :]
        v = beta[..., None] * v
    H = jnp.exp(g)[..., None, None] * H
    X = k[..., :, None] * v[..., None, :]
    if lam is None:
        H = H + X
        return readout(H, q), H
    H = H.at[0].add(X)
    return readout(H, q, lam), LevelState(H, state.t + 1)


def cast(dt, *xs):
    return [None if x is None else jnp.asarray(x).astype(dt) for x in xs]


def cast_state(state, dt):
    """An initial state in the state dtype (``LevelState.t`` as int32)."""
    if isinstance(state, LevelState):
        return LevelState(jnp.asarray(state.H).astype(dt), jnp.asarray(state.t).astype(jnp.int32))
    return jnp.asarray(state).astype(dt)


def reset(g, segment_ids, seq_axis=None):
    """``g: [B,T,H]`` with ``-inf`` at every document start (``core.documents.reset_gate``)."""
    return reset_gate(g, segment_ids, *g.shape, g.dtype, seq_axis)
