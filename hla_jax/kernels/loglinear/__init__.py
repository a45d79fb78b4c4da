"""Log-linear Mamba-2: ``loglinear_mamba2_pallas`` and its backends (Triton, Mosaic TPU) over one
chunk math, and the kernel settings both log-linear kernels share."""
