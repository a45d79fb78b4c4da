"""Third-order HLA, SPEC.md §3, two semantics (``mask="causal"`` is the default).

causal:  o_t = Σ_{u≤t} Σ_{i,j≤u} D(t,i) D(t,u) D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j
         (= ((W_g Wᵀ) ∘ Γ)(W_g V); without decay (((W Wᵀ) ∘ L) W) V)
paper:   o_t = Σ over triples (i,u,j) ≤ t whose largest index occurs at least twice of
         (q_t·k_i)(k_i·q_u)(q_u·k_j) v_j  (no decay; the HLA paper's streaming algebra)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)``, ``den`` the same sum with ``v_j``
replaced by 1.  Both operators are linear in V, so the normalised form runs once on ``[V | 1]``
(``dv + 1`` columns): the last column of every ``d×dv`` state is its ``mK`` twin (P -> mK).
Forms that agree: ``reference``, ``recurrent`` (``step`` = decode step), token-level associative
``scan`` (``combine``), ``chunked``.  The causal ``chunked`` form is SPEC §7's chain of two
first-order linear-attention passes (``chains.hla3``: ``LA(q, K̃, Ṽ; 2g)`` with
``[K̃ | Ṽ] = LA(q, k, [k | v]; g)``) over XLA's chunked LA, and "pallas" the same chain over the
Pallas LA kernel; the decode state is the chain's LA states: ``S = Σ D k kᵀ`` and
``P = Σ D k vᵀ`` the inner LA's (values ``[k | v]``), ``F = Σ_u D(t,u)² K̃_u Ṽ_uᵀ`` the outer
one's (decay ``a²``, ``K̃_t = S_t q_t``, ``Ṽ_t = P_tᵀ q_t``).  The ``paper`` mask does not factor
so: its chunked form is ``paper_chunk`` scanned over chunks.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay ``<= 0``), ``[H]`` or
``None``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops import chains, hla_forms, reference, sequence
from hla_jax.ops.common import (
    cast_inputs,
    causal_mask,
    ein,
    from_chunks,
    mm,
    outer,
    pad_time,
    precision_from_inputs,
    to_chunks,
    tr,
)
from hla_jax.ops.hla_forms import finish

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas", "auto")
MASKS = ("causal", "paper")


def _vq(q, M):
    """``qᵀ M`` for ``q: [...,d]``, ``M: [...,d,n]``."""
    return ein("...i,...in->...n", q, M)


def _check_mask(mask, g):
    if mask not in MASKS:
        raise ValueError(f"hla3: mask={mask!r} is not one of {MASKS}")
    if mask == "paper" and g is not None:
        raise ValueError("hla3: mask='paper' is defined without decay: g must be None")


# ---------------------------------------------------------------------------------------------
# causal


class State(NamedTuple):
    """Causal recurrent state, each ``[B,H,...]``: ``S: d×d``, ``P, F: d×dv``."""
    S: jax.Array
    P: jax.Array
    F: jax.Array


class Summary(NamedTuple):
    """Causal segment summary ``(ρ, S, P, Q2, X, Y, F)``, any leading axes ``[...]``.

    ``ρ: [...]``; ``S, Q2, Y: [...,d,d]``; ``P, X, F: [...,d,dv]``; ``Q2 = Σ q qᵀ`` is NOT
    decayed.  With ``S_u, P_u`` the segment-local prefixes and ``D = D(end,u)``:
    ``X = Σ D q_u q_uᵀ P_u``, ``Y = Σ D S_u q_u q_uᵀ``, ``F = Σ D² (S_u q_u)(q_uᵀ P_u)``.
    """
    rho: jax.Array
    S: jax.Array
    P: jax.Array
    Q2: jax.Array
    X: jax.Array
    Y: jax.Array
    F: jax.Array


def init_state(B: int, H: int, d: int, dv: int, *, normalize: bool = False,
               dtype=jnp.float32) -> State:
    """The empty causal prefix (``dv + 1`` value columns when ``normalize``)."""
    dvn = dv + normalize
    return State(jnp.zeros((B, H, d, d), dtype), jnp.zeros((B, H, d, dvn), dtype),
                 jnp.zeros((B, H, d, dvn), dtype))


def readout(s, q, *, normalize: bool = False, eps: float = 1e-6):
    """``o = qᵀ F`` from a causal prefix state or summary (``q: [...,d]``)."""
    return finish(_vq(q, s.F), normalize, eps)


def step(state: State, q_t, k_t, v_t, g_t=None, *, normalize: bool = False, eps: float = 1e-6):
    """One token of the causal recurrence; ``q_t, k_t: [B,H,d]``, ``v_t: [B,H,dv]``, ``g_t: [B,H]``.

        S ← a S + k kᵀ     P ← a P + k vᵀ     F ← a² F + (S q)(qᵀ P)     o = qᵀ F

    Returns ``(o_t [B,H,dv], new_state)``.
    """
    q_t, k_t, v_t, g_t = cast_inputs(q_t, k_t, v_t, g_t, normalize)
    a = 1.0 if g_t is None else jnp.exp(g_t)[..., None, None]
    S = a * state.S + outer(k_t, k_t)
    P = a * state.P + outer(k_t, v_t)
    new = State(S, P, a**2 * state.F + outer(_vq(q_t, S), _vq(q_t, P)))
    return readout(new, q_t, normalize=normalize, eps=eps), new


def token_summaries(q, k, v, g=None) -> Summary:
    """Per-token ``(a, kkᵀ, kvᵀ, qqᵀ, qqᵀkvᵀ, kkᵀqqᵀ, kkᵀqqᵀkvᵀ)``, any leading axes."""
    rho = jnp.ones(q.shape[:-1], q.dtype) if g is None else jnp.exp(g)
    qk = jnp.sum(q * k, -1)[..., None, None]
    S, P, Q2 = outer(k, k), outer(k, v), outer(q, q)
    return Summary(rho, S, P, Q2, qk * outer(q, v), qk * outer(k, q), qk**2 * P)


def combine(a: Summary, b: Summary) -> Summary:
    """Segment ``a`` followed by segment ``b`` (associative; broadcasts over leading axes).

        S = ρ_B S_A + S_B    P = ρ_B P_A + P_B    Q2 = Q2_A + Q2_B
        X = ρ_B X_A + ρ_B Q2_B P_A + X_B          Y = ρ_B Y_A + ρ_B S_A Q2_B + Y_B
        F = ρ_B² F_A + F_B + ρ_B² S_A Q2_B P_A + ρ_B S_A X_B + ρ_B Y_B P_A
    """
    r = b.rho[..., None, None]
    SQ = mm(a.S, b.Q2)
    return Summary(
        rho=a.rho * b.rho,
        S=r * a.S + b.S,
        P=r * a.P + b.P,
        Q2=a.Q2 + b.Q2,
        X=r * (a.X + mm(b.Q2, a.P)) + b.X,
        Y=r * (a.Y + SQ) + b.Y,
        F=r**2 * (a.F + mm(SQ, a.P)) + r * (mm(a.S, b.X) + mm(b.Y, a.P)) + b.F,
    )


# ---------------------------------------------------------------------------------------------
# paper


class PaperState(NamedTuple):
    """``paper`` state, each ``[B,H,...]``: moments ``SK, SQ: d×d``, ``P: d×dv``, and the cross
    summaries ``G1, G2, G3: d×dv``.  The prefix operator is ``H = SK SQ P − G1 − G2 − G3``."""
    SK: jax.Array
    SQ: jax.Array
    P: jax.Array
    G1: jax.Array
    G2: jax.Array
    G3: jax.Array


class PaperSummary(NamedTuple):
    """``paper`` segment summary, any leading axes ``[...]`` (no decay, so no ρ).

    ``SK, SQ, X = Σ (q·k) k qᵀ: [...,d,d]``; ``P, Y = Σ (q·k) q vᵀ: [...,d,dv]``;
    ``M = Σ k⊗k⊗k⊗v: [...,d,d,d,dv]``, the map ``M[Z] = Σ (kᵀ Z k) k vᵀ`` stored densely
    (d³·dv numbers); ``H: [...,d,dv]`` the sum over the segment's triples with a repeated maximum.
    """
    SK: jax.Array
    SQ: jax.Array
    P: jax.Array
    X: jax.Array
    Y: jax.Array
    M: jax.Array
    H: jax.Array


def paper_init_state(B: int, H: int, d: int, dv: int, *, normalize: bool = False,
                     dtype=jnp.float32) -> PaperState:
    """The empty ``paper`` prefix (``dv + 1`` value columns when ``normalize``)."""
    dd, dvn = jnp.zeros((B, H, d, d), dtype), jnp.zeros((B, H, d, dv + normalize), dtype)
    return PaperState(dd, dd, dvn, dvn, dvn, dvn)


def _paper_H(s: PaperState):
    return mm(mm(s.SK, s.SQ), s.P) - s.G1 - s.G2 - s.G3


def paper_readout(s: PaperSummary, q, *, normalize: bool = False, eps: float = 1e-6):
    """``o = qᵀ H`` from a ``paper`` prefix summary (``q: [...,d]``)."""
    return finish(_vq(q, s.H), normalize, eps)


def paper_step(state: PaperState, q_t, k_t, v_t, *, normalize: bool = False, eps: float = 1e-6):
    """One token of the ``paper`` recurrence (cross summaries BEFORE the moments take token t):

        G1 += k kᵀ SQ P     G2 += SK q qᵀ P     G3 += SK SQ k vᵀ
        SK += k kᵀ          SQ += q qᵀ          P += k vᵀ          o = qᵀ(SK SQ P − G1 − G2 − G3)

    Returns ``(o_t [B,H,dv], new_state)``.
    """
    q_t, k_t, v_t, _ = cast_inputs(q_t, k_t, v_t, None, normalize)
    s = state
    kSQ = _vq(k_t, s.SQ)  # (SQ k)ᵀ, SQ symmetric
    new = PaperState(
        SK=s.SK + outer(k_t, k_t),
        SQ=s.SQ + outer(q_t, q_t),
        P=s.P + outer(k_t, v_t),
        G1=s.G1 + outer(k_t, _vq(kSQ, s.P)),
        G2=s.G2 + outer(_vq(q_t, s.SK), _vq(q_t, s.P)),
        G3=s.G3 + outer(_vq(kSQ, s.SK), v_t),
    )
    qSK = _vq(q_t, new.SK)
    o = _vq(_vq(qSK, new.SQ), new.P) - _vq(q_t, new.G1 + new.G2 + new.G3)
    return finish(o, normalize, eps), new


def paper_token_summaries(q, k, v) -> PaperSummary:
    """Per-token ``(kkᵀ, qqᵀ, kvᵀ, (q·k) kqᵀ, (q·k) qvᵀ, k⊗k⊗k⊗v, (q·k)² kvᵀ)``, any leading axes."""
    qk = jnp.sum(q * k, -1)[..., None, None]
    P = outer(k, v)
    M = k[..., :, None, None, None] * k[..., None, :, None, None] * P[..., None, None, :, :]
    return PaperSummary(outer(k, k), outer(q, q), P, qk * outer(k, q), qk * outer(q, v), M,
                        qk**2 * P)


def paper_combine(a: PaperSummary, b: PaperSummary) -> PaperSummary:
    """Segment ``a`` followed by segment ``b`` for ``paper`` (associative).

    A triple of ``a·b`` with a repeated maximum has it inside ``a`` (``H_A``), inside ``b`` with
    every index in ``b`` (``H_B``), or inside ``b`` with the third index in ``a``:
    ``i = j = m`` (``M_B[SQ_A]``), ``i = u = m`` (``X_B P_A``), ``u = j = m`` (``SK_A Y_B``).

        H = H_A + H_B + M_B[SQ_A] + X_B P_A + SK_A Y_B,     every other field adds.
    """
    H = (a.H + b.H + ein("...abcv,...bc->...av", b.M, a.SQ) + mm(b.X, a.P) + mm(a.SK, b.Y))
    return PaperSummary(*(x + y for x, y in zip(a[:-1], b[:-1])), H)


def paper_chunk(state: PaperState, Q, K, V):
    """One chunk of the ``paper`` form (``Q, K: [B,H,c,d]``, ``V: [B,H,c,dv]``): returns the state
    after the chunk (the recurrent ``PaperState``: a chunked prefill can hand it to ``paper_step``)
    and the chunk's outputs ``[B,H,c,dv]``.

    With the carried ``(SK0, SQ0, P0, G·0)``, ``A = QKᵀ``, ``a = diag(A)``, strict mask ``L_s``,
    rows of the pre-token moments (no per-token d×d states):
    ``Z_τ = k_τᵀ SQ_{τ-1}``: ``Z = K SQ0 + (L_s ∘ Aᵀ) Q``;  ``Y_τ = (SK_{τ-1} q_τ)ᵀ``:
    ``Y = Q SK0 + (L_s ∘ A) K``;  ``R_τ = q_τᵀ P_{τ-1}``: ``R = Q P0 + (L_s ∘ A) V``;
    ``σ_τ = k_τᵀ SQ_{τ-1} k_τ = Z_τ·k_τ``.  Token m adds to ``H = SK SQ P − ΣG`` the triples with
    maximum m repeated, ``a_m k_m R_m + a_m (SK_{m-1} q_m) v_mᵀ + (σ_m + a_m²) k_m v_mᵀ``, so

        O  = Q H0 + (L ∘ A)(a R + (σ + a²) V) + (L ∘ (Q Yᵀ)) (a V)
        G1 += Kᵀ (Z P0 + (L_s ∘ Z Kᵀ) V)     G2 += Yᵀ R     G3 += (Z SK0 + (L_s ∘ Z Kᵀ) K)ᵀ V
    """
    c = Q.shape[-2]
    L, Ls = causal_mask(c, Q.dtype), jnp.tril(jnp.ones((c, c), Q.dtype), -1)
    A = mm(Q, tr(K))
    a = jnp.diagonal(A, axis1=-2, axis2=-1)[..., None]
    Z = mm(K, state.SQ) + mm(Ls * tr(A), Q)
    Y = mm(Q, state.SK) + mm(Ls * A, K)
    R = mm(Q, state.P) + mm(Ls * A, V)
    sigma = jnp.sum(Z * K, -1, keepdims=True)
    ZK = Ls * mm(Z, tr(K))
    O = (mm(Q, _paper_H(state)) + mm(L * A, a * R + (sigma + a**2) * V)
         + mm(L * mm(Q, tr(Y)), a * V))
    new = PaperState(
        SK=state.SK + mm(tr(K), K),
        SQ=state.SQ + mm(tr(Q), Q),
        P=state.P + mm(tr(K), V),
        G1=state.G1 + mm(tr(K), mm(Z, state.P) + mm(ZK, V)),
        G2=state.G2 + mm(tr(Y), R),
        G3=state.G3 + mm(tr(mm(Z, state.SK) + mm(ZK, K)), V),
    )
    return new, O


# ---------------------------------------------------------------------------------------------
# forms


@functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
def paper_chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None):
    """``paper`` chunked form ``[B,T,H,dv]`` (``g`` is ``None``): T padded to a multiple of
    ``c = min(chunk_size, T)``, a ``lax.scan`` of ``paper_chunk`` over the chunks ``[B,H,N,c,·]``.

    Under ``seq_axis`` (shard ``j``), in two small collectives instead of gathering the
    ``d³·dv`` map of ``paper_combine``: the moments ``(SK0, SQ0, P0)`` of the earlier shards are
    an exclusive sum; the scan starts from ``(SK0, SQ0, P0, G = 0)``, whose ``H`` is
    ``H0' = SK0 SQ0 P0``; ``H`` then grows by a term ``ΔH_j`` that depends on the moments only,
    so the true prefix is ``H0 = Σ_{i<j} ΔH_i`` (a second exclusive sum) and every output gains
    ``Q (H0 − H0')`` (``o_t = q_tᵀ H_t`` is affine in the initial ``H``).
    """
    B, T, H, d = q.shape
    q, k, v, _ = cast_inputs(q, k, v, None, normalize)
    c = min(chunk_size, T)
    Q, K, V = (to_chunks(pad_time(x, c), c) for x in (q, k, v))
    init = paper_init_state(B, H, d, V.shape[-1], dtype=Q.dtype)
    if seq_axis is not None:
        moments = [ein("bhncd,bhnce->bhde", x, y) for x, y in ((K, K), (Q, Q), (K, V))]
        init = sequence.varying(init, seq_axis)._replace(
            **dict(zip(("SK", "SQ", "P"), sequence.exclusive_sum(moments, seq_axis))))
    final, O = jax.lax.scan(lambda s, x: paper_chunk(s, *x), init,
                            tuple(jnp.moveaxis(x, 2, 0) for x in (Q, K, V)))
    O = jnp.moveaxis(O, 0, 2)
    if seq_axis is not None:
        H0 = sequence.exclusive_sum(_paper_H(final) - _paper_H(init), seq_axis)
        O = O + mm(Q, (H0 - _paper_H(init))[:, :, None])
    return finish(from_chunks(O, T), normalize, eps)


CAUSAL = hla_forms.Family("hla3", init_state, step, token_summaries, combine, readout,
                          functools.partial(reference.hla3, mask="causal"),
                          chains.over_xla(chains.hla3), chains.over_pallas(chains.hla3))
PAPER = hla_forms.Family("hla3", paper_init_state, paper_step, paper_token_summaries,
                         paper_combine, paper_readout,
                         functools.partial(reference.hla3, mask="paper"), paper_chunked)


@precision_from_inputs
def hla3(q, k, v, g=None, *, mask="causal", normalize=False, eps=1e-6, impl="auto",
         chunk_size=64, seq_axis=None):
    """Third-order HLA, ``[B,T,H,dv]`` in the state dtype (float32, float64 for float64 inputs).

    ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g``: log-decay ``[B,T,H]``, per-head ``[H]`` or
    ``None`` (``mask="paper"`` has no decay: ``g`` must be ``None``).  ``mask``: "causal" |
    "paper".  ``normalize`` divides by ``clamp_signed(den, eps)``.  ``impl``: "reference" |
    "recurrent" | "scan" | "chunked" (causal: ``chains.hla3`` over ``linear.chunked``; paper:
    ``paper_chunked``) | "pallas" (causal mask only: the chain over
    ``hla_jax.kernels.la.la_pallas``; interpret mode on CPU) | "auto" (the causal Pallas chain
    on a GPU for bf16 inputs, ``common.pallas_preferred``; else "chunked").  ``seq_axis``: the
    mesh axis the time axis is sharded over, inside ``jax.shard_map`` (chunked only;
    ``ops.sequence``).
    """
    _check_mask(mask, g)
    if mask == "paper" and impl == "pallas":
        raise ValueError("hla3: impl='pallas' is for mask='causal' only")
    return hla_forms.dispatch(PAPER if mask == "paper" else CAUSAL, impl, IMPLS, q, k, v, g,
                              normalize=normalize, eps=eps, chunk_size=chunk_size,
                              seq_axis=seq_axis)
