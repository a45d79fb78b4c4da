"""AHLA chunked kernels for NVIDIA GPUs: ``pallas_call`` lowered through Triton (jax 0.11.2).

As ``kernels.gpu.hla2``: one program per (batch, head, value tile) walks the chunks in order with
the float32 state ``P, E: d×bv`` in registers (``lax.fori_loop`` carry), inputs read in the
caller's ``[B,Tp,H,·]`` layout.  Both state parts belong to the value tile (AHLA has no ``d×d``
state), so value tiles are fully independent.

- ``forward``: outputs ``O`` and, when ``save_states``, every chunk's incoming ``P, E``
  (``[B,H,N,d,dv]`` each, in the input dtype) for the backward.
- ``backward``: walks the chunks in reverse with the cotangent state ``(dP, dE)``; value tile ``j``
  yields its share of ``dQ, dK, db`` (summed by the caller) and its slice of ``dV``.

``c``, ``d`` and ``bv`` are powers of two >= 16 (the caller pads).  Runs in interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.ahla_chunk import chunk_backward, chunk_forward
from hla_jax.kernels.gpu.hla2 import compiler_params
from hla_jax.kernels.hla2_chunk import F32


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(q, k, v, b, *, c, bv, save_states=False, num_warps=8, interpret=False):
    """``q, k: [B,Tp,H,d]``, ``v: [B,Tp,H,dv]``, ``b: [B,H,Tp]`` (local log cumulative decay per
    chunk) -> ``O [B,Tp,H,dv]`` float32 (plus the per-chunk incoming ``P, E`` when
    ``save_states``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *state_refs):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, carry):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            if save_states:
                for ref, x in zip(state_refs, carry):
                    ref[i, h, n, :, vs] = x.astype(ref.dtype)
            O, P, E = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                    b_ref[i, h, ts], *carry)
            o_ref[i, ts, h, vs] = O
            return P, E

        jax.lax.fori_loop(0, N, body, (jnp.zeros((d, bv), F32), jnp.zeros((d, bv), F32)))

    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, dv), F32)]
    if save_states:
        out_shape += 2 * [jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype)]
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                         compiler_params=compiler_params(num_warps, interpret),
                         interpret=interpret)(q, k, v, b)
    return tuple(out) if save_states else out[0]


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(q, k, v, b, P, E, do, *, c, bv, num_warps=8, interpret=False):
    """Cotangents of ``forward``: ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile),
    ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``, all float32; ``P, E`` are the saved chunk states."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv = Tp // c, dv // bv

    def kernel(q_ref, k_ref, v_ref, b_ref, p_ref, e_ref, do_ref, dq_ref, dk_ref, dv_ref, db_ref):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(m, carry):
            n = N - 1 - m
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            dQ, dK, dV, db, dP, dE = chunk_backward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
                p_ref[i, h, n, :, vs].astype(F32), e_ref[i, h, n, :, vs].astype(F32),
                do_ref[i, ts, h, vs], *carry)
            dq_ref[j, i, ts, h, :] = dQ
            dk_ref[j, i, ts, h, :] = dK
            dv_ref[i, ts, h, vs] = dV
            db_ref[j, i, h, ts] = db
            return dP, dE

        jax.lax.fori_loop(0, N, body, (jnp.zeros((d, bv), F32), jnp.zeros((d, bv), F32)))

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, P, E, do))
