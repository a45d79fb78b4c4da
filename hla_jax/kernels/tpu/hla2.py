"""HLA2 chunked kernels for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU was available; the
tests run these in interpret mode on CPU only.

The TPU way of layout (a): grid ``(B, H, N)`` with the chunk axis last and sequential
("arbitrary"); each step's ``[c, d]`` tiles arrive by the pipeline's DMA, and the float32
state ``S: d×d``, ``U: d×dv`` persists across the chunk axis in VMEM scratch
(``pltpu.VMEM``), reset at the first chunk.  No value tiling (Mosaic tiles want the last dim a
multiple of 128 or the full extent, so ``dv`` is one tile).  Inputs are moved to
``[B,H,Tp,·]`` so every block's last two dims are ``(c, d)`` with ``c >= 8``; the gate comes as
``[B,H,N,1,c]``.  Same interface as ``kernels.gpu.hla2`` (``bv``/``num_warps`` are ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.hla2_chunk import F32, chunk_backward, chunk_forward


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


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(q, k, v, b, *, c, bv=None, save_states=False, num_warps=None, interpret=False):
    """As ``kernels.gpu.hla2.forward``: ``O [B,Tp,H,dv]`` float32 (plus per-chunk states)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, False, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *rest):
        s_scr, u_scr = rest[-2:]

        @pl.when(pl.program_id(2) == 0)
        def _():
            s_scr[...] = jnp.zeros_like(s_scr)
            u_scr[...] = jnp.zeros_like(u_scr)

        S, U = s_scr[...], u_scr[...]
        if save_states:
            rest[0][...] = S.astype(rest[0].dtype)
            rest[1][...] = U.astype(rest[1].dtype)
        O, s_scr[...], u_scr[...] = chunk_forward(q_ref[...], k_ref[...], v_ref[...],
                                                  b_ref[0], S, U)
        o_ref[...] = O

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)]
    out_specs = [tile(dv)]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((B, H, N, d, d), q.dtype),
                      jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype)]
        out_specs += [state(d), state(dv)]
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate], out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((d, d), F32), pltpu.VMEM((d, dv), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c))
    O = heads_first(out[0])
    return (O, out[1], out[2]) if save_states else O


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(q, k, v, b, S, U, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.hla2.backward`` with one value tile (``nv = 1``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, True, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, u_ref, do_ref, dq_ref, dk_ref, dv_ref, db_ref,
               ds_scr, du_scr):
        @pl.when(pl.program_id(2) == 0)
        def _():
            ds_scr[...] = jnp.zeros_like(ds_scr)
            du_scr[...] = jnp.zeros_like(du_scr)

        dq_ref[...], dk_ref[...], dv_ref[...], db, ds_scr[...], du_scr[...] = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], s_ref[...].astype(F32),
            u_ref[...].astype(F32), do_ref[...], ds_scr[...], du_scr[...])
        db_ref[...] = db[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32), jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    dq, dk, dvv, db = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate, state(d), state(dv), tile(dv)],
        out_specs=[tile(d), tile(d), tile(dv), gate],
        scratch_shapes=[pltpu.VMEM((d, d), F32), pltpu.VMEM((d, dv), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), S, U,
      heads_first(do))
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp))
