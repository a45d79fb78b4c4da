"""One chunk of first-order scalar-gated linear attention (LA), forward and backward (docs/math.md#chains).

LA is the base of every chunk step: the helpers here (``dot``, ``decays``, ``at_end``) serve the
log-linear ones too.  The NVIDIA (Triton) and TPU (Mosaic) walks call these on ``[c, ·]`` tiles
of one (batch, head, value tile) with the state in float32.  Notation (one chunk, local
positions τ): ``b_τ`` = local cumulative log-decay, ``ρ = exp(b)``, ``ρ_c = ρ`` at the chunk
end, ``γ = ρ_c / ρ`` (decay to the chunk end), ``Γ[t,s] = ρ_t / ρ_s`` (``s ≤ t``, else 0).
State ``S = Σ D k vᵀ: d×bv``:

    O  = diag(ρ) Q S0 + ((Q Kᵀ) ∘ Γ) V
    S1 = ρ_c S0 + (γ∘K)ᵀ V

Matmul operands are in the input dtype (bf16 or float32), accumulation in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def dot(a, b, ta: bool = False, tb: bool = False):
    """``op(a) @ op(b)`` with ``op`` = transpose when ``ta``/``tb``; operands cast to the dtype of
    ``a`` when it is bf16, else float32 at full precision (float64 stays float64, for the
    tests); accumulation in float32 (float64)."""
    acc = jnp.result_type(F32, a.dtype)
    dt = jnp.bfloat16 if a.dtype == jnp.bfloat16 else acc
    prec = None if dt == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), dims, precision=prec,
                               preferred_element_type=acc)


def decays(bb):
    """``ρ, ρ_c, γ, Γ, L`` from the local log cumulative decay ``bb: [c]`` (non-increasing)."""
    c = bb.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower = rows >= cols
    bc = jnp.min(bb)  # b at the chunk end, since g <= 0
    gam_mat = jnp.exp(jnp.where(lower, bb[:, None] - bb[None, :], -jnp.inf))
    return jnp.exp(bb), jnp.exp(bc), jnp.exp(bc - bb), gam_mat, lower


def at_end(x, c):
    """A ``[c]`` vector with the scalar ``x`` at the last position (the chunk end's ``b``)."""
    return jnp.where(jax.lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1, x, 0.0)


def chunk_forward(Q, K, V, bb, S):
    """``(O [c,bv], S1 [d,bv])`` from ``Q, K [c,d]``, ``V [c,bv]``, ``bb [c]`` and the incoming
    ``S [d,bv]`` (float32)."""
    dt = Q.dtype
    r, rc, gam, Gam, _ = decays(bb)
    M = dot(Q, K, tb=True) * Gam
    O = r[:, None] * dot(Q, S.astype(dt)) + dot(M.astype(dt), V)
    S1 = rc * S + dot((gam[:, None] * K).astype(dt), V, ta=True)
    return O, S1


def chunk_backward(Q, K, V, bb, S, dO, dS1):
    """Reverse-mode step of ``chunk_forward``: given the incoming ``S [d,bv]`` and the cotangents
    ``dO [c,bv]``, ``dS1 [d,bv]`` of its outputs, return ``(dQ [c,d], dK [c,d], dV [c,bv], db [c],
    dS0 [d,bv])`` (all float32).  With ``M = (Q Kᵀ) ∘ Γ`` and ``dM = (dO Vᵀ) ∘ Γ``:

        dQ = diag(ρ) dO S0ᵀ + dM K            dK = diag(γ) V dS1ᵀ + dMᵀ Q
        dV = Mᵀ dO + (γ∘K) dS1                dS0 = ρ_c dS1 + (ρ∘Q)ᵀ dO
        db = Σ_rows Q∘dQ − Σ_rows K∘dK  +  at the end  ρ_c Σ S0∘dS1 + Σ K∘(diag(γ) V dS1ᵀ)

    (``ρ`` and the rows of ``Γ`` follow ``b_t`` like ``q_t``, ``γ`` and the columns of ``Γ``
    follow ``−b_s`` like ``k_s``, and ``ρ_c``, ``γ`` follow the chunk end.)  ``S`` does not
    enter the state cotangent: LA is linear in its state.
    """
    dt = Q.dtype
    c = Q.shape[0]
    r, rc, gam, Gam, _ = decays(bb)
    M = dot(Q, K, tb=True) * Gam
    dO_ = dO.astype(dt)
    dM = dot(dO_, V, tb=True) * Gam
    dK_inter = gam[:, None] * dot(V, dS1.astype(dt), tb=True)
    dQ = r[:, None] * dot(dO_, S.astype(dt), tb=True) + dot(dM.astype(dt), K)
    dK = dK_inter + dot(dM.astype(dt), Q, ta=True)
    dV = dot(M.astype(dt), dO_, ta=True) + dot((gam[:, None] * K).astype(dt), dS1.astype(dt))
    dS0 = rc * dS1 + dot((r[:, None] * Q).astype(dt), dO_, ta=True)
    Qf, Kf = Q.astype(dQ.dtype), K.astype(dK.dtype)
    end = rc * jnp.sum(S * dS1) + jnp.sum(Kf * dK_inter)
    db = jnp.sum(Qf * dQ, 1) - jnp.sum(Kf * dK, 1) + at_end(end, c)
    return dQ, dK, dV, db, dS0
