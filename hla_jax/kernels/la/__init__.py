"""First-order scalar-gated linear attention (LA, the Mamba-2 SSD core): ``la_pallas`` and its
backends (Mosaic GPU, Triton, Mosaic TPU) over one chunk math."""
