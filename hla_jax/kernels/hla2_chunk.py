"""One chunk of second-order HLA, forward and backward, as small 2-D matmuls (SPEC §1).

Shared by the NVIDIA (Triton) and TPU (Mosaic) kernels: each kernel walks the chunks of one
(batch, head, value tile) and calls these on ``[c, ·]`` tiles with the state in float32.
Notation (one chunk, local positions τ): ``b_τ`` = local cumulative log-decay, ``ρ = exp(b)``,
``ρ_c = ρ`` at the chunk end, ``γ = ρ_c / ρ`` (decay to the chunk end), ``Γ[t,s] = ρ_t / ρ_s``
(``s ≤ t``), ``A = Q Kᵀ``, ``W = L ∘ A``, ``W_g = Γ ∘ A``.  State ``S: d×d``,
``U = S C − G: d×bv`` (the readout ``o_t = q_tᵀ U_t`` needs only these two):

    P  = Q S0
    M  = (diag(ρ) P Qᵀ + W_g Wᵀ) ∘ Γ
    O  = diag(ρ²) Q U0 + M V
    S1 = ρ_c S0 + (γ∘K)ᵀ K
    U1 = ρ_c² U0 + ρ_c (γ∘P)ᵀ V + Kᵀ Yᵀ V,      Y = W ∘ γγᵀ

Matmul operands are in the input dtype (bf16 or float32), accumulation in float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.la_chunk import at_end, decays, dot


def chunk_forward(Q, K, V, bb, S, U):
    """``(O [c,bv], S1 [d,d], U1 [d,bv])`` from ``Q, K [c,d]``, ``V [c,bv]``, ``bb [c]`` and the
    incoming ``S [d,d]``, ``U [d,bv]`` (float32)."""
    dt = Q.dtype
    r, rc, gam, Gam, lower = decays(bb)
    A = dot(Q, K, tb=True)
    W = jnp.where(lower, A, 0.0)
    P = dot(Q, S.astype(dt))
    M = (r[:, None] * dot(P.astype(dt), Q, tb=True) + dot((Gam * A).astype(dt), W, tb=True)) * Gam
    O = (r * r)[:, None] * dot(Q, U.astype(dt)) + dot(M.astype(dt), V)
    Y = W * (gam[:, None] * gam[None, :])
    S1 = rc * S + dot((gam[:, None] * K).astype(dt), K, ta=True)
    YtV = dot(Y.astype(dt), V, ta=True)
    U1 = rc * rc * U + dot((rc * gam[:, None] * P).astype(dt), V, ta=True) + dot(K, YtV.astype(dt), ta=True)
    return O, S1, U1


def chunk_backward(Q, K, V, bb, S, U, dO, dS1, dU1):
    """Reverse-mode step of ``chunk_forward``: given the incoming state ``S, U`` (``S``
    symmetric) and the cotangents ``dO [c,bv]``, ``dU1 [d,bv]`` and the symmetrised
    ``dS1 + dS1ᵀ [d,d]`` of its outputs, return ``(dQ [c,d], dK [c,d], dV [c,bv], db [c],
    dS0 + dS0ᵀ, dU0)`` (all float32).  Carrying the symmetric part suffices since ``S`` is
    symmetric, and spares transposes of the ``d×d`` state."""
    dt = Q.dtype
    c = Q.shape[0]
    r, rc, gam, Gam, lower = decays(bb)
    A = dot(Q, K, tb=True)
    W = jnp.where(lower, A, 0.0)
    Wg = Gam * A
    P = dot(Q, S.astype(dt))
    rB1 = r[:, None] * dot(P.astype(dt), Q, tb=True)
    M = (rB1 + dot(Wg.astype(dt), W, tb=True)) * Gam
    gg = gam[:, None] * gam[None, :]
    Y = W * gg
    rgP = rc * gam[:, None] * P
    QU0 = dot(Q, U.astype(dt))
    dO_ = dO.astype(dt)
    dU1_ = dU1.astype(dt)

    dM = dot(dO_, V, tb=True)
    D = Gam * dM                                   # cotangent of diag(ρ) P Qᵀ + W_g Wᵀ
    dB1 = r[:, None] * D
    VdU = dot(V, dU1_, tb=True)                    # V dU1ᵀ  [c,d]
    KdU = dot(K, dU1_)                             # K dU1   [c,bv]
    dP = rc * gam[:, None] * VdU + dot(dB1.astype(dt), Q)
    dWg = dot(D.astype(dt), W.astype(dt))
    dW = dot(D.astype(dt), Wg.astype(dt), ta=True)
    dY = dot(V, KdU.astype(dt), tb=True)
    dA = Gam * dWg + jnp.where(lower, dW + gg * dY, 0.0)

    dV = dot(M.astype(dt), dO_, ta=True) + dot(rgP.astype(dt), dU1_) + dot(Y.astype(dt), KdU.astype(dt))
    dQ = ((r * r)[:, None] * dot(dO_, U.astype(dt), tb=True) + dot(dB1.astype(dt), P.astype(dt), ta=True)
          + dot(dP.astype(dt), S.astype(dt)) + dot(dA.astype(dt), K))
    KdS = dot(K, dS1.astype(dt))
    YtV = dot(Y.astype(dt), V, ta=True)
    dK = (dot(dA.astype(dt), Q, ta=True) + dot(YtV.astype(dt), dU1_, tb=True)
          + gam[:, None] * KdS)
    dS0 = rc * dS1 + dot(Q, dP.astype(dt), ta=True) + dot(dP.astype(dt), Q, ta=True)
    dU0 = rc * rc * dU1 + dot(((r * r)[:, None] * Q).astype(dt), dO_, ta=True)

    def row_minus_col(H):
        return jnp.sum(H, 1) - jnp.sum(H, 0)

    HY = dY * Y
    e = 0.5 * gam * jnp.sum(K.astype(KdS.dtype) * KdS, 1)
    f = jnp.sum(VdU * rgP, 1)
    end = (0.5 * rc * jnp.sum(dS1 * S) + jnp.sum(e) + 2 * rc * rc * jnp.sum(dU1 * U)
           + 2 * jnp.sum(f) + 2 * jnp.sum(HY))
    db = (2 * (r * r) * jnp.sum(dO * QU0, 1) + row_minus_col(dM * M) + jnp.sum(D * rB1, 1)
          + row_minus_col(dWg * Wg) - e - f - jnp.sum(HY, 1) - jnp.sum(HY, 0) + at_end(end, c))
    return dQ, dK, dV, db, dS0, dU0
