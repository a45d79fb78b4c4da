"""Gated DeltaNet: ``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ``,
``A_r = a_r (I − β_r k_r k_rᵀ)``; state ``H_t = A_t H_{t−1} + k_t β_t v_tᵀ``, ``o_t = H_tᵀ q_t``.

Forms: the quadratic ``reference.gated_deltanet``, the state-space core's recurrence and scan
(``xla.ssm_forms``), XLA's chunked UT form (``xla.gdn_chunked``) and the Hopper kernel
(``kernels.gated_deltanet_kernel``; ``auto`` takes it where ``gdn_entry.supports``).
Shapes: ``q, k: [B,T,H,d]`` (keys L2-normalised by the caller), ``v: [B,T,H,dv]``,
``g, beta: [B,T,H]``; outputs ``[B,T,H,dv]``.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels import gated_deltanet_kernel
from hla_jax.kernels.gdn import gdn_entry
from hla_jax.ops import dispatch, reference
from hla_jax.ops.spec import Spec, gate, kernels_preferred, reset, with_state
from hla_jax.ops.xla import gdn_chunked, ssm, ssm_forms

__all__ = ["GATED_DELTANET", "SPECS", "gated_deltanet", "init_state", "step"]


def init_state(B, H, d, dv, *, dtype=jnp.float32, **_):
    """Zero state ``H: [B,H,d,dv]``."""
    return ssm.init_state(B, H, d, dv, None, dtype)


def step(state, q, k, v, g, beta, *_, **__):
    """One token: ``H ← a_t (I − β_t k_t k_tᵀ) H + β_t k_t v_tᵀ``, ``o_t = q_tᵀ H``; returns
    ``(o_t, H)`` (``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g, beta: [B,H]``)."""
    return ssm.step(state, q, k, v, g, beta)


def _reference(c):
    return reference.gated_deltanet(c.q, c.k, c.v, c.g, c.beta, segment_ids=c.segment_ids), None


def _chunked(c):
    return gdn_chunked.chunked(c.q, c.k, c.v, gate(c), c.beta, c.chunk_size, c.seq_axis,
                               c.initial_state)


def _pallas(c):
    return with_state(c, gated_deltanet_kernel(c.q, c.k, c.v, reset(c), c.beta,
                                               chunk_size=c.chunk_size,
                                               initial_state=c.initial_state,
                                               return_final_state=c.return_final_state))


def _auto(c):
    """The kernel is Hopper's (``gdn_entry.supports``: Mosaic GPU, 16-bit, ``d`` 64 or 128,
    chunk 64)."""
    fits = kernels_preferred(c) and gdn_entry.supports(c.q, c.k, c.v, c.chunk_size)
    return "pallas" if fits else "chunked"


def flops(T, d, c):
    """UT/WY chunk form: ``KKᵀ, QKᵀ`` ``4cd``, triangular solve ``c²/3``, ``W = T K``,
    ``U = T V``, ``(QKᵀ∘Γ) T``, ``M V`` ``4cd + 2c²``; prefix ``Q H, W H, (QKᵀ∘Γ)(WH)``
    ``4d² + 2cd``; state ``K̃ᵀ(WH), K̃ᵀU`` ``4d²``."""
    return 10 * c * d + 2 * c * c + c * c / 3 + 8 * d * d


GATED_DELTANET = Spec(
    "gated_deltanet",
    {"reference": _reference, "recurrent": ssm_forms.recurrent_form,
     "scan": ssm_forms.scan_form, "chunked": _chunked, "pallas": _pallas},
    _auto, init_state, step, gate="required", beta=True, flops=flops, mixer="gated_deltanet",
    features="delta")
SPECS = (GATED_DELTANET,)


def gated_deltanet(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                   return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """Gated DeltaNet, ``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ`` with
    ``A_r = a_r (I − β_r k_r k_rᵀ)``.

    Assumes L2-normalised keys (the calling layer's job) and ``beta`` in (0, 1).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``, unit norm.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        beta: write strengths ``[B,T,H]``.
        segment_ids: ``[B,T]`` int, packed documents, or None.
        initial_state: ``[B,H,d,dv]`` to continue, or None.
        return_final_state: also return the state after the row.
        impl: "reference" | "recurrent" | "scan" | "chunked" (``xla.gdn_chunked``, the UT
            transform by matmuls) | "pallas" (``kernels.gated_deltanet_pallas``: Mosaic GPU
            with 16-bit inputs, ``d ∈ {64, 128}``, chunk 64; Mosaic TPU, never run on TPU
            hardware) | "auto".
        chunk_size: tokens per chunk.
        seq_axis: the mesh axis time is sharded over, or None.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, final_state [B,H,d,dv])`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument (shapes, dtypes, the sign of ``g``, ``impl``, state).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4)) / 2
        >>> g, beta = -0.1 * jnp.ones((1, 8, 2)), 0.5 * jnp.ones((1, 8, 2))
        >>> ops.gated_deltanet(q, k, v, g, beta, impl="chunked").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(GATED_DELTANET, q, k, v, g, beta, impl=impl, chunk_size=chunk_size,
                        seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state)
