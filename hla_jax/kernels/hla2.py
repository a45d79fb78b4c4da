"""``hla2_pallas``: second-order HLA (SPEC §1) through Pallas kernels, differentiable.

Same semantics as ``hla_jax.ops.hla2``: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay
``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]`` float32, divided by
``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator with ``v = 1``, run as
a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).

Design (see DESIGN.md "Kernels", layout (a)): one program per (batch, head, value tile) walks
the chunks in order with the float32 state ``(S, U = S C − G)`` on chip, so no per-chunk state
touches HBM in the forward.  ``jax.custom_vjp``: the forward keeps only its inputs; the backward
re-runs the forward kernel to write every chunk's incoming state (recompute, transient: these
states exist only inside the backward), then a reverse kernel walks the chunks with the
cotangent state ``(dS, dU)``.  Gates enter as the per-chunk cumulative log-decay ``b``; ``dg``
follows by autodiff of that cumulative sum.  Log-decays are floored at ``LOG_DECAY_FLOOR``
(``exp(-30) ≈ 1e-13``), which keeps every exponent finite (a reset ``g = -inf`` works).

Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (``kernels/gpu``, Triton lowering) is tested on an H200; the TPU path (``kernels/tpu``,
Mosaic) is tested in interpret mode only: no TPU was available.  Inputs other than bf16 run in
float32; ``d`` is zero-padded to a power of two >= 16 and ``dv`` to a multiple of the value
tile, ``T`` to a multiple of ``chunk_size`` (a power of two >= 16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.ops.common import check_gate, check_qkv, clamp_signed, gate_or_zeros

LOG_DECAY_FLOOR = -30.0


class Config(NamedTuple):
    """Static kernel settings: chunk, value tiles and warps of forward and backward."""
    c: int
    bv_fwd: int
    bv_bwd: int
    warps_fwd: int = 8
    warps_bwd: int = 8
    interpret: bool = False
    platform: str = "gpu"


def _kernels(platform: str):
    if platform == "tpu":
        from hla_jax.kernels.tpu import hla2 as mod
    else:
        from hla_jax.kernels.gpu import hla2 as mod
    return mod


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def hla2_core(q, k, v, b, cfg: Config):
    """Unnormalised HLA2 on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``
    (per-chunk cumulative log-decay) -> ``[B,Tp,H,dv]`` float32."""
    return _kernels(cfg.platform).forward(q, k, v, b, c=cfg.c, bv=cfg.bv_fwd,
                                          num_warps=cfg.warps_fwd, interpret=cfg.interpret)


def _core_fwd(q, k, v, b, cfg):
    return hla2_core(q, k, v, b, cfg), (q, k, v, b)


def _core_bwd(cfg, res, do):
    q, k, v, b = res
    mod = _kernels(cfg.platform)
    _, S, U = mod.forward(q, k, v, b, c=cfg.c, bv=cfg.bv_fwd, save_states=True,
                          num_warps=cfg.warps_fwd, interpret=cfg.interpret)
    dq, dk, dv, db = mod.backward(q, k, v, b, S, U, do.astype(q.dtype), c=cfg.c, bv=cfg.bv_bwd,
                                  num_warps=cfg.warps_bwd, interpret=cfg.interpret)
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype),
            db.sum(0))


hla2_core.defvjp(_core_fwd, _core_bwd)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pad(x, T: int, width: int):
    """Zero-pad time (axis 1) to ``T`` and features (last axis) to ``width``."""
    return jnp.pad(x, ((0, 0), (0, T - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


def chunk_log_decay(g, c: int):
    """``[B,Tp,H]`` log-decay -> ``b [B,H,Tp]``: the cumulative sum within each chunk of ``c``."""
    B, Tp, H = g.shape
    b = jnp.cumsum(jnp.maximum(g, LOG_DECAY_FLOOR).reshape(B, Tp // c, c, H), axis=2)
    return jnp.transpose(b.reshape(B, Tp, H), (0, 2, 1))


def hla2_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=None, num_warps=8, num_warps_bwd=None, platform=None):
    """Second-order masked HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``block_v``/``block_v_bwd`` (value tiles, powers of two >= 16), ``num_warps`` (Triton) and
    ``platform`` ("gpu" | "tpu"; default from ``jax.default_backend()``) tune the kernels.
    """
    B, T, H, d, dv = check_qkv(q, k, v, name="hla2_pallas")
    g = check_gate(g, B, T, H, name="hla2_pallas")
    c = chunk_size
    if not isinstance(c, int) or c < 16 or c & (c - 1):
        raise ValueError(f"hla2_pallas: chunk_size must be a power of two >= 16, got {c!r}")
    backend = jax.default_backend()
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    platform = platform or ("tpu" if backend == "tpu" else "gpu")
    dt = jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in (q, k, v)) else jnp.float32
    Tp = -(-T // c) * c
    dp = _pow2_at_least(max(d, 16))
    bv = min(block_v, _pow2_at_least(max(dv, 16)))
    dvp = -(-dv // bv) * bv
    cfg = Config(c, bv, min(block_v_bwd or bv, bv), num_warps, num_warps_bwd or num_warps,
                 interpret, platform)
    qp, kp = (_pad(x.astype(dt), Tp, dp) for x in (q, k))
    gp = jnp.pad(gate_or_zeros(g, B, T, H, jnp.float32), ((0, 0), (0, Tp - T), (0, 0)))
    b = chunk_log_decay(gp, c)
    o = hla2_core(qp, kp, _pad(v.astype(dt), Tp, dvp), b, cfg)[:, :T, :, :dv]
    if normalize:
        ones = jnp.zeros((B, Tp, H, 16), dt).at[..., 0].set(1)
        den = hla2_core(qp, kp, ones, b, cfg._replace(bv_fwd=16, bv_bwd=16))[:, :T, :, 0]
        o = o / clamp_signed(den, eps)[..., None]
    return o
