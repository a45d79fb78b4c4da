"""One chunk of Gated DeltaNet's UT transform, forward and backward, as small 2-D matmuls.

For ``c`` tokens with the local cumulative log-decay ``b`` (``ρ = exp(b)``, ``Γ[τ,σ] = ρ_τ/ρ_σ``)::

    A = strict_tril(diag(β)(K Kᵀ) ∘ Γ),   X = (I + A)⁻¹,   T = X diag(β)
    W = T (ρ∘K),   U = T V

``X`` by block doubling (``loglinear_gdn_chunk.unit_lower_inverse``) and every product with
``T`` on float32 operands (TF32 for bf16 inputs: a bf16 ``T`` costs the gate's gradient, which
sums such errors over a chunk, about 10%); ``K Kᵀ`` and ``dT`` on operands of the input dtype.
The backward gives ``dK, dV, dβ`` for ``b`` held fixed (the Gated DeltaNet kernel takes the
gate's gradient from an identity, ``kernels/gdn.py``)::

    dT = dW (ρ∘K)ᵀ + dU Vᵀ,   dV = Tᵀ dU,   dβ_σ ⊇ Σ_τ X∘dT,   dX = dT diag(β)
    dA = strict_tril(−Xᵀ dX Xᵀ),   E = dA ∘ Γ,   dβ_τ ⊇ Σ_σ E∘(K Kᵀ)
    dK = ρ∘(Tᵀ dW) + (β∘E) K + (β∘E)ᵀ K
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.la_chunk import decays, dot
from hla_jax.kernels.loglinear_gdn_chunk import strict_lower, tri_dot, unit_lower_inverse


def _pieces(K, bb, beta):
    """``(ρ, Γ, K Kᵀ, A, X)`` of one chunk, float32."""
    r, _, _, Gam, _ = decays(bb)
    KK = dot(K, K, tb=True)
    A = jnp.where(strict_lower(K.shape[0]), beta[:, None] * KK * Gam, 0.0)
    return r, Gam, KK, A, unit_lower_inverse(A, K.dtype == jnp.bfloat16)


def ut_forward(K, V, bb, beta):
    """``(W [c,d], U [c,dv])`` float32 from ``K [c,d]``, ``V [c,dv]``, ``bb, beta [c]``."""
    fast = K.dtype == jnp.bfloat16
    r, _, _, _, X = _pieces(K, bb, beta)
    Tm = X * beta[None, :]
    return tri_dot(Tm, r[:, None] * K, fast), tri_dot(Tm, V, fast)


def ut_backward(K, V, bb, beta, dW, dU):
    """Cotangents ``(dK [c,d], dV [c,dv], dβ [c])`` (float32, ``b`` fixed) of ``ut_forward``."""
    dt = K.dtype
    fast = dt == jnp.bfloat16
    r, Gam, KK, _, X = _pieces(K, bb, beta)
    Tm = X * beta[None, :]
    dTm = dot(dW.astype(dt), (r[:, None] * K).astype(dt), tb=True) + dot(dU.astype(dt), V, tb=True)
    dA = -tri_dot(tri_dot(X, dTm * beta[None, :], fast, ta=True), X, fast, tb=True)
    E = jnp.where(strict_lower(K.shape[0]), dA, 0.0) * Gam
    dKK = (beta[:, None] * E).astype(dt)
    dK = r[:, None] * tri_dot(Tm, dW, fast, ta=True) + dot(dKK, K) + dot(dKK, K, ta=True)
    dbeta = jnp.sum(X * dTm, axis=0) + jnp.sum(E * KK, axis=1)
    return dK, tri_dot(Tm, dU, fast, ta=True), dbeta
