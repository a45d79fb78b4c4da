"""The HLA chunk walk for NVIDIA GPUs: ``pallas_call`` lowered through Triton (jax 0.11.2).

Layout (a) of DESIGN.md, generic over a family's chunk step (``kernels/<family>_chunk.py``) and
its state ``layout``: a tuple of ``DD`` (a ``d×d`` state, shared by every value tile) and ``DV``
(a ``d×bv`` state of one value tile).  One program per (batch, head, value tile) walks the
chunks in order with the float32 states in registers (``lax.fori_loop`` carry); inputs stay in
the caller's ``[B,Tp,H,·]`` layout (strided tile loads, no transposes).

- ``forward``: outputs ``O`` and, when ``save_states``, the incoming states of every chunk
  (``DD: [B,H,N,d,d]`` written by value tile 0, ``DV: [B,H,N,d,dv]``, in the input dtype: the
  backward's matmuls read them in that dtype anyway).
- ``backward``: walks the chunks in reverse with the cotangent states and the saved incoming
  states; value tile ``j`` yields its own share of ``dQ, dK, db`` (summed by the caller) and its
  slice of ``dV``.

Triton needs power-of-two tiles and every matmul dimension >= 16: ``c``, ``d`` and ``bv`` are
powers of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.hla2_chunk import F32

DD, DV = "dd", "dv"


def compiler_params(num_warps, interpret):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _zeros(layout, d, bv):
    return tuple(jnp.zeros((d, d if kind == DD else bv), F32) for kind in layout)


def _saved_shapes(layout, B, H, N, d, dv, dtype):
    return [jax.ShapeDtypeStruct((B, H, N, d, d if kind == DD else dv), dtype) for kind in layout]


@functools.partial(jax.jit, static_argnums=(0, 1),
                   static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def forward(chunk_forward, layout, q, k, v, b, *, c, bv, save_states=False, num_warps=8,
            interpret=False):
    """``q, k: [B,Tp,H,d]``, ``v: [B,Tp,H,dv]``, ``b: [B,H,Tp]`` (local log cumulative decay per
    chunk) -> ``O [B,Tp,H,dv]`` float32 (plus every chunk's incoming states when ``save_states``).
    ``chunk_forward(Q, K, V, bb, *states) -> (O, *states)``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c

    def kernel(q_ref, k_ref, v_ref, b_ref, o_ref, *state_refs):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, carry):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            for kind, ref, x in zip(layout if save_states else (), state_refs, carry):
                if kind == DV:
                    ref[i, h, n, :, vs] = x.astype(ref.dtype)
                    continue

                @pl.when(j == 0)  # a d×d state is the same in every value tile: write it once
                def _(ref=ref, x=x):
                    ref[i, h, n] = x.astype(ref.dtype)
            O, *carry = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                      b_ref[i, h, ts], *carry)
            o_ref[i, ts, h, vs] = O
            return tuple(carry)

        jax.lax.fori_loop(0, N, body, _zeros(layout, d, bv))

    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, dv), F32)]
    if save_states:
        out_shape += _saved_shapes(layout, B, H, N, d, dv, q.dtype)
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                         compiler_params=compiler_params(num_warps, interpret),
                         interpret=interpret)(q, k, v, b)
    return tuple(out) if save_states else out[0]


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("c", "bv", "num_warps", "interpret"))
def backward(chunk_backward, layout, q, k, v, b, *states_do, c, bv, num_warps=8, interpret=False):
    """Cotangents of ``forward`` from its saved states and ``do`` (the last positional argument):
    ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile), ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``,
    all float32.  ``chunk_backward(Q, K, V, bb, *states, dO, *dstates) -> (dQ, dK, dV, db,
    *dstates)``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv = Tp // c, dv // bv

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, (do_ref, dq_ref, dk_ref, dv_ref, db_ref) = refs[:len(layout)], refs[len(layout):]
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(m, carry):
            n = N - 1 - m
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            saved = [ref[i, h, n] if kind == DD else ref[i, h, n, :, vs]  # in the input dtype
                     for kind, ref in zip(layout, state_refs)]
            dQ, dK, dV, db, *carry = chunk_backward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
                *saved, do_ref[i, ts, h, vs], *carry)
            dq_ref[j, i, ts, h, :] = dQ
            dk_ref[j, i, ts, h, :] = dK
            dv_ref[i, ts, h, vs] = dV
            db_ref[j, i, h, ts] = db
            return tuple(carry)

        jax.lax.fori_loop(0, N, body, _zeros(layout, d, bv))

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, *states_do))
