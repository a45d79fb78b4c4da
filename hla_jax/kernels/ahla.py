"""``ahla_pallas``: asymmetric second-order HLA (SPEC §2) through Pallas kernels, differentiable.

Same semantics as ``hla_jax.ops.ahla``: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay
``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]`` float32, divided by
``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator with ``v = 1``, run as
a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).

Same design as ``hla2_pallas`` (plumbing in ``kernels/wrap.py``): one program per (batch, head,
value tile) walks the chunks with the float32 state ``(P, E)``, both ``d×bv``, on chip
(``kernels/ahla_chunk.py``); ``jax.custom_vjp`` whose backward re-runs the forward to save every
chunk's incoming state, then walks the chunks in reverse.  The NVIDIA path (``kernels/gpu/walk``,
Triton) passes the H200 check in bf16 (``experiments/check_kernels_gpu.py``; float32 inputs at
``d = 128`` exceed Triton's shared memory there); the TPU path
(``kernels/tpu/walk``, Mosaic) is tested in interpret mode and checked to lower only: no TPU was
available.
"""

from __future__ import annotations

from hla_jax.kernels.wrap import pallas_operator


def ahla_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=None, num_warps=8, num_warps_bwd=None, platform=None,
                parallel_forward=False):
    """Asymmetric second-order HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``chunk_size`` (a power of two >= 16), ``block_v``/``block_v_bwd`` (value tiles, powers of two
    >= 16), ``num_warps`` (Triton) and ``platform`` ("gpu" | "tpu"; default from
    ``jax.default_backend()``) tune the kernels; ``interpret=None`` runs compiled on GPU/TPU and
    in interpret mode on CPU.
    """
    return pallas_operator("ahla", q, k, v, g, normalize=normalize, eps=eps,
                           chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                           block_v_bwd=block_v_bwd, num_warps=num_warps,
                           num_warps_bwd=num_warps_bwd, platform=platform,
                           parallel_forward=parallel_forward)
