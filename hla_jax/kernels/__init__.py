"""Pallas kernels (``gpu/``: Triton and Mosaic GPU for NVIDIA; ``tpu/``: Mosaic TPU,
interpret-tested).  ``linear_attention_pallas`` and ``mamba2_pallas`` (the kernels of
``ops.linear_attention`` / ``ops.mamba2``, ``impl="pallas"``) are ``la_pallas``."""

from hla_jax.kernels.ahla import ahla_pallas
from hla_jax.kernels.hla2 import hla2_pallas
from hla_jax.kernels.hla3 import hla3_pallas
from hla_jax.kernels.la import la_pallas
from hla_jax.kernels.loglinear import loglinear_mamba2_pallas
from hla_jax.kernels.loglinear_gdn import loglinear_gated_deltanet_pallas

linear_attention_pallas = mamba2_pallas = la_pallas

__all__ = ["ahla_pallas", "hla2_pallas", "hla3_pallas", "la_pallas", "linear_attention_pallas",
           "loglinear_gated_deltanet_pallas", "loglinear_mamba2_pallas", "mamba2_pallas"]
