"""``loglinear_mamba2_pallas``: log-linear Mamba-2 (SPEC §4) through Pallas kernels, differentiable.

Same semantics as ``ops.loglinear_mamba2``: ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s`` with
``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay ``[B,T,H]`` (or ``[H]``),
``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``; returns ``[B,T,H,dv]`` float32.

Design (DESIGN.md "Kernels", layout (a)): one program per (batch, head, value tile) walks the
``N`` chunks with the binary counter of ``P = max(1, bit_length(N−1))`` chunk-level states on
chip (``kernels/loglinear_chunk.py``): levels ``0..lc`` (``c = 2^lc``) are masked attention
inside the chunk, level ``lc + 1 + j`` is slot ``j`` read with ``q`` and its λ.  The counter is
lazy: a slot keeps its block state as written and is read through a scalar decay
``s[n, j]`` (``level_scales``, plain JAX from the gates: local sums, no long cumulative sums),
so a chunk touches only its live slots (bit ``j`` of the chunk index set; dead ones skip their
matmuls) and writes one.  Cost O(T·c·d + T·d·dv·log(T/c)).

``jax.custom_vjp``: the forward keeps only its inputs; the backward re-runs the forward walk to
checkpoint, per chunk, the one block state it wrote (``W: [B,H,N,d,dv]``, transient: chunk ``n``'s
slot ``j`` is ``W[block_end(n, j)]``), then a reverse walk carries the slots' cotangents and,
per slot, the accumulated cotangent of its decay (which flows into ``db`` of every chunk it
crossed), writing per chunk the cotangent of its merged state; last, a chunk-parallel kernel
computes every chunk's ``dq, dk, dv, db, dλ`` at once, with its own value tile
(``block_v_bwd``).  ``dg`` by autodiff of the chunk cumulative log-decay
(``wrap.chunk_gate``, floored at ``LOG_DECAY_FLOOR`` so a reset ``g = -inf`` stays finite).

Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (``kernels/gpu``, Triton lowering) passes the H200 check in bf16 and float32
(``experiments/check_kernels_gpu.py``; float32 at ``d >= 128`` with tiles of 32,
``wrap.F32_GPU_TILE``); the TPU path
(``kernels/tpu``, Mosaic) passes the Mosaic lowering but runs in interpret mode only: no TPU was
available.
Inputs other than all-bf16 run in float32; ``d`` is zero-padded to a power of two >= 16, ``dv``
to a multiple of the value tile, ``T`` to a multiple of ``chunk_size`` (a power of two >= 16),
``lam`` to the ``lc + 1 + P`` levels the kernels read (more are never used).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.kernels.loglinear_chunk import num_slots
from hla_jax.kernels.wrap import backend_module, chunk_gate, launch, pad, pow2_at_least
from hla_jax.ops import fenwick
from hla_jax.ops.common import check_gate, check_qkv
from hla_jax.ops.loglinear import check_lam

STACK_BYTES = 64 * 1024   # registers the level stack of one Triton program may take


class Config(NamedTuple):
    """Static kernel settings: chunk, value tile of the walks and of the chunk-parallel
    gradients, warps, interpret mode, platform."""
    c: int
    bv: int
    bv_bwd: int
    num_warps: int = 8
    interpret: bool = False
    platform: str = "gpu"


def _kernels(platform: str):
    return backend_module(platform, "loglinear")


def chunk_levels(T: int, c: int) -> int:
    """``P``: chunk-level states of a sequence of ``T`` tokens in chunks of ``c`` (at least 1)."""
    return max(1, fenwick.num_levels(-(-T // c)) - 1)


def value_tile(block_v: int, d: int, dv: int, P: int) -> int:
    """The value tile: ``block_v``, at most ``dv`` rounded up to a power of two, and small enough
    that ``P`` float32 ``d×bv`` states fit ``STACK_BYTES`` (never below 16)."""
    fit = 1 << max(4, (STACK_BYTES // (4 * P * d)).bit_length() - 1)
    return min(block_v, pow2_at_least(max(dv, 16)), fit)


def value_tiles(block_v: int, block_v_bwd: int, d: int, dv: int, P: int):
    """``(bv, bv_bwd, dvp)``: the walks' value tile (``value_tile``), the chunk-parallel
    gradients' (``block_v_bwd``, at most ``dv`` rounded up to a power of two) and ``dv`` padded
    to a multiple of both."""
    bv = value_tile(block_v, d, dv, P)
    bvb = min(block_v_bwd, pow2_at_least(max(dv, 16)))
    return bv, bvb, -(-dv // max(bv, bvb)) * max(bv, bvb)


def level_scales(b, c: int, P: int):
    """``s: [B,H,N,P]`` from ``b [B,H,Tp]``: chunk ``n`` reads slot ``j`` as ``s[n,j] W[m]``,
    ``m = block_end(n, j)``, with ``s[n,j] = exp(Σ_{m<k<n} b_k^end)`` (the decay of the chunks
    between) when bit ``j`` of ``n`` is set, else 0.  Each sum runs inside the right half of an
    aligned block of ``2^(j+1)`` chunks, so no long cumulative sum loses precision."""
    tot = b[..., c - 1::c]                                  # [B,H,N] log-decay of each chunk
    B, H, N = tot.shape
    cols = []
    for j in range(P):
        half = 1 << j
        Np = -(-N // (2 * half)) * 2 * half
        right = jnp.pad(tot, ((0, 0), (0, 0), (0, Np - N))).reshape(B, H, -1, 2, half)[..., 1, :]
        before = jnp.cumsum(jnp.pad(right[..., :-1], ((0, 0),) * 3 + ((1, 0),)), axis=-1)
        s = jnp.stack([jnp.zeros_like(before), jnp.exp(before)], axis=-2)
        cols.append(s.reshape(B, H, Np)[..., :N])
    return jnp.stack(cols, axis=-1)


def _scales(b, lam, c):
    """``level_scales`` for the slots behind ``lam [B,H,Ln,Tp]``."""
    return level_scales(b, c, num_slots(lam.shape[2], c))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def loglinear_core(q, k, v, b, lam, cfg: Config):
    """Log-linear Mamba-2 on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``
    (per-chunk cumulative log-decay), ``lam [B,H,Ln,Tp]`` -> ``[B,Tp,H,dv]`` float32."""
    return _kernels(cfg.platform).forward(q, k, v, b, lam, _scales(b, lam, cfg.c), c=cfg.c,
                                          bv=cfg.bv, num_warps=cfg.num_warps, interpret=cfg.interpret)


def _core_fwd(q, k, v, b, lam, cfg):
    return loglinear_core(q, k, v, b, lam, cfg), (q, k, v, b, lam)


def _core_bwd(cfg, res, do):
    q, k, v, b, lam = res
    mod = _kernels(cfg.platform)
    kw = dict(c=cfg.c, bv=cfg.bv, num_warps=cfg.num_warps, interpret=cfg.interpret)
    s = _scales(b, lam, cfg.c)
    do = do.astype(q.dtype)
    W = mod.states(q, k, v, b, lam, s, **kw)
    dM, carried = mod.dstates(q, k, v, b, lam, s, W, do, **kw)
    dq, dk, dv, db, dlam = mod.grads(q, k, v, b, lam, s, W, do, dM, **(kw | dict(bv=cfg.bv_bwd)))
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype),
            db.sum(0) + carried.sum(0), dlam.sum(0))


loglinear_core.defvjp(_core_fwd, _core_bwd)


def levels_first(lam, Tp: int, Ln: int):
    """``lam [B,T,H,L] -> [B,H,Ln,Tp]`` float32: zero-padded (or cut) to ``Ln`` levels and ``Tp``
    tokens, one contiguous row per level."""
    lam = lam.astype(jnp.float32)[..., :Ln]
    lam = jnp.pad(lam, ((0, 0), (0, Tp - lam.shape[1]), (0, 0), (0, Ln - lam.shape[-1])))
    return jnp.transpose(lam, (0, 2, 3, 1))


def loglinear_mamba2_pallas(q, k, v, g, lam, *, chunk_size=64, interpret=None, block_v=64,
                            block_v_bwd=64, num_warps=8, platform=None):
    """Log-linear Mamba-2 via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``block_v`` (the largest value tile of the walks, a power of two >= 16; shrunk so the level
    stack fits ``STACK_BYTES``), ``block_v_bwd`` (the value tile of the chunk-parallel
    gradients), ``num_warps`` (Triton) and ``platform`` ("gpu" | "tpu"; default from
    ``jax.default_backend()``) tune the kernels.
    """
    name = "loglinear_mamba2_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=True)
    lam = check_lam(lam, B, T, H, name=name)
    c, Tp, dp, dt, interpret, platform, block_v, block_v_bwd = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        platform=platform, block_v_bwd=block_v_bwd)
    P = chunk_levels(T, c)
    bv, bvb, dvp = value_tiles(block_v, block_v_bwd, dp, dv, P)
    cfg = Config(c, bv, bvb, num_warps, interpret, platform)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    lamp = levels_first(lam, Tp, c.bit_length() + P)
    o = loglinear_core(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c), lamp, cfg)
    return o[:, :T, :, :dv]
