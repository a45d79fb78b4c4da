"""``hla2_pallas``: second-order HLA (SPEC §1) through Pallas kernels, differentiable.

Same semantics as ``hla_jax.ops.hla2``: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay
``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]`` float32, divided by
``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator with ``v = 1``, run as
a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).

Design (DESIGN.md "Kernels"; the five kernels in ``kernels/gpu/walk.py``, plumbing in
``kernels/wrap.py``, one chunk in ``kernels/hla2_chunk.py``): the forward is a walk over the
chunks (one program per batch, head and value tile, the float32 state ``(S, U = S C − G)`` on
chip), by default split into a ``states`` walk and chunk-parallel ``outputs``
(``parallel_forward``).  ``jax.custom_vjp``: the forward keeps only its inputs; the backward
re-runs the ``states`` walk (every chunk's incoming state, transient), walks the chunks in
reverse with the cotangent state ``(dS, dU)`` only (which does not depend on the states: HLA2 is
linear in them), then computes every chunk's ``dq, dk, dv, db`` at once, in its own value tile
(``block_v_bwd``); beyond ``checkpoint_every`` chunks (default 1024) it does so segment by
segment from float32 state checkpoints, holding per-chunk states for one segment only.
Defaults (``block_v=64``, ``block_v_bwd=128``, ``parallel_forward=True``) are the fastest
forward+backward measured on the H200 at T=8192 (``experiments/bench_kernels.py --tune``).
Gates enter as the per-chunk cumulative log-decay ``b``; ``dg`` follows by autodiff of that
cumulative sum.

Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (``kernels/gpu/walk.py``, Triton lowering) passes the H200 check in bf16 and float32;
float32 inputs at ``d >= 128`` run there with chunk and value tiles capped at
``wrap.F32_GPU_TILE`` (32 for hla2: the bf16 tiles exceed Triton's shared memory).  The TPU
path (``kernels/tpu/walk.py``, Mosaic) is tested in interpret mode only: no TPU was available.
Inputs other than bf16 run in float32; ``d`` is zero-padded to a power of two >= 16 and ``dv``
to a multiple of the value tile, ``T`` to a multiple of ``chunk_size`` (a power of two >= 16).
"""

from __future__ import annotations

from hla_jax.kernels.wrap import CHECKPOINT_EVERY, pallas_operator


def hla2_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=128, num_warps=8, num_warps_bwd=None, platform=None,
                parallel_forward=True, checkpoint_every=CHECKPOINT_EVERY):
    """Second-order masked HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``chunk_size`` (a power of two >= 16), ``block_v``/``block_v_bwd`` (value tiles, powers of two
    >= 16), ``parallel_forward`` (``states`` walk + chunk-parallel outputs), ``num_warps``
    (Triton) and ``platform`` ("gpu" | "tpu"; default from ``jax.default_backend()``) tune the
    kernels; ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.
    ``checkpoint_every`` (chunks, or None for one segment) bounds the backward's per-chunk
    states to one segment of a longer sequence, at the price of one more state walk.
    """
    return pallas_operator("hla2", q, k, v, g, normalize=normalize, eps=eps,
                           chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                           block_v_bwd=block_v_bwd, num_warps=num_warps,
                           num_warps_bwd=num_warps_bwd, platform=platform,
                           parallel_forward=parallel_forward,
                           checkpoint_every=checkpoint_every)
