"""``loglinear_mamba2_pallas``: log-linear Mamba-2 (docs/math.md#loglinear) through Pallas kernels,
differentiable.

Same semantics as ``ops.loglinear_mamba2``: ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s`` with
``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay ``[B,T,H]`` (or ``[H]``),
``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``; returns ``[B,T,H,dv]`` float32.

Design: the block form of ``ops.xla.loglinear_blocks``, with no walk over chunks at all.  Chunk level
``j`` is "the left half of each aligned block of ``2^(j+1)`` chunks writes a state ``H_j``, the
right half reads it", with per-token weights ``lw`` (``token_weights``: decays and λ, plain JAX,
exact, its autodiff carries ``dlw`` into ``dg`` and ``dλ``).  Kernels (``loglinear_triton.py``,
``loglinear_tpu.py``; the chunk math in ``loglinear_chunk.py``), all parallel over chunks:

- forward: ``half_states`` per level (``H_j``, left halves), then one program per chunk reads
  its intra-chunk levels (``(QKᵀ ∘ Γ ∘ Λ) V``) and the states of the levels whose right half
  holds it;
- backward (``jax.custom_vjp``, residuals: the inputs and ``H_j``): ``half_states`` of ``q, dO``
  on the right halves gives ``dH_j``, then one program per chunk computes its ``dq, dk, dv``,
  ``db`` (the chunk-local log-decay, whose autodiff gives the rest of ``dg``), the intra ``dλ``
  and ``dlw``, reading ``H_j`` where the chunk reads and ``dH_j`` where it writes.

O(T·c·d + T·d·dv·log(T/c)) work, every state in HBM once per level (``N`` states of ``d×dv`` in
all, in the input dtype).  The kernels take whole rows with positions from 0; packed documents
and a row that continues a ``LevelState`` are compositions of them in ``ops.levels``.
Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (Triton lowering) takes bf16 and float32 (``experiments/kernels/check_kernels_gpu.py``
checks both; float32 at ``d >= 128`` with tiles of 32, ``wrap.F32_GPU_TILE``); the TPU path
(Mosaic) passes the Mosaic lowering but has never run on TPU hardware: the tests run it in
interpret mode.  Inputs other than all-bf16 run in float32; ``d`` is
zero-padded to a power of two >= 16, ``dv`` to a multiple of the value tiles, ``T`` to a
multiple of ``chunk_size`` (a power of two >= 16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.block_levels import token_weights
from hla_jax.core.checks import check_gate, check_lam, check_qkv
from hla_jax.core.layout import heads_first
from hla_jax.kernels.loglinear import loglinear_tpu, loglinear_triton
from hla_jax.kernels.wrap import backend_choice, chunk_gate, launch, pad, pow2_at_least

BACKENDS = {"triton": loglinear_triton, "tpu": loglinear_tpu}


class Config(NamedTuple):
    """Static kernel settings: chunk, value tile of the forward and of the backward, warps,
    interpret mode, backend ("triton" | "tpu")."""
    c: int
    bv: int
    bv_bwd: int
    num_warps: int = 8
    interpret: bool = False
    backend: str = "triton"


def levels_first(lam, Tp: int, Ln: int):
    """``lam [B,T,H,L] -> [B,H,Ln,Tp]`` float32: zero-padded (or cut) to ``Ln`` levels and ``Tp``
    tokens, one contiguous row per level."""
    lam = lam.astype(jnp.float32)[..., :Ln]
    lam = jnp.pad(lam, ((0, 0), (0, Tp - lam.shape[1]), (0, 0), (0, Ln - lam.shape[-1])))
    return jnp.transpose(lam, (0, 2, 3, 1))


def _states(x, y, lw, side: int, cfg: Config):
    """``half_states`` of every level: ``H_j`` (``x, y = k, v``, ``side=0``) or ``dH_j``
    (``q, dO``, ``side=1``)."""
    mod = BACKENDS[cfg.backend]
    return [mod.half_states(x, y, lw, j=j, side=side, c=cfg.c, bv=cfg.bv, num_warps=cfg.num_warps,
                            interpret=cfg.interpret) for j in range(lw.shape[2])]


def _forward(q, k, v, b, lam, lw, cfg):
    Hs = _states(k, v, lw, 0, cfg)
    o = BACKENDS[cfg.backend].forward(
        q, k, v, b, lam, lw, Hs, c=cfg.c, bv=cfg.bv, num_warps=cfg.num_warps,
        interpret=cfg.interpret)
    return o, Hs


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def loglinear_core(q, k, v, b, lam, lw, cfg: Config):
    """Log-linear Mamba-2 on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``
    (per-chunk cumulative log-decay), ``lam [B,H,lc+1,Tp]`` (the intra-chunk levels),
    ``lw [B,H,P,Tp]`` (``token_weights``) -> ``[B,Tp,H,dv]`` float32."""
    return _forward(q, k, v, b, lam, lw, cfg)[0]


def _core_fwd(q, k, v, b, lam, lw, cfg):
    o, Hs = _forward(q, k, v, b, lam, lw, cfg)
    return o, (q, k, v, b, lam, lw, Hs)


def _core_bwd(cfg, res, do):
    q, k, v, b, lam, lw, Hs = res
    do = do.astype(q.dtype)
    dHs = _states(q, do, lw, 1, cfg)
    dq, dk, dv, db, dlam, dlw = BACKENDS[cfg.backend].backward(
        q, k, v, b, lam, lw, Hs, dHs, do, c=cfg.c, bv=cfg.bv_bwd, num_warps=cfg.num_warps,
        interpret=cfg.interpret)
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype),
            db.sum(0), dlam.sum(0), dlw.sum(0))


loglinear_core.defvjp(_core_fwd, _core_bwd)


def loglinear_mamba2_pallas(q, k, v, g, lam, *, chunk_size=64, interpret=None, block_v=128,
                            block_v_bwd=128, num_warps=4, backend=None):
    """Log-linear Mamba-2 via Pallas (see the module docstring) on whole rows, positions from 0:
    packed documents and continued states are compositions in ``ops.levels``
    (``ops.loglinear_mamba2(impl="pallas", segment_ids=…)``).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        lam: level weights ``[B,T,H,L]``, ``L ≥ ⌈log2 T⌉+1``.
        chunk_size: a power of two >= 16.
        interpret: None runs compiled on GPU/TPU and in interpret mode on CPU.
        block_v: the forward kernels' value tile, a power of two >= 16 (at most ``dv`` rounded
            up to a power of two).
        block_v_bwd: the backward kernels' value tile, likewise.
        num_warps: Triton's warps per program.
        backend: "triton" | "tpu" | None (the default device's: "tpu" on a TPU, else "triton").

    Returns:
        ``o [B,T,H,dv]`` float32.

    Raises:
        ValueError: naming the argument (shapes, dtypes, ``g``, too few levels, tiles).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax.kernels import loglinear_mamba2_pallas
        >>> q = k = v = jnp.ones((1, 32, 1, 16))
        >>> g, lam = -0.1 * jnp.ones((1, 32, 1)), jnp.ones((1, 32, 1, 6))
        >>> loglinear_mamba2_pallas(q, k, v, g, lam, chunk_size=16).shape
        (1, 32, 1, 16)
    """
    name = "loglinear_mamba2_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=True)
    lam = check_lam(lam, B, T, H, name=name)
    return loglinear_mamba2_kernel(q, k, v, g, lam, chunk_size=chunk_size, interpret=interpret,
                                   block_v=block_v, block_v_bwd=block_v_bwd, num_warps=num_warps,
                                   backend=backend)


def loglinear_mamba2_kernel(q, k, v, g, lam, *, chunk_size=64, interpret=None, block_v=128,
                            block_v_bwd=128, num_warps=4, backend=None):
    """``loglinear_mamba2_pallas`` on inputs it has checked (``g`` and per-token inputs
    ``[B,T,H]``): the ops' entry, which checks them itself."""
    name = "loglinear_mamba2_pallas"
    B, T, H, d = q.shape
    dv = v.shape[-1]
    backend = backend_choice(name, backend, tuple(BACKENDS), "triton")
    c, Tp, dp, dt, interpret, backend, block_v, block_v_bwd = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        backend=backend, block_v_bwd=block_v_bwd)
    bv, bvb = (min(x, pow2_at_least(max(dv, 16))) for x in (block_v, block_v_bwd))
    dvp = -(-dv // max(bv, bvb)) * max(bv, bvb)
    lc, N = fenwick.chunk_log2(c), Tp // c
    lw = token_weights(heads_first(g, Tp, jnp.float32), heads_first(lam, Tp, jnp.float32), lc, N)
    if N == 1:  # no chunk level: one level of zero weights keeps every kernel input non-empty
        lw = jnp.zeros((B, H, 1, Tp), jnp.float32)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    o = loglinear_core(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c),
                       levels_first(lam, Tp, lc + 1), lw, Config(c, bv, bvb, num_warps, interpret,
                                                                 backend))
    return o[:, :T, :, :dv]
