"""Plumbing of the Pallas kernels: the chunk-walk path of ``la_pallas`` (``prepare`` and
``core``, over ``kernels/gpu/walk.py`` (Triton) or ``kernels/tpu/walk.py`` (Mosaic)) and the
launch helpers it shares with the log-linear kernels (``launch``, ``pad``, ``chunk_log_decay``,
``backend_module``, ``F32_GPU_TILE``).

``core`` is LA on padded inputs as a ``jax.custom_vjp`` over the walks, from an initial state
``h0`` (or zeros) to the final state ``hT``.  The forward keeps only its inputs: one
``forward`` walk, or (``Config.parallel_forward``) the ``states`` walk plus the chunk-parallel
``outputs``.  The backward re-runs ``states`` (recompute, transient), walks ``dstates`` back
from ``dhT`` and computes every chunk's ``dq, dk, dv, db`` at once (``grads``): only the two
cheap state walks are sequential; the reverse walk's last carry is ``dh0``.  A sequence longer
than ``checkpoint_every`` chunks is done in equal segments, last first: one ``states`` walk
writes float32 checkpoints (each segment's incoming state), then per segment ``states`` from its
checkpoint, ``dstates`` from the cotangent carried back from the next segment, and ``grads``;
per-chunk states are held for one segment at a time.

``prepare`` pads the inputs (``T`` to the chunk and the segments, ``d`` to a power of two >= 16,
``dv`` to a multiple of the value tiles) and turns the gate into ``chunk_log_decay``; ``dg``
follows by autodiff of its cumulative sum.  Log-decays are floored at ``LOG_DECAY_FLOOR``
(``exp(-30) ≈ 1e-13``), which keeps every exponent finite (a reset ``g = -inf`` works).
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOG_DECAY_FLOOR = -30.0
CHECKPOINT_EVERY = 1024  # chunks per backward segment (65536 tokens at c = 64; shorter: one segment)
# float32 inputs from this (padded) head dim on exceed Triton's shared memory at the bf16 tiles:
# chunk and value tiles are capped per kernel, at what fits a Hopper GPU's shared memory
F32_GPU_MAX_D = 128
F32_GPU_TILE = {"la_pallas": 64, "loglinear_mamba2_pallas": 32, "loglinear_gated_deltanet_pallas": 16}


class Config(NamedTuple):
    """Static settings of ``core``: chunk, value tiles of forward and backward, interpret mode,
    platform ("gpu" | "tpu"), whether the forward is the ``states`` walk + chunk-parallel
    ``outputs`` instead of one walk, and the backward's segment in chunks (None: one)."""
    c: int
    bv_fwd: int
    bv_bwd: int
    interpret: bool = False
    platform: str = "gpu"
    parallel_forward: bool = False
    checkpoint_every: int | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def core(q, k, v, b, h0, cfg: Config):
    """LA on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``, ``h0`` the
    initial state (float32 ``[B,H,d,dv]``) or None (zeros) -> ``(O [B,Tp,H,dv]`` float32,
    ``hT)``, ``hT`` the final state (float32 ``[B,H,d,dv]``; None when ``h0`` is)."""
    walk = backend_module(cfg.platform, "walk")
    kw = dict(c=cfg.c, bv=cfg.bv_fwd, interpret=cfg.interpret)
    final = h0 is not None
    if cfg.parallel_forward:
        out = walk.states(q, k, v, b, h0, final=final, **kw)
        S, hT = out if final else (out, None)
        return walk.outputs(q, k, v, b, S, **kw), hT
    out = walk.forward(q, k, v, b, h0, final=final, **kw)
    return out if final else (out, None)


def _core_fwd(q, k, v, b, h0, cfg):
    return core(q, k, v, b, h0, cfg), (q, k, v, b, h0)


def _core_bwd(cfg, res, cts):
    q, k, v, b, h0 = res
    do, dhT = cts
    walk = backend_module(cfg.platform, "walk")
    fwd = dict(c=cfg.c, bv=cfg.bv_fwd, interpret=cfg.interpret)
    bwd = dict(fwd, bv=cfg.bv_bwd)
    do = do.astype(q.dtype)
    Tp = q.shape[1]
    G = cfg.checkpoint_every or Tp // cfg.c  # segments() made it divide Tp / c
    L, n_seg = G * cfg.c, Tp // (G * cfg.c)
    ckpts = walk.states(q, k, v, b, h0, every=G, **fwd) if n_seg > 1 else None

    def segment(s, dS):
        """Segment ``s`` (chunks ``[sG, (s+1)G)``): its states from checkpoint ``s`` (or ``h0``),
        their cotangents from ``dS`` (the next segment's ``dh0``, or ``dhT``), its input
        cotangents."""
        qs, ks, vs, dos = (jax.lax.dynamic_slice_in_dim(x, s * L, L, 1) for x in (q, k, v, do))
        bs = jax.lax.dynamic_slice_in_dim(b, s * L, L, 2)
        S0 = h0 if ckpts is None else jax.lax.dynamic_index_in_dim(ckpts, s, 2, keepdims=False)
        S = walk.states(qs, ks, vs, bs, S0, **fwd)
        dSs, dS0 = walk.dstates(qs, ks, vs, bs, dos, dS, **bwd)
        dq, dk, dv, db = walk.grads(qs, ks, vs, bs, S, dos, dSs, **bwd)
        return dS0, (dq.sum(0), dk.sum(0), dv, db.sum(0))

    dS, last = segment(n_seg - 1, dhT)
    if n_seg > 1:  # the other segments in reverse, carrying the state cotangent back
        dS, rest = jax.lax.scan(lambda dS, s: segment(s, dS), dS, jnp.arange(n_seg - 1),
                                reverse=True)
        last = [jnp.concatenate([r, x[None]]) for r, x in zip(rest, last)]
        last = [jnp.moveaxis(x, 0, a).reshape(x.shape[1:a + 1] + (-1,) + x.shape[a + 2:])
                for x, a in zip(last, (1, 1, 1, 2))]
    dq, dk, dv, db = last
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db,
            None if h0 is None else dS)


core.defvjp(_core_fwd, _core_bwd)


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


class Launch(NamedTuple):
    """What every Pallas operator derives from its inputs: the chunk ``c``, the padded length
    ``Tp`` and key width ``dp`` (a power of two >= 16), the matmul dtype ``dt`` (bf16 when all
    of q, k, v are bf16, else float32), interpret mode, platform ("gpu" | "tpu") and the value
    tiles ``bv``, ``bv_bwd`` (``block_v``, ``block_v_bwd``; capped like ``c`` for float32 on a
    GPU, see ``F32_GPU_TILE``)."""
    c: int
    Tp: int
    dp: int
    dt: object
    interpret: bool
    platform: str
    bv: int
    bv_bwd: int


def launch(name, q, k, v, *, chunk_size, block_v, interpret, platform, block_v_bwd=None) -> Launch:
    """``Launch`` of the operator ``name`` (ValueErrors name ``chunk_size`` / ``block_v`` /
    ``block_v_bwd``); ``interpret=None`` is interpret mode on CPU only, ``platform=None`` the
    default backend's.  Compiled on a GPU, float32 inputs with a (padded) head dim of at least
    ``F32_GPU_MAX_D`` get every tile capped at ``F32_GPU_TILE[name]`` (Triton's shared memory),
    or are refused where that is None."""
    block_v_bwd = block_v_bwd or block_v
    for arg, x in (("chunk_size", chunk_size), ("block_v", block_v), ("block_v_bwd", block_v_bwd)):
        if not isinstance(x, int) or x < 16 or x & (x - 1):
            raise ValueError(f"{name}: {arg} must be a power of two >= 16, got {x!r}")
    backend = jax.default_backend()
    T, d = q.shape[1], q.shape[-1]
    dp = pow2_at_least(max(d, 16))
    dt = jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in (q, k, v)) else jnp.float32
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    platform = platform or ("tpu" if backend == "tpu" else "gpu")
    if platform == "gpu" and not interpret and dt == jnp.float32 and dp >= F32_GPU_MAX_D:
        cap = F32_GPU_TILE.get(name)
        if cap is None:
            raise ValueError(
                f"{name}: float32 q, k, v with head dim {d} (padded to {dp}) need more GPU shared "
                f"memory than Triton has; pass bf16 inputs (float32 state either way) or use the "
                f"operator's impl='chunked'")
        chunk_size, block_v, block_v_bwd = (min(x, cap) for x in (chunk_size, block_v, block_v_bwd))
    return Launch(chunk_size, -(-T // chunk_size) * chunk_size, dp, dt, interpret, platform,
                  block_v, block_v_bwd)


def backend_module(platform: str, name: str):
    """The kernel module ``hla_jax.kernels.{gpu|tpu}.<name>``."""
    return importlib.import_module(f"hla_jax.kernels.{'tpu' if platform == 'tpu' else 'gpu'}.{name}")


def segments(Tp: int, c: int, checkpoint_every: int | None) -> tuple[int, int | None]:
    """``(Tp', G)``: the backward's segment of ``G`` chunks (None: one segment) for at most
    ``checkpoint_every`` chunks per segment, in equal segments, and ``Tp`` padded to them."""
    N = Tp // c
    if checkpoint_every is None or N <= checkpoint_every:
        return Tp, None
    n_seg = -(-N // checkpoint_every)
    G = -(-N // n_seg)
    return n_seg * G * c, G


def chunk_gate(g, B: int, H: int, Tp: int, c: int):
    """``b [B,H,Tp]`` float32 of a checked gate ``g [B,T,H]`` (or None: no decay), zero-padded to
    ``Tp``: ``chunk_log_decay``; without a gate a constant, not a cumsum of zeros (XLA's GPU
    compiler folds those slowly)."""
    if g is None:
        return jnp.zeros((B, H, Tp), jnp.float32)
    g = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, Tp - g.shape[1]), (0, 0)))
    return chunk_log_decay(g, c)


class Prepared(NamedTuple):
    """``core``'s padded inputs (``q, k [B,Tp,H,dp]``, ``v [B,Tp,H,dvp]`` in the matmul dtype,
    ``b [B,H,Tp]``) and its ``Config``."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    b: jax.Array
    cfg: Config


def prepare(q, k, v, g, *, chunk_size=64, interpret=None, block_v=64, block_v_bwd=None,
            platform=None, parallel_forward=False, checkpoint_every=CHECKPOINT_EVERY) -> Prepared:
    """``core``'s ``Prepared`` inputs from checked ``q, k, v`` and gate ``g`` (``[B,T,H]`` or
    None): chunk and value tiles as in ``launch`` (``block_v_bwd=None``: ``block_v``; neither
    wider than ``dv`` padded to a power of two), the ``Config`` settings as named there."""
    name = "la_pallas"
    B, _, H, _ = q.shape
    dv = v.shape[-1]
    c, Tp, dp, dt, interpret, platform, bv, bvb = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        platform=platform, block_v_bwd=block_v_bwd)
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"{name}: checkpoint_every must be a positive int (chunks) or None, got "
                         f"{checkpoint_every!r}")
    Tp, G = segments(Tp, c, checkpoint_every)
    bv, bvb = (min(x, pow2_at_least(max(dv, 16))) for x in (bv, bvb))
    dvp = -(-dv // max(bv, bvb)) * max(bv, bvb)
    cfg = Config(c, bv, bvb, interpret, platform, parallel_forward, G)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    return Prepared(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c), cfg)
