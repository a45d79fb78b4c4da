"""The chunk walks of LA and the HLA family for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU
was available; the tests run them in interpret mode on CPU and check that they lower through
Mosaic.

The TPU way of ``kernels/gpu/walk.py`` (same five kernels, same interface; ``bv``/``num_warps``
are ignored and there is one value tile, ``nv = 1``): grid ``(B, H, N)``, each step's ``[c, d]``
tiles arriving by the pipeline's DMA.  In the walks (``forward``, ``states``, ``dstates``) the
chunk axis is last and sequential ("arbitrary") and the float32 states persist across it in VMEM
scratch (``pltpu.VMEM``), reset at the first chunk; in ``outputs`` and ``grads`` every axis is
parallel.  Inputs are moved to ``[B,H,Tp,·]`` so every block's last two dims are ``(c, d)`` with
``c >= 8``; the gate comes as ``[B,H,N,1,c]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.gpu.walk import DD, STATIC
from hla_jax.kernels.la_chunk import F32


def heads_first(x):
    return jnp.swapaxes(x, 1, 2)  # [B,Tp,H,·] <-> [B,H,Tp,·]


def specs(c, rev, N):
    """Per-chunk blocks of q, k, v and the gate; ``rev`` walks the chunks backwards."""
    n_of = (lambda n: N - 1 - n) if rev else (lambda n: n)
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n_of(n), 0))
    gate = pl.BlockSpec((None, None, None, 1, c), lambda i, h, n: (i, h, n_of(n), 0, 0))
    return tile, gate


def compiler_params(interpret, sequential=True):
    return None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary" if sequential else "parallel"))


def _widths(layout, d, dv):
    return [d if kind == DD else dv for kind in layout]


def _state_io(layout, B, H, n_blocks, d, dv, dtype, at, share=False):
    """Shapes and blocks of states stacked along a chunk axis of ``n_blocks``, grid step ``n``
    at block ``at(n)``; ``share``: ``DD`` with a leading value-tile axis of 1 (the layout of
    ``dstates``)."""
    shapes, blocks = [], []
    for kind, w in zip(layout, _widths(layout, d, dv)):
        lead = (1,) if share and kind == DD else ()
        shapes.append(jax.ShapeDtypeStruct(lead + (B, H, n_blocks, d, w), dtype))
        blocks.append(pl.BlockSpec((None,) * len(lead) + (None, None, None, d, w),
                                   lambda i, h, n, lead=lead: (0,) * len(lead) + (i, h, at(n), 0, 0)))
    return shapes, blocks


def _start(scratch, init_refs=()):
    """At the first chunk, set the carried states to ``init_refs`` (float32), or to zeros."""
    @pl.when(pl.program_id(2) == 0)
    def _():
        for k, s in enumerate(scratch):
            s[...] = init_refs[k][...].astype(F32) if init_refs else jnp.zeros_like(s)


def _store_last(scratch, refs, N):
    """At the last chunk (after ``_advance``), copy the carried states to ``refs``."""
    @pl.when(pl.program_id(2) == N - 1)
    def _():
        for ref, s in zip(refs, scratch):
            ref[...] = s[...]


def _ends(layout, B, H, d, dv, share=False):
    """Shapes and blocks of one float32 state per layout entry, the same block at every grid step:
    the walks' ``init`` and last states."""
    return _state_io(layout, B, H, 1, d, dv, F32, lambda n: 0, share)


def _advance(scratch, outputs):
    """Store the trailing ``len(scratch)`` outputs (the new states) in ``scratch``; return the
    leading ones."""
    k = len(outputs) - len(scratch)
    for s, x in zip(scratch, outputs[k:]):
        s[...] = x
    return outputs[:k]


def _call(kernel, out_shape, in_specs, out_specs, grid, scratch, sequential, interpret, q, k, v, b,
          *rest):
    B, Tp, H, _ = q.shape
    c = Tp // grid[2]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch, compiler_params=compiler_params(interpret, sequential),
        interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, grid[2], 1, c), *rest)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC + ("final",))
def forward(chunk_forward, layout, q, k, v, b, *, init=None, final=False, c, bv=None,
            num_warps=None, interpret=False):
    """As ``kernels.gpu.walk.forward``: ``O [B,Tp,H,dv]`` float32 from ``init`` (float32, zeros if
    None), with ``final`` ``(O, last)``."""
    B, Tp, H, d = q.shape
    dv, N, init = v.shape[-1], Tp // c, tuple(init or ())
    tile, gate = specs(c, False, N)
    end_shapes, end_blocks = _ends(layout, B, H, d, dv)
    n_last = len(layout) if final else 0

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        init_refs, (o_ref, *refs) = refs[:len(init)], refs[len(init):]
        last_refs, scratch = refs[:n_last], refs[n_last:]
        _start(scratch, init_refs)
        o_ref[...], = _advance(scratch, chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                                      *(s[...] for s in scratch)))
        _store_last(scratch, last_refs, N)

    out = _call(kernel, [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)] + end_shapes[:n_last],
                [tile(d), tile(d), tile(dv), gate, *end_blocks[:len(init)]],
                [tile(dv)] + end_blocks[:n_last], (B, H, N),
                [pltpu.VMEM((d, w), F32) for w in _widths(layout, d, dv)], True, interpret,
                q, k, v, b, *init)
    return (heads_first(out[0]), tuple(out[1:])) if final else heads_first(out[0])


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC + ("every", "final"))
def states(chunk_forward, layout, q, k, v, b, *, init=None, every=1, final=False, c, bv=None,
           num_warps=None, interpret=False):
    """As ``kernels.gpu.walk.states``: the incoming states of every ``every``-th chunk, input
    dtype (float32 checkpoints when ``every > 1``), the walk starting from ``init`` (float32,
    zeros if None); with ``final`` ``(per_chunk, last)``."""
    B, Tp, H, d = q.shape
    dv, N, init = v.shape[-1], Tp // c, tuple(init or ())
    tile, gate = specs(c, False, N)
    shapes, blocks = _state_io(layout, B, H, -(-N // every), d, dv, F32 if every > 1 else q.dtype,
                               lambda n: jax.lax.div(n, every))  # n >= 0: no floor fix-up
    end_shapes, end_blocks = _ends(layout, B, H, d, dv)
    L, n_last = len(layout), len(layout) if final else 0

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        init_refs, refs = refs[:len(init)], refs[len(init):]
        saved, last, scratch = refs[:L], refs[L:L + n_last], refs[L + n_last:]
        _start(scratch, init_refs)
        xs = [s[...] for s in scratch]

        @pl.when(jax.lax.rem(pl.program_id(2), every) == 0)
        def _():
            for ref, x in zip(saved, xs):
                ref[...] = x.astype(ref.dtype)

        _advance(scratch, chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0], *xs))
        _store_last(scratch, last, N)

    out = _call(kernel, shapes + end_shapes[:n_last],
                [tile(d), tile(d), tile(dv), gate, *end_blocks[:len(init)]],
                blocks + end_blocks[:n_last], (B, H, N),
                [pltpu.VMEM((d, w), F32) for w in _widths(layout, d, dv)], True, interpret,
                q, k, v, b, *init)
    return (tuple(out[:L]), tuple(out[L:])) if final else tuple(out)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def dstates(chunk_backward, layout, q, k, v, b, *saved_do, init=None, c, bv=None, num_warps=None,
            interpret=False):
    """As ``kernels.gpu.walk.dstates`` with one value tile (``DD``: ``[1,B,H,N,d,d]``):
    ``(per_chunk, first)``, the walk starting from ``init`` (float32, zeros if None)."""
    B, Tp, H, d = q.shape
    dv, N, L, init = v.shape[-1], Tp // c, len(saved_do) - 1, tuple(init or ())
    tile, gate = specs(c, True, N)
    shapes, blocks = _state_io(layout, B, H, N, d, dv, q.dtype, lambda n: N - 1 - n, share=True)
    _, state_blocks = _state_io(layout, B, H, N, d, dv, q.dtype, lambda n: N - 1 - n)
    end_shapes, end_blocks = _ends(layout, B, H, d, dv, share=True)
    widths = _widths(layout, d, dv)

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, do_ref, init_refs = refs[:L], refs[L], refs[L + 1:L + 1 + len(init)]
        outs = refs[L + 1 + len(init):]
        dsaved, first, scratch = outs[:len(layout)], outs[len(layout):2 * len(layout)], \
            outs[2 * len(layout):]
        _start(scratch, init_refs)
        xs = [s[...] for s in scratch]
        for ref, x in zip(dsaved, xs):
            ref[...] = x.astype(ref.dtype)
        saved = [ref[...] for ref in state_refs] if L else [jnp.zeros((d, w), q.dtype) for w in widths]
        out = chunk_backward(q_ref[...], k_ref[...], v_ref[...], b_ref[0], *saved, do_ref[...], *xs)
        _advance(scratch, out[4:])
        _store_last(scratch, first, N)

    *saved, do = saved_do
    out = _call(kernel, shapes + end_shapes,
                [tile(d), tile(d), tile(dv), gate, *state_blocks[:L], tile(dv), *end_blocks[:len(init)]],
                blocks + end_blocks, (B, H, N), [pltpu.VMEM((d, w), F32) for w in widths], True,
                interpret, q, k, v, b, *saved, heads_first(do), *init)
    return tuple(out[:len(layout)]), tuple(out[len(layout):])


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def outputs(chunk_forward, layout, q, k, v, b, *saved, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.walk.outputs``: every chunk at once, grid ``(B, H, N)`` all parallel."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile, gate = specs(c, False, N)
    _, blocks = _state_io(layout, B, H, N, d, dv, q.dtype, lambda n: n)

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, o_ref = refs[:-1], refs[-1]
        o_ref[...], *_ = chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                       *(ref[...] for ref in state_refs))

    O = _call(kernel, jax.ShapeDtypeStruct((B, H, Tp, dv), F32),
              [tile(d), tile(d), tile(dv), gate, *blocks], tile(dv), (B, H, N), [], False,
              interpret, q, k, v, b, *saved)
    return heads_first(O)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def grads(chunk_backward, layout, q, k, v, b, *saved_do_dsaved, c, bv=None, num_warps=None,
          interpret=False):
    """As ``kernels.gpu.walk.grads`` with one value tile: every chunk at once, grid ``(B, H, N)``
    all parallel."""
    B, Tp, H, d = q.shape
    dv, N, L = v.shape[-1], Tp // c, len(layout)
    tile, gate = specs(c, False, N)
    _, state_blocks = _state_io(layout, B, H, N, d, dv, q.dtype, lambda n: n)
    _, dstate_blocks = _state_io(layout, B, H, N, d, dv, q.dtype, lambda n: n, share=True)
    saved, do, dsaved = saved_do_dsaved[:L], saved_do_dsaved[L], saved_do_dsaved[L + 1:]

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, do_ref, dstate_refs = refs[:L], refs[L], refs[L + 1:2 * L + 1]
        dq_ref, dk_ref, dv_ref, db_ref = refs[2 * L + 1:]
        dq_ref[...], dk_ref[...], dv_ref[...], db, *_ = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], *(ref[...] for ref in state_refs),
            do_ref[...], *(ref[...].astype(F32) for ref in dstate_refs))
        db_ref[...] = db[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32), jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    dq, dk, dvv, db = _call(
        kernel, out_shape, [tile(d), tile(d), tile(dv), gate, *state_blocks, tile(dv), *dstate_blocks],
        [tile(d), tile(d), tile(dv), gate], (B, H, N), [], False, interpret, q, k, v, b, *saved,
        heads_first(do), *dsaved)
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp))
