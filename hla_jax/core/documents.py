"""Packed documents (docs/math.md#packed-documents): where documents start in a row of
``segment_ids: [B,T]`` (consecutive equal ids form one document), each token's position in its
document, and the gate that resets a gated operator's state at every start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def doc_starts(segment_ids, seq_axis=None):
    """``[B,T]`` bool: True where a document begins, i.e. where the id differs from the previous
    token's.  The row's first token is never a start: whatever precedes it (an initial state, or
    under ``seq_axis`` the previous shard, whose last id is fetched by a ``ppermute``) continues
    into it; with nothing before it there is nothing to reset."""
    prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    if seq_axis is not None:
        n = jax.lax.axis_size(seq_axis)
        left = jax.lax.ppermute(segment_ids[:, -1:], seq_axis, [(i, i + 1) for i in range(n - 1)])
        first = jnp.where(jax.lax.axis_index(seq_axis) > 0, left, segment_ids[:, :1])
        prev = jnp.concatenate([first, prev[:, 1:]], axis=1)
    return segment_ids != prev


def gate_or_zeros(g, B: int, T: int, H: int, dtype) -> jax.Array:
    """``g`` as ``[B,T,H]`` in ``dtype``, zeros (no decay) when ``g is None``."""
    if g is None:
        return jnp.zeros((B, T, H), dtype)
    return g.astype(dtype)


def reset_gate(g, segment_ids, B: int, T: int, H: int, dtype, seq_axis=None):
    """The log-decay with ``-inf`` at every document start (docs/math.md#packed-documents: a gated
    operator on packed
    documents is the operator with its state reset there).  ``g``: ``[B,T,H]`` or ``None`` (no
    decay: zeros); returns ``g`` unchanged when ``segment_ids`` is ``None``."""
    if segment_ids is None:
        return g
    g = gate_or_zeros(g, B, T, H, dtype)
    return jnp.where(doc_starts(segment_ids, seq_axis)[..., None], -jnp.inf, g)


def doc_positions(segment_ids, first=None, seq_axis=None):
    """``[B,T]`` int32: each token's position in its document, ``t − t0`` (``t0`` its document's
    first token).  The tokens before the row's first document start continue from ``first: [B]``
    (the position of an initial state, or of a shard's first token in its document; None: 0);
    ``seq_axis`` as for ``doc_starts``."""
    T = segment_ids.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)
    since = jax.lax.cummax(jnp.where(doc_starts(segment_ids, seq_axis), t, -1), axis=1)
    before = t if first is None else first[:, None] + t
    return jnp.where(since < 0, before, t - since)


def same_doc(segment_ids):
    """``[B,T,T]`` bool: tokens ``t`` and ``s`` lie in one document (the quadratic oracles' mask)."""
    doc = jnp.cumsum(doc_starts(segment_ids), axis=1)
    return doc[:, :, None] == doc[:, None, :]
