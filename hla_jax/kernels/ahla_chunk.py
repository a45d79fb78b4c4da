"""One chunk of asymmetric second-order HLA (AHLA), forward and backward, as 2-D matmuls (SPEC §2).

Shared by the NVIDIA (Triton) and TPU (Mosaic) kernels, like ``hla2_chunk``, with its notation
(one chunk, local positions τ): ``b_τ`` local cumulative log-decay, ``ρ = exp(b)``, ``ρ_c`` at
the chunk end, ``γ = ρ_c / ρ``, ``Γ[t,s] = ρ_t / ρ_s`` (``s ≤ t``), ``A = Q Kᵀ``,
``A_L = L ∘ A``, ``W_g = Γ ∘ A``.  State ``P = Σ D k vᵀ`` and ``E``, both ``d×bv``: AHLA is
linear in V column by column, so a value tile carries its own state and there is no ``d×d``
part (the undecayed ``R = Σ k qᵀ`` of the summaries only enters through ``Kᵀ X``):

    X  = Q P0,   Z = W_g V
    O  = diag(ρ) (Q E0 + A_L X) + W_g Z
    P1 = ρ_c P0 + (γ∘K)ᵀ V
    E1 = ρ_c E0 + Kᵀ (ρ_c X + γ∘Z)

Matmul operands are in the input dtype (bf16 or float32), accumulation in float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.la_chunk import at_end, decays, dot


def _matmul(dt):
    """``dot`` with both operands in the chunk's matmul dtype ``dt``."""
    return lambda a, b, ta=False, tb=False: dot(a.astype(dt), b.astype(dt), ta, tb)


def chunk_forward(Q, K, V, bb, P, E):
    """``(O [c,bv], P1, E1 [d,bv])`` from ``Q, K [c,d]``, ``V [c,bv]``, ``bb [c]`` and the incoming
    ``P, E [d,bv]`` (float32)."""
    mm = _matmul(Q.dtype)
    r, rc, gam, Gam, lower = decays(bb)
    A = mm(Q, K, tb=True)
    Wg = Gam * A
    X = mm(Q, P)
    Z = mm(Wg, V)
    O = r[:, None] * (mm(Q, E) + mm(jnp.where(lower, A, 0.0), X)) + mm(Wg, Z)
    P1 = rc * P + mm(K, gam[:, None] * V, ta=True)
    E1 = rc * E + mm(K, rc * X + gam[:, None] * Z, ta=True)
    return O, P1, E1


def chunk_backward(Q, K, V, bb, P, E, dO, dP1, dE1):
    """Reverse-mode step of ``chunk_forward``: given the incoming state ``P, E`` and the cotangents
    ``dO [c,bv]``, ``dP1, dE1 [d,bv]`` of its outputs, return ``(dQ [c,d], dK [c,d], dV [c,bv],
    db [c], dP0, dE0 [d,bv])`` (all float32).

        dX = A_Lᵀ (ρ∘dO) + ρ_c K dE1          dZ = W_gᵀ dO + γ∘(K dE1)
        dA = Γ ∘ (dO Zᵀ + dZ Vᵀ) + L ∘ ((ρ∘dO) Xᵀ)
        dQ = dA K + (ρ∘dO) E0ᵀ + dX P0ᵀ       dK = dAᵀ Q + (γ∘V) dP1ᵀ + (γ∘Z + ρ_c X) dE1ᵀ
        dV = W_gᵀ dZ + γ∘(K dP1)              dP0 = ρ_c dP1 + Qᵀ dX      dE0 = ρ_c dE1 + Qᵀ (ρ∘dO)

    ``db`` collects the decays' shares: ``ρ`` (rows), ``Γ`` (row minus column sums of
    ``dW_g ∘ W_g``), ``γ`` (minus at τ, plus at the end) and ``ρ_c`` (at the end).
    """
    mm = _matmul(Q.dtype)
    c = Q.shape[0]
    r, rc, gam, Gam, lower = decays(bb)
    A = mm(Q, K, tb=True)
    AL = jnp.where(lower, A, 0.0)
    Wg = Gam * A
    X = mm(Q, P)
    Z = mm(Wg, V)
    rdO = r[:, None] * dO
    KdE = mm(K, dE1)
    KdP = mm(K, dP1)

    dX = mm(AL, rdO, ta=True) + rc * KdE
    dZ = mm(Wg, dO, ta=True) + gam[:, None] * KdE
    dWg = mm(dO, Z, tb=True) + mm(dZ, V, tb=True)
    dAL = jnp.where(lower, mm(rdO, X, tb=True), 0.0)
    dA = Gam * dWg + dAL
    rdOE = mm(rdO, E, tb=True)
    dQ = mm(dA, K) + rdOE + mm(dX, P, tb=True)
    dK = (mm(dA, Q, ta=True) + mm(gam[:, None] * V, dP1, tb=True)
          + mm(gam[:, None] * Z + rc * X, dE1, tb=True))
    dV = mm(Wg, dZ, ta=True) + gam[:, None] * KdP
    dP0 = rc * dP1 + mm(Q, dX, ta=True)
    dE0 = rc * dE1 + mm(Q, rdO, ta=True)

    Hr = jnp.sum(Q * rdOE, 1) + jnp.sum(AL * dAL, 1)  # ρ ∘ dρ = ρ ∘ rowsum(dO ∘ (Q E0 + A_L X))
    Hg = gam * jnp.sum(V * KdP + Z * KdE, 1)           # γ ∘ dγ
    HW = dWg * Wg                                      # Γ ∘ dΓ
    end = rc * (jnp.sum(dP1 * P) + jnp.sum(dE1 * E) + jnp.sum(KdE * X)) + jnp.sum(Hg)
    db = Hr + jnp.sum(HW, 1) - jnp.sum(HW, 0) - Hg + at_end(end, c)
    return dQ, dK, dV, db, dP0, dE0
