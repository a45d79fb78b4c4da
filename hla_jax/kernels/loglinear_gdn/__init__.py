"""Log-linear Gated DeltaNet: ``loglinear_gated_deltanet_pallas`` and its backends (Triton,
Mosaic TPU) over one chunk math, and the kernel parts of its block form (``gdn_blocks``)."""
