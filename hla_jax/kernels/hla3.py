"""``hla3_pallas``: causal third-order HLA (SPEC §3, ``mask="causal"``) through Pallas kernels,
differentiable.

Same semantics as ``hla_jax.ops.hla3(..., mask="causal")``: ``q, k: [B,T,H,d]``,
``v: [B,T,H,dv]``, ``g`` a log-decay ``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]``
float32, divided by ``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator
with ``v = 1``, run as a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).
The ``paper`` semantics has no kernel.

Same design as ``hla2_pallas`` (kernels in ``kernels/gpu/walk.py``, plumbing in
``kernels/wrap.py``): the float32 state ``S: d×d`` (shared by all value tiles, each recomputes
it) and ``P, F: d×bv`` (``kernels/hla3_chunk.py``).  ``F``'s update is bilinear in ``S`` and
``P``, so the reverse walk of the cotangent state ``(dS + dSᵀ, dP, dF)`` reads the saved states
(``wrap.BILINEAR``); then every chunk's gradients are computed at once.  Defaults
(``parallel_forward=True``, ``block_v_bwd=128``) are the fastest measured on the H200 at
T=8192.  The NVIDIA path (Triton) passes the H200 check in bf16 and float32 (float32 at
``d >= 128`` with chunk and value tiles of 16, ``wrap.F32_GPU_TILE``: Triton's shared memory);
the TPU path (``kernels/tpu/walk``, Mosaic) is tested in interpret mode only: no TPU was
available.
"""

from __future__ import annotations

from hla_jax.kernels.wrap import CHECKPOINT_EVERY, pallas_operator


def hla3_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=128, num_warps=8, num_warps_bwd=None, platform=None,
                parallel_forward=True, checkpoint_every=CHECKPOINT_EVERY):
    """Causal third-order HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    The tuning arguments are those of ``hla2_pallas`` (defaults: the fastest on the H200).
    """
    return pallas_operator("hla3", q, k, v, g, normalize=normalize, eps=eps,
                           chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                           block_v_bwd=block_v_bwd,
                           num_warps=num_warps, num_warps_bwd=num_warps_bwd, platform=platform,
                           parallel_forward=parallel_forward,
                           checkpoint_every=checkpoint_every)
