"""Log-linear Mamba-2 and log-linear Gated DeltaNet (docs/math.md#loglinear):

    o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ,    ℓ(t,s) = bit_length(t XOR s)

with ``A_r = a_r`` (Mamba-2, β = 1) or ``a_r (I − β_r k_r k_rᵀ)`` (Gated DeltaNet).  State
``LevelState(H: [L,B,H,d,dv], t: [B])``: one state per Fenwick level and each row's position
(with ``segment_ids``: the last document's).  Forms: the quadratic references, the state-space
core's recurrence and scan (``xla.ssm_forms``), the chunked block forms on whole rows
(``xla.loglinear_blocks``, ``xla.loglinear_gdn_blocks``) or the counter form with documents, a
state or ``seq_axis`` (``xla.loglinear_chunked``), and the kernels, composed for packed
documents and continued states in ``ops.levels``.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``, ``lam: [B,T,H,L]`` with
``L ≥ ⌈log2 T⌉+1``; outputs ``[B,T,H,dv]``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from hla_jax.kernels import loglinear_gated_deltanet_kernel, loglinear_mamba2_kernel
from hla_jax.kernels.gdn import gdn_entry
from hla_jax.ops import dispatch, levels, reference
from hla_jax.ops.families import gated_deltanet, linear
from hla_jax.ops.families.gated_deltanet import GATED_DELTANET
from hla_jax.ops.families.linear import MAMBA2
from hla_jax.ops.spec import Call, Spec, chunk_levels, kernels_preferred, reset
from hla_jax.ops.xla import loglinear_blocks, loglinear_chunked, loglinear_gdn_blocks, ssm
from hla_jax.ops.xla.ssm import cast_state, combine, readout, token_summaries
from hla_jax.ops.xla.ssm_forms import recurrent_form, scan_form

__all__ = ["LOGLINEAR_GATED_DELTANET", "LOGLINEAR_MAMBA2", "SPECS", "combine", "init_state",
           "loglinear_gated_deltanet", "loglinear_mamba2", "readout", "step", "token_summaries"]


def init_state(B, H, d, dv, *, levels=None, dtype=jnp.float32, **_):
    """``LevelState(H=[levels,B,H,d,dv] zeros, t=[B] zeros)`` (``levels=None``: the plain
    ``[B,H,d,dv]`` of Mamba-2 and Gated DeltaNet)."""
    return ssm.init_state(B, H, d, dv, levels, dtype)


def step(state, q, k, v, g, beta=None, lam=None, **_):
    """One token at each row's position ``state.t`` (``xla.ssm.step``): carry the binary counter,
    ``H[ℓ] ← A_t H[ℓ]``, ``H[0] = k_t β_t v_tᵀ``, ``o_t = Σ_ℓ λ_t^ℓ H[ℓ]ᵀ q_t``; returns
    ``(o_t, state)`` (``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g, beta: [B,H]``, ``lam: [B,H,L]``)."""
    return ssm.step(state, q, k, v, g, beta, lam)


def _reference(c):
    if c.beta is None:
        return reference.loglinear_mamba2(c.q, c.k, c.v, c.g, c.lam,
                                          segment_ids=c.segment_ids), None
    return reference.loglinear_gated_deltanet(c.q, c.k, c.v, c.g, c.beta, c.lam,
                                              segment_ids=c.segment_ids), None


def _chunked(c, terms="xla"):
    """Whole rows: the block forms (no scan); with ``segment_ids``, a state or ``seq_axis``: the
    counter form (``xla.loglinear_chunked``)."""
    if c.segment_ids is None and not c.stateful and c.seq_axis is None:
        if c.beta is None:
            return loglinear_blocks.blocks(c.q, c.k, c.v, c.g, c.lam, chunk_size=c.chunk_size), None
        return loglinear_gdn_blocks.blocks(c.q, c.k, c.v, c.g, c.beta, c.lam,
                                           chunk_size=c.chunk_size, terms=terms), None
    return loglinear_chunked.chunked(c.q, c.k, c.v, c.g, c.beta, c.lam, c.chunk_size, c.seq_axis,
                                     c.initial_state, c.segment_ids)


def _first_order(spec: Spec, chunk_size: int):
    """``f(q, k, v, g, *beta, initial_state, return_final_state)``: the operator without levels
    (``spec``) on inputs derived from checked ones, by its ``auto`` rule."""

    def f(q, k, v, g, *beta, initial_state, return_final_state):
        c = Call(spec, q, k, v, g, *beta, initial_state=initial_state,
                 return_final_state=return_final_state, chunk_size=chunk_size)
        return spec.forms[spec.auto(c)](c)

    return f


def _pallas(kernel, first: Spec):
    """The kernels on whole rows or packed documents (``levels.packed``); from a state, the
    kernels on the row composed with one ``first``-order pass (``levels.from_state``).  The
    kernels take documents or a state, not both."""

    def form(c):
        extras = () if c.beta is None else (c.beta,)
        entry = functools.partial(kernel, chunk_size=c.chunk_size)
        if c.stateful and c.segment_ids is not None:
            given = "initial_state" if c.initial_state is not None else "return_final_state"
            raise ValueError(f"{c.spec}: impl='pallas' takes segment_ids or {given}, not both; "
                             f"impl='chunked' takes both")
        if c.stateful:
            state = None if c.initial_state is None else cast_state(c.initial_state, jnp.float32)
            return levels.from_state(entry, _first_order(first, c.chunk_size), c.q, c.k, c.v,
                                     c.g, extras, c.lam, state)
        if c.segment_ids is not None:
            B, T, H = c.q.shape[:3]
            return levels.packed(entry, c.q, c.k, c.v, jnp.broadcast_to(reset(c), (B, T, H)),
                                 extras, c.lam, c.segment_ids), None
        return entry(c.q, c.k, c.v, c.g, *extras, c.lam), None

    return form


def _auto_mamba2(c):
    """The kernels where preferred, unless a call has both a state and ``segment_ids`` (the
    kernels take one or the other): the counter form."""
    both = c.stateful and c.segment_ids is not None
    return "pallas" if kernels_preferred(c) and not both else "chunked"


def _auto_gated_deltanet(c):
    """On whole rows the block form, faster forward+backward than the kernels, with its chunk
    terms from the Gated DeltaNet kernel's UT transform where that kernel runs
    ("chunked_ut_kernel"; with a state, the counter form); with ``segment_ids`` the kernels
    unless a state comes too."""
    if not kernels_preferred(c):
        return "chunked"
    if c.segment_ids is None:
        ut = not c.stateful and gdn_entry.supports(c.q, c.k, c.v, c.chunk_size)
        return "chunked_ut_kernel" if ut else "chunked"
    return "chunked" if c.stateful else "pallas"


def _flops_mamba2(T, d, c):
    """Mamba-2's, plus per chunk level read (``chunk_levels``) ``Q H_ℓ``: ``2d²``."""
    return linear.flops(T, d, c) + 2 * d * d * chunk_levels(T, c)


def _flops_gated_deltanet(T, d, c):
    """Gated DeltaNet's, plus per chunk level ``Q H_ℓ, W H_ℓ, K̃ᵀ(W H_ℓ)`` ``6d²`` and
    ``(QKᵀ∘Γ)(W H_ℓ)`` ``2cd``."""
    return gated_deltanet.flops(T, d, c) + (6 * d * d + 2 * c * d) * chunk_levels(T, c)


_FORMS = {"reference": _reference, "recurrent": recurrent_form, "scan": scan_form,
          "chunked": _chunked}
LOGLINEAR_MAMBA2 = Spec(
    "loglinear_mamba2", {**_FORMS, "pallas": _pallas(loglinear_mamba2_kernel, MAMBA2)},
    _auto_mamba2, init_state, step, gate="required", lam=True, flops=_flops_mamba2,
    mixer="loglinear_mamba2",
    features="mamba2")
LOGLINEAR_GATED_DELTANET = Spec(
    "loglinear_gated_deltanet",
    {**_FORMS, "pallas": _pallas(loglinear_gated_deltanet_kernel, GATED_DELTANET),
     "chunked_ut_kernel": functools.partial(_chunked, terms="kernel")},
    _auto_gated_deltanet, init_state, step, gate="required", beta=True, lam=True,
    flops=_flops_gated_deltanet, mixer="loglinear_gated_deltanet", features="delta")
SPECS = (LOGLINEAR_MAMBA2, LOGLINEAR_GATED_DELTANET)

def loglinear_mamba2(q, k, v, g, lam, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """Log-linear Mamba-2, ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s``,
    ``ℓ(t,s) = bit_length(t XOR s)``.

    Args:
        q: queries (``C``) ``[B,T,H,d]``.
        k: keys (``B``) ``[B,T,H,d]``.
        v: values (``dt·x``) ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        lam: level weights ``[B,T,H,L]``, ``L ≥ ⌈log2 T⌉+1`` (``T`` the global length under
            ``seq_axis``).
        impl: "reference" | "recurrent" | "scan" | "chunked" (the block form on whole rows,
            else the counter form) | "pallas" (``kernels.loglinear_mamba2_pallas``, composed
            in ``ops.levels`` for ``segment_ids`` or a state, not both) | "auto".
        segment_ids: ``[B,T]`` int, packed documents (the levels count from each document's
            first token), or None.
        initial_state: ``LevelState(H [L,B,H,d,dv], t [B] int)`` to continue, or None.
        return_final_state: also return the ``LevelState`` after the row.
        chunk_size: a power of two, tokens per chunk.
        seq_axis: the mesh axis time is sharded over (chunked, auto), or None.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, LevelState)`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument (shapes, too few levels, a chunk that is not a power of
            two, ``impl``, state).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4))
        >>> g, lam = -0.1 * jnp.ones((1, 8, 2)), jnp.ones((1, 8, 2, 4))
        >>> ops.loglinear_mamba2(q, k, v, g, lam, impl="chunked", chunk_size=4).shape
        (1, 8, 2, 4)
    """
    return dispatch.run(LOGLINEAR_MAMBA2, q, k, v, g, lam=lam, impl=impl, chunk_size=chunk_size,
                        seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state)


def loglinear_gated_deltanet(q, k, v, g, beta, lam, *, segment_ids=None, initial_state=None,
                             return_final_state=False, impl="auto", chunk_size=64,
                             seq_axis=None):
    """Log-linear Gated DeltaNet, ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ``,
    ``A_r = a_r (I − β_r k_r k_rᵀ)``.

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``, unit norm.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        beta: write strengths ``[B,T,H]``.
        lam: level weights ``[B,T,H,L]``, ``L ≥ ⌈log2 T⌉+1``.
        impl: "reference" | "recurrent" | "scan" | "chunked" (the block form on whole rows: an
            up-sweep of chunk transitions and a running query per token; else the counter
            form) | "chunked_ut_kernel" (the block form with its chunk terms from the Gated
            DeltaNet kernel's UT transform) | "pallas"
            (``kernels.loglinear_gated_deltanet_pallas``, ``segment_ids`` or a state as for
            ``loglinear_mamba2``) | "auto".
        segment_ids: ``[B,T]`` int, packed documents, or None.
        initial_state: ``LevelState(H [L,B,H,d,dv], t [B] int)`` to continue, or None.
        return_final_state: also return the ``LevelState`` after the row.
        chunk_size: a power of two, tokens per chunk.
        seq_axis: the mesh axis time is sharded over (chunked, auto), or None.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, LevelState)`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument, as for ``loglinear_mamba2``; ``beta`` too.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4)) / 2
        >>> g, beta = -0.1 * jnp.ones((1, 8, 2)), 0.5 * jnp.ones((1, 8, 2))
        >>> lam = jnp.ones((1, 8, 2, 4))
        >>> ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl="recurrent").shape
        (1, 8, 2, 4)
    """
    return dispatch.run(LOGLINEAR_GATED_DELTANET, q, k, v, g, beta, lam, impl=impl,
                        chunk_size=chunk_size, seq_axis=seq_axis, segment_ids=segment_ids,
                        initial_state=initial_state, return_final_state=return_final_state)
