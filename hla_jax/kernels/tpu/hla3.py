"""Causal HLA3 chunked kernels for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU was
available; the tests run these in interpret mode on CPU only.

Same layout as ``kernels.tpu.hla2``: grid ``(B, H, N)`` with the chunk axis last and sequential
("arbitrary"); each step's ``[c, d]`` tiles arrive by the pipeline's DMA, and the float32 state
``S: d×d``, ``P, F: d×dv`` (the cotangents ``dS + dSᵀ, dP, dF`` in the backward) persists
across the chunk axis in VMEM scratch, reset at the first chunk.  No value tiling (``dv`` is one
tile).  Same interface as ``kernels.gpu.hla3`` (``bv``/``num_warps`` are ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.hla2_chunk import F32
from hla_jax.kernels.hla3_chunk import chunk_backward, chunk_forward
from hla_jax.kernels.tpu.hla2 import compiler_params, heads_first, specs


def _scratch(d, dv):
    return [pltpu.VMEM((d, d), F32), pltpu.VMEM((d, dv), F32), pltpu.VMEM((d, dv), F32)]


def _reset_at_first_chunk(scratch):
    @pl.when(pl.program_id(2) == 0)
    def _():
        for s in scratch:
            s[...] = jnp.zeros_like(s)


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(q, k, v, b, *, c, bv=None, save_states=False, num_warps=None, interpret=False):
    """As ``kernels.gpu.hla3.forward``: ``O [B,Tp,H,dv]`` float32 (plus per-chunk states)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, False, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *rest):
        scratch = rest[-3:]
        _reset_at_first_chunk(scratch)
        SPF = [s[...] for s in scratch]
        if save_states:
            for ref, x in zip(rest[:3], SPF):
                ref[...] = x.astype(ref.dtype)
        o_ref[...], *new = chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0], *SPF)
        for s, x in zip(scratch, new):
            s[...] = x

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)]
    out_specs = [tile(dv)]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((B, H, N, d, w), q.dtype) for w in (d, dv, dv)]
        out_specs += [state(d), state(dv), state(dv)]
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate], out_specs=out_specs,
        scratch_shapes=_scratch(d, dv), compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c))
    O = heads_first(out[0])
    return (O, *out[1:]) if save_states else O


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(q, k, v, b, S, P, F, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.hla3.backward`` with one value tile (``nv = 1``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    tile, gate, state = specs(c, d, dv, True, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, p_ref, f_ref, do_ref,
               dq_ref, dk_ref, dv_ref, db_ref, *scratch):
        _reset_at_first_chunk(scratch)
        dq_ref[...], dk_ref[...], dv_ref[...], db, *new = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], s_ref[...], p_ref[...], f_ref[...],
            do_ref[...], *(s[...] for s in scratch))
        db_ref[...] = db[None, :]
        for s, x in zip(scratch, new):
            s[...] = x

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32), jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    dq, dk, dvv, db = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), gate, state(d), state(dv), state(dv), tile(dv)],
        out_specs=[tile(d), tile(d), tile(dv), gate],
        scratch_shapes=_scratch(d, dv), compiler_params=compiler_params(interpret), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), S, P, F,
      heads_first(do))
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp))
