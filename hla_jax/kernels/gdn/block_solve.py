"""The inverse of ``I + A`` for a strictly lower ``A [64,64]`` restricted to its ``16×16`` diagonal
blocks, inside a Mosaic GPU kernel: forward substitution in float32 on the CUDA cores, one thread
per column.

Thread ``j`` (of 64) solves column ``j`` of its block (rows ``f … f+15``, ``f = 16⌊j/16⌋``,
``l = j − f``):

    x_i = [i = l] − Σ_{m<i} A[f+i, f+m] x_m,     i = 0 … 15

(``x_m = 0`` for ``m < l`` falls out of the recurrence), 120 fused multiply-adds on values kept
in registers, the rows of ``A`` read from shared memory as 16-byte vectors that the 16 threads of
a block share.  ``A`` goes to shared memory and ``X`` comes back through it, rows padded by
``PAD`` floats: with 256-byte rows the register tiles' stores and loads (a warp touches eight rows
at once) would meet 8-way bank conflicts.  The two CTAs an SM holds solve on different warp pairs
(by the parity of the CTA index), so both halves of the SM's schedulers take part.

The GPU interpreter runs no inline Mosaic GPU code; there the same inverse is
``lax.linalg.triangular_solve`` (the doubling steps that follow are shared).
"""

from __future__ import annotations

import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import utils as mgu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mlir.dialects import math as mmath

from hla_jax.kernels.mosaic_gpu import F32, C

BLOCK, PAD = 16, 4


def scratch():
    """The two padded float32 tiles the GPU solve passes ``A`` and ``X`` through."""
    return plgpu.SMEM((C, C + PAD), F32)


def inverse(a, a_s, x_s, interpret):
    """``(I + A)⁻¹`` (float32 ``[64,64]``, wgmma layout) for ``A`` the ``16×16`` diagonal blocks
    of the strictly lower ``a`` (the solve reads nothing else); ``a_s, x_s``: ``scratch()`` tiles
    (unused in the interpreter)."""
    if interpret:
        r, c = jnp.indices((C, C))
        blocks = jnp.where(r // BLOCK == c // BLOCK, a, 0.0)
        return lax.linalg.triangular_solve(blocks, jnp.eye(C, dtype=F32), left_side=True,
                                           lower=True, unit_diagonal=True)
    return _substitute(-a, a_s.at[:, :C], x_s.at[:, :C])


@plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((C, C), F32, layout=plgpu.Layout.WGMMA))
def _substitute(ctx, neg_a, a_ref, x_ref):
    """The module docstring's solve on ``−A`` (so each step is one ``fma``)."""
    del ctx
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    neg_a.store_untiled(a_ref, optimized=False)
    mgpu.FragmentedArray.splat(mgu.c(0.0, f32), (C, C), layout=mgpu.WGMMA_LAYOUT).store_untiled(
        x_ref, optimized=False)
    mgu.warpgroup_barrier()
    pair = arith.remui(mgu.block_idx(), mgu.c(2, i32))          # which warp pair solves
    col = arith.subi(arith.remui(mgu.thread_idx(), mgu.c(128, i32)), arith.muli(pair, mgu.c(C, i32)))
    inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, col, mgu.c(0, i32)),
                        arith.cmpi(arith.CmpIPredicate.slt, col, mgu.c(C, i32)))
    with mgu.when(inside):
        local = arith.remui(col, mgu.c(BLOCK, i32))
        first = arith.index_cast(index, arith.subi(col, local))
        j = arith.index_cast(index, col)
        vec4 = ir.VectorType.get([4], f32)
        x = []
        for i in range(BLOCK):
            acc = arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, mgu.c(i, i32)),
                               mgu.c(1.0, f32), mgu.c(0.0, f32))
            row = arith.addi(first, mgu.c(i, index))
            for m0 in range(0, i, 4):
                seg = vector.load(vec4, a_ref, [row, arith.addi(first, mgu.c(m0, index))])
                for m in range(m0, min(m0 + 4, i)):
                    acc = mmath.fma(vector.extract(seg, dynamic_position=[],
                                                   static_position=ir.DenseI64ArrayAttr.get([m - m0])),
                                    x[m], acc)
            memref.store(acc, x_ref, [row, j])
            x.append(acc)
    mgu.warpgroup_barrier()
    return mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)
