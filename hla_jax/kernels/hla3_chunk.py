"""One chunk of causal third-order HLA, forward and backward, as small 2-D matmuls (SPEC §3).

Shared by the NVIDIA (Triton) and TPU (Mosaic) kernels: each kernel walks the chunks of one
(batch, head, value tile) and calls these on ``[c, ·]`` tiles with the state in float32.
Notation as in ``kernels/hla2_chunk.py`` (local log cumulative decay ``b``, ``ρ = exp(b)``,
``ρ_c``, ``γ = ρ_c / ρ``, ``Γ``, ``A = Q Kᵀ``, ``W_g = Γ ∘ A``).  State ``S: d×d``,
``P, F: d×bv``.  Inside the chunk the rows ``R_τ = (S_τ q_τ)ᵀ`` and ``Z_τ = q_τᵀ P_τ`` of the
per-token recurrence ``F_t = a_t² F_{t-1} + (S_t q_t)(q_tᵀ P_t)`` are matmuls, so

    R  = diag(ρ) Q S0 + W_g K          Z = diag(ρ) Q P0 + W_g V
    M  = Γ² ∘ (Q Rᵀ)                   (Γ² = Γ ∘ Γ, lower triangular)
    O  = diag(ρ²) Q F0 + M Z
    S1 = ρ_c S0 + (γ∘K)ᵀ K      P1 = ρ_c P0 + (γ∘K)ᵀ V      F1 = ρ_c² F0 + (γ²∘R)ᵀ Z

which is SPEC's five-term chunk form regrouped (``Γ[t,u] Γ[u,s] = Γ[t,s]``).
Matmul operands are in the input dtype (bf16 or float32), accumulation in float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.la_chunk import at_end, decays, dot


def _rows(Q, K, V, bb, S, P):
    """Decays and the in-chunk rows ``Q S0, Q P0, W_g, R, Z, M`` shared by forward and backward."""
    dt = Q.dtype
    r, rc, gam, Gam, _ = decays(bb)
    Wg = Gam * dot(Q, K, tb=True)
    QS = dot(Q, S.astype(dt))
    QP = dot(Q, P.astype(dt))
    R = r[:, None] * QS + dot(Wg.astype(dt), K)
    Z = r[:, None] * QP + dot(Wg.astype(dt), V)
    M = Gam * Gam * dot(Q, R.astype(dt), tb=True)
    return (r, rc, gam, Gam), (QS, QP, Wg, R, Z, M)


def chunk_forward(Q, K, V, bb, S, P, F):
    """``(O [c,bv], S1 [d,d], P1 [d,bv], F1 [d,bv])`` from ``Q, K [c,d]``, ``V [c,bv]``,
    ``bb [c]`` and the incoming ``S [d,d]``, ``P, F [d,bv]`` (float32)."""
    dt = Q.dtype
    (r, rc, gam, _), (_, _, _, R, Z, M) = _rows(Q, K, V, bb, S, P)
    Z_ = Z.astype(dt)
    O = (r * r)[:, None] * dot(Q, F.astype(dt)) + dot(M.astype(dt), Z_)
    gK = (gam[:, None] * K).astype(dt)
    S1 = rc * S + dot(gK, K, ta=True)
    P1 = rc * P + dot(gK, V, ta=True)
    F1 = rc * rc * F + dot(((gam * gam)[:, None] * R).astype(dt), Z_, ta=True)
    return O, S1, P1, F1


def chunk_backward(Q, K, V, bb, S, P, F, dO, dS1, dP1, dF1):
    """Reverse-mode step of ``chunk_forward``: given the incoming state ``S, P, F`` (``S``
    symmetric; any float dtype) and the cotangents ``dO [c,bv]``, ``dP1, dF1 [d,bv]`` and the
    symmetrised ``dS1 + dS1ᵀ [d,d]`` of its outputs, return ``(dQ [c,d], dK [c,d], dV [c,bv],
    db [c], dS0 + dS0ᵀ, dP0, dF0)`` (all float32).  As for HLA2, the symmetric part of ``dS``
    is all the previous chunk needs.

        dM = dO Zᵀ      dZ = Mᵀ dO + (γ²∘R) dF1      dR = γ² ∘ (Z dF1ᵀ) + (Γ² ∘ dM)ᵀ Q
        dW_g = dZ Vᵀ + dR Kᵀ,  dA = Γ ∘ dW_g,  and ``db`` from every ``ρ, ρ_c, γ, Γ`` factor.
    """
    dt = Q.dtype
    c = Q.shape[0]
    (r, rc, gam, Gam), (QS, QP, Wg, R, Z, M) = _rows(Q, K, V, bb, S, P)
    g2 = gam * gam
    g2R = g2[:, None] * R
    dO_, Z_, Wg_ = dO.astype(dt), Z.astype(dt), Wg.astype(dt)
    dF1_ = dF1.astype(dt)

    dM = dot(dO_, Z_, tb=True)
    dQR = Gam * Gam * dM                           # cotangent of Q Rᵀ
    ZdF = dot(Z_, dF1_, tb=True)                   # Z dF1ᵀ  [c,d]
    dZ = dot(M.astype(dt), dO_, ta=True) + dot(g2R.astype(dt), dF1_)
    dR = g2[:, None] * ZdF + dot(dQR.astype(dt), Q, ta=True)
    dQS, dQP = r[:, None] * dR, r[:, None] * dZ
    dWg = dot(dZ.astype(dt), V, tb=True) + dot(dR.astype(dt), K, tb=True)
    dA = Gam * dWg
    dOF = dot(dO_, F.astype(dt), tb=True)          # dO F0ᵀ  [c,d]
    VdP = dot(V, dP1.astype(dt), tb=True)          # V dP1ᵀ  [c,d]
    KdS = dot(K, dS1.astype(dt))                   # K (dS1 + dS1ᵀ)  [c,d]

    dQ = ((r * r)[:, None] * dOF + dot(dQR.astype(dt), R.astype(dt))
          + dot(dQS.astype(dt), S.astype(dt)) + dot(dQP.astype(dt), P.astype(dt), tb=True)
          + dot(dA.astype(dt), K))
    dK = (dot(Wg_, dR.astype(dt), ta=True) + dot(dA.astype(dt), Q, ta=True)
          + gam[:, None] * (KdS + VdP))
    dV = dot(Wg_, dZ.astype(dt), ta=True) + dot((gam[:, None] * K).astype(dt), dP1.astype(dt))
    dS0 = rc * dS1 + dot(Q, dQS.astype(dt), ta=True) + dot(dQS.astype(dt), Q, ta=True)
    dP0 = rc * dP1 + dot(Q, dQP.astype(dt), ta=True)
    dF0 = rc * rc * dF1 + dot(((r * r)[:, None] * Q).astype(dt), dO_, ta=True)

    def row_minus_col(H):
        return jnp.sum(H, 1) - jnp.sum(H, 0)

    Qf = Q.astype(dOF.dtype)
    Kf = K.astype(dOF.dtype)
    e = 0.5 * gam * jnp.sum(Kf * KdS, 1)           # γ-factor of (γ∘K)ᵀ K
    f = gam * jnp.sum(Kf * VdP, 1)                 # γ-factor of (γ∘K)ᵀ V
    h = 2 * jnp.sum(g2R * ZdF, 1)                  # γ²-factor of (γ²∘R)ᵀ Z
    end = (0.5 * rc * jnp.sum(dS1 * S) + rc * jnp.sum(dP1 * P) + 2 * rc * rc * jnp.sum(dF1 * F)
           + jnp.sum(e + f + h))
    db = (2 * (r * r) * jnp.sum(Qf * dOF, 1) + jnp.sum(dQS * QS, 1) + jnp.sum(dQP * QP, 1)
          + row_minus_col(dWg * Wg) + 2 * row_minus_col(dM * M) - e - f - h + at_end(end, c))
    return dQ, dK, dV, db, dS0, dP0, dF0
