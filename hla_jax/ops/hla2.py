"""Second-order HLA (symmetric, masked), SPEC.md §1.

    o_t = Σ_{j≤t} Σ_{i≤j} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j          (= ((W_g Wᵀ) ∘ Γ) V)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)`` with ``den`` the same sum with
``v_j`` replaced by 1.  Four forms that agree: the quadratic ``reference``, the serial
``recurrent`` form (``step`` = the decode step), the token-level associative ``scan`` over
``token_summaries`` with ``combine``, and the ``chunked`` form (matmuls inside chunks, the same
``combine`` across chunks).  Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]``
(log-decay ``<= 0``) or ``[H]`` or ``None``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops import reference, sequence
from hla_jax.ops.common import (
    causal_mask,
    check_chunk_size,
    check_gate,
    check_impl,
    check_qkv,
    clamp_signed,
    decay_matrix,
    ein,
    empty_segment,
    from_chunks,
    gate_or_zeros,
    mm,
    pad_time,
    precision_from_inputs,
    scan_time,
    state_dtype,
    to_chunks,
)

IMPLS = ("reference", "recurrent", "scan", "chunked", "auto")


class State(NamedTuple):
    """Recurrent state, each ``[B,H,...]``: ``S: d×d, C: d×dv, G: d×dv, m: d, h: d``."""
    S: jax.Array
    C: jax.Array
    G: jax.Array
    m: jax.Array
    h: jax.Array


class Summary(NamedTuple):
    """Segment summary ``(ρ, S, C, m, G, h)`` with any leading axes ``[...]``.

    ``ρ: [...]`` is the product of the segment's decays ``a``; ``S: [...,d,d]``,
    ``C, G: [...,d,dv]``, ``m, h: [...,d]``.
    """
    rho: jax.Array
    S: jax.Array
    C: jax.Array
    m: jax.Array
    G: jax.Array
    h: jax.Array


def init_state(B: int, H: int, d: int, dv: int, dtype=jnp.float32) -> State:
    """The empty prefix: every state zero."""
    return State(jnp.zeros((B, H, d, d), dtype), jnp.zeros((B, H, d, dv), dtype),
                 jnp.zeros((B, H, d, dv), dtype), jnp.zeros((B, H, d), dtype),
                 jnp.zeros((B, H, d), dtype))


def readout(s, q):
    """``o = qᵀ(S C − G)`` and ``den = qᵀ(S m − h)`` from a prefix state or summary.

    ``q: [...,d]`` against states with the same leading axes; returns ``(o [...,dv], den [...])``.
    """
    qS = ein("...i,...ij->...j", q, s.S)
    o = ein("...j,...jv->...v", qS, s.C) - ein("...i,...iv->...v", q, s.G)
    den = jnp.sum(qS * s.m, -1) - jnp.sum(q * s.h, -1)
    return o, den


def _finish(o, den, normalize: bool, eps):
    """``o`` or ``o / clamp_signed(den, eps)``."""
    return o / clamp_signed(den, eps)[..., None] if normalize else o


def step(state: State, q_t, k_t, v_t, g_t=None, normalize: bool = False, eps: float = 1e-6):
    """One token of the recurrence (SPEC §1); ``q_t, k_t: [B,H,d]``, ``v_t: [B,H,dv]``, ``g_t: [B,H]``.

        G ← a² G + a k (kᵀ C)     h ← a² h + a k (kᵀ m)        (previous C, m)
        S ← a S + k kᵀ            C ← a C + q vᵀ                m ← a m + q
        o = qᵀ(S C − G)           den = qᵀ(S m − h)

    Returns ``(o_t [B,H,dv], new_state)``, ``o_t`` divided by ``clamp_signed(den, eps)`` when
    ``normalize``.
    """
    dt = state.S.dtype
    q_t, k_t, v_t = (x.astype(dt) for x in (q_t, k_t, v_t))
    a = jnp.ones(q_t.shape[:-1], dt) if g_t is None else jnp.exp(g_t.astype(dt))
    a1, a2 = a[..., None], a[..., None, None]
    kC = ein("...i,...iv->...v", k_t, state.C)
    km = jnp.sum(k_t * state.m, -1, keepdims=True)
    new = State(
        S=a2 * state.S + k_t[..., :, None] * k_t[..., None, :],
        C=a2 * state.C + q_t[..., :, None] * v_t[..., None, :],
        G=a2**2 * state.G + a2 * k_t[..., :, None] * kC[..., None, :],
        m=a1 * state.m + q_t,
        h=a1**2 * state.h + a1 * k_t * km,
    )
    return _finish(*readout(new, q_t), normalize, eps), new


def token_summaries(q, k, v, g=None) -> Summary:
    """Per-token summaries ``(a_t, k_t k_tᵀ, q_t v_tᵀ, q_t, 0, 0)``, leading axes ``[B,T,H]``."""
    rho = jnp.ones(q.shape[:-1], q.dtype) if g is None else jnp.exp(g)
    C = q[..., :, None] * v[..., None, :]
    return Summary(rho, k[..., :, None] * k[..., None, :], C, q, jnp.zeros_like(C),
                   jnp.zeros_like(q))


def combine(a: Summary, b: Summary) -> Summary:
    """Segment ``a`` followed by segment ``b`` (associative; broadcasts over leading axes).

        ρ = ρ_A ρ_B    S = ρ_B S_A + S_B    C = ρ_B C_A + C_B    m = ρ_B m_A + m_B
        G = ρ_B² G_A + G_B + ρ_B S_B C_A     h = ρ_B² h_A + h_B + ρ_B S_B m_A
    """
    r1, r2 = b.rho[..., None], b.rho[..., None, None]
    return Summary(
        rho=a.rho * b.rho,
        S=r2 * a.S + b.S,
        C=r2 * a.C + b.C,
        m=r1 * a.m + b.m,
        G=r2**2 * a.G + b.G + r2 * mm(b.S, a.C),
        h=r1**2 * a.h + b.h + r1 * ein("...ij,...j->...i", b.S, a.m),
    )


def _prepare(q, k, v, g):
    """Check shapes, broadcast ``g`` to ``[B,T,H]`` (or keep ``None``), cast to the state dtype."""
    B, T, H, d, dv = check_qkv(q, k, v, name="hla2")
    g = check_gate(g, B, T, H, name="hla2")
    dt = state_dtype(q, k, v, g)
    return (q.astype(dt), k.astype(dt), v.astype(dt), None if g is None else g.astype(dt),
            (B, T, H, d, dv))


@functools.partial(jax.jit, static_argnames=("normalize",))
def hla2_recurrent(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Serial recurrence: ``lax.scan`` of ``step`` over time, O(d² + d·dv) state per head."""
    q, k, v, g, (B, _, H, d, dv) = _prepare(q, k, v, g)

    out, _ = scan_time(step, init_state(B, H, d, dv, q.dtype), q, k, v, g,
                       normalize=normalize, eps=eps)
    return out


@functools.partial(jax.jit, static_argnames=("normalize",))
def hla2_scan(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Token-level ``jax.lax.associative_scan(combine, token_summaries)``, then ``readout``.

    Materialises a ``d×d`` and two ``d×dv`` summaries per token: O(T·d²) memory by nature (the
    chunked form is the one that scales).
    """
    q, k, v, g, _ = _prepare(q, k, v, g)
    prefix = jax.lax.associative_scan(combine, token_summaries(q, k, v, g), axis=1)
    return _finish(*readout(prefix, q), normalize, eps)


def chunk_summaries(Q, K, V, g, Gam) -> Summary:
    """Each chunk's own summary; ``Q, K: [...,c,d]``, ``V: [...,c,dv]``, ``g: [...,c]``, ``Γ: [...,c,c]``.

    With ``γ_τ = D(c,τ)`` (decay to the chunk's end, last row of Γ):
    ``S = Kᵀ diag(γ) K``, ``C = (γ∘Q)ᵀ V``, ``m = (γ∘Q)ᵀ 1``, and
    ``G = Σ_{i>j} γ_i γ_j k_i (k_i·q_j) v_jᵀ = Kᵀ X V`` with ``X = strict_tril((γ∘K)(γ∘Q)ᵀ)``,
    ``h = Kᵀ X 1``.
    """
    gam = Gam[..., -1, :, None]
    Kg, Qg = gam * K, gam * Q
    X = jnp.tril(mm(Kg, jnp.swapaxes(Qg, -1, -2)), -1)
    KX = mm(jnp.swapaxes(K, -1, -2), X)  # [...,d,c]
    return Summary(
        rho=jnp.exp(jnp.sum(g, -1)),
        S=mm(jnp.swapaxes(Kg, -1, -2), K),
        C=mm(jnp.swapaxes(Qg, -1, -2), V),
        m=jnp.sum(Qg, -2),
        G=mm(KX, V),
        h=jnp.sum(KX, -1),
    )


@functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
def hla2_chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None):
    """Chunked form (SPEC §1): per chunk, with the prefix ``(S0, C0, m0, G0, h0)`` of earlier chunks,

        O   = diag(ρ²) Q U0 + M V,     U0 = S0 C0 − G0
        den = diag(ρ²) Q u0 + M 1,     u0 = S0 m0 − h0
        M   = diag(ρ) ((Q S0 Qᵀ) ∘ Γ) + (W_g Wᵀ) ∘ Γ,   W_g = Γ ∘ QKᵀ,  W = L ∘ QKᵀ

    with local ``ρ_τ = exp(g_1+…+g_τ)`` and local ``Γ``.  Prefixes come from
    ``exclusive_scan(combine, ·)`` over ``chunk_summaries``, preceded by the earlier shards' total
    under ``seq_axis`` (``sequence.chunk_prefixes``).  Memory: O(T·c) plus one state per chunk;
    T is padded to a multiple of the chunk internally.
    """
    q, k, v, g, (B, T, H, _, _) = _prepare(q, k, v, g)
    c = min(check_chunk_size(chunk_size), T)
    g = gate_or_zeros(g, B, T, H, q.dtype)
    Q, K, V, gc = (to_chunks(pad_time(x, c), c) for x in (q, k, v, g))  # [B,H,N,c,...]
    Gam = decay_matrix(gc)
    own = chunk_summaries(Q, K, V, gc, Gam)
    p = sequence.chunk_prefixes(combine, empty_segment(own, 2), own, 2, seq_axis)

    rho = jnp.exp(jnp.cumsum(gc, -1))[..., None]
    A = mm(Q, jnp.swapaxes(K, -1, -2))
    W = causal_mask(c, A.dtype) * A
    QS0Q = mm(mm(Q, p.S), jnp.swapaxes(Q, -1, -2))
    M = (rho * QS0Q + mm(Gam * A, jnp.swapaxes(W, -1, -2))) * Gam
    U0 = mm(p.S, p.C) - p.G
    O = rho**2 * mm(Q, U0) + mm(M, V)
    if normalize:
        u0 = ein("...ij,...j->...i", p.S, p.m) - p.h
        den = rho[..., 0] ** 2 * ein("...ci,...i->...c", Q, u0) + jnp.sum(M, -1)
        O = _finish(O, den, True, eps)
    return from_chunks(O, T)


@precision_from_inputs
def hla2(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None):
    """Second-order masked HLA, ``[B,T,H,dv]`` in the state dtype (float32, float64 for float64 inputs).

    ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g``: log-decay ``[B,T,H]``, per-head ``[H]`` or
    ``None``.  ``normalize`` divides by ``clamp_signed(den, eps)``.  ``impl``: "reference" |
    "recurrent" | "scan" | "chunked" | "auto" (= "chunked").  ``seq_axis``: the mesh axis the
    time axis is sharded over, inside ``jax.shard_map`` (chunked only; ``ops.sequence``).
    """
    check_impl(impl, IMPLS)
    sequence.check_impl(impl, seq_axis, name="hla2")
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, _, _ = check_qkv(q, k, v, name="hla2")
    g = check_gate(g, B, T, H, name="hla2")
    if impl == "reference":
        return reference.hla2(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "recurrent":
        return hla2_recurrent(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "scan":
        return hla2_scan(q, k, v, g, normalize=normalize, eps=eps)
    return hla2_chunked(q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size,
                        seq_axis=seq_axis)
