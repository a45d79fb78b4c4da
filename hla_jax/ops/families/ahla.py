"""Asymmetric second-order HLA (AHLA), docs/math.md#ahla.

    o_t = Σ_{j≤i≤t} D(t,j) (q_t·k_i)(q_i·k_j) v_j          (= (W_g W_g) V,  W_g = Γ ∘ QKᵀ)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)``, ``den`` the same sum with ``v_j``
replaced by 1.  The operator is linear in V, so the normalised form runs once on ``[V | 1]``
(``dv + 1`` columns): the last columns of ``P`` and ``E`` are the normaliser's ``mK`` and ``n``.
Forms that agree: the quadratic ``reference``, the serial ``recurrent`` form (``step`` = the
decode step), the token-level associative ``scan`` over ``token_summaries`` with ``combine``, and
the ``chunked`` form, which is the chain (docs/math.md#chains) of two first-order linear-attention passes
(``chains.ahla``: ``W_g (W_g V) = LA(q, k, Ṽ; g)`` with ``Ṽ = LA(q, k, v; g)``) over XLA's
chunked LA; "pallas" is the same chain over the Pallas LA kernel.  The decode state is the
chain's two LA states: ``P = Σ D k vᵀ`` is the inner LA's, and ``E = Σ_i D(t,i) k_i Ṽ_iᵀ`` the
outer one's (values ``Ṽ_t = P_tᵀ q_t``: ``E ← a E + k (qᵀ P)``).
Packed documents (``segment_ids``, docs/math.md#packed-documents): the state resets at every document start,
``g = −∞`` there (``ops.dispatch``), in every form.  The recurrent, chunked and Pallas
forms start from an ``initial_state`` (a ``State``) and can return the final one (from the
chain's two LA passes in the chunked and Pallas forms).
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay ``<= 0``), ``[H]`` or
``None``, ``segment_ids: [B,T]`` int or ``None``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops import chains, dispatch, reference
from hla_jax.ops.common import cast_inputs, ein, mm, outer
from hla_jax.ops.xla import hla_forms
from hla_jax.ops.xla.hla_forms import finish


class State(NamedTuple):
    """Recurrent state, each ``[B,H,...]``: ``P = Σ D k vᵀ`` and ``E``, both ``d×dv``
    (``d×(dv+1)`` when normalised: the last column is ``mK`` resp. ``n``)."""
    P: jax.Array
    E: jax.Array


class Summary(NamedTuple):
    """Segment summary ``(ρ, P, R, E)`` with any leading axes ``[...]``.

    ``ρ: [...]`` product of the segment's decays; ``P, E: [...,d,dv]``; ``R = Σ k qᵀ: [...,d,d]``
    is NOT decayed.  the normaliser's states ``mK, n`` are the last columns of ``P, E`` for ``[V | 1]``.
    """
    rho: jax.Array
    P: jax.Array
    R: jax.Array
    E: jax.Array


def init_state(B: int, H: int, d: int, dv: int, *, normalize: bool = False,
               dtype=jnp.float32) -> State:
    """The empty prefix (``dv + 1`` value columns when ``normalize``)."""
    shape = (B, H, d, dv + normalize)
    return State(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def readout(s, q, *, normalize: bool = False, eps: float = 1e-6):
    """``o = qᵀ E`` from a prefix state or summary (``q: [...,d]``), divided by the denominator
    column when ``normalize``."""
    o = ein("...i,...iv->...v", q, s.E)
    return finish(o, normalize, eps)


def step(state: State, q_t, k_t, v_t, g_t=None, *, normalize: bool = False, eps: float = 1e-6):
    """One token of the recurrence; ``q_t, k_t: [B,H,d]``, ``v_t: [B,H,dv]``, ``g_t: [B,H]``.

        P ← a P + k vᵀ        E ← a E + k (qᵀ P)        (the CURRENT P)        o = qᵀ E

    Returns ``(o_t [B,H,dv], new_state)``.
    """
    q_t, k_t, v_t, g_t = cast_inputs(q_t, k_t, v_t, g_t, normalize)
    a = 1.0 if g_t is None else jnp.exp(g_t)[..., None, None]
    P = a * state.P + outer(k_t, v_t)
    new = State(P, a * state.E + outer(k_t, ein("...i,...iv->...v", q_t, P)))
    return readout(new, q_t, normalize=normalize, eps=eps), new


def token_summaries(q, k, v, g=None) -> Summary:
    """Per-token ``(a, k vᵀ, k qᵀ, (q·k) k vᵀ)``, any leading axes (``[B,T,H]``)."""
    rho = jnp.ones(q.shape[:-1], q.dtype) if g is None else jnp.exp(g)
    P = outer(k, v)
    return Summary(rho, P, outer(k, q), jnp.sum(q * k, -1)[..., None, None] * P)


def combine(a: Summary, b: Summary) -> Summary:
    """Segment ``a`` followed by segment ``b`` (associative; broadcasts over leading axes).

        ρ = ρ_A ρ_B    P = ρ_B P_A + P_B    R = R_A + R_B    E = ρ_B E_A + E_B + ρ_B R_B P_A
    """
    r = b.rho[..., None, None]
    return Summary(a.rho * b.rho, r * a.P + b.P, a.R + b.R, r * (a.E + mm(b.R, a.P)) + b.E)


FAMILY = hla_forms.Family("ahla", init_state, step, token_summaries, combine, readout,
                          reference.ahla, chains.over_xla(chains.ahla, State),
                          chains.over_pallas(chains.ahla, State))

def flops(T, d, c):
    """Chunk form: ``QKᵀ`` ``2cd``, ``W_g W_g`` ``2c²``, ``(·)V, A_L(QP₀), W_g V`` ``6cd``;
    ``Q E₀, Q P₀`` ``4d²``; summaries ``KᵀV, KᵀQ, Kᵀ(W_gV)`` ``6d²``; combine ``R_B P_A``
    ``2d³/c``."""
    return 8 * c * d + 2 * c * c + 10 * d * d + 2 * d ** 3 / c


SPEC = hla_forms.spec(FAMILY, flops=flops)
SPECS = (SPEC,)


def ahla(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Asymmetric second-order HLA (docs/math.md#ahla),
    ``o_t = Σ_{j≤t} Σ_{i≤j} D(t,j) D(j,i) (q_t·k_j)(q_j·k_i) v_i``.

    "chunked" and "pallas" are the chain ``LA(q, k, Ṽ; g)``, ``Ṽ = LA(q, k, v; g)``
    (docs/math.md#chains).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``), or None (no decay).
        normalize: divide by ``clamp_signed(den, eps)``, ``den`` the same sum with ``v``
            replaced by 1 (one pass over ``[v | 1]``).
        eps: the clamp of the denominator, ``> 0``.
        impl: "reference" | "recurrent" | "scan" | "chunked" (the chain over XLA's chunked
            LA) | "pallas" (the chain over ``kernels.la_pallas``) | "auto".
        chunk_size: tokens per chunk of the chunked and Pallas forms.
        seq_axis: the mesh axis time is sharded over, inside ``jax.shard_map``
            (``ops.sequence``; chunked and auto), or None.
        segment_ids: ``[B,T]`` int, packed documents (each computed as if alone), or None.
        initial_state: a ``ahla.State(P, E)`` to continue (recurrent, chunked, pallas, auto), or None.
        return_final_state: also return the ``ahla.State(P, E)`` after the row.

    Returns:
        ``o [B,T,H,dv]`` in the state dtype (float32; float64 for float64 inputs), or
        ``(o, ahla.State(P, E))`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument, for a wrong shape, rank or dtype, a positive log-decay,
            ``eps <= 0`` with ``normalize``, an unknown ``impl``, or a state with an impl or
            ``seq_axis`` that takes none.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4)) / 2
        >>> ops.ahla(q, k, v, impl="recurrent").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(SPEC, q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state, normalize=normalize, eps=eps)
