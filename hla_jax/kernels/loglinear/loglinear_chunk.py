"""One chunk of log-linear Mamba-2 (docs/math.md#loglinear) in the block form (``ops.xla.loglinear_blocks``),
forward and backward: small 2-D matmuls shared by the NVIDIA (Triton) and TPU (Mosaic) kernels.

One chunk ``n`` of ``c = 2^lc`` tokens, local positions τ, σ; ``bb`` the local cumulative
log-decay, ``Γ[τ,σ] = exp(bb_τ − bb_σ)`` (σ ≤ τ), as in ``la_chunk``; ``lams[ℓ]: [c]`` is
``λ^{(ℓ)}`` of the chunk's tokens.  Levels ``0..lc`` live inside the chunk:
``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}``, ``ℓ = bit_length(τ XOR σ)``.  Chunk level ``j`` (level ``lc+1+j``):
the chunk lies in the right half of its aligned block of ``2^(j+1)`` chunks when bit ``j`` of
``n`` is 1 (it reads the left half's state ``H_j: d×bv``), else in the left half (it writes
into ``H_j``); ``lw[j]: [c]`` are its tokens' weights there (``core.block_levels.token_weights``):

    O  = (QKᵀ ∘ Γ ∘ Λ) V + Σ_{j: bit j of n} diag(lw_j) Q H_j
    H_j = Σ_{chunks of the left half} (lw_j ∘ K)ᵀ V              (``half_state``)

The backward is two kernels per chunk (fewer live accumulators than one): the query side
(``dQ``, ``db``, the intra ``dλ``, ``dlw`` where it reads ``H_j``) and the key/value side
(``dK``, ``dV``, ``dlw`` where it writes, from ``dH_j = Σ_{right half} (lw_j ∘ Q)ᵀ dO``,
``half_state`` again).  Matmul operands in the input dtype, accumulation in float32.  Levels the
chunk skips cost no matmul (``lax.cond``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.kernels.la.la_chunk import F32, decays, dot


def live(n, j: int):
    """Chunk ``n`` (traced int) reads level ``j``'s state iff bit ``j`` of ``n`` is 1."""
    return ((n >> j) & 1) == 1


# --------------------------------------------------------------------------- intra-chunk levels


def level_table(c: int):
    """``ℓ(τ,σ) = bit_length(τ XOR σ): [c, c]`` int32, computed on chip (``clz``), no table."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    return fenwick.bit_length(rows ^ jax.lax.broadcasted_iota(jnp.int32, (c, c), 1))


def level_weights(lams, lev):
    """``Λ[τ,σ] = λ_τ^{(lev[τ,σ])}`` from ``lams = [λ^{(0)}, …, λ^{(lc)}]`` (``[c]`` each)."""
    Lam = jnp.broadcast_to(lams[0][:, None], lev.shape)
    for ell in range(1, len(lams)):
        Lam = jnp.where(lev == ell, lams[ell][:, None], Lam)
    return Lam


def level_sums(D, lev, levels: int):
    """Transpose of ``level_weights``: ``[Σ_σ D[τ,σ] [lev[τ,σ] = ℓ] for ℓ < levels]`` (``[c]``
    each); ``D`` lower triangular."""
    return [jnp.sum(jnp.where(lev == ell, D, 0.0), 1) for ell in range(levels)]


def _when(flag, fn, *acc):
    """``fn(*acc)`` if the traced ``flag`` else ``acc``: a skipped branch costs no matmul."""
    return jax.lax.cond(flag, fn, lambda *a: a, *acc)


# --------------------------------------------------------------------------- one chunk


def half_state(X, Y, w, acc):
    """``acc + (w ∘ X)ᵀ Y``: one chunk's share of ``H_j`` (``X, Y = K, V``) or of its cotangent
    (``Q, dO``); ``X [c,d]``, ``Y [c,bv]``, ``w [c]``, ``acc [d,bv]`` float32."""
    return acc + dot((w[:, None] * X).astype(X.dtype), Y, ta=True)


def chunk_forward(Q, K, V, bb, lams, lw, state, lives):
    """``O [c,bv]`` from ``Q, K [c,d]``, ``V [c,bv]``, ``bb [c]``, ``lams`` (``lc + 1`` vectors
    ``[c]``), ``lw`` (one ``[c]`` per chunk level), ``state(j)`` (``H_j [d,bv]``, called only
    when read) and ``lives`` (one traced bool per level)."""
    dt, c = Q.dtype, Q.shape[0]
    _, _, _, Gam, _ = decays(bb)
    O = dot((dot(Q, K, tb=True) * Gam * level_weights(lams, level_table(c))).astype(dt), V)
    for j, w in enumerate(lw):
        O = _when(lives[j], lambda O, j=j, w=w: (O + dot((w[:, None] * Q).astype(dt),
                                                         state(j).astype(dt)),), O)[0]
    return O


def _intra_backward(Q, K, V, bb, lams, dO):
    """``(A, Γ, GL, dM, dO_)`` of the intra-chunk levels: ``A = QKᵀ``, ``GL = Γ ∘ Λ`` (so
    ``M = A ∘ GL``), ``dM = dO Vᵀ``, ``dO`` in the matmul dtype."""
    dt, c = Q.dtype, Q.shape[0]
    _, _, _, Gam, _ = decays(bb)
    A = dot(Q, K, tb=True)
    dO_ = dO.astype(dt)
    return A, Gam, Gam * level_weights(lams, level_table(c)), dot(dO_, V, tb=True), dO_


def chunk_backward_q(Q, K, V, bb, lams, lw, state, lives, dO):
    """The query side of ``chunk_forward``'s reverse mode, given ``dO [c,bv]``: ``(dQ [c,d],
    db [c], dlams, dlw)``, ``dlams`` one ``[c]`` per intra level, ``dlw`` one per chunk level
    (zero where the chunk writes ``H_j``), float32."""
    dt, c = Q.dtype, Q.shape[0]
    A, Gam, GL, dM, dO_ = _intra_backward(Q, K, V, bb, lams, dO)
    dQ = dot((dM * GL).astype(dt), K)
    dlams = level_sums(dM * A * Gam, level_table(c), len(lams))
    # Γ's log-decay cotangent: row sums (= Σ_ℓ λ^ℓ dλ^ℓ) minus column sums of dM ∘ M
    dMM = dM * A * GL
    db = jnp.sum(dMM, 1) - jnp.sum(dMM, 0)
    zero = jnp.zeros((c,), jnp.result_type(F32, Q.dtype))
    dlw = []
    for j, w in enumerate(lw):
        def read(dQ, j=j, w=w):     # O ⊇ diag(w) Q H_j
            R = dot(dO_, state(j).astype(dt), tb=True)
            return dQ + w[:, None] * R, jnp.sum(Q * R, 1)

        dQ, dw = jax.lax.cond(lives[j], read, lambda dQ: (dQ, zero), dQ)
        dlw.append(dw)
    return dQ, db, dlams, dlw


def chunk_backward_kv(Q, K, V, bb, lams, lw, dstate, lives, dO):
    """The key/value side: ``(dK [c,d], dV [c,bv], dlw)`` given ``dO`` and ``dstate(j)``
    (``dH_j``, called where the chunk writes ``H_j``; ``dlw`` is zero where it reads)."""
    dt, c = Q.dtype, Q.shape[0]
    A, _, GL, dM, dO_ = _intra_backward(Q, K, V, bb, lams, dO)
    dK = dot((dM * GL).astype(dt), Q, ta=True)
    dV = dot((A * GL).astype(dt), dO_, ta=True)
    zero = jnp.zeros((c,), jnp.result_type(F32, Q.dtype))
    dlw = []
    for j, w in enumerate(lw):
        def write(dK, dV, j=j, w=w):    # H_j ⊇ (w ∘ K)ᵀ V
            dH = dstate(j).astype(dt)
            R = dot(V, dH, tb=True)
            return dK + w[:, None] * R, dV + dot((w[:, None] * K).astype(dt), dH), jnp.sum(K * R, 1)

        dK, dV, dw = jax.lax.cond(lives[j], lambda dK, dV: (dK, dV, zero), write, dK, dV)
        dlw.append(dw)
    return dK, dV, dlw
