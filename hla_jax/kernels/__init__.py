"""Pallas kernels, one package per family, each with its entry (a ``jax.custom_vjp`` over its
backends), its chunk math and its backends (Mosaic GPU and Triton for NVIDIA, Mosaic TPU,
interpret-tested): first-order gated linear attention ``la_pallas`` (``la/``; the kernel of
``ops.linear_attention`` / ``ops.mamba2`` with ``impl="pallas"`` and of the HLA operators'
Pallas chains, ``ops.chains``), first-order Gated DeltaNet ``gated_deltanet_pallas`` (``gdn/``)
and the log-linear kernels (``loglinear/``, ``loglinear_gdn/``).  Each ``*_pallas`` entry checks
its inputs and calls its ``*_kernel`` twin, which the operators call on inputs they have
checked.  Shared: ``wrap`` (backend choice, launch settings, padding), ``mosaic_gpu``,
``triton`` and ``mosaic_tpu`` (each backend's helpers)."""

from hla_jax.kernels.gdn.gdn_entry import gated_deltanet_kernel, gated_deltanet_pallas
from hla_jax.kernels.la.la_entry import la_kernel, la_pallas
from hla_jax.kernels.loglinear.loglinear_entry import loglinear_mamba2_kernel, loglinear_mamba2_pallas
from hla_jax.kernels.loglinear_gdn.loglinear_gdn_entry import (
    loglinear_gated_deltanet_kernel,
    loglinear_gated_deltanet_pallas,
)

__all__ = ["gated_deltanet_kernel", "gated_deltanet_pallas", "la_kernel", "la_pallas",
           "loglinear_gated_deltanet_kernel", "loglinear_gated_deltanet_pallas",
           "loglinear_mamba2_kernel", "loglinear_mamba2_pallas"]
