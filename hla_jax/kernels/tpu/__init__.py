"""Pallas kernels for TPU (Mosaic); never run on TPU hardware, tested in interpret mode only."""
