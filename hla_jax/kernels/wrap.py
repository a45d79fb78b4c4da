"""Shared plumbing of the chunked Pallas operators on the generic chunk walks (``la_pallas``,
``hla2_pallas``, ``ahla_pallas``, ``hla3_pallas``).

A family ``f`` is its one-chunk step ``kernels/f_chunk.py`` (``chunk_forward``,
``chunk_backward``) and its state layout ``LAYOUTS[f]`` (``DD``: ``d×d``, ``DV``: ``d×dv``); the
chunk walks ``kernels/gpu/walk.py`` (Triton) and ``kernels/tpu/walk.py`` (Mosaic) run any
family:

- ``forward``: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]`` (per-chunk cumulative
  log-decay) -> ``O [B,Tp,H,dv]`` float32, by one walk over the chunks;
- ``states`` (a walk) and ``outputs`` (chunk-parallel): the same ``O`` in two kernels, through
  every chunk's incoming states (``Config.parallel_forward``);
- ``dstates`` (a reverse walk) and ``grads`` (chunk-parallel): the cotangents, from the saved
  states and the cotangents of every chunk's outgoing states.

``stateful_core`` is the ``jax.custom_vjp`` over these (``chunked_core``: from zero states, no
final state): the forward keeps only its inputs; the backward re-runs ``states`` (recompute,
transient), walks ``dstates`` back, and then computes every chunk's ``dq, dk, dv, db`` at once:
only the two cheap state walks are sequential.  With initial states ``h0`` (``d×dv`` layouts:
LA, AHLA) the walks start from them and write the final states ``hT``; the backward seeds the
reverse walk with ``dhT`` and returns its last carry as ``dh0``.  A sequence longer than
``checkpoint_every`` chunks is done in equal segments, last first: one ``states`` walk writes
float32 checkpoints (each segment's incoming state), then per segment ``states`` from its
checkpoint, ``dstates`` from the cotangent carried back from the next segment, and ``grads``;
per-chunk states are held for one segment at a time.
``prepare`` pads the inputs (``T`` to the chunk, ``d`` to a power of two >= 16, ``dv`` to a
multiple of the value tile) and turns gates into ``chunk_log_decay``; ``pallas_operator`` is the
public entry of the HLA operators: input checks, ``prepare``, ratio normalisation by a second
call on a 16-wide value tile ``[1, 0, …, 0]`` (the operators are linear in V, so this is the
denominator); ``dg`` by autodiff of the cumulative sum.  Log-decays are floored at
``LOG_DECAY_FLOOR`` (``exp(-30) ≈ 1e-13``), which keeps every exponent finite (a reset
``g = -inf`` works).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.kernels.gpu.walk import DD, DV
from hla_jax.ops.common import check_gate, check_qkv, clamp_signed

LOG_DECAY_FLOOR = -30.0
CHECKPOINT_EVERY = 1024  # chunks per backward segment (65536 tokens at c = 64; shorter: one segment)
# float32 inputs from this (padded) head dim on exceed Triton's shared memory at the bf16 tiles:
# chunk and value tiles are capped per operator (H200: hla3's tiles of 32 asked 236 KiB of 227;
# la's of 64 fit)
F32_GPU_MAX_D = 128
F32_GPU_TILE = {"la_pallas": 64, "hla2_pallas": 32, "ahla_pallas": 32, "hla3_pallas": 16,
                "loglinear_mamba2_pallas": 32, "loglinear_gated_deltanet_pallas": 16}


class Config(NamedTuple):
    """Static kernel settings: family (kernel module name), chunk, value tiles and warps of
    forward and backward, interpret mode, platform ("gpu" | "tpu"), and whether the forward is
    the ``states`` walk + chunk-parallel ``outputs`` instead of one walk; ``checkpoint_every``:
    the backward's segment in chunks (None: the whole sequence is one segment)."""
    family: str
    c: int
    bv_fwd: int
    bv_bwd: int
    warps_fwd: int = 8
    warps_bwd: int = 8
    interpret: bool = False
    platform: str = "gpu"
    parallel_forward: bool = False
    checkpoint_every: int | None = None


# (S), (S, U), (P, E), (S, P, F)
LAYOUTS = {"la": (DV,), "hla2": (DD, DV), "ahla": (DV, DV), "hla3": (DD, DV, DV)}
# families whose state cotangents depend on the states (HLA3: F's update is bilinear in S and P)
BILINEAR = frozenset({"hla3"})


class Kernels(NamedTuple):
    forward: Callable
    states: Callable
    outputs: Callable
    dstates: Callable
    grads: Callable


def kernels(cfg: Config) -> Kernels:
    """``cfg.family``'s chunk step in the kernels of ``cfg.platform`` ("gpu" | "tpu")."""
    walk = backend_module(cfg.platform, "walk")
    chunk = importlib.import_module(f"hla_jax.kernels.{cfg.family}_chunk")
    layout = LAYOUTS[cfg.family]
    fwd, bwd = chunk.chunk_forward, chunk.chunk_backward
    return Kernels(*(functools.partial(f, step, layout) for f, step in (
        (walk.forward, fwd), (walk.states, fwd), (walk.outputs, fwd), (walk.dstates, bwd),
        (walk.grads, bwd))))


def _chunk_axis(states):
    """States ``[B,H,d,w]`` as the walks' one-chunk ``init`` ``[B,H,1,d,w]`` (None if none)."""
    return [x[:, :, None] for x in states] or None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def stateful_core(q, k, v, b, h0, cfg: Config):
    """The operator on padded inputs, from initial states to final ones: ``q, k [B,Tp,H,d]``,
    ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``, ``h0`` the initial states (float32 ``[B,H,d,dv]``, one per
    entry of ``LAYOUTS[cfg.family]``, all ``DV``) or ``()`` (zeros) -> ``(O [B,Tp,H,dv]`` float32,
    ``hT)``, ``hT`` the final states shaped as ``h0`` (``()`` when ``h0`` is)."""
    if h0 and DD in LAYOUTS[cfg.family]:
        raise ValueError(f"{cfg.family}: initial and final states are for d×dv state layouts only")
    mod, kw = kernels(cfg), dict(c=cfg.c, bv=cfg.bv_fwd, num_warps=cfg.warps_fwd,
                                 interpret=cfg.interpret)
    walk = mod.states if cfg.parallel_forward else mod.forward
    out = walk(q, k, v, b, init=_chunk_axis(h0), final=bool(h0), **kw)
    out, last = out if h0 else (out, ())
    o = mod.outputs(q, k, v, b, *out, **kw) if cfg.parallel_forward else out
    return o, tuple(x[:, :, 0] for x in last)


def _core_fwd(q, k, v, b, h0, cfg):
    return stateful_core(q, k, v, b, h0, cfg), (q, k, v, b, h0)


def _core_bwd(cfg, res, cts):
    q, k, v, b, h0 = res
    do, dhT = cts
    mod = kernels(cfg)
    kw = dict(c=cfg.c, interpret=cfg.interpret)
    fwd_kw = dict(kw, bv=cfg.bv_fwd, num_warps=cfg.warps_fwd)
    bwd_kw = dict(kw, bv=cfg.bv_bwd, num_warps=cfg.warps_bwd)
    do = do.astype(q.dtype)
    Tp = q.shape[1]
    G = cfg.checkpoint_every or Tp // cfg.c  # segments() made it divide Tp / c
    L, n_seg = G * cfg.c, Tp // (G * cfg.c)
    init0 = _chunk_axis(h0)
    ckpts = mod.states(q, k, v, b, init=init0, every=G, **fwd_kw) if n_seg > 1 else ()

    def segment(s, dinit):
        """Segment ``s`` (chunks ``[sG, (s+1)G)``): its states from checkpoint ``s`` (or ``h0``),
        their cotangents from ``dinit`` (the next segment's, or ``dhT``), its input cotangents."""
        qs, ks, vs, dos = (jax.lax.dynamic_slice_in_dim(x, s * L, L, 1) for x in (q, k, v, do))
        bs = jax.lax.dynamic_slice_in_dim(b, s * L, L, 2)
        init = [jax.lax.dynamic_slice_in_dim(x, s, 1, 2) for x in ckpts] or init0
        saved = mod.states(qs, ks, vs, bs, init=init, **fwd_kw)
        dsaved, dfirst = mod.dstates(qs, ks, vs, bs, *(saved if cfg.family in BILINEAR else ()),
                                     dos, init=dinit, **bwd_kw)
        dq, dk, dv, db = mod.grads(qs, ks, vs, bs, *saved, dos, *dsaved, **bwd_kw)
        return dfirst, (dq.sum(0), dk.sum(0), dv, db.sum(0))

    carry, last = segment(n_seg - 1, _chunk_axis(dhT))
    if n_seg > 1:  # the other segments in reverse, carrying the state cotangent back
        carry, rest = jax.lax.scan(lambda dinit, s: segment(s, dinit), carry,
                                   jnp.arange(n_seg - 1), reverse=True)
        last = [jnp.concatenate([r, x[None]]) for r, x in zip(rest, last)]
        last = [jnp.moveaxis(x, 0, a).reshape(x.shape[1:a + 1] + (-1,) + x.shape[a + 2:])
                for x, a in zip(last, (1, 1, 1, 2))]
    dq, dk, dv, db = last
    dh0 = tuple(x[:, :, 0] for x in carry) if h0 else ()
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db, dh0


stateful_core.defvjp(_core_fwd, _core_bwd)


def chunked_core(q, k, v, b, cfg: Config):
    """``stateful_core`` from zero states: ``O [B,Tp,H,dv]`` float32."""
    return stateful_core(q, k, v, b, (), cfg)[0]


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pad(x, T: int, width: int):
    """Zero-pad time (axis 1) to ``T`` and features (last axis) to ``width``."""
    return jnp.pad(x, ((0, 0), (0, T - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


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
    """A family's padded kernel inputs (``q, k [B,Tp,H,dp]``, ``v [B,Tp,H,dvp]`` in the matmul
    dtype, ``b [B,H,Tp]``) and its ``Config``."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    b: jax.Array
    cfg: Config


def prepare(family: str, q, k, v, g, *, chunk_size=64, interpret=None, block_v=64,
            block_v_bwd=None, num_warps=8, num_warps_bwd=None, platform=None,
            parallel_forward=False, checkpoint_every=CHECKPOINT_EVERY) -> Prepared:
    """``Prepared`` inputs of ``family``'s kernels from checked ``q, k, v`` and gate ``g``
    (``[B,T,H]`` or None); the arguments are those of ``hla2_pallas``."""
    name = f"{family}_pallas"
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
    cfg = Config(family, c, bv, bvb, num_warps, num_warps_bwd or num_warps, interpret, platform,
                 parallel_forward, G)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    return Prepared(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c), cfg)


def pallas_operator(family: str, q, k, v, g=None, *, normalize=False, eps=1e-6, **tuning):
    """``family``'s operator via its Pallas kernels, ``[B,T,H,dv]`` float32 (the arguments are
    those of ``hla2_pallas``; inputs other than all-bf16 run in float32)."""
    name = f"{family}_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    p = prepare(family, q, k, v, check_gate(g, B, T, H, name=name), **tuning)
    o = chunked_core(p.q, p.k, p.v, p.b, p.cfg)[:, :T, :, :dv]
    if normalize:
        ones = jnp.zeros(p.q.shape[:3] + (16,), p.q.dtype).at[..., 0].set(1)
        den = chunked_core(p.q, p.k, ones, p.b, p.cfg._replace(bv_fwd=16, bv_bwd=16))[:, :T, :, 0]
        o = o / clamp_signed(den, eps)[..., None]
    return o
