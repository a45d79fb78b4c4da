"""One chunk of log-linear Mamba-2 (SPEC §4), forward and backward, and the binary counter of
chunk-level states: small 2-D matmuls shared by the NVIDIA (Triton) and TPU (Mosaic) kernels.

One chunk of ``c = 2^lc`` tokens, local positions τ, σ; ``bb`` the local cumulative log-decay,
``ρ = exp(bb)``, ``ρ_c`` its value at the chunk end, ``γ = ρ_c / ρ``, ``Γ[τ,σ] = ρ_τ / ρ_σ``
(σ ≤ τ), as in ``la_chunk``.  ``lams[ℓ]: [c]`` is ``λ^{(ℓ)}`` of the chunk's tokens.  Levels
``0..lc`` live inside the chunk: ``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}``, ``ℓ = bit_length(τ XOR σ)``.

Chunk ``n`` sees chunk ``n' < n`` at level ``lc + bit_length(n XOR n')``: slot ``j < P`` of the
counter holds the block of earlier chunks at level ``lc + 1 + j``, and is live exactly when bit
``j`` of ``n`` is 1.  The counter is lazy: slot ``j`` keeps its block state ``W_j: d×bv``
(float32) as written, at the end of chunk ``block_end(n, j)``, and chunk ``n`` reads it as
``s_j W_j`` with the scalar decay ``s_j = s[n, j]`` of the chunks in between
(``kernels.loglinear.level_scales``).  Nothing is rescaled per chunk: a chunk reads its live
slots and writes one.  With ``z`` = the number of trailing 1 bits of ``n``:

    O      = (QKᵀ ∘ Γ ∘ Λ) V + Σ_{j live} s_j diag(λ^{(lc+1+j)} ∘ ρ) Q W_j
    merged = (γ ∘ K)ᵀ V + ρ_c Σ_{j<z} s_j W_j          (then W_z ← merged: ``place``)

Dead slots skip their matmuls and loads (``lax.cond``).  Matmul operands in the input dtype,
accumulation and state in float32.  The counter and level helpers (``live``, ``block_end``,
``counter_flags``, ``place``, ``take``, ``level_weights``, ``level_sums``) know nothing of Mamba-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.kernels.la_chunk import at_end, decays, dot
from hla_jax.ops import fenwick

# --------------------------------------------------------------------------- binary counter


def num_slots(levels: int, c: int) -> int:
    """``P``: the counter slots behind ``levels = lc + 1 + P`` rows of λ for chunks of ``c``."""
    return levels - c.bit_length()


def live(n, j: int):
    """Slot ``j`` is live at chunk ``n`` (traced int) iff bit ``j`` of ``n`` is 1."""
    return ((n >> j) & 1) == 1


def block_end(n, j: int):
    """The chunk whose merge wrote the slot-``j`` state that chunk ``n`` reads (bit ``j`` of ``n``
    set): the last chunk of the left half of ``n``'s aligned block of ``2^(j+1)`` chunks."""
    return (n & ~((2 << j) - 1)) | ((1 << j) - 1)


def _reaches(n, j: int):
    """``j ≤ z``, ``z`` = the number of trailing 1 bits of ``n`` (the carry when ``n+1`` starts)."""
    return ((n + 1) & ((1 << j) - 1)) == 0


def counter_flags(n, P: int):
    """``(lives, merges, ats)`` at chunk ``n``, one bool per slot: read (bit ``j`` of ``n``),
    merged into the new state (``j < z``), written (``j = z``; none when ``z ≥ P``, which only
    happens at the last chunk)."""
    upto = [_reaches(n, j) for j in range(P + 1)]
    return ([live(n, j) for j in range(P)], upto[1:],
            [upto[j] & ~upto[j + 1] for j in range(P)])


def place(Ws, merged, ats):
    """``W_z ← merged`` on a list of slot states (the others untouched, no arithmetic)."""
    return [_when(at, lambda W: (merged,), W)[0] for W, at in zip(Ws, ats)]


def take(dWs, acc, ats):
    """Transpose of ``place``: ``d_merged = dW_z``, then slot ``z``'s cotangent ``dW_z`` and its
    decay accumulator ``acc_z`` restart at 0 (the state before the write is another one).
    Returns ``(d_merged, dWs, acc)``."""
    d_merged = jnp.zeros_like(dWs[0])
    out = []
    for dW, at in zip(dWs, ats):
        d_merged, dW = _when(at, lambda d, w: (w, jnp.zeros_like(w)), d_merged, dW)
        out.append(dW)
    return d_merged, out, [jnp.where(at, 0.0, a) for a, at in zip(acc, ats)]


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


def chunk_forward(Q, K, V, bb, lams, state, scales, lives, merges):
    """``(O [c,bv], merged [d,bv])`` from ``Q, K [c,d]``, ``V [c,bv]``, ``bb [c]``, ``lams``
    (``lc + 1 + P`` vectors ``[c]``), ``state(j)`` (slot ``j``'s ``W_j``, called only when live),
    the scalars ``scales[j] = s_j`` and the ``counter_flags`` ``lives``, ``merges``."""
    dt = Q.dtype
    c = Q.shape[0]
    lc = c.bit_length() - 1
    r, rc, gam, Gam, _ = decays(bb)
    M = dot(Q, K, tb=True) * (Gam * level_weights(lams[:lc + 1], level_table(c)))
    O = dot(M.astype(dt), V)
    merged = dot((gam[:, None] * K).astype(dt), V, ta=True)
    for j, s in enumerate(scales):
        def level(O, merged, j=j, s=s, lam=lams[lc + 1 + j]):
            W = state(j)
            O = O + (s * lam * r)[:, None] * dot(Q, W.astype(dt))
            return O, _when(merges[j], lambda m: (m + (rc * s) * W,), merged)[0]

        O, merged = _when(lives[j], level, O, merged)
    return O, merged


def chunk_backward(Q, K, V, bb, lams, state, scales, lives, merges, dO, d_merged, dWs, carried):
    """Reverse-mode step of ``chunk_forward`` given the cotangents ``dO [c,bv]`` and
    ``d_merged [d,bv]``; ``dWs`` (the slots' cotangents so far) get this chunk's share added, and
    ``carried`` (the cotangent of this chunk's total log-decay through the states that cross it,
    from the counter) joins ``db``.  Returns ``(dQ [c,d], dK [c,d], dV [c,bv], db [c], dlams,
    dWs, dlogs)``: ``dlams`` one ``[c]`` per level, ``dlogs[j] = s_j ∂/∂s_j`` (float32)."""
    dt = Q.dtype
    c = Q.shape[0]
    lc = c.bit_length() - 1
    r, rc, gam, Gam, _ = decays(bb)
    lev = level_table(c)
    GL = Gam * level_weights(lams[:lc + 1], lev)
    A = dot(Q, K, tb=True)
    M = A * GL
    dO_ = dO.astype(dt)
    dm_ = d_merged.astype(dt)
    Kg = gam[:, None] * K

    dM = dot(dO_, V, tb=True)
    dA = (dM * GL).astype(dt)
    Vdm = dot(V, dm_, tb=True)                      # V d_mergedᵀ  [c,d]
    dV = dot(M.astype(dt), dO_, ta=True) + dot(Kg.astype(dt), dm_)
    dQ = dot(dA, K)
    dK = dot(dA, Q, ta=True) + gam[:, None] * Vdm
    dlams = level_sums(dM * A * Gam, lev, lc + 1)
    e = gam * jnp.sum(K * Vdm, 1)                   # cotangent of γ, times γ
    # Γ's log-decay cotangent: row sums minus column sums of dM ∘ M (row sums = Σ_ℓ λ^ℓ dλ^ℓ)
    db = sum(lam * dl for lam, dl in zip(lams, dlams)) - jnp.sum(dM * M, 0) - e
    end = jnp.sum(e) + carried

    zero = jnp.zeros_like(db)
    dWs_out, dlogs = [], []
    for j, (s, dW) in enumerate(zip(scales, dWs)):
        def level(dQ, dW, dl, g, j=j, s=s, lam=lams[lc + 1 + j]):
            W = state(j)
            R = dot(dO_, W.astype(dt), tb=True)     # dO Wᵀ  [c,d]
            dl = (s * r) * jnp.sum(Q * R, 1)        # = dλ^{(lc+1+j)}
            dQ = dQ + (s * lam * r)[:, None] * R
            dW = dW + s * dot(((lam * r)[:, None] * Q).astype(dt), dO_, ta=True)

            def merge(dW, g):
                q = (rc * s) * jnp.sum(d_merged * W)
                return dW + (rc * s) * d_merged, g + at_end(q, c)

            dW, g = _when(merges[j], merge, dW, lam * dl)
            return dQ, dW, dl, g

        dQ, dW, dl, g = _when(lives[j], level, dQ, dW, zero, zero)
        db = db + g             # Σ g = s_j ∂/∂s_j: λ·dλ through ρ, the merge's q through ρ_c
        dlams.append(dl)
        dWs_out.append(dW)
        dlogs.append(jnp.sum(g))
    return dQ, dK, dV, db + at_end(end, c), dlams, dWs_out, dlogs
