"""The experiments: scripts run as ``python -m experiments.NAME`` from the repository root, each
writing its results (JSON with their provenance, a Markdown table, a plot) to
``experiments/results/``. ``experiments.kernels`` holds the kernel-development tools."""
