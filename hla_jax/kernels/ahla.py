"""``ahla_pallas``: asymmetric second-order HLA (SPEC §2) through Pallas kernels, differentiable.

Same semantics as ``hla_jax.ops.ahla``: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g`` a log-decay
``[B,T,H]``, ``[H]`` or ``None``; returns ``[B,T,H,dv]`` float32, divided by
``clamp_signed(den, eps)`` when ``normalize`` (``den`` is the same operator with ``v = 1``, run as
a second kernel call on a 16-wide value tile ``[1, 0, …, 0]``).

Same design as ``hla2_pallas`` (kernels in ``kernels/gpu/walk.py``, plumbing in
``kernels/wrap.py``): the float32 state ``(P, E)``, both ``d×bv``, per value tile
(``kernels/ahla_chunk.py``); AHLA is linear in its states, so the reverse walk carries only
their cotangents, then every chunk's gradients are computed at once.  Defaults (one walk for
the forward, ``block_v_bwd=64``) are the fastest measured on the H200 at T=8192.  The NVIDIA
path (Triton) passes the H200 check in bf16 and float32 (``experiments/check_kernels_gpu.py``;
float32 at ``d >= 128`` with tiles capped at ``wrap.F32_GPU_TILE``); the TPU path
(``kernels/tpu/walk``, Mosaic) is tested in interpret mode and checked to lower only: no TPU was
available.
"""

from __future__ import annotations

from hla_jax.kernels.wrap import CHECKPOINT_EVERY, pallas_operator


def ahla_pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, interpret=None,
                block_v=64, block_v_bwd=64, num_warps=8, num_warps_bwd=None, platform=None,
                parallel_forward=False, checkpoint_every=CHECKPOINT_EVERY):
    """Asymmetric second-order HLA via Pallas (see the module docstring), ``[B,T,H,dv]`` float32.

    The tuning arguments are those of ``hla2_pallas`` (defaults: the fastest on the H200).
    """
    return pallas_operator("ahla", q, k, v, g, normalize=normalize, eps=eps,
                           chunk_size=chunk_size, interpret=interpret, block_v=block_v,
                           block_v_bwd=block_v_bwd, num_warps=num_warps,
                           num_warps_bwd=num_warps_bwd, platform=platform,
                           parallel_forward=parallel_forward,
                           checkpoint_every=checkpoint_every)
