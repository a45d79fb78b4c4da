"""Third-order HLA, docs/math.md#hla3, two semantics (``mask="causal"`` is the default).

causal:  o_t = Σ_{u≤t} Σ_{i,j≤u} D(t,i) D(t,u) D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j
         (= ((W_g Wᵀ) ∘ Γ)(W_g V); without decay (((W Wᵀ) ∘ L) W) V)
paper:   o_t = Σ over triples (i,u,j) ≤ t whose largest index occurs at least twice of
         (q_t·k_i)(k_i·q_u)(q_u·k_j) v_j  (no decay; the HLA paper's streaming algebra)

optionally ratio-normalised: ``o_t / clamp_signed(den_t, eps)``, ``den`` the same sum with ``v_j``
replaced by 1.  Both operators are linear in V, so the normalised form runs once on ``[V | 1]``
(``dv + 1`` columns): the last column of every ``d×dv`` state is its ``mK`` twin (P -> mK).
Forms that agree: ``reference``, ``recurrent`` (``step`` = decode step), token-level associative
``scan`` (``combine``), ``chunked``.  The causal ``chunked`` form is the chain (docs/math.md#chains) of two
first-order linear-attention passes (``chains.hla3``: ``LA(q, K̃, Ṽ; 2g)`` with
``[K̃ | Ṽ] = LA(q, k, [k | v]; g)``) over XLA's chunked LA, and "pallas" the same chain over the
Pallas LA kernel; the decode state is the chain's LA states: ``S = Σ D k kᵀ`` and
``P = Σ D k vᵀ`` the inner LA's (values ``[k | v]``), ``F = Σ_u D(t,u)² K̃_u Ṽ_uᵀ`` the outer
one's (decay ``a²``, ``K̃_t = S_t q_t``, ``Ṽ_t = P_tᵀ q_t``).  The ``paper`` mask does not factor
so: its chunked form is ``paper_chunk`` scanned over chunks, whose carry is the recurrent
``PaperState``.
Packed documents (``segment_ids``, docs/math.md#packed-documents), every form: causal resets its
state through the gate, ``g = −∞`` at every document start (``spec.reset``); ``paper`` has no decay, so its
forms cut at the starts themselves: the reference zeroes the cross-document entries of QKᵀ
(``paper_reference``), the recurrence restarts from the empty state, the scan's combine is
segmented, and ``paper_chunk`` masks by document and cuts the carried state (``paper_chunked``,
sequence-parallel too).  States: the recurrent, chunked and Pallas forms start from an
``initial_state`` (``State``; ``PaperState`` for ``paper``) and can return the final one.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay ``<= 0``), ``[H]`` or
``None``, ``segment_ids: [B,T]`` int or ``None``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.core.layout import from_chunks, pad_time, to_chunks
from hla_jax.ops import chains, dispatch, reference, sequence
from hla_jax.ops.common import cast_inputs, causal_mask, ein, mm, outer, tr
from hla_jax.ops.spec import Spec
from hla_jax.ops.xla import hla_forms
from hla_jax.ops.xla.hla_forms import finish


def _vq(q, M):
    """``qᵀ M`` for ``q: [...,d]``, ``M: [...,d,n]``."""
    return ein("...i,...in->...n", q, M)


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


def paper_chunk(state: PaperState, Q, K, V, doc=None):
    """One chunk of the ``paper`` form (``Q, K: [B,H,c,d]``, ``V: [B,H,c,dv]``): returns the state
    after the chunk (the recurrent ``PaperState``: a chunked prefill can hand it to ``paper_step``)
    and the chunk's outputs ``[B,H,c,dv]``.  ``doc: [B,c]`` int: each token's document counted
    from the chunk's start, 0 for the one the carried state belongs to (None: all 0).

    With the carried ``(SK0, SQ0, P0, G·0)``, ``A = QKᵀ``, ``a = diag(A)``, the masks
    ``L ∘ E``, ``L_s ∘ E`` (``L_s`` strict, ``E[τ,σ] = [doc τ = doc σ]``; below, ``L`` and ``L_s``
    include ``E``), ``f_τ = [doc τ = 0]`` (the token reads the carried state) and rows of the
    pre-token moments of the token's document (no per-token d×d states):
    ``Z_τ = k_τᵀ SQ_{τ-1}``: ``Z = f ∘ K SQ0 + (L_s ∘ Aᵀ) Q``;  ``Y_τ = (SK_{τ-1} q_τ)ᵀ``:
    ``Y = f ∘ Q SK0 + (L_s ∘ A) K``;  ``R_τ = q_τᵀ P_{τ-1}``: ``R = f ∘ Q P0 + (L_s ∘ A) V``;
    ``σ_τ = k_τᵀ SQ_{τ-1} k_τ = Z_τ·k_τ``.  Token m adds to ``H = SK SQ P − ΣG`` the triples with
    maximum m repeated, ``a_m k_m R_m + a_m (SK_{m-1} q_m) v_mᵀ + (σ_m + a_m²) k_m v_mᵀ``, so

        O  = f ∘ Q H0 + (L ∘ A)(a R + (σ + a²) V) + (L ∘ (Q Yᵀ)) (a V)

    and the state after the chunk is its last document's: with ``l_τ = [doc τ = doc_c]`` and
    ``κ = f_c`` (no start in the chunk: the carried state goes on), ``X → κ X + …`` for every
    field, ``SK += Kᵀ(l ∘ K)``, ``SQ += Qᵀ(l ∘ Q)``, ``P += Kᵀ(l ∘ V)`` and

        G1 += Kᵀ (l ∘ (f ∘ Z P0 + (L_s ∘ Z Kᵀ) V))     G2 += Yᵀ (l ∘ R)
        G3 += (f ∘ Z SK0 + (L_s ∘ Z Kᵀ) K)ᵀ (l ∘ V)
    """
    c = Q.shape[-2]
    doc = (jnp.zeros((1, c), jnp.int32) if doc is None else doc)[:, None]  # [B,1,c] over heads
    same = (doc[..., :, None] == doc[..., None, :]).astype(Q.dtype)
    L, Ls = causal_mask(c, Q.dtype) * same, jnp.tril(jnp.ones((c, c), Q.dtype), -1) * same
    f = (doc == 0)[..., None].astype(Q.dtype)
    l = (doc == doc[..., -1:])[..., None].astype(Q.dtype)
    kappa = f[..., -1:, :]
    A = mm(Q, tr(K))
    a = jnp.diagonal(A, axis1=-2, axis2=-1)[..., None]
    Z = f * mm(K, state.SQ) + mm(Ls * tr(A), Q)
    Y = f * mm(Q, state.SK) + mm(Ls * A, K)
    R = f * mm(Q, state.P) + mm(Ls * A, V)
    sigma = jnp.sum(Z * K, -1, keepdims=True)
    ZK = Ls * mm(Z, tr(K))
    O = (f * mm(Q, _paper_H(state)) + mm(L * A, a * R + (sigma + a**2) * V)
         + mm(L * mm(Q, tr(Y)), a * V))
    new = PaperState(
        SK=mm(tr(K), l * K),
        SQ=mm(tr(Q), l * Q),
        P=mm(tr(K), l * V),
        G1=mm(tr(K), l * (f * mm(Z, state.P) + mm(ZK, V))),
        G2=mm(tr(Y), l * R),
        G3=mm(tr(f * mm(Z, state.SK) + mm(ZK, K)), l * V),
    )
    return PaperState(*(kappa * x + y for x, y in zip(state, new))), O


def paper_reference(q, k, v, g=None, *, normalize=False, eps=1e-6, starts=None):
    """``reference.hla3(mask="paper")``; with ``starts [B,T]`` (document starts) on ``QKᵀ`` with
    every cross-document entry zeroed."""
    doc = None if starts is None else jnp.cumsum(starts, axis=1)
    same = None if doc is None else doc[:, :, None] == doc[:, None, :]
    return reference.hla3(q, k, v, g, mask="paper", normalize=normalize, eps=eps, same=same)


def _shard_prefix(total, restart, seq_axis):
    """``Σ total_i`` over the shards ``i < j`` back to the latest one that restarts (holds a
    document start; its total is then its last document's alone): ``restart: [B]`` bool, or
    ``None`` (no documents: ``sequence.exclusive_sum``)."""
    if restart is None:
        return sequence.exclusive_sum(total, seq_axis)

    def step(_, acc, s):
        x, r = s
        return jax.tree.map(lambda a, y: jnp.where(r[:, None, None, None], y, a + y), acc, x)

    return sequence.device_prefix(step, jax.tree.map(jnp.zeros_like, total), (total, restart),
                                  seq_axis)


# ---------------------------------------------------------------------------------------------
# forms


@functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
def paper_chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None,
                  initial_state=None, starts=None):
    """``paper`` chunked form (``g`` is ``None``) -> ``(o [B,T,H,dv], final PaperState)``: T
    padded to a multiple of ``c = min(chunk_size, T)``, a ``lax.scan`` of ``paper_chunk`` over the
    chunks ``[B,H,N,c,·]`` from ``initial_state`` (None: empty), each chunk told its tokens'
    documents from the document starts ``starts [B,T]`` (None: one document).

    Under ``seq_axis`` (shard ``j``), in two small collectives instead of gathering the
    ``d³·dv`` map of ``paper_combine``: the moments ``(SK0, SQ0, P0)`` of the earlier shards are
    an exclusive sum; the scan starts from ``(SK0, SQ0, P0, G = 0)``, whose ``H`` is
    ``H0' = SK0 SQ0 P0``; ``H`` then grows by a term ``ΔH_j`` that depends on the moments only,
    so the true prefix is ``H0 = Σ_{i<j} ΔH_i`` (a second exclusive sum) and every output gains
    ``Q (H0 − H0')`` (``o_t = q_tᵀ H_t`` is affine in the initial ``H``).  With documents, both
    sums run back to the latest shard holding a start (``_shard_prefix``): such a shard
    contributes its last document's moments and its final ``H`` (which no longer depends on
    what came before), and only the tokens before the shard's first start gain the correction.
    """
    B, T, H, d = q.shape
    q, k, v, _ = cast_inputs(q, k, v, None, normalize)
    c = min(chunk_size, T)
    Q, K, V = (to_chunks(pad_time(x, c), c) for x in (q, k, v))
    N = Q.shape[2]
    at_start = jnp.zeros((B, T), bool) if starts is None else starts
    doc = jnp.cumsum(pad_time(at_start, c).reshape(B, N, c), -1)  # documents from each chunk start
    init = (paper_init_state(B, H, d, V.shape[-1], dtype=Q.dtype) if initial_state is None
            else PaperState(*(x.astype(Q.dtype) for x in initial_state)))
    if seq_axis is not None:
        shard_doc = jnp.cumsum(at_start, 1)  # documents from the shard's start
        restart = None if starts is None else shard_doc[:, -1] > 0
        last = (shard_doc == shard_doc[:, -1:]).astype(q.dtype)[:, :, None, None]
        moments = [ein("bthd,bthe->bhde", last * x, y) for x, y in ((k, k), (q, q), (k, v))]
        init = sequence.varying(init, seq_axis)._replace(
            **dict(zip(("SK", "SQ", "P"), _shard_prefix(moments, restart, seq_axis))))
    final, O = jax.lax.scan(lambda s, x: paper_chunk(s, *x), init,
                            (*(jnp.moveaxis(x, 2, 0) for x in (Q, K, V)), jnp.moveaxis(doc, 1, 0)))
    O = jnp.moveaxis(O, 0, 2)
    if seq_axis is not None:
        carried = 1.0 if restart is None else (~restart).astype(q.dtype)[:, None, None, None]
        H0 = _shard_prefix(_paper_H(final) - carried * _paper_H(init), restart, seq_axis)
        first = (pad_time(shard_doc, c).reshape(B, 1, N, c, 1) == 0).astype(O.dtype)
        O = O + first * mm(Q, (H0 - _paper_H(init))[:, :, None])
    return finish(from_chunks(O, T), normalize, eps), final


CAUSAL = hla_forms.Family("hla3", init_state, step, token_summaries, combine, readout,
                          functools.partial(reference.hla3, mask="causal"),
                          chains.over_xla(chains.hla3, State), chains.over_pallas(chains.hla3, State))
PAPER = hla_forms.Family("hla3", paper_init_state, paper_step, paper_token_summaries,
                         paper_combine, paper_readout, paper_reference, paper_chunked,
                         decayed=False)

def flops(T, d, c):
    """Causal chunk form: ``QKᵀ, Q S₀ Qᵀ`` ``4cd``, ``A W_gᵀ, W_g A_Lᵀ`` ``4c²``, ``W_g V`` and
    four ``(c×c)(c×d)`` products ``10cd``; ``Q S₀, Q P₀, Q F₀`` ``6d²``; summaries
    ``S, P, Q2, X, Y, F`` ``12d²``; combine (five ``d×d·d×d`` products) ``10d³/c``."""
    return 14 * c * d + 4 * c * c + 18 * d * d + 10 * d ** 3 / c


MASKS = ("causal", "paper")


def _mask(mask="causal") -> Spec:
    """The spec of ``mask``: "causal" (``SPEC``) or "paper" (``PAPER_SPEC``, no decay, no
    kernel)."""
    if mask not in MASKS:
        raise ValueError(f"hla3: mask={mask!r} is not one of {MASKS}")
    return SPEC if mask == "causal" else PAPER_SPEC


SPEC = hla_forms.spec(CAUSAL, flops=flops, variant=_mask)
PAPER_SPEC = hla_forms.spec(PAPER, label="hla3 (mask='paper')", mixer="")
SPECS = (SPEC,)


def hla3(q, k, v, g=None, *, mask="causal", normalize=False, eps=1e-6, impl="auto",
         chunk_size=64, seq_axis=None, segment_ids=None, initial_state=None,
         return_final_state=False):
    """Third-order HLA (docs/math.md#hla3) with ``mask`` "causal" (the default),
    ``o_t = Σ_{u≤t} Σ_{i,j≤u} D(t,i) D(t,u) D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j``, or
    "paper" (the HLA paper's streaming algebra, no decay).

    Causal: "chunked" and "pallas" are the chain ``LA(q, K̃, Ṽ; 2g)``,
    ``[K̃ | Ṽ] = LA(q, k, [k | v]; g)`` (docs/math.md#chains).  Paper: "chunked" is
    ``paper_chunked``; there is no "pallas".

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``), or None (no decay; must be None with
            ``mask="paper"``).
        mask: "causal" | "paper".
        normalize: divide by ``clamp_signed(den, eps)``, ``den`` the same sum with ``v``
            replaced by 1.
        eps: the clamp of the denominator, ``> 0``.
        impl: "reference" | "recurrent" | "scan" | "chunked" | "pallas" (causal) | "auto".
        chunk_size: tokens per chunk of the chunked and Pallas forms.
        seq_axis: the mesh axis time is sharded over (chunked, auto), or None.
        segment_ids: ``[B,T]`` int, packed documents (each computed as if alone), or None.
        initial_state: a ``hla3.State(S, P, F)`` (``hla3.PaperState`` for "paper") to continue,
            or None.
        return_final_state: also return the state after the row.

    Returns:
        ``o [B,T,H,dv]`` in the state dtype, or ``(o, state)`` with ``return_final_state``.

    Raises:
        ValueError: naming the argument: an unknown ``mask``, a gate with "paper", "pallas"
            with "paper", and every check of ``hla2``.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 2, 4)) / 2
        >>> ops.hla3(q, k, v, mask="paper", impl="chunked", chunk_size=4).shape
        (1, 8, 2, 4)
    """
    return dispatch.run(SPEC, q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_final_state=return_final_state, normalize=normalize, eps=eps,
                        mask=mask)
