"""The counter form of log-linear Mamba-2 and Gated DeltaNet (docs/math.md#loglinear): matmuls
inside chunks of ``c`` tokens and a binary counter of chunk-level states across them, on the grid
of positions or, for packed documents and states at any position, over document-relative blocks.
The form for packed documents, states and sequence parallelism (whole rows take the block forms,
``ops.xla.loglinear_blocks`` and ``ops.xla.loglinear_gdn_blocks``).  ``chunked`` is the entry; shapes as
in ``ops.families.loglinear``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.core import fenwick
from hla_jax.core.documents import doc_positions, doc_starts
from hla_jax.core.layout import from_chunks, to_chunks
from hla_jax.core.state import LevelState, state_dtype
from hla_jax.ops import common, sequence
from hla_jax.ops.xla.gdn_chunked import ut_matrix
from hla_jax.ops.xla.la_chunked import decays
from hla_jax.ops.xla.ssm import cast, combine, mul, reset


def chunk_terms(Q, K, V, G, Beta):

    """Per-chunk pieces, all parallel over chunks (``[B,H,N,c,...]`` inputs), from the
    first-order chunk forms' decays (``la_chunked.decays``) and UT matrix
    (``gdn_chunked.ut_matrix``).

    Returns ``M`` (intra-chunk attention, ``[..., c, c]``), ``Q̂`` (what reads an incoming state,
    ``o ⊇ Q̂ H``), the chunk transition ``A_c`` and the write keys ``K_w`` (the chunk's own state
    is ``K_wᵀ V``, linear in V):
      Mamba-2:       M = (QKᵀ)∘Γ,  Q̂ = γ∘Q,          A_c = γ_c,            K_w = K̃
      Gated DeltaNet (UT transform ``T = (I + strict_tril(diag(β)(KKᵀ)∘Γ))⁻¹ diag(β)``,
      ``W = T(γ∘K)``): ``delta_terms`` and ``K_w = Tᵀ K̃`` (own = K̃ᵀ T V);
    with ``K̃ = (γ_c/γ)∘K``.
    """
    Gam, gamma = decays(G)
    if Beta is None:
        return (common.ein("...td,...sd->...ts", Q, K) * Gam, gamma[..., None] * Q,
                gamma[..., -1, None, None], Gam[..., -1, :, None] * K)
    Tm = ut_matrix(K, Beta, Gam)
    W = common.ein("...ts,...sd->...td", Tm, gamma[..., None] * K)
    M, Qh, A_c, Kt = delta_terms(Q, K, Gam, gamma, Tm, W)
    return M, Qh, A_c, common.ein("...ts,...td->...sd", Tm, Kt)


def delta_terms(Q, K, Gam, gamma, Tm, W):
    """Gated DeltaNet's ``(M, Q̂, A_c, K̃)`` of one chunk given its decays (``la_chunked.decays``), its
    UT transform ``Tm [..., c, c]`` and ``W = T(γ∘K) [..., c, d]`` (however computed:
    ``chunk_terms`` or the UT kernel): ``P = (QKᵀ)∘Γ``, ``M = P T``, ``Q̂ = γ∘Q − P W``,
    ``A_c = γ_c I − K̃ᵀ W``, ``K̃ = (γ_c/γ)∘K``."""
    Kt = Gam[..., -1, :, None] * K
    P = common.ein("...td,...sd->...ts", Q, K) * Gam
    d = K.shape[-1]
    A_c = gamma[..., -1, None, None] * jnp.eye(d, dtype=K.dtype) - common.ein("...cd,...ce->...de", Kt, W)
    return (common.ein("...ts,...sr->...tr", P, Tm),
            gamma[..., None] * Q - common.ein("...ts,...sd->...td", P, W), A_c, Kt)


def _at_levels(Lam, idx):
    """``λ`` at integer levels: ``Lam: [B,H,N,c,L]``, ``idx`` broadcastable to ``[B,H,N,c,K]``
    (clipped to the table) -> ``[B,H,N,c,K]``; a static (NumPy) ``idx``: ``fenwick.at_table``."""
    if isinstance(idx, np.ndarray):
        return fenwick.at_table(Lam, idx)
    idx = jnp.clip(idx, 0, Lam.shape[-1] - 1)
    return jnp.take_along_axis(Lam, jnp.broadcast_to(idx, Lam.shape[:-1] + idx.shape[-1:]), -1)


def _previous(x, n=1, fill=0):
    """``x`` of the chunk ``n`` before (axis 2, ``fill`` for the first ``n`` chunks)."""
    x = jnp.pad(x, [(0, 0), (0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 3), constant_values=fill)
    return x[:, :, :x.shape[2] - n]


class _Plan(NamedTuple):
    """Where chunk n's queries find each key: the exact window (``window``: the chunk's own
    keys at levels ``own``, with ``prev`` the previous chunk's too) and the counter
    (``_level_scan``: slots read at levels ``counter``, fed ``parts`` at ``slots``, index ``nxt``,
    ``late``)."""

    own: jax.Array
    prev: tuple | None
    counter: jax.Array
    nxt: jax.Array
    parts: jax.Array
    slots: jax.Array
    late: bool


def _level_scan(Qh, A_c, counter=None, incoming=None, seq_axis=None):
    """The prefix terms of every chunk, in one ``lax.scan`` over chunks ``n``; returns them
    (``[B,H,N,c,dv]``) and the states as read by the last chunk.

    ``counter = (w, plan)``: chunk-level states ``Hc: [S,B,H,d,dv]`` kept as a binary counter
    and read as ``Σ_j w[τ,j] Q̂_τ Hc[j]`` (``w: [B,H,N,c,S]``).  Before chunk n is read,
    ``Hc ← carry(A_{n−1} Hc + Σ_k e_{slots[k]} parts[k], nxt)`` (``plan.late``:
    ``carry(A_{n−1} (Hc + Σ_k e_{slots[k]} parts[k]), nxt)``, the parts cross chunk n−1 too),
    with ``plan.parts: [K,B,H,N,d,dv]`` added at level slots ``plan.slots: [K,B,N]`` and the
    counter index ``plan.nxt: [B,N]``.  ``incoming = (H_in: [L,B,H,d,dv], w_in: [B,H,N,c,L])``: states that
    cross every chunk and are never merged, read with their own weights.
    """
    B, H, N, _, d = Qh.shape
    a = A_c.shape[-1]
    first = (jnp.arange(N) == 0).reshape(N, 1, 1, 1, 1)
    eye = jnp.ones((1, 1), A_c.dtype) if a == 1 else jnp.eye(a, dtype=A_c.dtype)
    xs = {"Qh": jnp.moveaxis(Qh, 2, 0),
          "A": jnp.where(first, eye, jnp.moveaxis(_previous(A_c), 2, 0))}  # A_{n−1}
    carry = {}
    if counter is not None:
        w, plan = counter
        late = plan.late
        xs |= {"w": jnp.moveaxis(w, 2, 0), "nxt": plan.nxt.T,
               "parts": jnp.moveaxis(plan.parts, 3, 0), "slots": jnp.moveaxis(plan.slots, 2, 0)}
        carry["Hc"] = jnp.zeros((w.shape[-1], B, H, d) + plan.parts.shape[-1:], plan.parts.dtype)
        if seq_axis is not None:
            carry["Hc"] = sequence.varying(carry["Hc"], seq_axis)
    if incoming is not None:
        carry["Hin"], w_in = incoming
        xs["w_in"] = jnp.moveaxis(w_in, 2, 0)

    def body(st, x):
        st = dict(st)
        out = 0
        if "Hc" in st:
            S = st["Hc"].shape[0]
            add = common.ein("kbs,kbhdv->sbhdv", jax.nn.one_hot(x["slots"], S, dtype=Qh.dtype),
                             x["parts"])
            Hc = mul(x["A"], st["Hc"] + add) if late else mul(x["A"], st["Hc"]) + add
            st["Hc"] = fenwick.carry(Hc, x["nxt"])
            out = common.ein("bhcs,bhcd,sbhdv->bhcv", x["w"], x["Qh"], st["Hc"])
        if "Hin" in st:
            st["Hin"] = mul(x["A"], st["Hin"])
            out = out + common.ein("bhcl,bhcd,lbhdv->bhcv", x["w_in"], x["Qh"], st["Hin"])
        return st, out

    st, out = jax.lax.scan(body, carry, xs)
    return jnp.moveaxis(out, 0, 2), st


def _levels_of(L, states=(), keys=()):
    """``[L,B,H,d,dv]``: level states assembled from ``states`` (``(H: [K,B,H,d,dv], level: [B,K])``,
    state k at its level) and ``keys`` (``(K_w: [B,H,c,d], V: [B,H,c,dv], level: [B,c])``, the
    state ``K_w[σ] V[σ]ᵀ`` of each key at its level)."""
    out = 0
    for Hs, lev in states:
        out = out + common.ein("bkl,kbhdv->lbhdv", jax.nn.one_hot(lev, L, dtype=Hs.dtype), Hs)
    for Kw, V, lev in keys:
        out = out + common.ein("bcl,bhcd,bhcv->lbhdv", jax.nn.one_hot(lev, L, dtype=V.dtype), Kw, V)
    return out


def _fold_shards(total, level_of, seq_axis):
    """The earlier shards' keys as level states at this shard's first token: ``H ↦ A_i
    collapse(H, level_of(i, s_i)) + Own_i`` folded over shards ``i < j`` by
    ``sequence.device_prefix``, ``s_i = (A_i, Own_i, …)`` shard i's ``total``."""
    def cross(i, H, s):
        return mul(s[0], fenwick.collapse(H, level_of(i, s))) + s[1]

    return sequence.device_prefix(cross, jnp.zeros_like(total[1]), total, seq_axis)


def _incoming_levels(A_c, Kw, V, pos, t0, T, levels, seq_axis):
    """Fenwick level states of the earlier shards' keys, as seen from this shard's ``t0``.

    Shard ``i`` summarises itself by its transition ``A_i`` and ``Own_i[ℓ]``, its keys at level
    ``ℓ`` of ``t_{i+1} = t_i + T`` carried to its end (``K_wᵀ V`` with V masked by level, then
    the chunk combine).  Crossing shard ``i`` maps the earlier keys' states ``H ↦ A_i
    collapse(H, ℓ_i) + Own_i`` with ``ℓ_i = bit_length(t_{i+1} XOR t_i)`` (``_fold_shards``).
    Returns ``[levels,B,H,d,dv]``.
    """
    onehot = fenwick.level(t0 + T, pos)[None] == jnp.arange(levels)[:, None, None]
    own = common.ein("...cd,l...cv->l...dv", Kw, onehot[:, None, None, :, :, None] * V[None])
    A_i, Own_i = sequence.segment_total(combine, (A_c[None], own), axis=3)
    return _fold_shards((A_i[:, :, :, 0], Own_i[:, :, :, 0]),
                        lambda i, s: int(fenwick.level((i + 1) * T, i * T)), seq_axis)


def window(Lam, M, V, lev, prev=None):
    """The exact part: ``(Λ ∘ M) V`` over the chunk's own keys, ``Λ[τ,σ] = λ_τ^{lev[τ,σ]}``,
    plus ``(Λ' ∘ (Q̂ K_w'ᵀ)) V'`` over the previous chunk's with ``prev = (Q̂, K_w', V', lev')``."""
    out = common.ein("...ts,...sv->...tv", _at_levels(Lam, lev) * M, V)
    if prev is None:
        return out
    Qh, Kw_p, V_p, lev_p = prev
    P = common.ein("...td,...sd->...ts", Qh, Kw_p)
    return out + common.ein("...ts,...sv->...tv", _at_levels(Lam, lev_p) * P, V_p)


def _grid_plan(own, c: int, S: int, n0):
    """Chunks on the grid of positions (chunk n holds positions ``(n0 + n) c …``): the static
    table ``fenwick.level_table(c)`` inside a chunk, and a counter over chunks that chunk n−1's
    keys enter before chunk n is read, slot j at level ``log2 c + j``."""
    B, _, N = own.shape[:3]
    return _Plan(fenwick.level_table(c), None, fenwick.chunk_log2(c) + np.arange(S),
                 jnp.broadcast_to(n0 + jnp.arange(N), (B, N)), _previous(own)[None],
                 jnp.zeros((1, B, N), jnp.int32), False)


def _document_plan(pos, Qh, Kw, V, own, S: int):
    """Chunks off the grid of positions: levels count from document starts anywhere (``pos:
    [B,1,N,c]``, each token's position in its document).

    The exact window of chunk n is chunks n−1 and n, at levels ``ℓ(p_τ, p_σ)``.  Older keys are
    in a binary counter over document-relative blocks ``m = p >> log2 c``: query block ``m_τ``
    and key block ``m_σ < m_τ`` are at level ``log2 c + bit_length(m_τ XOR m_σ)``.  Chunk n's
    queries lie in blocks ``M_n`` (that of its first token) and ``M_n + 1``; the counter holds
    the keys of chunks ≤ n−2 at their levels for block ``M_n``, and block ``m_τ`` reads slot j
    at level ``log2 c + max(j, bit_length(m_τ XOR M_n))`` (``fenwick.levels_at``).  Chunk
    n's keys enter before chunk n+2 is read (one chunk late, so the counter never holds a
    query's own block), split into the parts in blocks ``M_{n+1} − 1`` and ``M_{n+1}``.  A
    document start in a chunk zeroes its transition (``g = -inf``), so the counter and incoming
    states are empty behind it, and ``Q̂`` is zero from it to the chunk's end.
    """
    lc = fenwick.chunk_log2(pos.shape[-1])
    prev = (Qh, _previous(Kw), _previous(V),
            fenwick.level(pos[..., :, None], _previous(pos)[..., None, :]))
    blk = pos >> lc
    Mb = blk[..., 0]                                               # [B,1,N]
    hi = blk == jnp.concatenate([Mb[..., 1:], Mb[..., -1:] + 1], -1)[..., None]
    own_hi = common.ein("...cd,...cv->...dv", Kw, jnp.where(hi[..., None], V, 0))
    M_p = _previous(Mb)[:, 0]                                      # [B,N]: M_{n−1}
    return _Plan(fenwick.level(pos[..., :, None], pos[..., None, :]), prev,
                 lc + fenwick.levels_at(S, blk, Mb[..., None]), Mb[:, 0],
                 jnp.stack([_previous(own - own_hi, 2), _previous(own_hi, 2)]),
                 jnp.stack([fenwick.level(M_p, M_p - 1), jnp.zeros_like(M_p)]), True)


def _shard_start(segment_ids, t0, T: int, seq_axis):
    """``[B]``: the position of this shard's first token in its document, ``t0`` minus the
    last document start on an earlier shard (0 if none; ``sequence.device_prefix``)."""
    starts = doc_starts(segment_ids, seq_axis)
    latest = jnp.max(jnp.where(starts, t0 + jnp.arange(T), 0), axis=1)
    return t0 - sequence.device_prefix(lambda _, a, s: jnp.maximum(a, s), jnp.zeros_like(latest),
                                       latest, seq_axis)


def _final_state(plan, st, lev_in, A_c, Kw, V, L: int, T: int, t_next):
    """``LevelState`` after the last token (``τ`` in the last chunk): the states as the last
    chunk reads them and the previous chunk's keys, each at its level for ``τ`` and crossed by
    the last chunk, plus the last chunk's own keys at their levels."""
    B, _, N, c = Kw.shape[:4]
    tau = (T - 1) - (N - 1) * c

    def at_tau(lev):
        return jnp.broadcast_to(lev, (B, 1, N, c) + lev.shape[-1:])[:, 0, N - 1, tau]

    older = [(st["Hc"], at_tau(plan.counter))]
    if lev_in is not None:
        older.append((st["Hin"], at_tau(lev_in)))
    keys = [] if plan.prev is None else [(plan.prev[1][:, :, -1], plan.prev[2][:, :, -1],
                                          at_tau(plan.prev[3]))]
    H = (mul(A_c[:, :, -1], _levels_of(L, older, keys))
         + _levels_of(L, keys=[(Kw[:, :, -1], V[:, :, -1], at_tau(plan.own))]))
    return LevelState(H, t_next)


def _incoming_read(Qh, A_c, Lam, pos, start, local, seq_axis):
    """With ``segment_ids`` under ``seq_axis``: what this shard's queries read of the earlier
    shards' keys.  Shard i is summarised by its transition and its final state ``local`` (from
    an empty state, at its documents' positions) carried to the next position ``te``;
    crossing it collapses the earlier keys' levels by ``bit_length(te XOR P_i)``, ``P_i`` its
    first position.  A second pass over the chunks reads them."""
    A_i = sequence.segment_total(lambda a, b: mul(b, a), A_c, axis=2)[:, :, 0]
    te = local.t
    H_in = _fold_shards((A_i, fenwick.carry(local.H, te), fenwick.level(te, start)),
                        lambda _, s: s[2], seq_axis)
    w_in = _at_levels(Lam, fenwick.levels_at(H_in.shape[0], pos, start[:, None, None, None]))
    return _level_scan(Qh, A_c, incoming=(H_in, w_in), seq_axis=seq_axis)[0]


def chunked(q, k, v, g, beta, lam, chunk_size=64, seq_axis=None, initial_state=None,
            segment_ids=None):
    """Counter form: O(T·c) intra-chunk matmuls plus a scan over chunk states.  Returns
    ``(o, final_state)``: the ``LevelState`` after the last token (None under ``seq_axis``).
    ``beta=None``: log-linear Mamba-2.

    ``chunk_size`` a power of two; levels
    ``0..log2 c`` are inside the chunk, ``O ⊇ (Λ_intra ∘ M) V`` with
    ``Λ_intra[τ,σ] = λ_τ^{ℓ(τ,σ)}`` from the static table ``fenwick.level_table(c)``; chunk
    ``n' < n`` is at level ``log2 c + bit_length(n XOR n')`` and enters as ``λ_τ^{(ℓ)} Q̂_τ Hc[ℓ]``.
    The level states are a binary counter over chunks in one pass (``_grid_plan``): O(T log T)
    time, O(log T) states in memory.

    With ``segment_ids [B,T]`` or an ``initial_state`` (``LevelState``, at any position ``P``)
    the levels count from positions off the chunk grid: ``_document_plan`` reads levels of
    document positions over a two-chunk window (twice the intra-chunk work) and keeps its
    counter over document-relative blocks; still O(T log T) time and O(log T) states, static
    shapes.  The initial state's keys come in as level states at ``P``, read by query t at
    level ``max(ℓ, bit_length(p_t XOR P))`` (``fenwick.levels_at``).

    ``seq_axis`` (``ops.sequence``): levels depend on global positions: shard ``j`` (first token
    ``t0 = j T``) shifts its tokens by ``t0 mod c`` behind zero tokens so that its chunks sit on
    the global chunk grid (``level_table`` and the counter, started empty at global chunk
    ``⌊t0/c⌋``, stay exact; a chunk split between shards is read by both, each with its own
    keys), and the earlier shards' keys come in as level states at ``t0``
    (``_incoming_levels``).  With ``segment_ids`` each shard runs the document plan from its
    first token's position in its document (``_shard_start``) and the earlier shards' keys are
    read in a second pass (``_incoming_read``).
    """
    dt = state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = cast(dt, q, k, v, g, beta, lam)
    B, T = q.shape[:2]
    g = reset(g, segment_ids, seq_axis)
    c = chunk_size
    documents = segment_ids is not None or initial_state is not None
    t0 = sequence.first_position(seq_axis, T)
    shifted = not documents and seq_axis is not None and T % c != 0
    shift = t0 % c if shifted else 0
    N = -(-(T + (c - 1) * shifted) // c)

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, N * c - T)] + [(0, 0)] * (x.ndim - 2))
        return to_chunks(jnp.roll(x, shift, axis=1) if shifted else x, c)

    Q, K, V, G, Beta, Lam = (None if x is None else chunks(x) for x in (q, k, v, g, beta, lam))
    M, Qh, A_c, Kw = chunk_terms(Q, K, V, G, Beta)
    own = common.ein("...cd,...cv->...dv", Kw, V)
    L = Lam.shape[-1]
    lc = fenwick.chunk_log2(c)
    S = fenwick.num_levels(-(-(T * sequence.axis_size(seq_axis)) // c) + int(shifted))
    H_in = None
    if documents:
        start = jnp.zeros((B,), jnp.int32)
        if initial_state is not None:
            start, S = initial_state.t.astype(jnp.int32), max(S, L - lc)
            H_in = fenwick.carry(initial_state.H.astype(dt), start)
        elif seq_axis is not None:
            start = _shard_start(segment_ids, t0, T, seq_axis)
        pos = (start[:, None] + jnp.arange(T, dtype=jnp.int32) if segment_ids is None
               else doc_positions(segment_ids, start, seq_axis))
        pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(N * c - T)], 1)
        pos = pos.reshape(B, 1, N, c)
        plan = _document_plan(pos, Qh, Kw, V, own, S)
    else:
        start = t0
        pos = (t0 - shift + jnp.arange(N * c)).reshape(N, c)  # global positions (padding: zeros)
        plan = _grid_plan(own, c, S, t0 // c)
        if seq_axis is not None:
            levels = fenwick.num_levels(T * sequence.axis_size(seq_axis))
            H_in = _incoming_levels(A_c, Kw, V, pos, t0, T, levels, seq_axis)
    Lam = jnp.pad(Lam, [(0, 0)] * 4 + [(0, max(0, lc + S - L))])
    lev_in = None if H_in is None else fenwick.levels_at(
        H_in.shape[0], pos, start[:, None, None, None] if documents else start)
    prefix, st = _level_scan(Qh, A_c, (_at_levels(Lam, plan.counter), plan),
                             None if H_in is None else (H_in, _at_levels(Lam, lev_in)), seq_axis)
    out = window(Lam, M, V, plan.own, plan.prev) + prefix
    final = None
    if seq_axis is None or documents:
        t_next = (pos.reshape(B, N * c)[:, T - 1] + 1 if documents
                  else jnp.full((B,), T, jnp.int32))
        final = _final_state(plan, st, lev_in, A_c, Kw, V, L, T, t_next)
    if seq_axis is not None and documents:
        out = out + _incoming_read(Qh, A_c, Lam, pos, start, final, seq_axis)
        final = None
    out = from_chunks(out, N * c)
    return (jnp.roll(out, -shift, axis=1) if shifted else out)[:, :T], final
