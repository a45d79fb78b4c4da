"""Pallas kernels lowered through Triton for NVIDIA GPUs."""
