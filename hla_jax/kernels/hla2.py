"""``hla2_pallas``: second-order HLA (SPEC §1) through Pallas kernels, differentiable.

Same semantics as ``hla_jax.ops.hla2``: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay
``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]`` float32, divided by
``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator with ``v = 1``, run as
a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).

Design (see DESIGN.md "Kernels", layout (a); plumbing in ``kernels/wrap.py``): one program per
(batch, head, value tile) walks the chunks in order with the float32 state ``(S, U = S C − G)``
on chip (``kernels/hla2_chunk.py``), so no per-chunk state touches HBM in the forward.
``jax.custom_vjp``: the forward keeps only its inputs; the backward re-runs the forward kernel to
write every chunk's incoming state (recompute, transient: these states exist only inside the
backward), then a reverse kernel walks the chunks with the cotangent state ``(dS, dU)``.  Gates
enter as the per-chunk cumulative log-decay ``b``; ``dg`` follows by autodiff of that cumulative
sum.

Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (``kernels/gpu/walk.py``, Triton lowering) passes the H200 check in bf16; float32 inputs at
``d = 128`` exceed Triton's shared memory there (smaller ``d`` were checked with an earlier
version).  The TPU path (``kernels/tpu/walk.py``, Mosaic) is tested in interpret mode only: no
TPU was available.  Inputs other than bf16 run in
float32; ``d`` is zero-padded to a power of two >= 16 and ``dv`` to a multiple of the value
tile, ``T`` to a multiple of ``chunk_size`` (a power of two >= 16).
"""

from __future__ import annotations

from hla_jax.kernels.wrap import pallas_operator


def hla2_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=None, num_warps=8, num_warps_bwd=None, platform=None,
                parallel_forward=False):
    """Second-order masked HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    ``chunk_size`` (a power of two >= 16), ``block_v``/``block_v_bwd`` (value tiles, powers of two
    >= 16), ``num_warps`` (Triton) and ``platform`` ("gpu" | "tpu"; default from
    ``jax.default_backend()``) tune the kernels; ``interpret=None`` runs compiled on GPU/TPU and
    in interpret mode on CPU.
    """
    return pallas_operator("hla2", q, k, v, g, normalize=normalize, eps=eps,
                           chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                           block_v_bwd=block_v_bwd, num_warps=num_warps,
                           num_warps_bwd=num_warps_bwd, platform=platform,
                           parallel_forward=parallel_forward)
