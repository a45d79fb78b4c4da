"""One chunk of Gated DeltaNet's UT transform, forward and backward, and the chunk-parallel part
of the walk's backward, as small 2-D matmuls.

For ``c`` tokens with the local cumulative log-decay ``b`` (``ρ = exp(b)``, ``Γ[τ,σ] = ρ_τ/ρ_σ``)::

    A = strict_tril(diag(β)(K Kᵀ) ∘ Γ),   X = (I + A)⁻¹,   T = X diag(β)
    W = T (ρ∘K),   U = T V

The forward works on ``n = c/cb`` row blocks of ``cb`` tokens (``A_ij = diag(β_i)(K_i K_jᵀ) ∘ Γ_ij``,
strictly lower for ``i = j``), so the inverse costs ``n`` small ones and a block substitution
instead of full ``c×c`` products::

    X_ii = (I + A_ii)⁻¹ (``loglinear_gdn_chunk.unit_lower_inverse``),   X_ij = −X_ii Σ_{j≤m<i} A_im X_mj
    W_i = Σ_{j≤i} X_ij (β∘ρ∘K)_j,   U_i = Σ_{j≤i} X_ij (β∘V)_j

and keeps ``X`` for the backward, which takes it whole (``[c,c]``) and gives ``dK, dV, dβ``
and its share of ``∂L/∂b``::

    dT = dW (ρ∘K)ᵀ + dU Vᵀ,   dV = Tᵀ dU,   dβ_σ ⊇ Σ_τ X∘dT,   dX = dT diag(β)
    dA = strict_tril(−Xᵀ dX Xᵀ),   E = dA ∘ Γ,   dβ_τ ⊇ Σ_σ E∘(K Kᵀ)
    dK = ρ∘(Tᵀ dW) + (β∘E) K + (β∘E)ᵀ K
    ∂L/∂b ⊇ k·(ρ∘(Tᵀ dW)) + rows(M) − cols(M),   M = (β∘E) ∘ (K Kᵀ)

(``rows``/``cols``: row and column sums.  Each entry of ``M`` is one pair ``(τ, σ)``'s term,
entering ``b_τ`` with ``+`` and ``b_σ`` with ``−`` (``Γ = e^{b_τ − b_σ}``), so in the gate's
reverse cumulative sum the pairs cancel exactly, float32 for float32.)

The walks over the chunks (``gdn_walk_mgpu.py`` in Mosaic GPU; ``walk_forward`` and
``walk_backward`` here for the TPU's) read the delta-rule value from the state entering the chunk
and run an LA chunk with it (``la_chunk``), then carry the state's cotangent back::

    V' = U − W S,   O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V',   S ← ρ_c S + (γ̄∘K)ᵀ V'
    dV' = ((K Qᵀ) ∘ Γᵀ) dO + diag(γ̄) K dS,   dS ← ρ_c dS + (ρ∘Q)ᵀ dO − Wᵀ dV'

and leave per chunk the products, given the state ``S`` entering the chunk and the cotangent
``dS`` of the one leaving it::

    D = dO V'ᵀ,   dQ = diag(ρ) dO Sᵀ + (D ∘ Γ) K,   dK = diag(γ̄) V' dSᵀ + (D ∘ Γ)ᵀ Q,   dW = −dV' Sᵀ
    ∂L/∂b ⊇ q·(ρ∘dO Sᵀ) − k·(γ̄∘V' dSᵀ) + rows(M) − cols(M) + [Σ k·(γ̄∘V' dSᵀ) + ρ_c⟨S, dS⟩]_c
    M = D ∘ Γ ∘ (Q Kᵀ)

(``[·]_c`` at the chunk's last token; each block of keys and value tile adds its share).

Every product with ``X`` or ``T`` runs on float32 operands (TF32 for bf16 inputs: the gate's
gradient sums the rounding errors of a bf16 ``T`` over a chunk); ``K Kᵀ`` and ``dT`` on operands
of the input dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.la.la_chunk import at_end, chunk_forward, decays, dot
from hla_jax.kernels.loglinear_gdn.loglinear_gdn_chunk import strict_lower, tri_dot, unit_lower_inverse


def ut_inverse(Ks, bs, betas):
    """``X = (I + A)⁻¹`` of one chunk given as ``n`` row blocks ``Ks[i] [cb,d]``, ``bs[i],
    betas[i] [cb]``: the blocks ``X[i][j] [cb,cb]`` float32 (zeros above the diagonal)."""
    n, fast = len(Ks), Ks[0].dtype == jnp.bfloat16
    X = [[None] * n for _ in range(n)]
    def a(i, m):   # A_im, m ≤ i
        log_gam = bs[i][:, None] - bs[m][None, :]
        if m == i:
            log_gam = jnp.where(strict_lower(log_gam.shape[0]), log_gam, -jnp.inf)
        return betas[i][:, None] * dot(Ks[i], Ks[m], tb=True) * jnp.exp(log_gam)

    for i in range(n):
        X[i][i] = unit_lower_inverse(a(i, i), fast)
        row = [a(i, m) for m in range(i)]
        for j in range(i):
            acc = sum(tri_dot(row[m], X[m][j], fast) for m in range(j, i))
            X[i][j] = -tri_dot(X[i][i], acc, fast)
        for j in range(i + 1, n):
            X[i][j] = jnp.zeros_like(X[i][i])
    return X


def ut_apply(X, Ys, fast: bool):
    """The blocks ``Σ_{j≤i} X[i][j] Ys[j]`` of ``X Y`` (``W`` from ``Ys = β∘ρ∘K``, ``U`` from
    ``β∘V``), float32 operands (TF32 when ``fast``)."""
    return [sum(tri_dot(X[i][j], Ys[j], fast) for j in range(i + 1)) for i in range(len(Ys))]


def ut_backward(K, bb, beta, X, dW, dUV):
    """``(dK [c,d], dβ [c], ∂L/∂b [c])`` (float32; ``∂L/∂b`` the UT transform's share) from the
    forward's ``X [c,c]`` float32, ``K, dW [c,d]`` (operands in ``K``'s dtype, ``ρ = exp(b)``) and
    ``dUV = dU Vᵀ [c,c]`` (summed over value tiles by the caller)::

        dT = dUV + dW (ρ∘K)ᵀ,   E = strict_tril(−Xᵀ dX Xᵀ) ∘ Γ (dX = dT diag β),   M = (β∘E) ∘ (K Kᵀ)
        dβ = cols(X∘dT) + rows(E∘(K Kᵀ)),   dK = ρ∘(Tᵀ dW) + (β∘E) K + (β∘E)ᵀ K
        ∂L/∂b = rows(M) − cols(M) + k·(ρ∘(Tᵀ dW))      (the inverse's share, then W = T (ρ∘K)'s)
    """
    dt, fast, r = K.dtype, K.dtype == jnp.bfloat16, jnp.exp(bb)
    dTm = dUV + dot(dW.astype(dt), (r[:, None] * K).astype(dt), tb=True)
    KK = dot(K, K, tb=True)
    dA = -tri_dot(tri_dot(X, dTm * beta[None, :], fast, ta=True), X, fast, tb=True)
    E = jnp.where(strict_lower(X.shape[0]), dA, 0.0) * decays(bb)[3]
    bE = beta[:, None] * E
    M = bE * KK
    dKK = bE.astype(dt)
    dKW = r[:, None] * tri_dot(X * beta[None, :], dW, fast, ta=True)
    dK = dKW + dot(dKK, K) + dot(dKK, K, ta=True)
    dbeta = jnp.sum(X * dTm, axis=0) + jnp.sum(E * KK, axis=1)
    db = jnp.sum(M, 1) - jnp.sum(M, 0) + jnp.sum(K.astype(dKW.dtype) * dKW, axis=1)
    return dK, dbeta, db


def ut_backward_values(X, beta, dU, fast: bool):
    """``dV = Tᵀ dU`` (``T = X diag(β)``) of one value tile ``dU [c,bv]``, float32."""
    return tri_dot(X * beta[None, :], dU, fast, ta=True)


def walk_forward(Q, K, W, U, bb, S):
    """``(O, V', S')`` of one chunk (module docstring) from the state ``S [d,dv]`` entering it;
    ``V'`` in ``Q``'s dtype (the operand of the chunk's products), ``O`` and ``S'`` float32."""
    Vn = (U - dot(W, S)).astype(Q.dtype)
    O, S1 = chunk_forward(Q, K, Vn, bb, S)
    return O, Vn, S1


def walk_backward(Q, K, W, dO, bb, dS):
    """``(−dV', dS')`` of one chunk from the cotangent ``dS [d,dv]`` of the state leaving it:
    ``−dV'`` in ``Q``'s dtype (``dU = dV'``, the operand of the products and the UT backward),
    ``dS'`` (the state entering) float32."""
    dt = Q.dtype
    rho, rho_c, gam, Gam, _ = decays(bb)
    dVn = dot((dot(K, Q, tb=True) * Gam.T).astype(dt), dO) + gam[:, None] * dot(K, dS)
    neg = (-dVn).astype(dt)
    return neg, rho_c * dS + dot((rho[:, None] * Q).astype(dt), dO, ta=True) + dot(W, neg, ta=True)


def walk_products(dO, Vn, nDVn, sT, dsT):
    """One value tile's share ``(D, dO Sᵀ, V' dSᵀ, dW, ⟨S, dS⟩)`` of the walk's products
    (module docstring) from ``dO, V', −dV' [c,bv]`` and the transposed states ``Sᵀ, dSᵀ
    [bv,kb]`` (a block of ``kb`` keys); float32, operands in the inputs' dtype."""
    acc = jnp.promote_types(sT.dtype, jnp.float32)
    inner = jnp.sum(jnp.sum(sT.astype(acc) * dsT.astype(acc), 1))
    return dot(dO, Vn, tb=True), dot(dO, sT), dot(Vn, dsT), dot(nDVn, sT), inner


def walk_grads(Q, K, bb, D, dOS, VdS, SdS):
    """``(dQ, dK, ∂L/∂b)`` of one chunk and block of keys (``Q, K [c,kb]``) from the
    value-summed ``walk_products``: ``∂L/∂b [c]`` float32 is this block's share of the walk's
    part (module docstring), the states' inner product ``SdS`` over the block included."""
    rho, rho_c, gam, Gam, _ = decays(bb)
    DG = D * Gam
    P = DG.astype(K.dtype)
    dq_inter, dk_inter = rho[:, None] * dOS, gam[:, None] * VdS
    dQ, dK = dq_inter + dot(P, K), dk_inter + dot(P, Q, ta=True)
    M = DG * dot(Q, K, tb=True)
    kdk = jnp.sum(K.astype(dK.dtype) * dk_inter, 1)
    db = (jnp.sum(Q.astype(dQ.dtype) * dq_inter, 1) - kdk + jnp.sum(M, 1) - jnp.sum(M, 0)
          + at_end(jnp.sum(kdk) + rho_c * SdS, Q.shape[0]))
    return dQ, dK, db
