"""Shared pieces of the Pallas Mosaic GPU kernels on Hopper (wgmma, TMA): the chunk and value
tiles, which inputs the kernels take, shared-memory tiles, the tensor-core products (compiled or in
the GPU interpreter), the causal decay of a chunk, the double-buffered walk step, the kernel
builder, and the cut of long sequences into pieces that walk in parallel (``pieces``).

Decays run in log2 units (``exp2``); ``WGMMA`` is the register layout of a wgmma tile, ``ROWS``
and ``COLS`` one value per row or column of it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

C = 64
BV = 64  # value columns per walk CTA
MIN_PIECE = 8  # chunks per piece at least, when a sequence is cut into pieces
F32 = jnp.float32
LOG2E = math.log2(math.e)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128)
WGMMA = plgpu.Layout.WGMMA
ROWS = WGMMA.reduce(1)  # one value per row of a wgmma tile
COLS = WGMMA.reduce(0)  # one value per column


def takes(q, k, v, chunk_size: int) -> bool:
    """Whether these kernels take the inputs: 16-bit ``q, k, v`` of one dtype, head dim 64 or
    128, chunk 64 (any ``T`` and value width: the caller pads)."""
    return (chunk_size == C and q.shape[-1] in HEAD_DIMS and jnp.dtype(q.dtype) in DTYPES
            and q.dtype == k.dtype == v.dtype)


def supports(q, k, v, chunk_size: int) -> bool:
    """``takes``, on a Hopper GPU (sm_90: wgmma)."""
    dev = jax.devices()[0]
    return (dev.platform == "gpu" and getattr(dev, "compute_capability", None) == "9.0"
            and takes(q, k, v, chunk_size))


def smem_tile(shape, dtype):
    """Shared memory tiled and swizzled for TMA and wgmma (the last dim is the minor one)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle)))


def matmul(a, b, shape, init=None, *, interpret=False):
    """``init + a @ b`` on the tensor cores (``a``: shared memory or 16-bit wgmma registers);
    compiled, ``matmuls`` of one pair (``init`` seeds the accumulator); the GPU interpreter
    cannot seed it: it adds, and it multiplies register operands with ``lax.dot``."""
    if not interpret:
        return matmuls([(a, b)], shape, init)
    if isinstance(getattr(a, "aval", None), jax.core.ShapedArray):
        # registers as the left operand: the interpreter's wgmma reads shared memory only
        out = lax.dot(a, plgpu.load(b), preferred_element_type=F32)
    else:
        out = _accumulated([(a, b)], shape)
    return lax.optimization_barrier(out if init is None else init + out)


def matmuls(pairs, shape, init=None, *, interpret=False):
    """``init + Σ a @ b`` over ``pairs`` on the tensor cores: compiled, every product is issued
    into one accumulator (seeded with ``init``) and waited once (``matmul``'s operands).

    The optimisation barrier keeps arithmetic on the result after the accumulator's wait."""
    if interpret:
        out = sum(matmul(a, b, shape, interpret=True) for a, b in pairs)
        return out if init is None else init + out
    if init is None:
        return lax.optimization_barrier(_accumulated(pairs, shape))

    def issue(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)

    return lax.optimization_barrier(pl.run_state(issue)(plgpu.ACC.init(init)))


def _accumulated(pairs, shape):
    """``Σ a @ b`` into a fresh accumulator, read once every product is issued."""
    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(scoped, plgpu.ACC(shape, F32))


def value_tiles(dv: int) -> tuple[int, int]:
    """``(bv, nv)``: ``dv`` value columns as ``nv`` tiles of ``bv = 128`` (64 when ``dv`` is an odd
    multiple of 64)."""
    bv = 128 if dv % 128 == 0 else 64
    return bv, dv // bv


def products(interpret):
    """``(matmul, matmuls)`` compiled, or in the GPU interpreter for a true ``interpret``."""
    return (functools.partial(matmul, interpret=bool(interpret)),
            functools.partial(matmuls, interpret=bool(interpret)))


def bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def causal_decay(b_row, b_col, shape, transpose=False, strict=False):
    """``Γ = exp2(b_t − b_s)`` on ``s ≤ t`` (``strict``: ``s < t``) and 0 elsewhere
    (``transpose``: ``Γᵀ``, rows ``s``); the exponent is masked before ``exp2``, so nothing
    overflows."""
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
    if transpose:
        keep = rows < cols if strict else rows <= cols
        expo = bcast_cols(b_col, shape) - bcast_rows(b_row, shape)
    else:
        keep = rows > cols if strict else rows >= cols
        expo = bcast_rows(b_row, shape) - bcast_cols(b_col, shape)
    return jnp.exp2(jnp.where(keep, expo, -jnp.inf))


def store_state(s_t, s_io, dst):
    """The float32 state ``s_t`` to ``dst`` in memory through the shared tile ``s_io``, waited."""
    s_io[...] = s_t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_io, dst)
    plgpu.wait_smem_to_gmem(0)


def await_tiles(in_bar, slot, i, n, issue):
    """Wait for step ``i``'s tiles (``slot = i % 2`` of the double buffer, ``in_bar``), then start
    ``issue(i + 1, 1 − slot)`` if a step ``i + 1 < n`` follows."""
    plgpu.barrier_wait(in_bar.at[slot])

    @pl.when(i + 1 < n)
    def _prefetch():
        plgpu.commit_smem()   # the other slot's last reads are done
        issue(i + 1, 1 - slot)


def build(body, out_type, scratch, grid, names, interpret, name, **threads):
    """``plgpu.kernel`` named ``name``; ``threads``: ``num_threads``, ``thread_name`` of a
    warp-specialized kernel."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=names, compiler_params=plgpu.CompilerParams(approx_math=True),
                        interpret=interpret or None, kernel_name=name, **threads)


def pieces(B, H, dv, N) -> int:
    """Pieces per sequence for the walks: the largest power of two ``P`` with
    ``P·B·H·dv/64 <= SMs`` (one walk CTA per SM) and at least ``MIN_PIECE`` chunks a piece."""
    sms = getattr(jax.devices()[0], "core_count", 0) or 132
    P = 1
    while 2 * P * B * H * (dv // BV) <= sms and N // (2 * P) >= MIN_PIECE and N % (2 * P) == 0:
        P *= 2
    return P


def split_pieces(x, P):
    """A token tensor ``[B,Tp,...]`` -> ``[B·P,Tp/P,...]``: a sequence's pieces are consecutive
    rows (a reshape)."""
    return x.reshape((x.shape[0] * P, x.shape[1] // P) + x.shape[2:])


def piece_starts(local, first, advance, reverse):
    """The state each piece starts from: ``S_0 = first``, ``S_{p+1} = advance(p, S_p) + E_p``
    (``local = E [B,P,...]``; ``advance``: piece ``p``'s transition, ``ρ_p S`` here), or the same
    from the last piece back -> ``[B,P,...]``."""
    order = range(local.shape[1] - 1, -1, -1) if reverse else range(local.shape[1])
    s, starts = first, {}
    for p in order:
        starts[p] = s
        s = advance(p, s) + local[:, p]
    return jnp.stack([starts[p] for p in range(local.shape[1])], 1)
