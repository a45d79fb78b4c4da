"""The Fenwick hierarchy of log-linear attention (docs/math.md#loglinear): levels and the binary counter.

Key ``s`` sits at level ``ℓ(t,s) = bit_length(t XOR s)`` for query ``t ≥ s`` (``ℓ(t,t) = 0``).
Everything here is bit arithmetic: no ``T×T`` table is ever built on a fast path; the only table
is the static ``c×c`` one inside a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _is_static(x) -> bool:
    return isinstance(x, (int, np.integer, np.ndarray))


def bit_length(x):
    """Number of binary digits of a non-negative int (``bit_length(0) = 0``), elementwise.

    numpy/int inputs stay numpy (static tables); jax inputs use ``bits − clz(x)``.
    """
    if _is_static(x):
        x = np.asarray(x, np.int64)
        n = np.zeros_like(x)
        while np.any(x > 0):
            n += x > 0
            x = x >> 1
        return n
    x = jnp.asarray(x)
    return x.dtype.itemsize * 8 - jax.lax.clz(x)


def level(t, s):
    """``ℓ(t, s) = bit_length(t XOR s)`` for ``s ≤ t`` (0 when ``s = t``); numpy or jax ints."""
    return bit_length(t ^ s)


def trailing_zeros(t):
    """Number of trailing zero bits of a (traced) int ``t > 0``: ``popcount((t & −t) − 1)``."""
    t = jnp.asarray(t)
    return jax.lax.population_count((t & -t) - 1)


def num_levels(T: int) -> int:
    """Levels a sequence of length ``T`` uses: ``ℓ ∈ 0..bit_length(T−1)``, i.e. ``⌈log2 T⌉ + 1``."""
    return int(bit_length(max(int(T), 1) - 1)) + 1


def level_table(c: int) -> np.ndarray:
    """Static ``[c, c]`` table ``ℓ(i, j) = bit_length(i XOR j)`` for ``j ≤ i``, ``-1`` above."""
    i = np.arange(c)[:, None]
    j = np.arange(c)[None, :]
    return np.where(j <= i, level(i, j), -1)


def at_table(Lam, table: np.ndarray):
    """``λ`` of each row at the static levels ``table [c, K]`` (clipped to ``Lam``'s ``L`` levels):
    ``Lam [..., c, L]`` -> ``[..., c, K]``, one select per level the table holds (no gather
    forward, no scatter-add backward)."""
    table = np.clip(table, 0, Lam.shape[-1] - 1)
    return sum(jnp.where(table == lev, Lam[..., lev, None], 0.0) for lev in np.unique(table))


def chunk_log2(chunk_size: int) -> int:
    """``log2 c`` for a power-of-two chunk size; ValueError otherwise.

    Chunk ``n``'s queries see chunk ``n' < n`` at level ``log2 c + bit_length(n XOR n')``
    ``= log2 c + 1 + ⌊log2(n XOR n')⌋``.
    """
    c = int(chunk_size)
    if c < 1 or c & (c - 1):
        raise ValueError(
            f"chunk_size must be a power of two for the log-linear forms, got {chunk_size!r}")
    return c.bit_length() - 1


def collapse(H, m):
    """``H[m] += H[0] + … + H[m−1]``, then ``H[0..m−1] = 0`` (``m`` may be traced; 0: no-op).

    The levels of earlier keys when the query moves from ``t0`` to ``t > t0``: a key at level
    ``ℓ`` of ``t0`` is at level ``max(ℓ, bit_length(t XOR t0))`` of ``t``.  ``H: [L, ...]``;
    ``m``: one int, or one per batch row (``[B]`` for ``H: [L,B,...]``).
    """
    L = H.shape[0]
    m = jnp.asarray(m)
    m = m.reshape((1,) + m.shape + (1,) * (H.ndim - 1 - m.ndim))
    idx = jnp.arange(L).reshape((L,) + (1,) * (H.ndim - 1))
    merged = jnp.sum(jnp.where(idx < m, H, 0), axis=0)
    return jnp.where(idx < m, 0, H) + jnp.where((idx == m) & (m > 0), merged, 0)


def levels_at(L: int, t, t0):
    """``[..., L]``: the levels at ``t ≥ t0`` of the keys before ``t0`` that are at levels
    ``0..L−1`` of ``t0``: ``max(ℓ, bit_length(t XOR t0))`` (``collapse``'s rule; ``t, t0``
    broadcasting ints)."""
    return jnp.maximum(jnp.arange(L), level(t, t0)[..., None])


def carry(H, t):
    """Binary-counter carry of stacked level states before token (or chunk) ``t`` is added.

    ``H: [L, ...]`` holds ``H[ℓ]`` = the keys at level ℓ of position ``t − 1``.  For ``t > 0``
    with ``z = trailing_zeros(t)``: ``H[z+1] += H[0] + … + H[z]``; ``H[0..z] = 0``; for ``t = 0``
    nothing moves.  Afterwards ``H[ℓ]`` (ℓ ≥ 1) holds the keys at level ℓ of ``t``, and
    ``H[0]`` is empty.  ``t`` may be traced (no Python branching), one per batch row as in
    ``collapse``; requires ``t < 2^(L−1)``.
    """
    t = jnp.asarray(t)
    return collapse(H, jnp.where(t > 0, trailing_zeros(t) + 1, 0))
