"""Plumbing shared by the Pallas kernel entries, whatever the backend: the backend choice
(``backend_choice``), the launch settings every entry derives from its inputs (``launch``: chunk,
padded sizes, matmul dtype, interpret mode, value tiles, and the tile caps for float32 on a GPU,
``F32_GPU_TILE``), zero-padding (``pad``, ``pad_state``), the chunk-local cumulative log-decay
(``chunk_log_decay``, ``chunk_gate``; log-decays are floored at ``LOG_DECAY_FLOOR``,
``exp(-30) ≈ 1e-13``, which keeps every exponent finite: a reset ``g = -inf`` works), and the
optional-argument helpers of the walk kernels (``jit``, ``given``, ``unpack``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOG_DECAY_FLOOR = -30.0
# float32 inputs from this (padded) head dim on exceed Triton's shared memory at the bf16 tiles:
# chunk and value tiles are capped per kernel, at what fits a Hopper GPU's shared memory
F32_GPU_MAX_D = 128
F32_GPU_TILE = {"la_pallas": 64, "loglinear_mamba2_pallas": 32, "loglinear_gated_deltanet_pallas": 16}


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pad(x, T: int, width: int):
    """Zero-pad time (axis 1) to ``T`` and features (last axis) to ``width``."""
    return jnp.pad(x, ((0, 0), (0, T - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


def pad_state(h0, B, H, d, dv):
    """``h0 [B,H,·,·]`` as float32 ``[B,H,d,dv]`` (zero-padded); zeros when None."""
    if h0 is None:
        return jnp.zeros((B, H, d, dv), jnp.float32)
    return jnp.pad(h0.astype(jnp.float32),
                   ((0, 0), (0, 0), (0, d - h0.shape[2]), (0, dv - h0.shape[3])))


def chunk_log_decay(g, c: int):
    """``[B,Tp,H]`` log-decay -> ``b [B,H,Tp]``: the cumulative sum within each chunk of ``c``."""
    B, Tp, H = g.shape
    b = jnp.cumsum(jnp.maximum(g, LOG_DECAY_FLOOR).reshape(B, Tp // c, c, H), axis=2)
    return jnp.transpose(b.reshape(B, Tp, H), (0, 2, 1))


def backend_choice(name: str, backend, backends, gpu_default: str) -> str:
    """The kernel backend of the entry ``name``: ``backend``, or where None the one of the default
    device (``"tpu"`` on a TPU, else ``gpu_default``); ValueError unless one of ``backends``."""
    if backend is None:
        backend = "tpu" if jax.default_backend() == "tpu" else gpu_default
    if backend not in backends:
        raise ValueError(f"{name}: backend must be None or one of {backends}, got {backend!r}")
    return backend


class Launch(NamedTuple):
    """What every Pallas operator derives from its inputs: the chunk ``c``, the padded length
    ``Tp`` and key width ``dp`` (a power of two >= 16), the matmul dtype ``dt`` (bf16 when all
    of q, k, v are bf16, else float32), interpret mode, the backend ("triton" | "tpu") and the
    value tiles ``bv``, ``bv_bwd`` (``block_v``, ``block_v_bwd``; capped like ``c`` for float32
    on Triton, see ``F32_GPU_TILE``)."""
    c: int
    Tp: int
    dp: int
    dt: object
    interpret: bool
    backend: str
    bv: int
    bv_bwd: int


def launch(name, q, k, v, *, chunk_size, block_v, interpret, backend, block_v_bwd=None) -> Launch:
    """``Launch`` of the operator ``name`` on ``backend`` ("triton" | "tpu", ``backend_choice``'s)
    (ValueErrors name ``chunk_size`` / ``block_v`` / ``block_v_bwd``); ``interpret=None`` is
    interpret mode on CPU only.  Compiled on Triton, float32 inputs with a (padded) head dim of at
    least ``F32_GPU_MAX_D`` get every tile capped at ``F32_GPU_TILE[name]`` (Triton's shared
    memory), or are refused where that is None."""
    block_v_bwd = block_v_bwd or block_v
    for arg, x in (("chunk_size", chunk_size), ("block_v", block_v), ("block_v_bwd", block_v_bwd)):
        if not isinstance(x, int) or x < 16 or x & (x - 1):
            raise ValueError(f"{name}: {arg} must be a power of two >= 16, got {x!r}")
    T, d = q.shape[1], q.shape[-1]
    dp = pow2_at_least(max(d, 16))
    dt = jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in (q, k, v)) else jnp.float32
    interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
    if backend == "triton" and not interpret and dt == jnp.float32 and dp >= F32_GPU_MAX_D:
        cap = F32_GPU_TILE.get(name)
        if cap is None:
            raise ValueError(
                f"{name}: float32 q, k, v with head dim {d} (padded to {dp}) need more GPU shared "
                f"memory than Triton has; pass bf16 inputs (float32 state either way) or use the "
                f"operator's impl='chunked'")
        chunk_size, block_v, block_v_bwd = (min(x, cap) for x in (chunk_size, block_v, block_v_bwd))
    return Launch(chunk_size, -(-T // chunk_size) * chunk_size, dp, dt, interpret, backend,
                  block_v, block_v_bwd)


def chunk_gate(g, B: int, H: int, Tp: int, c: int):
    """``b [B,H,Tp]`` float32 of a checked gate ``g [B,T,H]`` (or None: no decay), zero-padded to
    ``Tp``: ``chunk_log_decay``; without a gate a constant, not a cumsum of zeros (XLA's GPU
    compiler folds those slowly)."""
    if g is None:
        return jnp.zeros((B, H, Tp), jnp.float32)
    g = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, Tp - g.shape[1]), (0, 0)))
    return chunk_log_decay(g, c)


WALK_STATIC = ("c", "bv", "interpret")  # the static arguments of every walk kernel


def jit(*extra):
    """``jax.jit`` of a walk kernel, static in ``WALK_STATIC`` and ``extra``."""
    return functools.partial(jax.jit, static_argnames=WALK_STATIC + extra)


def given(*xs):
    """The arguments that are not None (the optional states of a kernel call)."""
    return [x for x in xs if x is not None]


def unpack(refs, *present):
    """``refs`` spread over the flags ``present``: the next ref for a true flag, None for false."""
    it = iter(refs)
    return [next(it) if p else None for p in present]
