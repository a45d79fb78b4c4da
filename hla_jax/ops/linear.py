"""First-order linear attention and Mamba-2 (the SSD core): ``o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s``.

Equivalently ``o = (Γ ∘ QKᵀ) V``; state ``H_t = a_t H_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ H_t``.
The family's algebra, as the other families expose theirs: the recurrence and the scan are
the state-space core's (``ops.loglinear`` with ``lam=None``), the chunked form is
``ops.la_chunked``.  ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay;
outputs ``[B,T,H,dv]``.  The public entries are ``ops.linear_attention`` and ``ops.mamba2``.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.ops import la_chunked, loglinear
from hla_jax.ops.loglinear import combine, readout

__all__ = ["chunked", "combine", "init_state", "readout", "recurrent", "scan", "step",
           "token_summaries"]


def token_summaries(k, v, g):
    """Per-token SSM pair ``(a_t, k_t v_tᵀ)`` with ``a_t = exp(g_t)`` as ``[..., 1, 1]``.

    ``jax.lax.associative_scan(combine, token_summaries(k, v, g), axis=1)`` gives every ``H_t``.
    """
    return loglinear.token_summaries(k, v, g)


def init_state(B, H, d, dv, dtype=jnp.float32):
    """Zero state ``H: [B,H,d,dv]``."""
    return loglinear.init_state(B, H, d, dv, None, dtype)


def step(state, q, k, v, g=None):
    """One token: ``H ← a_t H + k_t v_tᵀ``, ``o_t = q_tᵀ H``; returns ``(o_t, H)``.

    ``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g: [B,H]`` (None: no decay), ``state: [B,H,d,dv]``.
    """
    g = jnp.zeros(q.shape[:-1], state.dtype) if g is None else g
    return loglinear.step(state, q, k, v, g)


def recurrent(q, k, v, g, initial_state=None):
    """Serial recurrence (``lax.scan`` of ``step``) from ``initial_state [B,H,d,dv]`` (None:
    zeros); returns ``(o, final_state)``."""
    return loglinear.recurrent(q, k, v, g, initial_state=initial_state)


def scan(q, k, v, g):
    """``jax.lax.associative_scan`` of ``combine`` over the token summaries; O(T·d·dv) memory."""
    return loglinear.scan(q, k, v, g)


def chunked(q, k, v, g, chunk_size=64, seq_axis=None, initial_state=None):
    """``la_chunked.chunked``: ``(o, final_state [B,H,d,dv])`` from ``initial_state`` (None:
    zeros)."""
    return la_chunked.chunked(q, k, v, g, chunk_size, seq_axis, initial_state)
