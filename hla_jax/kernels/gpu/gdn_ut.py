"""Gated DeltaNet's UT transform for NVIDIA GPUs: ``pallas_call`` lowered through Triton, one
program per (batch, head, chunk) over ``kernels/gdn_chunk.py``.

Inputs stay in the caller's layout: ``k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (strided tile loads),
``b`` (the chunk-local cumulative log-decay) and ``beta`` as ``[B,H,Tp]`` float32; ``d`` a power
of two >= 16 and ``dv`` a multiple of 64 (the caller pads), taken 128 (or 64) columns at a time.
``forward`` gives ``W [B,Tp,H,d]`` and ``U [B,Tp,H,dv]`` in the input dtype and the inverse
``X = (I + A)⁻¹ [B,H,Tp,c]`` float32 (working on row blocks of ``cb`` tokens), which the
backward (``gdn_ut_mgpu.py``, Mosaic GPU) takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hla_jax.kernels import gdn_chunk
from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32


def _call(kernel, out_shape, c, num_warps, interpret, *args):
    B, Tp, H = args[0].shape[:3]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(*args))


def _rows(c, at=0, n=None):
    """This program's chunk rows ``[at, at + n)`` (all ``c`` by default)."""
    return pl.ds(pl.multiple_of(pl.program_id(2) * c + at, n or c), n or c)


def _over_value_tiles(dv, body, init):
    """``body(cols, carry)`` over the column slices of the value tiles (128 columns, or 64 when
    ``dv`` is an odd multiple of 64), in a loop (not unrolled: each tile's loads and products die
    with its step)."""
    bu = 128 if dv % 128 == 0 else min(dv, 64)
    return lax.fori_loop(0, dv // bu,
                         lambda t, carry: body(pl.ds(pl.multiple_of(t * bu, bu), bu), carry), init)


@functools.partial(jax.jit, static_argnames=("c", "cb", "num_warps", "interpret"))
def forward(k, v, b, beta, *, c=64, cb=32, num_warps=4, interpret=False):
    """``(W, U, X)`` of every chunk (module docstring), ``X [B,H,Tp,c]`` float32; ``U`` a value
    tile at a time."""
    def kernel(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref, x_ref):
        i, h = pl.program_id(0), pl.program_id(1)
        blocks = [_rows(c, m * cb, cb) for m in range(c // cb)]
        fast = k_ref.dtype == jnp.bfloat16
        bs, betas = [b_ref[i, h, ts] for ts in blocks], [beta_ref[i, h, ts] for ts in blocks]
        Ks = [k_ref[i, ts, h, :] for ts in blocks]
        X = gdn_chunk.ut_inverse(Ks, bs, betas)
        W = gdn_chunk.ut_apply(X, [(bt * jnp.exp(bb))[:, None] * K.astype(F32)
                                   for K, bb, bt in zip(Ks, bs, betas)], fast)
        for m, ts in enumerate(blocks):
            w_ref[i, ts, h, :] = W[m].astype(w_ref.dtype)
            for j, x in enumerate(X[m]):
                x_ref[i, h, ts, pl.ds(j * cb, cb)] = x

        def u_tile(cols, carry):
            U = gdn_chunk.ut_apply(X, [bt[:, None] * v_ref[i, ts, h, cols].astype(F32)
                                       for ts, bt in zip(blocks, betas)], fast)
            for m, ts in enumerate(blocks):
                u_ref[i, ts, h, cols] = U[m].astype(u_ref.dtype)
            return carry

        _over_value_tiles(v.shape[-1], u_tile, 0)

    B, Tp, H = k.shape[:3]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, k.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp, c), F32)]
    return _call(kernel, out_shape, c, num_warps, interpret, k, v, b, beta)
