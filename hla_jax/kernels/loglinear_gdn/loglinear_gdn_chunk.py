"""One chunk of log-linear Gated DeltaNet, forward and backward, as small 2-D matmuls
(docs/math.md#loglinear).

Shared by the NVIDIA (Triton) and TPU (Mosaic) kernels.  One chunk of ``c`` tokens, local
positions τ: ``b`` the local cumulative log-decay, ``γ = exp(b)``, ``γ_c`` its value at the chunk
end, ``Γ[τ,σ] = γ_τ/γ_σ`` (σ ≤ τ, else 0), ``K̃ = (γ_c/γ)∘K``.

UT part (no state: parallel over chunks), ``ut_forward``::

    A = strict_tril(diag(β)(K Kᵀ) ∘ Γ),   T = (I + A)⁻¹ diag(β)
    W = T (γ∘K),   U = T V,   P = (Q Kᵀ) ∘ Γ,   Q̂ = γ∘Q − P W
    O_intra = (Λ ∘ (P T)) V,   Λ[τ,σ] = λ_τ^{ℓ(τ,σ)},  ℓ = bit_length(τ XOR σ) ≤ log2 c

``(I + A)⁻¹`` of the strictly lower-triangular ``A`` doubles its diagonal blocks
(``unit_lower_inverse``, ``2 log2(c)`` matmuls), no linear solve.

Level walk (sequential over chunks ``n``), ``walk_forward``: level states ``H[m]: d×bv`` in
float32, ``m = 1..S``, holding the earlier chunks at level ``log2 c + m`` (``H[m] ≠ 0`` only when
bit ``m−1`` of ``n`` is set, so the others are skipped)::

    O = O_intra + Σ_m λ^{(log2 c + m)} ∘ (Q̂ H[m]),      H[m] ← γ_c H[m] − K̃ᵀ (W H[m])
    carry into n+1 (z = trailing zeros of n+1):  H[z+1] = K̃ᵀ U + Σ_{m≤z} H[m],  H[1..z] = 0

Matmul operands are in the input dtype (bf16 or float32), accumulation in float32; the
triangular inverse and every product with ``T`` run on float32 operands (TF32 when the inputs
are bf16), as in ``gdn_chunk``: a bf16 ``T`` costs the gate's and β's gradients most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.kernels.la.la_chunk import F32, at_end, decays, dot
from hla_jax.kernels.loglinear.loglinear_chunk import level_sums, level_table, level_weights


def tri_dot(a, b, fast: bool, ta: bool = False, tb: bool = False):
    """``op(a) @ op(b)`` on float32 operands (float64 stays float64): TF32 when ``fast``."""
    acc = jnp.result_type(F32, a.dtype)
    prec = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return jax.lax.dot_general(a.astype(acc), b.astype(acc), dims, precision=prec,
                               preferred_element_type=acc)


def coupling(rows, cols, s: int):
    """Where a ``[c,c]`` matrix couples the two ``s×s`` diagonal blocks of each ``2s×2s`` one (its
    lower left block), from row and column indices."""
    return ((rows ^ cols) < 2 * s) & ((rows & s) != 0) & ((cols & s) == 0)


def unit_lower_inverse(A, fast: bool = False):
    """``(I + A)⁻¹`` of a strictly lower-triangular ``A [c,c]`` by
    doubling the diagonal blocks: with ``X`` the block-diagonal inverse of the ``s×s`` blocks and
    ``A_s`` the entries coupling each pair of them into a ``2s×2s`` block,
    ``X ← X − X A_s X`` (``[[X₁,0],[−X₂A₂₁X₁, X₂]]``): ``2 log2(c)`` matmuls of bounded factors.

    The Neumann product ``(I − A)(I + A²)(I + A⁴)⋯`` is exact too but not stable: for
    correlated keys ``A``'s powers reach ``C(63,31) ≈ 10¹⁸`` at ``c = 64`` and cancel to an
    inverse of order 1, which float32 loses entirely."""
    c = A.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    X, s = jnp.where(i == j, 1.0, 0.0).astype(A.dtype), 1
    while s < c:
        X = X - tri_dot(tri_dot(X, jnp.where(coupling(i, j, s), A, 0.0), fast), X, fast)
        s *= 2
    return X


def strict_lower(c):
    """Strictly lower-triangular mask ``[c, c]``."""
    return jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) > jax.lax.broadcasted_iota(
        jnp.int32, (c, c), 1)


def ut_forward(Q, K, V, bb, beta, lam):
    """``(Q̂ [c,d], W [c,d], U [c,dv], O_intra [c,dv])`` (float32) from ``Q, K [c,d]``,
    ``V [c,dv]``, ``bb, beta [c]`` and ``lam``: the ``log2 c + 1`` intra levels, vectors ``[c]``."""
    dt = Q.dtype
    fast = dt == jnp.bfloat16
    r, _, _, Gam, _ = decays(bb)
    c = Q.shape[0]
    A = jnp.where(strict_lower(c), beta[:, None] * dot(K, K, tb=True) * Gam, 0.0)
    Tm = unit_lower_inverse(A, fast) * beta[None, :]
    W = tri_dot(Tm, r[:, None] * K, fast)
    U = tri_dot(Tm, V, fast)
    P = dot(Q, K, tb=True) * Gam
    Qh = r[:, None] * Q - dot(P.astype(dt), W.astype(dt))
    O = dot((level_weights(lam, level_table(c)) * tri_dot(P, Tm, fast)).astype(dt), V)
    return Qh, W, U, O


def ut_backward(Q, K, V, bb, beta, lam, dQh, dW, dU, dO):
    """Reverse-mode step of ``ut_forward``: cotangents ``dQh, dW [c,d]``, ``dU, dO [c,dv]`` ->
    ``(dQ, dK [c,d], dV [c,dv], dbb [c], dbeta [c], dlam (log2 c + 1 vectors [c]))``, float32."""
    dt = Q.dtype
    fast = dt == jnp.bfloat16
    c = Q.shape[0]
    r, _, _, Gam, _ = decays(bb)
    strict, lev = strict_lower(c), level_table(c)
    KK = dot(K, K, tb=True)
    A = jnp.where(strict, beta[:, None] * KK * Gam, 0.0)
    X = unit_lower_inverse(A, fast)
    Tm, Kr = X * beta[None, :], r[:, None] * K
    W = tri_dot(Tm, Kr, fast)
    P = dot(Q, K, tb=True) * Gam
    P_ = P.astype(dt)
    M = tri_dot(P, Tm, fast)
    Lam = level_weights(lam, lev)
    dO_, dQh_, dU_ = dO.astype(dt), dQh.astype(dt), dU.astype(dt)

    dOV = dot(dO_, V, tb=True)
    dM = Lam * dOV
    dlam = tuple(level_sums(M * dOV, lev, len(lam)))
    dV = dot((Lam * M).astype(dt), dO_, ta=True) + tri_dot(Tm, dU, fast, ta=True)
    dWt = dW - dot(P_, dQh_, ta=True)
    dP = tri_dot(dM, Tm, fast, tb=True) - dot(dQh_, W.astype(dt), tb=True)
    dTm = (dot(P_, dM.astype(dt), ta=True) + dot(dU_, V, tb=True)
           + dot(dWt.astype(dt), Kr.astype(dt), tb=True))
    dKr = tri_dot(Tm, dWt, fast, ta=True)
    dPG = (dP * Gam).astype(dt)
    dbeta = jnp.sum(X * dTm, axis=0)
    dA = -tri_dot(tri_dot(X, dTm * beta[None, :], fast, ta=True), X, fast, tb=True)
    dA = jnp.where(strict, dA, 0.0)
    E = dA * Gam
    dbeta = dbeta + jnp.sum(E * KK, axis=1)
    dKK = (beta[:, None] * E).astype(dt)
    dQ = r[:, None] * dQh + dot(dPG, K)
    dK = (r[:, None] * dKr + dot(dPG, Q, ta=True) + dot(dKK, K) + dot(dKK, K, ta=True))
    HG = dP * P + dA * A
    dbb = r * (jnp.sum(Q * dQh, axis=1) + jnp.sum(K * dKr, axis=1)) + jnp.sum(HG, 1) - jnp.sum(HG, 0)
    return dQ, dK, dV, dbb, dbeta, dlam


def chunk_end(K, bb):
    """``(K̃ = (γ_c/γ)∘K [c,d], γ_c)`` in float32."""
    bc = jnp.min(bb)  # b at the chunk end, since g <= 0
    return jnp.exp(bc - bb)[:, None] * K, jnp.exp(bc)


def chunk_end_backward(K, bb, dKt, dgc):
    """Cotangents ``(dK [c,d], dbb [c])`` of ``chunk_end`` given ``dK̃`` and ``dγ_c``."""
    bc = jnp.min(bb)
    e = jnp.exp(bc - bb)
    f = e * jnp.sum(K * dKt, axis=1)
    return e[:, None] * dKt, at_end(jnp.sum(f) + jnp.exp(bc) * dgc, bb.shape[0]) - f


def _bit(n, m: int):
    return (n & (1 << m)) != 0


def read_at(n, m: int):
    """Level ``m`` (1..S) is non-empty, so read, at chunk ``n``: bit ``m−1`` of ``n`` is set."""
    return _bit(n, m - 1)


def _carry_masks(n, S: int):
    """For the carry into chunk ``n ≥ 1`` (z = trailing zeros of n), per level m = 1..S as float
    scalars: ``below[m] = [m ≤ z+1]`` and ``top[m] = [m = z+1]``."""
    below = [((n & ((1 << (m - 1)) - 1)) == 0).astype(F32) for m in range(1, S + 1)]
    return below, [lo * _bit(n, m - 1).astype(F32) for m, lo in enumerate(below, 1)]


def walk_forward(Qh, W, Kt, U, gc, lam, H, n, save=None):
    """Chunk ``n`` of the level walk -> ``(O_inter [c,bv], the states after the carry into n+1)``.

    ``Qh, W [c,d]`` and ``U [c,bv]`` in the matmul dtype, ``Kt [c,d]`` float32 (its products
    in TF32 for bf16: the delta rule's ``H − K̃ᵀ(W H)`` removes a key direction only when ``K̃``
    matches ``W``'s keys, which a bf16 ``K̃`` does not on keys around one direction), ``gc`` = γ_c,
    ``lam``: S vectors
    ``[c]`` (λ at levels ``log2 c + 1 .. log2 c + S``), ``H``: S float32 states ``[d,bv]`` after
    the carry into chunk ``n``.  ``save(m, H[m])`` is called for each level read at this chunk (the backward's
    checkpoints).
    """
    dt, n = Qh.dtype, jnp.asarray(n, jnp.int32)
    fast = dt == jnp.bfloat16
    O = jnp.zeros((Qh.shape[0], U.shape[1]), H[0].dtype)
    out = []
    for m, (Hm, w) in enumerate(zip(H, lam), 1):
        def active(Hm, O, m=m, w=w):
            if save is not None:
                save(m, Hm)
            Hd = Hm.astype(dt)
            O = O + w[:, None] * dot(Qh, Hd)
            return gc * Hm - tri_dot(Kt, dot(W, Hd), fast, ta=True), O

        Hm, O = jax.lax.cond(_bit(n, m - 1), active, lambda Hm, O: (Hm, O), Hm, O)
        out.append(Hm)
    below, top = _carry_masks(n + 1, len(H))
    merged = tri_dot(Kt, U, fast, ta=True) + sum(lo * Hm for lo, Hm in zip(below, out))
    return O, tuple(tp * merged + (1.0 - lo) * Hm for lo, tp, Hm in zip(below, top, out))


def carry_backward(dH, n):
    """Transpose of the carry out of chunk ``n``: from the cotangents ``dH`` of the states
    ``walk_forward`` returned, ``(dOwn, dH_level)``: the cotangent of the chunk's merged block
    ``K̃ᵀ U + Σ_{m≤z} H[m]`` and those of the level states after the chunk's transitions."""
    below, top = _carry_masks(jnp.asarray(n, jnp.int32) + 1, len(dH))
    dOwn = sum(tp * dHm for tp, dHm in zip(top, dH))
    return dOwn, [lo * dOwn + (1.0 - lo) * dHm for lo, dHm in zip(below, dH)]


def walk_backward(Qh, W, Kt, U, gc, lam, dO, load, dOwn, dH, n, dload=None):
    """Reverse-mode step of ``walk_forward`` at chunk ``n``, after ``carry_backward``.

    ``dO [c,bv]``; ``dOwn`` and ``dH`` from ``carry_backward`` (or, with ``dload(m)``, level
    ``m``'s entry of ``dH`` loaded where it is read; ``dH`` then only passes through);
    ``load(m)``: the saved float32 ``H[m]`` (called for the levels read at ``n``).  Returns
    ``(dQh, dW, dKt [c,d], dU [c,bv], dgc, dlam (S vectors [c]), cotangents of the incoming
    states)``, float32.
    """
    dt, n = Qh.dtype, jnp.asarray(n, jnp.int32)
    fast = dt == jnp.bfloat16
    c, d = Qh.shape
    dOwn_ = dOwn.astype(dt)
    f = dOwn.dtype
    acc = (jnp.zeros((c, d), f), jnp.zeros((c, d), f), dot(U, dOwn_, tb=True),
           jnp.zeros((dOwn.shape[1],), f))  # dγ_c by columns: no scalar through lax.cond
    dlam, dH_in = [], []
    for m, (dHm, w) in enumerate(zip(dH, lam), 1):
        def active(dHm, dQh, dW, dKt, dgc, m=m, w=w):
            Hm = load(m)
            if dload is not None:
                dHm = dload(m)
            Hd, dHd = Hm.astype(dt), dHm.astype(dt)
            wdO = (w[:, None] * dO).astype(dt)
            Y = tri_dot(Kt, dHm, fast)
            return (gc * dHm - tri_dot(W, Y, fast, ta=True) + dot(Qh, wdO, ta=True),
                    dQh + dot(wdO, Hd, tb=True), dW - dot(Y.astype(dt), Hd, tb=True),
                    dKt - dot(dot(W, Hd).astype(dt), dHd, tb=True), dgc + jnp.sum(dHm * Hm, axis=0),
                    jnp.sum(dO * dot(Qh, Hd), axis=1))

        def idle(dHm, *acc):
            return (dHm, *acc, jnp.zeros((c,), f))

        dHm, *acc, dl = jax.lax.cond(_bit(n, m - 1), active, idle, dHm, *acc)
        dH_in.append(dHm)
        dlam.append(dl)
    dQh, dW, dKt, dgc = acc
    return dQh, dW, dKt, tri_dot(Kt, dOwn, fast), jnp.sum(dgc), tuple(dlam), tuple(dH_in)
