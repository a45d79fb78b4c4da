"""HLA2 chunked kernels for NVIDIA GPUs: ``pallas_call`` lowered through Triton (jax 0.11.2).

Layout (a) of DESIGN.md: one program per (batch, head, value tile) walks the chunks in order
with the float32 state ``S: d×d`` and ``U: d×bv`` in registers (``lax.fori_loop`` carry).
Inputs stay in the caller's ``[B,Tp,H,·]`` layout (strided tile loads, no transposes).

- ``forward``: outputs ``O`` and, when ``save_states``, the incoming state of every chunk
  (``S: [B,H,N,d,d]``, ``U: [B,H,N,d,dv]`` in the input dtype: the matmuls of the backward
  read them in that dtype anyway) for the backward.
- ``backward``: walks the chunks in reverse with the cotangent state ``(dS + dSᵀ, dU)`` and the saved
  incoming states; value tile ``j`` yields its own share of ``dQ, dK, db`` (summed by the caller)
  and its slice of ``dV``.

Triton needs power-of-two tiles and every matmul dimension >= 16: ``c``, ``d`` and ``bv`` are
powers of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.hla2_chunk import F32, chunk_backward, chunk_forward


def compiler_params(num_warps, interpret):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(q, k, v, b, *, c, bv, save_states=False, num_warps=8, interpret=False):
    """``q, k: [B,Tp,H,d]``, ``v: [B,Tp,H,dv]``, ``b: [B,H,Tp]`` (local log cumulative decay per
    chunk) -> ``O [B,Tp,H,dv]`` float32 (plus the per-chunk incoming states when ``save_states``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *state_refs):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, carry):
            S, U = carry
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            if save_states:
                s_ref, u_ref = state_refs

                @pl.when(j == 0)
                def _():
                    s_ref[i, h, n] = S.astype(s_ref.dtype)

                u_ref[i, h, n, :, vs] = U.astype(u_ref.dtype)
            O, S, U = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                    b_ref[i, h, ts], S, U)
            o_ref[i, ts, h, vs] = O
            return S, U

        jax.lax.fori_loop(0, N, body, (jnp.zeros((d, d), F32), jnp.zeros((d, bv), F32)))

    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, dv), F32)]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((B, H, N, d, d), q.dtype),
                      jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype)]
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                         compiler_params=compiler_params(num_warps, interpret),
                         interpret=interpret)(q, k, v, b)
    return tuple(out) if save_states else out[0]


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(q, k, v, b, S, U, do, *, c, bv, num_warps=8, interpret=False):
    """Cotangents of ``forward``: ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile),
    ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``, all float32; ``S, U`` are the saved chunk states."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv = Tp // c, dv // bv

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, u_ref, do_ref, dq_ref, dk_ref, dv_ref, db_ref):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(m, carry):
            dS, dU = carry
            n = N - 1 - m
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            dQ, dK, dV, db, dS, dU = chunk_backward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
                s_ref[i, h, n].astype(F32), u_ref[i, h, n, :, vs].astype(F32), do_ref[i, ts, h, vs], dS, dU)
            dq_ref[j, i, ts, h, :] = dQ
            dk_ref[j, i, ts, h, :] = dK
            dv_ref[i, ts, h, vs] = dV
            db_ref[j, i, h, ts] = db
            return dS, dU

        jax.lax.fori_loop(0, N, body, (jnp.zeros((d, d), F32), jnp.zeros((d, bv), F32)))

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, S, U, do))
