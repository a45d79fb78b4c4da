"""The chunk levels of log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``) for
NVIDIA GPUs: ``pallas_call`` lowered through Triton, one program per (batch, head, chunk).

Chunk ``n``'s tokens carry their running query ``r`` (first ``Q̂``) up the levels: at each level
``i`` at which ``n`` lies in a right half (bit ``i`` of ``n`` set), with ``(Π_i, Z_i)`` that
block's left half (node ``off_i + (n >> (i+1))`` of the up-sweep's stacks),

    o += λ_i ∘ (r Z_i),      r ← r Π_i

(products accumulated in float32, ``r`` rounded back to ``Q̂``'s dtype), so ``r`` and ``o`` stay
on chip and every token is read and written once.  It is the forward only: differentiated, the
reads are XLA's pass per level (``kernels.gdn_blocks.levels``).

Layouts, heads first: ``Q̂ [B,H,Tp,d]``, ``Π [B,H,S,d,d]``, ``Z [B,H,S,d,dv]`` (``S`` nodes over
the levels, level ``i``'s from ``off[i]``), ``λ [B,H,P,Tp]`` float32 (level ``i``'s weights in
row ``i``), ``o [B,H,Tp,dv]`` float32; ``d``, ``dv`` and ``c`` powers of two ≥ 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.la_chunk import F32, dot


@functools.partial(jax.jit, static_argnames=("offsets", "c", "interpret"))
def forward(qh, pis, zs, lam, *, offsets, c, interpret=False):
    """``o [B,H,Tp,dv]`` (module docstring)."""
    acc = jnp.result_type(F32, qh.dtype)

    def kernel(qh_ref, pi_ref, z_ref, lam_ref, o_ref):
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)

        def level(i, carry):
            r, o = carry
            node = offsets[i] + (n >> (i + 1))
            o = o + lam_ref[b, h, i, ts][:, None] * dot(r, z_ref[b, h, node, :, :])
            return dot(r, pi_ref[b, h, node, :, :]).astype(r.dtype), o

        carry = (qh_ref[b, h, ts, :], jnp.zeros((c, zs.shape[-1]), acc))
        for i in range(lam.shape[2]):
            carry = lax.cond((n >> i) & 1 == 1, functools.partial(level, i), lambda x: x, carry)
        o_ref[b, h, ts, :] = carry[1]

    B, H, Tp, _ = qh.shape
    out_shape = jax.ShapeDtypeStruct((B, H, Tp, zs.shape[-1]), acc)
    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                          compiler_params=params, interpret=interpret)(qh, pis, zs, lam)
