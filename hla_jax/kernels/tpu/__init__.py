"""Pallas kernels for TPU (Mosaic); tested in interpret mode only, no TPU was available."""
