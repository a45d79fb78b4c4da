"""AHLA chunked kernels for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU was available; the
tests run these in interpret mode on CPU and check that they lower through Mosaic.

As ``kernels.tpu.hla2`` (same block specs): grid ``(B, H, N)`` with the chunk axis last and
sequential; the float32 state ``P, E: d×dv`` persists across the chunk axis in VMEM scratch,
reset at the first chunk; one value tile; inputs moved to ``[B,H,Tp,·]``, the gate as
``[B,H,N,1,c]``.  Same interface as ``kernels.gpu.ahla`` (``bv``/``num_warps`` are ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.ahla_chunk import chunk_backward, chunk_forward
from hla_jax.kernels.hla2_chunk import F32
from hla_jax.kernels.tpu.hla2 import compiler_params, heads_first, specs


def _reset_at_first_chunk(*scratch):
    @pl.when(pl.program_id(2) == 0)
    def _():
        for s in scratch:
            s[...] = jnp.zeros_like(s)


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(q, k, v, b, *, c, bv=None, save_states=False, num_warps=None, interpret=False):
    """As ``kernels.gpu.ahla.forward``: ``O [B,Tp,H,dv]`` float32 (plus per-chunk ``P, E``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, False, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *rest):
        p_scr, e_scr = rest[-2:]
        _reset_at_first_chunk(p_scr, e_scr)
        P, E = p_scr[...], e_scr[...]
        if save_states:
            rest[0][...] = P.astype(rest[0].dtype)
            rest[1][...] = E.astype(rest[1].dtype)
        o_ref[...], p_scr[...], e_scr[...] = chunk_forward(q_ref[...], k_ref[...], v_ref[...],
                                                           b_ref[0], P, E)

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)]
    out_specs = [tile(dv)]
    if save_states:
        out_shape += 2 * [jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype)]
        out_specs += 2 * [state(dv)]
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate], out_specs=out_specs,
        scratch_shapes=2 * [pltpu.VMEM((d, dv), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c))
    O = heads_first(out[0])
    return (O, out[1], out[2]) if save_states else O


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(q, k, v, b, P, E, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.ahla.backward`` with one value tile (``nv = 1``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, True, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, p_ref, e_ref, do_ref, dq_ref, dk_ref, dv_ref, db_ref,
               dp_scr, de_scr):
        _reset_at_first_chunk(dp_scr, de_scr)
        dq_ref[...], dk_ref[...], dv_ref[...], db, dp_scr[...], de_scr[...] = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], p_ref[...].astype(F32),
            e_ref[...].astype(F32), do_ref[...], dp_scr[...], de_scr[...])
        db_ref[...] = db[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32), jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    dq, dk, dvv, db = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate, state(dv), state(dv), tile(dv)],
        out_specs=[tile(d), tile(d), tile(dv), gate],
        scratch_shapes=2 * [pltpu.VMEM((d, dv), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), P, E,
      heads_first(do))
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp))
