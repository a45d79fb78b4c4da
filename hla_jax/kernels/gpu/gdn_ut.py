"""Gated DeltaNet's UT transform for NVIDIA GPUs: ``pallas_call`` lowered through Triton, one
program per (batch, head, chunk) over ``kernels/gdn_chunk.py``.

Inputs stay in the caller's layout: ``k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (strided tile loads),
``b`` (the chunk-local cumulative log-decay) and ``beta`` as ``[B,H,Tp]`` float32; ``d`` and
``dv`` powers of two >= 16 (the caller pads).  ``forward`` gives ``W [B,Tp,H,d]`` and
``U [B,Tp,H,dv]`` in the input dtype, ``backward`` the float32 cotangents ``dk, dv, dbeta`` for
``b`` held fixed.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from hla_jax.kernels import gdn_chunk
from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32


def _call(kernel, out_shape, c, num_warps, interpret, *args):
    B, Tp, H = args[0].shape[:3]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(*args))


def _rows(c):
    return pl.ds(pl.multiple_of(pl.program_id(2) * c, c), c)


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def forward(k, v, b, beta, *, c=64, num_warps=4, interpret=False):
    """``(W, U)`` of every chunk (module docstring)."""
    def kernel(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref):
        i, h, ts = pl.program_id(0), pl.program_id(1), _rows(c)
        W, U = gdn_chunk.ut_forward(k_ref[i, ts, h, :], v_ref[i, ts, h, :], b_ref[i, h, ts],
                                    beta_ref[i, h, ts])
        w_ref[i, ts, h, :] = W.astype(w_ref.dtype)
        u_ref[i, ts, h, :] = U.astype(u_ref.dtype)

    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, k.dtype)]
    return _call(kernel, out_shape, c, num_warps, interpret, k, v, b, beta)


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def backward(k, v, b, beta, dw, du, *, c=64, num_warps=4, interpret=False):
    """``(dk, dv, dbeta)`` float32 from the cotangents ``dw [B,Tp,H,d]``, ``du [B,Tp,H,dv]``."""
    def kernel(k_ref, v_ref, b_ref, beta_ref, dw_ref, du_ref, dk_ref, dv_ref, dbeta_ref):
        i, h, ts = pl.program_id(0), pl.program_id(1), _rows(c)
        dK, dV, dbeta = gdn_chunk.ut_backward(
            k_ref[i, ts, h, :], v_ref[i, ts, h, :], b_ref[i, h, ts], beta_ref[i, h, ts],
            dw_ref[i, ts, h, :], du_ref[i, ts, h, :])
        dk_ref[i, ts, h, :] = dK
        dv_ref[i, ts, h, :] = dV
        dbeta_ref[i, h, ts] = dbeta

    B, Tp, H = k.shape[:3]
    out_shape = [jax.ShapeDtypeStruct(k.shape, F32), jax.ShapeDtypeStruct(v.shape, F32),
                 jax.ShapeDtypeStruct((B, H, Tp), F32)]
    return _call(kernel, out_shape, c, num_warps, interpret, k, v, b, beta, dw, du)
