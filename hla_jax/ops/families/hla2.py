"""Second-order HLA (symmetric, masked), docs/math.md#hla2.

    o_t = Σ_{j≤t} Σ_{i≤j} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j          (= ((W_g Wᵀ) ∘ Γ) V)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)`` with ``den`` the same sum with
``v_j`` replaced by 1.  The operator is linear in V, so the normalised form runs once on ``[V | 1]``
(``dv + 1`` columns): the last columns of ``C``, ``G`` and ``U`` are the normaliser's ``m``, ``h``, ``S m
− h``.
Forms that agree: the quadratic ``reference``, the serial ``recurrent`` form (``step`` = the
decode step), the token-level associative ``scan`` over ``token_summaries`` with ``combine``, and
the ``chunked`` form, which is the chain (docs/math.md#chains) of two first-order linear-attention passes
(``chains.hla2``: ``LA(q, K̃, v; 2g)`` with ``K̃ = LA(q, k, k; g)``) over XLA's chunked LA;
"pallas" is the same chain over the Pallas LA kernel.  The decode state is the chain's two LA
states: ``S = Σ D k kᵀ`` is the inner LA's (values ``k``), and ``U = S C − G = Σ_j D(t,j)² K̃_j v_jᵀ``
the outer one's (decay ``a²``, keys ``K̃_t = S_t q_t``), ``U_t = a_t² U_{t-1} + S_t q_t v_tᵀ``.
Packed documents (``segment_ids``, docs/math.md#packed-documents): the state resets at every document start,
``g = −∞`` there (``ops.dispatch``), in every form.  The recurrent, chunked and Pallas
forms start from an ``initial_state`` (a ``State``) and can return the final one (from the
chain's two LA passes in the chunked and Pallas forms).
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay ``<= 0``) or ``[H]`` or
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
    """Recurrent state, each ``[B,H,...]``, the two LA states of the chain (docs/math.md#chains):
    ``S = Σ D k kᵀ: d×d`` and ``U = S C − G = Σ_j D(t,j)² (S_j q_j) v_jᵀ: d×dv`` (``d×(dv+1)``
    when normalised: the last column is the denominator's ``S m − h``)."""
    S: jax.Array
    U: jax.Array


class Summary(NamedTuple):
    """Segment summary ``(ρ, S, C, G)`` with any leading axes ``[...]``.

    ``ρ: [...]`` is the product of the segment's decays ``a``; ``S: [...,d,d]``,
    ``C, G: [...,d,dv]``.  the normaliser's states ``m, h`` are the last columns of ``C, G`` for ``[V | 1]``.
    """
    rho: jax.Array
    S: jax.Array
    C: jax.Array
    G: jax.Array


def init_state(B: int, H: int, d: int, dv: int, *, normalize: bool = False,
               dtype=jnp.float32) -> State:
    """The empty prefix (``dv + 1`` value columns when ``normalize``)."""
    return State(jnp.zeros((B, H, d, d), dtype), jnp.zeros((B, H, d, dv + normalize), dtype))


def readout(s: Summary, q, *, normalize: bool = False, eps: float = 1e-6):
    """``o = qᵀ(S C − G)`` from a prefix summary (``q: [...,d]`` against summaries with the same
    leading axes), divided by the denominator column when ``normalize``."""
    qS = ein("...i,...ij->...j", q, s.S)
    o = ein("...j,...jv->...v", qS, s.C) - ein("...i,...iv->...v", q, s.G)
    return finish(o, normalize, eps)


def step(state: State, q_t, k_t, v_t, g_t=None, *, normalize: bool = False, eps: float = 1e-6):
    """One token of the recurrence (docs/math.md#hla2, the ``U = S C − G`` form); ``q_t, k_t: [B,H,d]``,
    ``v_t: [B,H,dv]``, ``g_t: [B,H]``.

        S ← a S + k kᵀ        U ← a² U + (S q) vᵀ   (the CURRENT S)        o = qᵀ U

    Returns ``(o_t [B,H,dv], new_state)``.
    """
    q_t, k_t, v_t, g_t = cast_inputs(q_t, k_t, v_t, g_t, normalize)
    a = 1.0 if g_t is None else jnp.exp(g_t)[..., None, None]
    S = a * state.S + outer(k_t, k_t)
    U = a**2 * state.U + outer(ein("...ij,...j->...i", S, q_t), v_t)
    return finish(ein("...i,...iv->...v", q_t, U), normalize, eps), State(S, U)


def token_summaries(q, k, v, g=None) -> Summary:
    """Per-token ``(a, k kᵀ, q vᵀ, 0)``, any leading axes (``[B,T,H]``)."""
    rho = jnp.ones(q.shape[:-1], q.dtype) if g is None else jnp.exp(g)
    C = outer(q, v)
    return Summary(rho, outer(k, k), C, jnp.zeros_like(C))


def combine(a: Summary, b: Summary) -> Summary:
    """Segment ``a`` followed by segment ``b`` (associative; broadcasts over leading axes).

        ρ = ρ_A ρ_B    S = ρ_B S_A + S_B    C = ρ_B C_A + C_B    G = ρ_B² G_A + G_B + ρ_B S_B C_A
    """
    r = b.rho[..., None, None]
    return Summary(a.rho * b.rho, r * a.S + b.S, r * a.C + b.C,
                   r * (r * a.G + mm(b.S, a.C)) + b.G)


FAMILY = hla_forms.Family("hla2", init_state, step, token_summaries, combine, readout,
                          reference.hla2, chains.over_xla(chains.hla2, State),
                          chains.over_pallas(chains.hla2, State))

def flops(T, d, c):
    """Chunk form: ``QKᵀ, Q S₀ Qᵀ`` ``4cd``, ``W_g Wᵀ`` ``2c²``, two ``(·)V`` ``4cd``;
    ``Q S₀, Q U₀`` ``4d²``; summaries ``KᵀK, QᵀV`` ``4d²``, own ``G`` ``4cd + 2d²``; combine
    ``S_B C_A`` ``2d³/c``."""
    return 12 * c * d + 2 * c * c + 10 * d * d + 2 * d ** 3 / c


SPEC = hla_forms.spec(FAMILY, flops=flops)
SPECS = (SPEC,)


def hla2(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Second-order masked HLA (docs/math.md#hla2),
    ``o_t = Σ_{j≤t} Σ_{i≤j} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j``.

    "chunked" and "pallas" are the chain ``LA(q, K̃, v; 2g)``, ``K̃ = LA(q, k, k; g)``
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
        initial_state: a ``hla2.State(S, U)`` to continue (recurrent, chunked, pallas, auto), or None.
        return_final_state: also return the ``hla2.State(S, U)`` after the row.

    Returns:
        ``o [B,T,H,dv]`` in the state dtype (float32; float64 for float64 inputs), or
        ``(o, hla2.State(S, U))`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument, for a wrong shape, rank or dtype, a positive log-decay,
            ``eps <= 0`` with ``normalize``, an unknown ``impl``, or a state with an impl or
            ``seq_axis`` that takes none.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4)) / 2
        >>> ops.hla2(q, k, v, impl="recurrent").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(SPEC, q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state, normalize=normalize, eps=eps)
