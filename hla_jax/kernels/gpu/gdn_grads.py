"""The chunk-parallel part of Gated DeltaNet's walk backward for NVIDIA GPUs: ``pallas_call``
lowered through Triton, one program per (batch, head, chunk, block of ``kb`` keys) over
``kernels/gdn_chunk.py`` (``walk_products`` a value tile at a time, then ``walk_grads``)::

    D = dO V'ᵀ,   dQ = diag(ρ) dO Sᵀ + (D ∘ Γ) K,   dK = diag(γ̄) V' dSᵀ + (D ∘ Γ)ᵀ Q,   dW = −dV' Sᵀ

from the states the walks wrote per chunk (``gdn_mgpu.walk``: ``Sᵀ`` entering the chunk, ``dSᵀ``
leaving it, ``[B,H,N,dv,d]`` 16-bit).  Inputs stay in the caller's layout: ``q, k [B,Tp,H,d]``,
``V', dO, −dV' [B,Tp,H,dv]`` (``dv`` a multiple of 64, taken 128 or 64 columns at a time),
``b [B,H,Tp]`` the chunk-local cumulative log-decay.  ``kb`` (a divisor of ``d``; ``None``: all
of it) trades the registers of the ``[c,kb]`` accumulators for a recomputed ``D``: 64 keys and 4
warps beat all 128 keys and 8 warps on the H200 (2.0 against 3.1 ms at B·T=65,536, H=16,
d=dv=128; ``experiments/bench_gdn_parts.py --sweep grads``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels import gdn_chunk
from hla_jax.kernels.gpu.gdn_ut import _over_value_tiles, _rows
from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32


@functools.partial(jax.jit, static_argnames=("c", "kb", "num_warps", "interpret"))
def backward(q, k, vn, do, ndvn, s, ds, b, *, c=64, kb=64, num_warps=4, interpret=False):
    """``(dQ, dK, dW, db)``: ``dQ``, ``dK`` (the walks' part) and ``dW``
    ``[B,Tp,H,d]`` in ``q``'s dtype (16-bit: half the float32 traffic to ``gdn_ut.backward``,
    which adds this ``dK`` to its own part and multiplies ``dW`` by 16-bit keys), and ``db
    [d/kb,B,H,Tp]`` float32, the walk's share of ``∂L/∂b`` in one share per key block
    (``gdn_chunk.walk_grads``, the states' inner product at each chunk's end included)."""
    B, Tp, H, d = q.shape
    kb = min(kb or d, d)
    if d % kb:
        raise ValueError(f"gdn_grads.backward: kb={kb} must divide the head dim d={d} of q [B,T,H,d]")

    def kernel(q_ref, k_ref, vn_ref, do_ref, ndvn_ref, s_ref, ds_ref, b_ref,
               dq_ref, dk_ref, dw_ref, db_ref):
        i, h, n, j = (pl.program_id(a) for a in range(4))
        ts, keys = _rows(c), pl.ds(pl.multiple_of(j * kb, kb), kb)

        def value_tile(cols, acc):
            share = gdn_chunk.walk_products(do_ref[i, ts, h, cols], vn_ref[i, ts, h, cols],
                                            ndvn_ref[i, ts, h, cols], s_ref[i, h, n, cols, keys],
                                            ds_ref[i, h, n, cols, keys])
            return tuple(a + x for a, x in zip(acc, share))

        D, dOS, VdS, dW, SdS = _over_value_tiles(
            vn.shape[-1], value_tile,
            (jnp.zeros((c, c), F32),) + 3 * (jnp.zeros((c, kb), F32),) + (jnp.zeros((), F32),))
        dQ, dK, db_ref[j, i, h, ts] = gdn_chunk.walk_grads(
            q_ref[i, ts, h, keys], k_ref[i, ts, h, keys], b_ref[i, h, ts], D, dOS, VdS, SdS)
        dq_ref[i, ts, h, keys] = dQ.astype(dq_ref.dtype)
        dk_ref[i, ts, h, keys] = dK.astype(dk_ref.dtype)
        dw_ref[i, ts, h, keys] = dW.astype(dw_ref.dtype)

    per_token = jax.ShapeDtypeStruct((d // kb, B, H, Tp), F32)   # one share per key block
    out_shape = 3 * [jax.ShapeDtypeStruct(q.shape, q.dtype)] + [per_token]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c, d // kb),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, vn, do, ndvn, s, ds, b))
