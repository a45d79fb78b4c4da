"""Asymmetric second-order HLA (AHLA), SPEC.md §2.

    o_t = Σ_{j≤i≤t} D(t,j) (q_t·k_i)(q_i·k_j) v_j          (= (W_g W_g) V,  W_g = Γ ∘ QKᵀ)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)``, ``den`` the same sum with ``v_j``
replaced by 1.  The operator is linear in V, so the normalised form runs once on ``[V | 1]``
(``dv + 1`` columns): the last columns of ``P`` and ``E`` are SPEC's ``mK`` and ``n``.
Forms that agree: the quadratic ``reference``, the serial ``recurrent`` form (``step`` = the
decode step), the token-level associative ``scan`` over ``token_summaries`` with ``combine``, and
the ``chunked`` form (matmuls inside chunks, the same ``combine`` across chunks).
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay ``<= 0``), ``[H]`` or
``None``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops import reference, sequence
from hla_jax.ops.common import (
    cast_inputs,
    causal_mask,
    check_chunk_size,
    check_gate,
    check_impl,
    check_qkv,
    decay_matrix,
    ein,
    empty_segment,
    from_chunks,
    gate_or_zeros,
    mm,
    outer,
    pad_time,
    precision_from_inputs,
    ratio_last_column,
    scan_time,
    state_dtype,
    to_chunks,
    tr,
)

IMPLS = ("reference", "recurrent", "scan", "chunked", "auto")


class State(NamedTuple):
    """Recurrent state, each ``[B,H,...]``: ``P = Σ D k vᵀ`` and ``E``, both ``d×dv``
    (``d×(dv+1)`` when normalised: the last column is ``mK`` resp. ``n``)."""
    P: jax.Array
    E: jax.Array


class Summary(NamedTuple):
    """Segment summary ``(ρ, P, R, E)`` with any leading axes ``[...]``.

    ``ρ: [...]`` product of the segment's decays; ``P, E: [...,d,dv]``; ``R = Σ k qᵀ: [...,d,d]``
    is NOT decayed.  SPEC's twins ``mK, n`` are the last columns of ``P, E`` for ``[V | 1]``.
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
    return ratio_last_column(o, eps) if normalize else o


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


@functools.partial(jax.jit, static_argnames=("normalize",))
def ahla_recurrent(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Serial recurrence: ``lax.scan`` of ``step`` over time, O(d·dv) state per head."""
    B, _, H, d, dv = check_qkv(q, k, v, name="ahla")
    state = init_state(B, H, d, dv, normalize=normalize, dtype=state_dtype(q, k, v, g))
    out, _ = scan_time(step, state, q, k, v, g, normalize=normalize, eps=eps)
    return out


@functools.partial(jax.jit, static_argnames=("normalize",))
def ahla_scan(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Token-level ``jax.lax.associative_scan(combine, token_summaries)``, then ``readout``.

    Materialises a ``d×d`` and two ``d×dv`` summaries per token: O(T·d²) memory by nature (the
    chunked form is the one that scales).
    """
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    prefix = jax.lax.associative_scan(combine, token_summaries(q, k, v, g), axis=1)
    return readout(prefix, q, normalize=normalize, eps=eps)


def chunk_summaries(Q, K, V, g, Gam, WgV) -> Summary:
    """Each chunk's own summary; ``Q, K: [...,c,d]``, ``V, WgV = W_g V: [...,c,dv]``, ``g: [...,c]``.

    With ``γ_τ = D(c,τ)`` (the last row of Γ): ``P = (γ∘K)ᵀ V``, ``R = Kᵀ Q``,
    ``E = Σ_τ γ_τ k_τ (q_τᵀ P_τ) = (γ∘K)ᵀ (W_g V)``.
    """
    Kg = tr(Gam[..., -1, :, None] * K)
    return Summary(jnp.exp(jnp.sum(g, -1)), mm(Kg, V), mm(tr(K), Q), mm(Kg, WgV))


@functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
def ahla_chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None):
    """Chunked form (SPEC §2): per chunk, with the prefix ``(P0, E0)`` of earlier chunks,

        O = diag(ρ) Q E0 + diag(ρ) A_L (Q P0) + (W_g W_g) V,    A_L = L ∘ QKᵀ,  W_g = Γ ∘ QKᵀ

    with local ``ρ_τ = exp(g_1+…+g_τ)`` and local ``Γ``.  Prefixes come from
    ``exclusive_scan(combine, ·)`` over ``chunk_summaries``, preceded by the earlier shards' total
    under ``seq_axis`` (``sequence.chunk_prefixes``).  Memory: O(T·c) plus one summary per
    chunk; T is padded to a multiple of the chunk internally.
    """
    B, T, H, _, _ = check_qkv(q, k, v, name="ahla")
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    c = min(check_chunk_size(chunk_size), T)
    g = gate_or_zeros(g, B, T, H, q.dtype)
    Q, K, V, gc = (to_chunks(pad_time(x, c), c) for x in (q, k, v, g))  # [B,H,N,c,...]
    Gam = decay_matrix(gc)
    A = mm(Q, tr(K))
    Wg = Gam * A
    WgV = mm(Wg, V)
    own = chunk_summaries(Q, K, V, gc, Gam, WgV)
    p = sequence.chunk_prefixes(combine, empty_segment(own, 2), own, 2, seq_axis)
    rho = jnp.exp(jnp.cumsum(gc, -1))[..., None]
    AL = causal_mask(c, A.dtype) * A
    O = rho * (mm(Q, p.E) + mm(AL, mm(Q, p.P))) + mm(Wg, WgV)
    O = from_chunks(O, T)
    return ratio_last_column(O, eps) if normalize else O


@precision_from_inputs
def ahla(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None):
    """Asymmetric second-order HLA, ``[B,T,H,dv]`` in the state dtype (float32, float64 for
    float64 inputs).

    ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g``: log-decay ``[B,T,H]``, per-head ``[H]`` or
    ``None``.  ``normalize`` divides by ``clamp_signed(den, eps)``.  ``impl``: "reference" |
    "recurrent" | "scan" | "chunked" | "auto" (= "chunked").  ``seq_axis``: the mesh axis the
    time axis is sharded over, inside ``jax.shard_map`` (chunked only; ``ops.sequence``).
    """
    check_impl(impl, IMPLS, name="ahla")
    sequence.check_impl(impl, seq_axis, name="ahla")
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, _, _ = check_qkv(q, k, v, name="ahla")
    g = check_gate(g, B, T, H, name="ahla")
    if impl == "reference":
        return reference.ahla(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "recurrent":
        return ahla_recurrent(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "scan":
        return ahla_scan(q, k, v, g, normalize=normalize, eps=eps)
    return ahla_chunked(q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size,
                        seq_axis=seq_axis)
