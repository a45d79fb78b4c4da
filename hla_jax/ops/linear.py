"""First-order linear attention and Mamba-2 (the SSD core): ``o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s``.

Equivalently ``o = (Γ ∘ QKᵀ) V``; state ``H_t = a_t H_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ H_t``.
These are the log-linear Mamba-2 of ``loglinear.py`` with every λ = 1, run by the same core with
the level split switched off (one d×dv state, plain cost).  ``q, k: [B,T,H,d]``,
``v: [B,T,H,dv]``, ``g: [B,T,H]`` or ``[H]`` log-decay (None: no decay); outputs ``[B,T,H,dv]``.
``impl="pallas"`` runs the first-order Pallas kernel ``hla_jax.kernels.la_pallas`` (which also
takes an initial state and returns the final one).
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.ops import loglinear
from hla_jax.ops.loglinear import combine, readout

__all__ = ["chunked", "combine", "init_state", "linear_attention", "mamba2", "readout",
           "recurrent", "scan", "step", "token_summaries"]


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
    """``O = ((QKᵀ)∘Γ) V + (γ∘Q) H_{n−1}`` per chunk; chunk states by an exclusive scan of
    ``combine`` over chunk summaries ``(γ_c, K̃ᵀ V)`` behind ``initial_state [B,H,d,dv]`` (None:
    zeros).  Returns ``(o, final_state)``: the state after the last token, the layout of
    ``init_state``/``step``."""
    return loglinear.chunked(q, k, v, g, chunk_size=chunk_size, seq_axis=seq_axis,
                             initial_state=initial_state)


def linear_attention(q, k, v, g=None, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """``o = (Γ ∘ QKᵀ) V``; ``g`` optional. impl: reference | recurrent | scan | chunked |
    pallas (``hla_jax.kernels.la_pallas``; interpret mode on CPU) | auto (the kernel on a GPU
    for all-bf16 inputs without ``seq_axis``, ``common.pallas_preferred``; else chunked).
    ``seq_axis``: the mesh axis the time axis is sharded over (``ops.sequence``).
    ``segment_ids [B,T]`` int: packed documents (docs/math.md#packed-documents), the state is reset (``g
    = -inf``) at
    each document start.  ``initial_state [B,H,d,dv]`` and ``return_final_state`` (recurrent,
    chunked, pallas): start from a state (the row's first token continues it) and return
    ``(o, final_state)`` in the layout of ``init_state``/``step``, so a prompt is prefilled in one
    parallel pass and a long sequence can be processed in pieces.
    """
    return loglinear.run("linear_attention", q, k, v, g, impl=impl, chunk_size=chunk_size,
                         gate_required=False, seq_axis=seq_axis, segment_ids=segment_ids,
                         initial_state=initial_state, return_final_state=return_final_state)


def mamba2(q, k, v, g, *, segment_ids=None, initial_state=None, return_final_state=False,
           impl="auto", chunk_size=64, seq_axis=None):
    """Scalar-gated linear attention (Mamba-2's SSD core: q=C, k=B, v=dt·x, g=dt·A); g required.
    ``impl``, ``segment_ids``, ``initial_state``, ``return_final_state`` as for
    ``linear_attention`` ("pallas": ``hla_jax.kernels.la_pallas``).
    """
    return loglinear.run("mamba2", q, k, v, g, impl=impl, chunk_size=chunk_size,
                         seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
                         return_final_state=return_final_state)


