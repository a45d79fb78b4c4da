"""``la_pallas``: first-order scalar-gated linear attention (LA, docs/math.md#chains) through Pallas kernels.

    LA(q,k,v;g)_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s + D(t,-1) q_tᵀ H0
    H_T = D(T-1,-1) H0 + Σ_s D(T-1,s) k_s v_sᵀ

with ``D(t,s) = exp(g_{s+1}+…+g_t)``, ``D(t,-1) = exp(g_0+…+g_t)``.  Shapes: ``q, k [B,T,H,d]``,
``v [B,T,H,dv]``, ``g`` a log-decay ``[B,T,H]``, ``[H]`` or None (no decay), ``initial_state``
``H0 [B,H,d,dv]`` (float32 state) or None (zeros).  This is ``ops.mamba2`` /
``ops.linear_attention`` (the Mamba-2 SSD core) and the building block of every HLA operator
(docs/math.md#chains), so it is differentiable in all of ``q, k, v, g, initial_state``.

Backends:

- ``"mosaic_gpu"`` (``la_mgpu.py``, Hopper, wgmma and TMA): taken by default on a GPU where
  ``mosaic_gpu.supports`` says so (16-bit inputs, its head dims, chunk 64);
- ``"triton"`` (``la_triton.py``): the chunk walks over the chunk step ``la_chunk.py`` (one
  float32 ``d×bv`` state per value tile), through ``la_walks.core``:
  forward as a ``states`` walk plus chunk-parallel outputs, backward recomputing the states, a
  reverse walk of the state cotangent, chunk-parallel gradients; the default elsewhere on a
  GPU, and on CPU in interpret mode.  Float32 at ``d = 128`` runs with ``wrap.F32_GPU_TILE``
  tiles of 64;
- ``"tpu"`` (``la_tpu.py``, Mosaic TPU): the same walks; the default on a TPU.
  Never run on TPU hardware: tested in interpret mode and checked to lower only.

``dg`` follows by autodiff of the chunk-local cumulative log-decay (``wrap.chunk_log_decay``,
floored at ``wrap.LOG_DECAY_FLOOR`` so that a reset ``g = -inf`` stays finite).  Inputs other
than all-bf16 run in float32 on the walks; ``T`` is zero-padded to the chunk, ``d`` to a power of
two >= 16 and ``dv`` to the value tile (to 64 for Mosaic GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core.checks import check_gate, check_qkv
from hla_jax.kernels import mosaic_gpu, wrap
from hla_jax.kernels.la import la_mgpu, la_walks

BACKENDS = ("mosaic_gpu", "triton", "tpu")
# the walks' tuning (la_walks.prepare): value tiles of 64 forward and 128 backward, the forward as the
# states walk plus chunk-parallel outputs (the fastest setting in the kernel benchmarks)
WALK_TUNING = dict(block_v=64, block_v_bwd=128, parallel_forward=True)


def la_pallas(q, k, v, g=None, *, initial_state=None, return_final_state=False, chunk_size=64,
              backend=None, interpret=None):
    """First-order gated linear attention via Pallas (see the module docstring).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``), or None (no decay).
        initial_state: ``H0 [B,H,d,dv]`` to continue, or None (zeros).
        return_final_state: also return the state after the row.
        chunk_size: a power of two >= 16 (64 for Mosaic GPU).
        backend: None (the platform's default, module docstring) | "mosaic_gpu" | "triton" |
            "tpu".
        interpret: None runs compiled on GPU/TPU and in interpret mode on CPU.

    Returns:
        ``o [B,T,H,dv]`` float32, or ``(o, final_state [B,H,d,dv] float32)`` with
        ``return_final_state``.

    Raises:
        ValueError: naming the argument (shapes, dtypes, the sign of ``g``, ``chunk_size``,
            ``backend`` and what Mosaic GPU takes).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax.kernels import la_pallas
        >>> q = k = v = jnp.ones((1, 32, 1, 16))
        >>> la_pallas(q, k, v, -0.1 * jnp.ones((1, 32, 1)), chunk_size=16).shape
        (1, 32, 1, 16)
    """
    name = "la_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name)
    if initial_state is not None and jnp.shape(initial_state) != (B, H, d, dv):
        raise ValueError(f"{name}: initial_state must have shape [B,H,d,dv]={(B, H, d, dv)}, got "
                         f"{jnp.shape(initial_state)}")
    return la_kernel(q, k, v, g, initial_state=initial_state, return_final_state=return_final_state,
                     chunk_size=chunk_size, backend=backend, interpret=interpret)


def la_kernel(q, k, v, g, *, initial_state=None, return_final_state=False, chunk_size=64,
              backend=None, interpret=None):
    """``la_pallas`` on inputs it has checked (``g`` ``[B,T,H]`` or None): the ops' entry,
    which checks them itself."""
    name = "la_pallas"
    B, T, H, d = q.shape
    dv = v.shape[-1]
    gpu_default = "mosaic_gpu" if mosaic_gpu.supports(q, k, v, chunk_size) else "triton"
    backend = wrap.backend_choice(name, backend, BACKENDS, gpu_default)
    if backend == "mosaic_gpu":
        if not mosaic_gpu.takes(q, k, v, chunk_size):
            raise ValueError(
                f"{name}: backend='mosaic_gpu' takes 16-bit q, k, v of one dtype with head dim in "
                f"{mosaic_gpu.HEAD_DIMS} and chunk_size={mosaic_gpu.C}; got {q.dtype}/{k.dtype}/"
                f"{v.dtype}, d={d}, chunk_size={chunk_size!r} (backend='triton' takes any)")
        interpret = jax.default_backend() == "cpu" if interpret is None else interpret
        Tp, dvp = (-(-n // mosaic_gpu.C) * mosaic_gpu.C for n in (T, dv))
        o, hT = la_mgpu.core(
            wrap.pad(q, Tp, d), wrap.pad(k, Tp, d), wrap.pad(v, Tp, dvp),
            wrap.chunk_gate(g, B, H, Tp, mosaic_gpu.C), wrap.pad_state(initial_state, B, H, d, dvp),
            interpret=interpret)
    else:
        p = la_walks.prepare(q, k, v, g, chunk_size=chunk_size, interpret=interpret,
                             backend=backend, **WALK_TUNING)
        stateful = initial_state is not None or return_final_state
        h0 = wrap.pad_state(initial_state, B, H, p.q.shape[-1], p.v.shape[-1]) if stateful else None
        o, hT = la_walks.core(p.q, p.k, p.v, p.b, h0, p.cfg)
    o = o[:, :T, :, :dv]
    return (o, hT[..., :d, :dv]) if return_final_state else o
