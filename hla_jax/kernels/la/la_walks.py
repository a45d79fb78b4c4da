"""The chunk-walk path of ``la_pallas`` on the Triton (``la_triton.py``) and Mosaic TPU
(``la_tpu.py``) walks: ``prepare`` pads the inputs, ``core`` is LA on padded inputs as one
``jax.custom_vjp``.

``core`` runs from an initial state ``h0`` (or zeros) to the final state ``hT``.  The forward keeps
only its inputs: one ``forward`` walk, or (``Config.parallel_forward``) the ``states`` walk plus
the chunk-parallel ``outputs``.  The backward re-runs ``states`` (recompute, transient), walks
``dstates`` back from ``dhT`` and computes every chunk's ``dq, dk, dv, db`` at once (``grads``):
only the two cheap state walks are sequential; the reverse walk's last carry is ``dh0``.  A
sequence longer than ``checkpoint_every`` chunks is done in equal segments, last first: one
``states`` walk writes float32 checkpoints (each segment's incoming state), then per segment
``states`` from its checkpoint, ``dstates`` from the cotangent carried back from the next
segment, and ``grads``; per-chunk states are held for one segment at a time.

``prepare`` pads the inputs (``T`` to the chunk and the segments, ``d`` to a power of two >= 16,
``dv`` to a multiple of the value tiles) and turns the gate into ``wrap.chunk_log_decay``; ``dg``
follows by autodiff of its cumulative sum.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.kernels.la import la_tpu, la_triton
from hla_jax.kernels.wrap import chunk_gate, launch, pad, pow2_at_least

CHECKPOINT_EVERY = 1024  # chunks per backward segment (65536 tokens at c = 64; shorter: one segment)
BACKENDS = {"triton": la_triton, "tpu": la_tpu}


class Config(NamedTuple):
    """Static settings of ``core``: chunk, value tiles of forward and backward, interpret mode,
    backend ("triton" | "tpu"), whether the forward is the ``states`` walk + chunk-parallel
    ``outputs`` instead of one walk, and the backward's segment in chunks (None: one)."""
    c: int
    bv_fwd: int
    bv_bwd: int
    interpret: bool = False
    backend: str = "triton"
    parallel_forward: bool = False
    checkpoint_every: int | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def core(q, k, v, b, h0, cfg: Config):
    """LA on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b [B,H,Tp]``, ``h0`` the
    initial state (float32 ``[B,H,d,dv]``) or None (zeros) -> ``(O [B,Tp,H,dv]`` float32,
    ``hT)``, ``hT`` the final state (float32 ``[B,H,d,dv]``; None when ``h0`` is)."""
    walk = BACKENDS[cfg.backend]
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
    walk = BACKENDS[cfg.backend]
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


def segments(Tp: int, c: int, checkpoint_every: int | None) -> tuple[int, int | None]:
    """``(Tp', G)``: the backward's segment of ``G`` chunks (None: one segment) for at most
    ``checkpoint_every`` chunks per segment, in equal segments, and ``Tp`` padded to them."""
    N = Tp // c
    if checkpoint_every is None or N <= checkpoint_every:
        return Tp, None
    n_seg = -(-N // checkpoint_every)
    G = -(-N // n_seg)
    return n_seg * G * c, G


class Prepared(NamedTuple):
    """``core``'s padded inputs (``q, k [B,Tp,H,dp]``, ``v [B,Tp,H,dvp]`` in the matmul dtype,
    ``b [B,H,Tp]``) and its ``Config``."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    b: jax.Array
    cfg: Config


def prepare(q, k, v, g, *, backend, chunk_size=64, interpret=None, block_v=64, block_v_bwd=None,
            parallel_forward=False, checkpoint_every=CHECKPOINT_EVERY) -> Prepared:
    """``core``'s ``Prepared`` inputs from checked ``q, k, v`` and gate ``g`` (``[B,T,H]`` or
    None): chunk and value tiles as in ``launch`` (``block_v_bwd=None``: ``block_v``; neither
    wider than ``dv`` padded to a power of two), ``backend`` "triton" | "tpu" (the entry's
    choice, ``la_entry.la_kernel``), the other ``Config`` settings as named there."""
    name = "la_pallas"
    B, _, H, _ = q.shape
    dv = v.shape[-1]
    c, Tp, dp, dt, interpret, backend, bv, bvb = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        backend=backend, block_v_bwd=block_v_bwd)
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"{name}: checkpoint_every must be a positive int (chunks) or None, got "
                         f"{checkpoint_every!r}")
    Tp, G = segments(Tp, c, checkpoint_every)
    bv, bvb = (min(x, pow2_at_least(max(dv, 16))) for x in (bv, bvb))
    dvp = -(-dv // max(bv, bvb)) * max(bv, bvb)
    cfg = Config(c, bv, bvb, interpret, backend, parallel_forward, G)
    qp, kp = (pad(x.astype(dt), Tp, dp) for x in (q, k))
    return Prepared(qp, kp, pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c), cfg)
