"""The chunk levels of the log-linear block forms (docs/math.md#loglinear) on the grid of
positions, shared by the XLA block forms (``ops.xla.loglinear_blocks``, ``ops.xla.loglinear_gdn_blocks``)
and the kernels.

Chunk ``n' < n`` (chunks of ``c = 2^lc`` tokens) is at level ``lc + 1 + j``,
``j = bit_length(n XOR n') − 1``: the left half of the aligned block of ``2^(j+1)`` chunks that
holds both writes, the right half reads.  Inside a chunk levels ``0..lc`` are the window
``(Λ ∘ M) V`` with ``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}`` from the static table ``fenwick.level_table(c)``.
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.core import fenwick


def halves(x, span: int):
    """``[B,H,Tp,...] -> [B,H,nb,2,span,...]``: aligned blocks of ``2·span`` tokens (zero-padded),
    their left and right halves."""
    B, H, Tp = x.shape[:3]
    nb = -(-Tp // (2 * span))
    x = jnp.pad(x, [(0, 0), (0, 0), (0, nb * 2 * span - Tp)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape((B, H, nb, 2, span) + x.shape[3:])


def level_decays(G, span: int):
    """``(log D(m, s), log D(t, m))``, each ``[B,H,nb,span]``: from a token ``s`` of a left half
    to its end ``m``, and from ``m`` to a token ``t`` of the right half, for the aligned blocks
    of ``2·span`` tokens of ``G [B,H,Tp]`` (log-decays); cumulative sums inside one half."""
    Gh = halves(G, span)
    after = jnp.pad(Gh[:, :, :, 0, 1:], [(0, 0)] * 3 + [(0, 1)])    # g_{s+1}, 0 past m
    return jnp.flip(jnp.cumsum(jnp.flip(after, -1), -1), -1), jnp.cumsum(Gh[:, :, :, 1], -1)


def token_weights(G, Lam, lc: int, N: int):
    """``LW: [B,H,P,Tp]``, ``P = bit_length(N − 1)`` chunk levels: at level ``j`` a token of a
    left half weighs ``D(m, s)`` in ``H_j``, one of a right half reads ``H_j`` with
    ``λ_t^{lc+1+j} D(t, m)`` (``G [B,H,Tp]`` log-decays, ``Lam [B,H,Tp,L]``, ``N`` chunks)."""
    B, H, Tp = G.shape
    rows = []
    for j in range(fenwick.num_levels(N) - 1):
        span = (Tp // N) << j
        left, right = level_decays(G, span)
        lam = halves(Lam[..., lc + 1 + j], span)[:, :, :, 1]
        rows.append(jnp.stack([jnp.exp(left), lam * jnp.exp(right)], 3).reshape(B, H, -1)[:, :, :Tp])
    return jnp.stack(rows, 2) if rows else jnp.zeros((B, H, 0, Tp), G.dtype)


def chunk_window(M, V, Lam):
    """The window ``(Λ ∘ M) V`` inside each chunk of ``c`` tokens, ``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}``
    (``fenwick.at_table`` of ``fenwick.level_table(c)``), at the caller's matmul precision:
    ``M [B,H,N,c,c]`` (or ``[B,H,N·c,c]``), ``V [B,N·c,H,dv]`` (tokens first),
    ``Lam [B,H,N·c,L]`` -> ``[B,H,N·c,dv]``."""
    B, H, Tp, c = Lam.shape[:3] + M.shape[-1:]
    chunk = lambda x: x.reshape(B, H, Tp // c, c, -1)                           # noqa: E731
    Lam, M, V = chunk(Lam), chunk(M), chunk(jnp.moveaxis(V, 1, 2))
    out = jnp.einsum("...ts,...sv->...tv", fenwick.at_table(Lam, fenwick.level_table(c)) * M, V)
    return out.reshape(B, H, Tp, -1)
