"""First-order Gated DeltaNet: ``gated_deltanet_pallas`` and its backends (Mosaic GPU, Mosaic
TPU) over one chunk math."""
