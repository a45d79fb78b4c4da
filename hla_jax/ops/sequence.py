"""Exact sequence (context) parallelism: the time axis sharded over a mesh axis ``seq_axis``.

Every public operator takes ``seq_axis=None``.  When it names a mesh axis of size ``P``, the call
must run inside ``jax.shard_map`` with the time axis of every ``[B,T,...]`` input sharded over
that axis: device ``j`` holds tokens ``[t0_j, t0_j + T)``, ``t0_j = j T`` (``T`` the local length,
any value: each shard is padded locally with zero tokens, which contribute nothing and decay
nothing).  Each first-order family then

1. computes its local chunk summaries, as in its chunked form;
2. reduces them to the device total ``s_j`` (a summary of the same type);
3. ``device_prefix``: all-gathers the totals over ``seq_axis`` and folds those of devices
   ``i < j`` in device order, giving the incoming prefix ``p_j = s_0 ⊕ … ⊕ s_{j−1}``;
4. computes its local outputs with ``p_j`` in front of every chunk prefix (``chunk_prefixes``).

hla2, ahla and causal hla3 are chains of two first-order LA passes (docs/math.md#chains, ``ops.chains``),
each of them sequence-parallel this way (two dependent all-gathers, one per pass).

The backward pass is the transpose of the same program (the transpose of ``all_gather`` is a
``psum_scatter``), so gradients are those of the unsharded operator.

Communication: one ``all_gather`` of one total summary per device (``|s|`` numbers per batch
row and head, float32): each device receives ``(P − 1)·|s|`` numbers, then does ``P − 1``
combines of summary size (no chunk-sized work); the backward moves the same volume through the
transposed ``psum_scatter``.  A log-step ``ppermute`` scan would receive ``⌈log2 P⌉·|s|`` but
needs ``⌈log2 P⌉`` dependent collective rounds, each followed by a combine.  The choice rests on
the volumes (a few summaries per device, counted from the lowered program by ``gathered_bytes``)
and the round count, not on timings of the collectives.  HLA3's
``paper`` mask (whose full summary holds a ``d³·dv`` map) uses two exclusive sums of ``d×d`` and
``d×dv`` moments instead, and the log-linear operators one state per Fenwick level (see their
modules).  ``over_time`` runs an operator this way from a model under ``jit``.
"""

from __future__ import annotations

import functools
import math
import operator
import re

import jax
import jax.numpy as jnp

from hla_jax.ops import common

SEQ_IMPLS = ("chunked", "auto")


def check_impl(impl: str, seq_axis, *, name: str) -> None:
    """Only the chunked form is sequence-parallel: ValueError naming ``seq_axis`` otherwise."""
    if seq_axis is not None and impl not in SEQ_IMPLS:
        raise ValueError(f"{name}: seq_axis={seq_axis!r} needs impl in {SEQ_IMPLS}, got "
                         f"impl={impl!r}")


def axis_size(seq_axis) -> int:
    """``P``: the number of sequence shards (1 when ``seq_axis`` is None)."""
    return 1 if seq_axis is None else jax.lax.axis_size(seq_axis)


def first_position(seq_axis, T: int):
    """``t0 = j T``: global position of this shard's first token (0 when ``seq_axis`` is None)."""
    return 0 if seq_axis is None else jax.lax.axis_index(seq_axis) * T


def varying(tree, seq_axis):
    """Mark device-independent values (e.g. a zero initial carry) as varying over ``seq_axis``,
    as ``shard_map`` requires of a ``lax.scan`` carry that becomes device-dependent."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, (seq_axis,), to="varying"), tree)


def device_prefix(step, init, total, seq_axis):
    """``step_{j−1}(… step_0(init, s_0) …, s_{j−1})`` on device ``j``, ``s_i`` device i's ``total``.

    ``step(i, acc, s_i)`` (``i`` a static int) folds device ``i``'s summary into the running
    prefix; ``init`` is the empty prefix (same tree structure and shapes as ``step``'s result).
    One ``all_gather`` of ``total`` over ``seq_axis``, then ``P − 1`` steps, each kept only on
    the devices after ``i``.
    """
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, seq_axis), total)
    j = jax.lax.axis_index(seq_axis)
    acc = init
    for i in range(axis_size(seq_axis) - 1):
        nxt = step(i, acc, jax.tree.map(operator.itemgetter(i), gathered))
        acc = jax.tree.map(functools.partial(jnp.where, i < j), nxt, acc)
    return acc


def exclusive_sum(total, seq_axis):
    """``Σ_{i<j} total_i`` on device ``j``: the prefix of additive summaries."""
    return device_prefix(lambda _, acc, s: jax.tree.map(jnp.add, acc, s),
                         jax.tree.map(jnp.zeros_like, total), total, seq_axis)


def chunk_prefixes(combine, identity, own, axis: int, seq_axis=None):
    """The prefix summary before each chunk: ``p_n = s_0 ⊕ … ⊕ s_{j−1} ⊕ own_0 ⊕ … ⊕ own_{n−1}``.

    ``own`` are the local chunk summaries along ``axis``; ``identity`` the empty summary with
    ``axis`` of length 1.  Without ``seq_axis`` this is ``common.exclusive_scan``; with it, the
    device total ``own_0 ⊕ … ⊕ own_{N−1}`` goes through ``device_prefix`` and the incoming
    prefix is combined in front of every local prefix.

    The scan is rematerialised in the backward pass (``jax.checkpoint``: only ``own`` is saved).
    Besides saving memory, this keeps the zero-sized intermediates of
    ``jax.lax.associative_scan`` (at 2 elements in its recursion) out of the residuals, which
    jax 0.11.2's SPMD partitioner cannot pass out of a ``shard_map`` body (it segfaults).
    """
    local = jax.checkpoint(functools.partial(common.exclusive_scan, combine, axis=axis))(
        identity, own)
    if seq_axis is None:
        return local

    def last(x):
        return jax.lax.slice_in_dim(x, x.shape[axis] - 1, x.shape[axis], axis=axis)

    total = combine(jax.tree.map(last, local), jax.tree.map(last, own))
    incoming = device_prefix(lambda _, acc, s: combine(acc, s), identity, total, seq_axis)
    return combine(incoming, local)


def segment_total(combine, elems, axis: int):
    """``e_0 ⊕ … ⊕ e_{N−1}`` along ``axis`` (kept with length 1; rematerialised in the backward
    pass, as in ``chunk_prefixes``)."""
    inclusive = jax.checkpoint(functools.partial(jax.lax.associative_scan, combine, axis=axis))(
        elems)
    n = jax.tree.leaves(elems)[0].shape[axis]
    return jax.tree.map(lambda x: jax.lax.slice_in_dim(x, n - 1, n, axis=axis), inclusive)


def over_time(entry, seq_axis: str, *, mesh=None, **kw):
    """``entry`` (a public operator) on global ``[B,T,...]`` arrays with the time axis sharded
    over ``seq_axis``, for models run under ``jit`` (``jax.set_mesh(mesh)`` or ``mesh=``).

    Wraps the call in a ``jax.shard_map`` that is manual over ``seq_axis`` only, so the other
    mesh axes (data, fsdp, tensor) stay automatic.  Returns ``f(*arrays, **named_arrays)``
    (``q, k, v, g, …`` positionally or by name; ``None`` entries such as ``g=None`` pass
    through); ``kw`` go to ``entry`` (``chunk_size``, ``normalize``, …).
    """
    spec = jax.sharding.PartitionSpec(None, seq_axis)

    def call(*args, **named):
        values = [*args, *named.values()]
        present = [x is not None for x in values]

        def body(*arrays):
            it = iter(arrays)
            full = [next(it) if p else None for p in present]
            return entry(*full[:len(args)], **dict(zip(named, full[len(args):])),
                         seq_axis=seq_axis, **kw)

        arrays = [x for x in values if x is not None]
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec,
                             axis_names={seq_axis})(*arrays)

    return call


def gathered_bytes(text: str, shards: int) -> int:
    """Bytes each device receives through the all-gathers of a lowered (StableHLO) program over
    ``shards`` devices: every operand ``tensor<A×B×…×fNN>`` from each of the ``shards − 1``
    others (how the communication volumes are counted)."""
    operands = re.findall(r"stablehlo\.all_gather.*?\(tensor<([\dx]+)x[a-z]+(\d+)>\)", text)
    return (shards - 1) * sum(math.prod(int(n) for n in shape.split("x")) * int(bits) // 8
                              for shape, bits in operands)
