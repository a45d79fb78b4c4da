"""Pallas kernels (``gpu/``: Triton and Mosaic GPU for NVIDIA; ``tpu/``: Mosaic TPU,
interpret-tested): first-order gated linear attention ``la_pallas`` (the kernel of
``ops.linear_attention`` / ``ops.mamba2``, ``impl="pallas"``, hence the aliases
``linear_attention_pallas`` and ``mamba2_pallas``, and of the HLA operators' Pallas chains,
``ops.chains``), first-order Gated DeltaNet ``gated_deltanet_pallas`` (Mosaic GPU) and the
log-linear kernels."""

from hla_jax.kernels.gdn import gated_deltanet_pallas
from hla_jax.kernels.la import la_pallas
from hla_jax.kernels.loglinear import loglinear_mamba2_pallas
from hla_jax.kernels.loglinear_gdn import loglinear_gated_deltanet_pallas

linear_attention_pallas = mamba2_pallas = la_pallas

__all__ = ["gated_deltanet_pallas", "la_pallas", "linear_attention_pallas", "loglinear_gated_deltanet_pallas",
           "loglinear_mamba2_pallas", "mamba2_pallas"]
