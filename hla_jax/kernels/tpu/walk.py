"""The HLA chunk walk for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU was available; the
tests run it in interpret mode on CPU and check that it lowers through Mosaic.

The TPU way of layout (a), generic over a family's chunk step and state ``layout`` (``DD``:
``d×d``, ``DV``: ``d×dv``; see ``kernels/gpu/walk.py``): grid ``(B, H, N)`` with the chunk axis
last and sequential ("arbitrary"); each step's ``[c, d]`` tiles arrive by the pipeline's DMA,
and the float32 states persist across the chunk axis in VMEM scratch (``pltpu.VMEM``), reset at
the first chunk.  No value tiling (Mosaic tiles want the last dim a multiple of 128 or the full
extent, so ``dv`` is one tile).  Inputs are moved to ``[B,H,Tp,·]`` so every block's last two
dims are ``(c, d)`` with ``c >= 8``; the gate comes as ``[B,H,N,1,c]``.  Same interface as
``kernels.gpu.walk`` (``bv``/``num_warps`` are ignored; the backward has ``nv = 1``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.gpu.walk import DD
from hla_jax.kernels.hla2_chunk import F32


def heads_first(x):
    return jnp.swapaxes(x, 1, 2)  # [B,Tp,H,·] <-> [B,H,Tp,·]


def specs(c, d, dv, rev, N):
    """Per-chunk blocks of q, k, v and the gate; ``rev`` walks the chunks backwards."""
    n_of = (lambda n: N - 1 - n) if rev else (lambda n: n)
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n_of(n), 0))
    gate = pl.BlockSpec((None, None, None, 1, c), lambda i, h, n: (i, h, n_of(n), 0, 0))
    state = lambda w: pl.BlockSpec((None, None, None, d, w), lambda i, h, n: (i, h, n_of(n), 0, 0))
    return tile, gate, state


def compiler_params(interpret):
    return None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"))


def _widths(layout, d, dv):
    return [d if kind == DD else dv for kind in layout]


def _reset_at_first_chunk(scratch):
    @pl.when(pl.program_id(2) == 0)
    def _():
        for s in scratch:
            s[...] = jnp.zeros_like(s)


def _advance(scratch, outputs):
    """Store the trailing ``len(scratch)`` outputs (the new states) in ``scratch``; return the
    leading ones."""
    k = len(outputs) - len(scratch)
    for s, x in zip(scratch, outputs[k:]):
        s[...] = x
    return outputs[:k]


@functools.partial(jax.jit, static_argnums=(0, 1),
                   static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(chunk_forward, layout, q, k, v, b, *, c, bv=None, save_states=False, num_warps=None,
            interpret=False):
    """As ``kernels.gpu.walk.forward``: ``O [B,Tp,H,dv]`` float32 (plus per-chunk states)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, False, N)
    widths = _widths(layout, d, dv)

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *rest):
        saved, scratch = rest[:-len(layout)], rest[-len(layout):]
        _reset_at_first_chunk(scratch)
        states = [x[...] for x in scratch]
        for ref, x in zip(saved, states):
            ref[...] = x.astype(ref.dtype)
        o_ref[...], = _advance(scratch, chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                                      *states))

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)]
    out_specs = [tile(dv)]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((B, H, N, d, w), q.dtype) for w in widths]
        out_specs += [state(w) for w in widths]
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate], out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((d, w), F32) for w in widths],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c))
    O = heads_first(out[0])
    return (O, *out[1:]) if save_states else O


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(chunk_backward, layout, q, k, v, b, *states_do, c, bv=None, num_warps=None,
             interpret=False):
    """As ``kernels.gpu.walk.backward`` with one value tile (``nv = 1``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, True, N)
    widths = _widths(layout, d, dv)
    n = len(layout)

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        saved, (do_ref, dq_ref, dk_ref, dv_ref, db_ref), scratch = refs[:n], refs[n:n + 5], refs[n + 5:]
        _reset_at_first_chunk(scratch)
        dq_ref[...], dk_ref[...], dv_ref[...], db = _advance(scratch, chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], *(ref[...] for ref in saved),
            do_ref[...], *(x[...] for x in scratch)))
        db_ref[...] = db[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32), jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    *states, do = states_do
    dq, dk, dvv, db = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate, *(state(w) for w in widths), tile(dv)],
        out_specs=[tile(d), tile(d), tile(dv), gate],
        scratch_shapes=[pltpu.VMEM((d, w), F32) for w in widths],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), *states,
      heads_first(do))
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp))
