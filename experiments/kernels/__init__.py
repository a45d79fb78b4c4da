"""Kernel-development tools: the kernel benchmark (``bench_kernels``), the GPU correctness check
(``check_kernels_gpu``) and a per-kernel profiler (``profile_kernels``), each run as
``python -m experiments.kernels.NAME``."""
