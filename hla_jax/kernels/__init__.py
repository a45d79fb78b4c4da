"""Pallas kernels (``gpu/``: Triton lowering for NVIDIA; ``tpu/``: Mosaic TPU, interpret-tested)."""

from hla_jax.kernels.hla2 import hla2_pallas

__all__ = ["hla2_pallas"]
