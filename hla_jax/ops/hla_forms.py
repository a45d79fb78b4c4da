"""The recurrent / scan / chunked drivers and the public-entry dispatch shared by the HLA families.

A family (``hla2``, ``ahla``, ``hla3`` causal and paper) supplies only its mathematics as a
``Family``: ``init_state``, ``step``, ``token_summaries``, ``combine``, ``readout`` and the chunk
output formula ``chunk_outputs(Chunks, seq_axis)``.  The drivers are jitted once with the family
static, so each (family, normalize, chunk_size, seq_axis) compiles once.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay or ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops import sequence
from hla_jax.ops.common import (
    cast_inputs,
    causal_mask,
    check_chunk_size,
    check_gate,
    check_impl,
    check_qkv,
    decay_matrix,
    empty_segment,
    from_chunks,
    pad_time,
    pallas_entry,
    pallas_preferred,
    ratio_last_column,
    scan_time,
    state_dtype,
    to_chunks,
)


class Family(NamedTuple):
    """One HLA family's mathematics, as the drivers use it (hashable: a static jit argument).

    ``step(state, q_t, k_t, v_t[, g_t], *, normalize, eps) -> (o_t, state)``;
    ``token_summaries(q, k, v[, g])``; ``combine(a, b)``; ``readout(prefix, q, *, normalize, eps)``;
    ``chunk_outputs(Chunks, seq_axis) -> O [B,H,N,c,dv]``; ``reference(q, k, v, g, *, normalize,
    eps)`` the quadratic oracle.  The gate ``g`` is passed only when it is not ``None``.
    """
    name: str
    init_state: Callable
    step: Callable
    token_summaries: Callable
    combine: Callable
    readout: Callable
    chunk_outputs: Callable
    reference: Callable


class Chunks(NamedTuple):
    """Chunked inputs ``[B,H,N,c,...]``: ``Q, K: d``, ``V: dv``, log-decays ``g: [B,H,N,c]``, the
    local decay matrix ``Γ: [...,c,c]`` and local decays ``ρ_τ = exp(g_1+…+g_τ): [...,c,1]``."""
    Q: jax.Array
    K: jax.Array
    V: jax.Array
    g: jax.Array
    Gam: jax.Array
    rho: jax.Array


def finish(o, normalize: bool, eps):
    """``o`` divided by its denominator column when ``normalize`` (``[V | 1]`` inputs)."""
    return ratio_last_column(o, eps) if normalize else o


def _qkvg(q, k, v, g):
    return (q, k, v) if g is None else (q, k, v, g)


def chunk_prefixes(combine, own, seq_axis=None):
    """The summary of everything before each chunk (``own: [B,H,N,...]`` the chunks' own
    summaries): ``exclusive_scan(combine, ·)`` along N, after the earlier shards under
    ``seq_axis`` (``sequence.chunk_prefixes``)."""
    return sequence.chunk_prefixes(combine, empty_segment(own, 2), own, 2, seq_axis)


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def recurrent(family: Family, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Serial recurrence: ``lax.scan`` of ``family.step`` over time from ``family.init_state``."""
    B, _, H, d, dv = check_qkv(q, k, v, name=family.name)
    state = family.init_state(B, H, d, dv, normalize=normalize, dtype=state_dtype(q, k, v, g))
    out, _ = scan_time(family.step, state, *_qkvg(q, k, v, g), normalize=normalize, eps=eps)
    return out


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def scan(family: Family, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Token-level ``jax.lax.associative_scan(combine, token_summaries)``, then ``readout``.

    Materialises one summary per token: O(T·d²) memory by nature (O(T·d³·dv) for hla3's paper
    summary); the chunked form is the one that scales.
    """
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    summaries = family.token_summaries(*_qkvg(q, k, v, g))
    prefix = jax.lax.associative_scan(family.combine, summaries, axis=1)
    return family.readout(prefix, q, normalize=normalize, eps=eps)


@functools.partial(jax.jit, static_argnames=("family", "normalize", "chunk_size", "seq_axis"))
def chunked(family: Family, q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64,
            seq_axis=None):
    """Chunked form: T padded to a multiple of ``c = min(chunk_size, T)``, cut into ``Chunks``,
    ``family.chunk_outputs`` (matmuls inside chunks, summaries across them), then un-chunked.
    Memory O(T·c) plus one summary per chunk."""
    B, T, H, _, _ = check_qkv(q, k, v, name=family.name)
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    c = min(check_chunk_size(chunk_size), T)
    Q, K, V = (to_chunks(pad_time(x, c), c) for x in (q, k, v))
    if g is None:  # Γ = L, ρ = 1 as constants: XLA's GPU compiler folds cumsums of zeros for minutes
        gc = jnp.zeros(Q.shape[:4], q.dtype)
        chunks = Chunks(Q, K, V, gc, jnp.broadcast_to(causal_mask(c, q.dtype), gc.shape + (c,)),
                        jnp.ones(gc.shape + (1,), q.dtype))
    else:
        gc = to_chunks(pad_time(g.astype(q.dtype), c), c)
        chunks = Chunks(Q, K, V, gc, decay_matrix(gc), jnp.exp(jnp.cumsum(gc, -1))[..., None])
    return finish(from_chunks(family.chunk_outputs(chunks, seq_axis), T), normalize, eps)


def pallas(name: str):
    """``impl="pallas"`` of the family ``name`` (``common.pallas_entry``), with the ``dispatch``
    kernel signature."""
    def kernel(q, k, v, g, *, normalize, eps, chunk_size):
        return pallas_entry(name)(q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size)
    return kernel


def dispatch(family: Family, impl, impls, q, k, v, g=None, *, normalize=False, eps=1e-6,
             chunk_size=64, seq_axis=None, kernels=None, auto_kernel=False):
    """A public entry's checks, then ``impl``: "reference" | "recurrent" | "scan" | "chunked" |
    "auto" | a name in ``kernels`` (``{impl: fn(q, k, v, g, *, normalize, eps, chunk_size)}``).
    "auto" is "pallas" when ``auto_kernel`` and ``common.pallas_preferred``, else "chunked".
    Bad ``impl``, ``seq_axis`` use, ``chunk_size``, ``q, k, v`` or ``g`` raise ``ValueError``
    naming the argument."""
    name = family.name
    check_impl(impl, impls, name=name)
    sequence.check_impl(impl, seq_axis, name=name)
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, _, _ = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name)
    if impl == "auto" and auto_kernel and pallas_preferred(seq_axis, chunk_size, q, k, v):
        impl = "pallas"
    if impl == "reference":
        return family.reference(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "recurrent":
        return recurrent(family, q, k, v, g, normalize=normalize, eps=eps)
    if impl == "scan":
        return scan(family, q, k, v, g, normalize=normalize, eps=eps)
    if kernels and impl in kernels:
        return kernels[impl](q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size)
    return chunked(family, q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size,
                   seq_axis=seq_axis)
