"""Pallas kernels (``gpu/``: Triton lowering for NVIDIA; ``tpu/``: Mosaic TPU, interpret-tested)."""

from hla_jax.kernels.ahla import ahla_pallas
from hla_jax.kernels.hla2 import hla2_pallas
from hla_jax.kernels.hla3 import hla3_pallas
from hla_jax.kernels.loglinear import loglinear_mamba2_pallas
from hla_jax.kernels.loglinear_gdn import loglinear_gated_deltanet_pallas

__all__ = ["ahla_pallas", "hla2_pallas", "hla3_pallas", "loglinear_gated_deltanet_pallas",
           "loglinear_mamba2_pallas"]
