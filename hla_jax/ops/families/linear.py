"""First-order linear attention and Mamba-2 (the SSD core): ``o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s``.

Equivalently ``o = (Γ ∘ QKᵀ) V``; state ``H_t = a_t H_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ H_t``.
Two operators share the family: ``linear_attention`` (``g`` optional) and ``mamba2`` (``g``
required; q=C, k=B, v=dt·x, g=dt·A).  Forms: the quadratic ``reference.linear_attention``, the
state-space core's recurrence and scan (``xla.ssm_forms``), XLA's chunked form
(``xla.la_chunked``) and the Pallas LA kernel (``kernels.la_kernel``), which is also the
building block of every HLA operator (``ops.chains``).
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay; outputs ``[B,T,H,dv]``.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels import la_kernel
from hla_jax.ops import dispatch, reference
from hla_jax.ops.spec import Spec, gate, kernels_preferred, reset, with_state
from hla_jax.ops.xla import la_chunked, ssm, ssm_forms
from hla_jax.ops.xla.ssm import combine, readout

__all__ = ["LINEAR_ATTENTION", "MAMBA2", "SPECS", "combine", "init_state", "linear_attention",
           "mamba2", "readout", "step", "token_summaries"]


def token_summaries(k, v, g):
    """Per-token SSM pair ``(a_t, k_t v_tᵀ)`` with ``a_t = exp(g_t)`` as ``[..., 1, 1]``.

    ``jax.lax.associative_scan(combine, token_summaries(k, v, g), axis=1)`` gives every ``H_t``.
    """
    return ssm.token_summaries(k, v, g)


def init_state(B, H, d, dv, *, dtype=jnp.float32, **_):
    """Zero state ``H: [B,H,d,dv]``."""
    return ssm.init_state(B, H, d, dv, None, dtype)


def step(state, q, k, v, g=None, *_, **__):
    """One token: ``H ← a_t H + k_t v_tᵀ``, ``o_t = q_tᵀ H``; returns ``(o_t, H)``.

    ``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g: [B,H]`` (None: no decay), ``state: [B,H,d,dv]``.
    """
    g = jnp.zeros(q.shape[:-1], state.dtype) if g is None else g
    return ssm.step(state, q, k, v, g)


def _reference(c):
    return reference.linear_attention(c.q, c.k, c.v, gate(c)), None


def _chunked(c):
    return la_chunked.chunked(c.q, c.k, c.v, gate(c), c.chunk_size, c.seq_axis, c.initial_state)


def _pallas(c):
    return with_state(c, la_kernel(c.q, c.k, c.v, reset(c), chunk_size=c.chunk_size,
                                   initial_state=c.initial_state,
                                   return_final_state=c.return_final_state))


def _auto(c):
    return "pallas" if kernels_preferred(c) else "chunked"


def flops(T, d, c):
    """SSD chunk form: ``QKᵀ`` and ``(·)V`` inside the chunk ``4·c·d``; prefix read ``Q H₀``
    and chunk state ``Kᵀ V``: ``4·d²``."""
    return 4 * c * d + 4 * d * d


FORMS = {"reference": _reference, "recurrent": ssm_forms.recurrent_form,
         "scan": ssm_forms.scan_form, "chunked": _chunked, "pallas": _pallas}
LINEAR_ATTENTION = Spec("linear_attention", FORMS, _auto, init_state, step, gate="optional",
                        flops=flops, mixer="linear", features="qk")
MAMBA2 = Spec("mamba2", FORMS, _auto, init_state, step, gate="required", flops=flops,
              mixer="mamba2", features="mamba2")
SPECS = (LINEAR_ATTENTION, MAMBA2)


def linear_attention(q, k, v, g=None, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """First-order linear attention ``o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s`` (``o = (Γ ∘ QKᵀ) V``).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``), or None (no decay).
        segment_ids: ``[B,T]`` int, packed documents (each computed as if alone), or None.
        initial_state: ``[B,H,d,dv]`` to continue (recurrent, chunked, pallas, auto), or None.
        return_final_state: also return the state after the row.
        impl: "reference" | "recurrent" | "scan" | "chunked" (``xla.la_chunked``) | "pallas"
            (``kernels.la_pallas``) | "auto".
        chunk_size: tokens per chunk of the chunked and Pallas forms.
        seq_axis: the mesh axis time is sharded over, inside ``jax.shard_map``
            (``ops.sequence``; chunked and auto), or None.

    Returns:
        ``o [B,T,H,dv]`` in the state dtype (float32; float64 for float64 inputs), or
        ``(o, final_state [B,H,d,dv])`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument, for a wrong shape, rank or dtype, a positive log-decay,
            an unknown ``impl``, or a state with an impl or ``seq_axis`` that takes none.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4))
        >>> ops.linear_attention(q, k, v, impl="recurrent").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(LINEAR_ATTENTION, q, k, v, g, impl=impl, chunk_size=chunk_size,
                        seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state)


def mamba2(q, k, v, g, *, segment_ids=None, initial_state=None, return_final_state=False,
           impl="auto", chunk_size=64, seq_axis=None):
    """Scalar-gated linear attention, Mamba-2's SSD core: ``linear_attention`` with ``g``
    required (``q = C``, ``k = B``, ``v = dt·x``, ``g = dt·A``).

    Args:
        q: ``C``, ``[B,T,H,d]``.
        k: ``B``, ``[B,T,H,d]``.
        v: ``dt·x``, ``[B,T,H,dv]``.
        g: log-decay ``dt·A``, ``[B,T,H]`` or ``[H]`` (``<= 0``).
        segment_ids: ``[B,T]`` int, packed documents, or None.
        initial_state: ``[B,H,d,dv]`` to continue, or None.
        return_final_state: also return the state after the row.
        impl: "reference" | "recurrent" | "scan" | "chunked" | "pallas" | "auto".
        chunk_size: tokens per chunk of the chunked and Pallas forms.
        seq_axis: the mesh axis time is sharded over, or None.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, final_state [B,H,d,dv])`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument, as for ``linear_attention``; ``g`` None too.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4))
        >>> ops.mamba2(q, k, v, -0.1 * jnp.ones((1, 8, 2)), impl="chunked").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(MAMBA2, q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state)
