"""Layouts of the time axis: zero-padding to chunks, chunks with heads first (``to_chunks``,
``[B,H,N,c,…]``) or with the chunk index first for a scan over them (``scan_chunks``,
``[N,B·H,c,…]``), and the buffer in which every packed document starts on an aligned block of its
own (docs/math.md#packed-documents).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.documents import doc_positions, doc_starts


def pad_time(x, multiple: int):
    """Zero-pad axis 1 (time) up to a multiple of ``multiple``.

    Padding is appended after the real tokens, so with causal operators it never changes the
    outputs of real positions (a zero log-decay and zero keys/values add nothing).
    """
    T = x.shape[1]
    pad = (-T) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)


def to_chunks(x, c: int):
    """``[B,T,H,...] -> [B,H,N,c,...]`` with T a multiple of c (pad first)."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // c, c, H, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x, T: int):
    """``[B,H,N,c,...] -> [B,T,H,...]``, dropping padding beyond ``T``."""
    B, H, N, c = x.shape[:4]
    x = jnp.moveaxis(x, 1, 3).reshape(B, N * c, H, *x.shape[4:])
    return x[:, :T]


def scan_chunks(x, c: int):
    """``[B,T,H,...] -> [N,B·H,c,...]``, ``N = ⌈T/c⌉``: chunks first, as ``lax.scan`` walks them,
    batch and heads merged into one batch axis of the matmuls; the tail is zero-padded (a zero
    token writes nothing and decays nothing)."""
    B, T, H = x.shape[:3]
    N = -(-T // c)
    x = jnp.pad(x, [(0, 0), (0, N * c - T)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x.reshape(B, N, c, H, *x.shape[3:]), (1, 2), (0, 3))
    return x.reshape(N, B * H, c, *x.shape[4:])


def from_scan_chunks(x, T: int, B: int):
    """``[N,B·H,c,...] -> [B,T,H,...]``, dropping the padding."""
    N, BH, c = x.shape[:3]
    x = jnp.moveaxis(x.reshape(N, B, BH // B, c, *x.shape[3:]), (0, 3), (1, 2))
    return x.reshape(B, N * c, BH // B, *x.shape[4:])[:, :T]


def heads_first(x, Tp: int, dtype):
    """``[B,T,H,...] -> [B,H,Tp,...]`` in ``dtype``, zero-padded to ``Tp`` tokens."""
    x = jnp.pad(x.astype(dtype), [(0, 0), (0, Tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x, 2, 1)


def aligned_layout(segment_ids):
    """``(dest [B,T] int32, Tb = 2T)``: where each token of a packed row goes in a buffer in
    which every document starts at a multiple of ``2^⌈log2 L⌉`` (``L`` its length), so the
    levels on the grid of the buffer's positions are the document's own,
    ``bit_length((t−t0) XOR (s−t0))``.  The documents are placed by those slots in decreasing
    order, so each offset is a multiple of its slot; the slots sum to less than ``2T``."""
    B, T = segment_ids.shape
    doc = jnp.cumsum(doc_starts(segment_ids), axis=1, dtype=jnp.int32)
    length = jax.vmap(lambda d: jnp.zeros(T, jnp.int32).at[d].add(1))(doc)
    slot = jnp.where(length > 0, 1 << fenwick.bit_length(jnp.maximum(length - 1, 0)), 0)
    order = jnp.argsort(-slot, axis=1, stable=True)
    sizes = jnp.take_along_axis(slot, order, axis=1)
    offset = jax.vmap(lambda o, x: jnp.zeros(T, jnp.int32).at[o].set(x))(
        order, jnp.cumsum(sizes, axis=1) - sizes)
    return jnp.take_along_axis(offset, doc, axis=1) + doc_positions(segment_ids), 2 * T
