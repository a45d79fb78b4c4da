"""Shared pieces of the Pallas kernels lowered through Triton for NVIDIA GPUs."""

from __future__ import annotations

from jax.experimental.pallas import triton as plgpu


def compiler_params(num_warps, interpret):
    """Triton's settings of a ``pallas_call``: ``num_warps`` warps, one pipeline stage (None in
    interpret mode)."""
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
