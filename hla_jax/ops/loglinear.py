"""Log-linear Mamba-2 and (log-linear) Gated DeltaNet: the first-order state-space core (SPEC §4).

One core covers four operators.  A token's transition is ``A_t = a_t`` (Mamba-2, stored as
``[..., 1, 1]``) or ``A_t = a_t (I − β_t k_t k_tᵀ)`` (Gated DeltaNet, ``[..., d, d]``), and it
writes ``X_t = k_t β_t v_tᵀ`` (β = 1 for Mamba-2).  Then

    plain:      o_t = q_tᵀ Σ_{s≤t} (A_t ⋯ A_{s+1}) X_s
    log-linear: o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) X_s,  ℓ(t,s) = bit_length(t XOR s)

With every λ = 1 the log-linear operator is the plain one; the plain forms here are the same
code with the level split switched off (``lam=None``: one state, plain cost).

Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``, ``lam: [B,T,H,L]`` with
``L ≥ fenwick.num_levels(T)``; outputs ``[B,T,H,dv]`` in the state dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from hla_jax.ops import common, fenwick, reference, sequence

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas", "auto")
# the entries with impl="pallas" (``common.pallas_entry``; linear_attention and mamba2: la_pallas)
KERNELS = ("linear_attention", "mamba2", "loglinear_mamba2", "loglinear_gated_deltanet")


def _mul(A, X):
    """``A X`` for a transition ``A``: ``[..., 1, 1]`` (scalar decay) or ``[..., d, d]``."""
    if A.shape[-1] == 1:
        return A * X
    return common.mm(A, X)


# --------------------------------------------------------------------------- algebra


def token_summaries(k, v, g, beta=None):
    """Per-token SSM pair ``(A_t, X_t)``, ``X_t = k_t β_t v_tᵀ: [..., d, dv]``.

    ``A_t = a_t`` as ``[..., 1, 1]`` (``beta=None``) or ``a_t (I − β_t k_t k_tᵀ): [..., d, d]``.
    ``k: [..., d]``, ``v: [..., dv]``, ``g, beta: [...]``.
    """
    a = jnp.exp(g)[..., None, None]
    if beta is None:
        return a, k[..., :, None] * v[..., None, :]
    kb = beta[..., None] * k
    eye = jnp.eye(k.shape[-1], dtype=k.dtype)
    return a * (eye - kb[..., :, None] * k[..., None, :]), kb[..., :, None] * v[..., None, :]


def combine(a, b):
    """SSM pair, ``a`` before ``b``: ``(A_a, H_a) ⊕ (A_b, H_b) = (A_b A_a, A_b H_a + H_b)``."""
    (A_a, H_a), (A_b, H_b) = a, b
    return _mul(A_b, A_a), _mul(A_b, H_a) + H_b


def readout(H, q, lam=None):
    """``o = qᵀ H`` (``H: [..., d, dv]``) or ``Σ_ℓ λ^ℓ qᵀ H[ℓ]`` (``H: [L, ..., d, dv]``,
    ``lam: [..., L]``)."""
    if lam is None:
        return common.ein("...d,...dv->...v", q, H)
    return common.ein("...l,...d,l...dv->...v", lam, q, H)


def init_state(B, H, d, dv, levels=None, dtype=jnp.float32):
    """Zero state: ``[B,H,d,dv]`` (plain) or ``[levels,B,H,d,dv]`` (one d×dv state per level)."""
    lead = () if levels is None else (levels,)
    return jnp.zeros((*lead, B, H, d, dv), dtype)


def step(state, t, q, k, v, g, beta=None, lam=None):
    """One token at (traced) position ``t``; returns ``(o_t, new_state)``.

    ``q, k: [B,H,d]``, ``v: [B,H,dv]``, ``g, beta: [B,H]``, ``lam: [B,H,L]`` (None: plain).
    Log-linear (SPEC §4): carry the binary counter, ``H[ℓ] ← A_t H[ℓ]`` for every ℓ,
    ``H[0] = k_t β_t v_tᵀ``, ``o_t = Σ_ℓ λ_t^ℓ H[ℓ]ᵀ q_t``.  Plain: ``H ← A_t H + k_t β_t v_tᵀ``.
    ``A_t H = a_t (H − β_t k_t (k_tᵀ H))`` is applied as a rank-one update (O(d·dv) per state).
    """
    H = state if lam is None else fenwick.carry(state, t)
    if beta is not None:
        kH = common.ein("...d,...dv->...v", k, H)
        H = H - beta[..., None, None] * k[..., :, None] * kH[..., None, :]
        v = beta[..., None] * v
    H = jnp.exp(g)[..., None, None] * H
    X = k[..., :, None] * v[..., None, :]
    H = H + X if lam is None else H.at[0].add(X)
    return readout(H, q, lam), H


# --------------------------------------------------------------------------- forms


def _cast(dt, *xs):
    return [None if x is None else jnp.asarray(x).astype(dt) for x in xs]


def recurrent(q, k, v, g, beta=None, lam=None):
    """Serial recurrence: ``lax.scan`` of ``step`` over time (the decode path)."""
    dt = common.state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = _cast(dt, q, k, v, g, beta, lam)
    B, _, H, d = q.shape
    levels = None if lam is None else lam.shape[-1]

    def body(carry, *x):
        state, t = carry
        o, state = step(state, t, *x)
        return o, (state, t + 1)

    carry0 = (init_state(B, H, d, v.shape[-1], levels, dt), jnp.zeros((), jnp.int32))
    out, _ = common.scan_time(body, carry0, q, k, v, g, beta, lam)
    return out


def _segmented_states(A, X, reset):
    """Inclusive prefix states ``H_t = A_t H_{t−1} + X_t`` over time, restarted at ``reset``."""
    A = jnp.where(jnp.asarray(reset).reshape((1, -1) + (1,) * (A.ndim - 2)), 0, A)
    return jax.lax.associative_scan(combine, (A, X), axis=1)[1]


def scan(q, k, v, g, beta=None, lam=None):
    """Token-level associative scan with ``combine`` (SPEC §4 "Token-level scan form").

    Plain: one scan, ``o_t = q_tᵀ H_t``.  Log-linear: level 0 is the token itself; for level
    ℓ ≥ 1 the bucket of query t (present when bit ℓ−1 of t is 1) is the aligned block
    ``[b, b + 2^{ℓ−1})``, ``b = (t >> ℓ) << ℓ``: one segmented scan per level, restarted at
    multiples of ``2^ℓ`` and fed only by the left half of each ``2^ℓ`` block, carries the
    block's state through ``A_{e+1} … A_t`` to its readers in the right half.
    Memory O(T·d·dv) per level, plus O(T·d²) for Gated DeltaNet's transitions: use the chunked
    form for long sequences.
    """
    dt = common.state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = _cast(dt, q, k, v, g, beta, lam)
    T = q.shape[1]
    A, X = token_summaries(k, v, g, beta)
    if lam is None:
        return readout(_segmented_states(A, X, np.zeros(T, bool)), q)
    out = lam[..., 0:1] * readout(X, q)
    pos = np.arange(T)
    for lev in range(1, fenwick.num_levels(T)):
        left = ((pos >> (lev - 1)) & 1) == 0
        block = _segmented_states(A, jnp.where(left[:, None, None, None], X, 0),
                                  pos % (1 << lev) == 0)
        out = out + jnp.where(left[:, None, None], 0, lam[..., lev:lev + 1]) * readout(block, q)
    return out


def _chunk_terms(Q, K, V, G, Beta):
    """Per-chunk pieces, all parallel over chunks (``[B,H,N,c,...]`` inputs).

    Returns ``M`` (intra-chunk attention, ``[..., c, c]``), ``Q̂`` (what reads an incoming state,
    ``o ⊇ Q̂ H``), the chunk transition ``A_c`` and the write keys ``K_w`` (the chunk's own state
    is ``K_wᵀ V``, linear in V):
      Mamba-2:       M = (QKᵀ)∘Γ,  Q̂ = γ∘Q,          A_c = γ_c,            K_w = K̃
      Gated DeltaNet (UT transform ``T = (I + strict_tril(diag(β)(KKᵀ)∘Γ))⁻¹ diag(β)``,
      ``W = T(γ∘K)``): M = ((QKᵀ)∘Γ) T,  Q̂ = γ∘Q − ((QKᵀ)∘Γ) W,
      A_c = γ_c I − K̃ᵀ W,  K_w = Tᵀ K̃ (own = K̃ᵀ T V);   with ``K̃ = (γ_c/γ)∘K``.
    """
    Gam = common.decay_matrix(G)                     # Γ: [..., c, c]
    gamma = jnp.exp(jnp.cumsum(G, axis=-1))          # γ_τ = D(τ, −1)
    Kt = Gam[..., -1, :, None] * K                   # K̃ = (γ_c / γ) ∘ K
    gamma_c = gamma[..., -1, None, None]
    P = common.ein("...td,...sd->...ts", Q, K) * Gam
    if Beta is None:
        return P, gamma[..., None] * Q, gamma_c, Kt
    c, d = K.shape[-2:]
    eye = jnp.eye(c, dtype=K.dtype)
    strict = jnp.tril(Beta[..., :, None] * common.ein("...td,...sd->...ts", K, K) * Gam, -1)
    Tm = solve_triangular(eye + strict, eye * Beta[..., None, :], lower=True, unit_diagonal=True)
    W = common.ein("...ts,...sd->...td", Tm, gamma[..., None] * K)
    Qh = gamma[..., None] * Q - common.ein("...ts,...sd->...td", P, W)
    A_c = gamma_c * jnp.eye(d, dtype=K.dtype) - common.ein("...cd,...ce->...de", Kt, W)
    return (common.ein("...ts,...sr->...tr", P, Tm), Qh, A_c,
            common.ein("...ts,...td->...sd", Tm, Kt))


def _prefix_plain(Qh, A_c, own, seq_axis=None):
    """``Q̂ H_{n−1}``, ``H`` the exclusive prefix of ``combine`` over chunks (and earlier shards)."""
    B, H, _, d = own.shape[:4]
    eye = jnp.ones((1, 1), own.dtype) if A_c.shape[-1] == 1 else jnp.eye(d, dtype=own.dtype)
    identity = (jnp.broadcast_to(eye, (B, H, 1) + eye.shape),
                jnp.zeros((B, H, 1) + own.shape[3:], own.dtype))
    Hp = sequence.chunk_prefixes(combine, identity, (A_c, own), 2, seq_axis)[1]
    return common.ein("...cd,...dv->...cv", Qh, Hp)


def _prefix_levels(Qh, A_c, own, w, n0=0, incoming=None):
    """``Σ_m w[τ,m] Q̂ Hc[m]`` with chunk-level states ``Hc`` kept as a binary counter over chunks.

    One ``lax.scan`` over chunks ``n = n0, n0+1, …`` carries ``Hc: [S,B,H,d,dv]``: carry(Hc, n),
    read the prefix, cross the chunk (``Hc[m] ← A_c Hc[m]`` for every m), then ``Hc[0] += own``.
    ``Hc[m]`` (m ≥ 1) holds the chunks at level ``log2 c + m``; ``w: [B,H,N,c,S]``.
    ``incoming = (H_in: [L,B,H,d,dv], w_in: [B,H,N,c,L])``: states from earlier shards, carried
    along (crossing every chunk, never merged) and read with their own weights.
    """
    S, N = w.shape[-1], own.shape[2]

    def body(Hc, x):
        n, Qh_n, A_n, own_n, w_n = x
        Hc = jnp.concatenate([fenwick.carry(Hc[:S], n), Hc[S:]])
        out = common.ein("bhcs,bhcd,sbhdv->bhcv", w_n, Qh_n, Hc)
        return _mul(A_n, Hc).at[0].add(own_n), out

    Hc0 = jnp.zeros((S,) + own.shape[:2] + own.shape[3:], own.dtype)
    if incoming is not None:
        Hc0, w = jnp.concatenate([Hc0, incoming[0]]), jnp.concatenate([w, incoming[1]], -1)
    xs = [jnp.moveaxis(x, 2, 0) for x in (Qh, A_c, own, w)]
    _, out = jax.lax.scan(body, Hc0, [n0 + jnp.arange(N, dtype=jnp.int32), *xs])
    return jnp.moveaxis(out, 0, 2)


def _incoming_levels(A_c, Kw, V, pos, t0, T, levels, seq_axis):
    """Fenwick level states of the earlier shards' keys, as seen from this shard's ``t0``.

    Shard ``i`` summarises itself by its transition ``A_i`` and ``Own_i[ℓ]``, its keys at level
    ``ℓ`` of ``t_{i+1} = t_i + T`` carried to its end (``K_wᵀ V`` with V masked by level, then
    the chunk combine).  Crossing shard ``i`` maps the earlier keys' states ``H ↦ A_i
    collapse(H, ℓ_i) + Own_i`` with ``ℓ_i = bit_length(t_{i+1} XOR t_i)`` (``fenwick.collapse``),
    folded over ``i < j`` by ``sequence.device_prefix``.  Returns ``[levels,B,H,d,dv]``.
    """
    onehot = fenwick.level(t0 + T, pos)[None] == jnp.arange(levels)[:, None, None]
    own = common.ein("...cd,l...cv->l...dv", Kw, onehot[:, None, None, :, :, None] * V[None])
    A_i, Own_i = sequence.segment_total(combine, (A_c[None], own), axis=3)

    def cross(i, H, s):
        A, Own = s
        return _mul(A, fenwick.collapse(H, int(fenwick.level((i + 1) * T, i * T)))) + Own

    init = jnp.zeros(own.shape[:3] + own.shape[4:], own.dtype)
    return sequence.device_prefix(cross, init, (A_i[:, :, :, 0], Own_i[:, :, :, 0]), seq_axis)


def chunked(q, k, v, g, beta=None, lam=None, chunk_size=64, seq_axis=None):
    """Chunked form: O(T·c) intra-chunk matmuls plus a scan over chunk states.

    Plain: ``O = M V + Q̂ H_{n−1}``.  Log-linear (``chunk_size`` a power of two): levels
    ``0..log2 c`` are inside the chunk, ``O ⊇ (Λ_intra ∘ M) V`` with
    ``Λ_intra[τ,σ] = λ_τ^{ℓ(τ,σ)}`` from the static table ``fenwick.level_table(c)``; chunk
    ``n' < n`` is at level ``log2 c + bit_length(n XOR n')`` and enters as ``λ_τ^{(ℓ)} Q̂_τ Hc[ℓ]``.
    The level states are a binary counter over chunks in one pass: O(T log T) time, O(log T)
    states in memory.

    ``seq_axis`` (``ops.sequence``): plain, the earlier shards' total state precedes the chunk
    prefixes.  Log-linear, levels depend on global positions: shard ``j`` (first token
    ``t0 = j T``) shifts its tokens by ``t0 mod c`` behind zero tokens so that its chunks sit on
    the global chunk grid (``level_table`` and the counter, started empty at global chunk
    ``⌊t0/c⌋``, stay exact; a chunk split between shards is read by both, each with its own
    keys), and the earlier shards' keys come in as level states relative to ``t0``
    (``_incoming_levels``): query ``t`` reads ``H_in[ℓ]`` at level ``max(ℓ, bit_length(t XOR t0))``.
    """
    dt = common.state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = _cast(dt, q, k, v, g, beta, lam)
    T = q.shape[1]
    c = chunk_size
    levels_sharded = lam is not None and seq_axis is not None
    t0 = sequence.first_position(seq_axis, T)
    shifted = levels_sharded and T % c != 0           # shards start off the global chunk grid
    shift = t0 % c if shifted else 0
    N = -(-(T + (c - 1) * shifted) // c)

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, N * c - T)] + [(0, 0)] * (x.ndim - 2))
        return common.to_chunks(jnp.roll(x, shift, axis=1) if shifted else x, c)

    Q, K, V, G, Beta, Lam = (None if x is None else chunks(x) for x in (q, k, v, g, beta, lam))
    M, Qh, A_c, Kw = _chunk_terms(Q, K, V, G, Beta)
    own = common.ein("...cd,...cv->...dv", Kw, V)
    if Lam is None:
        out = common.ein("...ts,...sv->...tv", M, V) + _prefix_plain(Qh, A_c, own, seq_axis)
        return common.from_chunks(out, T)
    lc = fenwick.chunk_log2(c)
    T_all = T * sequence.axis_size(seq_axis)
    S = fenwick.num_levels(-(-T_all // c) + int(shifted))  # chunk levels up to the last chunk
    L = Lam.shape[-1]
    Lam = jnp.pad(Lam, [(0, 0)] * 4 + [(0, max(0, lc + S - L))])
    idx = jnp.asarray(np.maximum(fenwick.level_table(c), 0))  # masked above the diagonal by M
    Lam_intra = jnp.take_along_axis(Lam, jnp.broadcast_to(idx, Lam.shape[:3] + idx.shape), axis=-1)
    incoming = None
    if levels_sharded:
        pos = (t0 - shift + jnp.arange(N * c)).reshape(N, c)  # global positions (padding: zeros)
        levels = fenwick.num_levels(T_all)
        H_in = _incoming_levels(A_c, Kw, V, pos, t0, T, levels, seq_axis)
        lev = jnp.maximum(jnp.arange(levels), fenwick.level(pos, t0)[..., None])
        lev = jnp.broadcast_to(jnp.minimum(lev, L - 1), Lam.shape[:2] + lev.shape)
        incoming = (H_in, jnp.take_along_axis(Lam, lev, axis=-1))
    out = common.ein("...ts,...sv->...tv", Lam_intra * M, V) + _prefix_levels(
        Qh, A_c, own, Lam[..., lc:lc + S], t0 // c, incoming)
    out = common.from_chunks(out, N * c)
    return (jnp.roll(out, -shift, axis=1) if shifted else out)[:, :T]


# --------------------------------------------------------------------------- public entries

_JITTED = {"recurrent": jax.jit(recurrent), "scan": jax.jit(scan),
           "chunked": jax.jit(chunked, static_argnames=("chunk_size", "seq_axis"))}


def check_lam(lam, B, T, H, *, name, T_all=None):
    """``lam: [B,T,H,L]`` with ``L ≥ fenwick.num_levels(T_all)`` (``T_all``: the global length
    of a sharded sequence, default ``T``); ValueError otherwise."""
    lam = jnp.asarray(lam)
    T_all = T if T_all is None else T_all
    need = fenwick.num_levels(T_all)
    if lam.ndim != 4 or lam.shape[:3] != (B, T, H):
        raise ValueError(f"{name}: lam must have shape [B,T,H,levels] with [B,T,H]={(B, T, H)}, "
                         f"got {lam.shape}")
    if lam.shape[-1] < need:
        raise ValueError(f"{name}: lam has {lam.shape[-1]} levels but T={T_all} needs at least "
                         f"{need} (⌈log2 T⌉+1)")
    return lam


def _reference(q, k, v, g, beta, lam):
    if beta is None:
        return (reference.linear_attention(q, k, v, g) if lam is None
                else reference.loglinear_mamba2(q, k, v, g, lam))
    return (reference.gated_deltanet(q, k, v, g, beta) if lam is None
            else reference.loglinear_gated_deltanet(q, k, v, g, beta, lam))


def run(name, q, k, v, g, beta=None, lam=None, *, impl="auto", chunk_size=64, log_levels=False,
        gate_required=True, seq_axis=None):
    """Validate, then dispatch ``impl`` to the reference or one of the (jitted) forms above.

    ``log_levels``: ``lam`` is required and ``chunk_size`` must be a power of two;
    ``gate_required=False``: ``g=None`` means no decay; ``seq_axis``: the mesh axis the time
    axis is sharded over, inside ``jax.shard_map`` (chunked only; ``ops.sequence``).
    """
    impl = common.check_impl(impl, IMPLS, name=name)
    if impl == "pallas" and name not in KERNELS:
        raise ValueError(f"{name}: impl='pallas' has kernels for {KERNELS} only")
    sequence.check_impl(impl, seq_axis, name=name)
    chunk_size = common.check_chunk_size(chunk_size)
    B, T, H, _, _ = common.check_qkv(q, k, v, name=name)
    if impl == "auto" and name in KERNELS and common.pallas_preferred(seq_axis, chunk_size, q, k, v):
        impl = "pallas"
    g = common.check_gate(g, B, T, H, name=name, required=gate_required)
    if beta is not None:
        beta = common.check_per_token(beta, B, T, H, "beta", name=name)
    if log_levels:
        lam = check_lam(lam, B, T, H, name=name, T_all=T * sequence.axis_size(seq_axis))
        fenwick.chunk_log2(chunk_size)
    if impl == "pallas":  # the kernels take g=None as no decay
        extra = [x for x in (beta, lam) if x is not None]
        return common.pallas_entry(name)(q, k, v, g, *extra, chunk_size=chunk_size)
    g = common.gate_or_zeros(g, B, T, H, q.dtype if g is None else g.dtype)
    if impl == "reference":
        return _reference(q, k, v, g, beta, lam)
    with common.matmul_precision(q, k, v):
        if impl in ("recurrent", "scan"):
            return _JITTED[impl](q, k, v, g, beta, lam)
        return _JITTED["chunked"](q, k, v, g, beta, lam, chunk_size=chunk_size, seq_axis=seq_axis)


def loglinear_mamba2(q, k, v, g, lam, *, impl="auto", chunk_size=64, seq_axis=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s``; ``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``
    (``T`` the global length under ``seq_axis``).  ``impl="pallas"``:
    ``hla_jax.kernels.loglinear_mamba2_pallas``; "auto" takes it on a GPU for bf16 inputs
    (``common.pallas_preferred``), else "chunked"."""
    return run("loglinear_mamba2", q, k, v, g, None, lam, impl=impl, chunk_size=chunk_size,
               log_levels=True, seq_axis=seq_axis)


def gated_deltanet(q, k, v, g, beta, *, impl="auto", chunk_size=64, seq_axis=None):
    """``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``, ``A_r = a_r (I − β_r k_r k_rᵀ)``.

    Assumes L2-normalised keys (the calling layer's job) and ``beta`` in (0, 1).
    """
    return run("gated_deltanet", q, k, v, g, beta, impl=impl, chunk_size=chunk_size,
               seq_axis=seq_axis)


def loglinear_gated_deltanet(q, k, v, g, beta, lam, *, impl="auto", chunk_size=64,
                             seq_axis=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``; ``lam: [B,T,H,L]``.
    ``impl="pallas"``: ``hla_jax.kernels.loglinear_gated_deltanet_pallas``; "auto" as for
    ``loglinear_mamba2``."""
    return run("loglinear_gated_deltanet", q, k, v, g, beta, lam, impl=impl,
               chunk_size=chunk_size, log_levels=True, seq_axis=seq_axis)
