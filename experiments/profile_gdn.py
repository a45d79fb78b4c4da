"""Hardware counters of the Gated DeltaNet kernel's five steps on a Hopper GPU, through Nsight
Compute: each step (``ut_fwd``, ``walk_out``, ``walk_rev``, ``grads``, ``ut_bwd``) compiled and
run once, then run again between ``cuProfilerStart`` and ``cuProfilerStop`` so that ncu counts
only the second set (``--profile-from-start off``)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \\
    ncu --profile-from-start off --clock-control none --csv --page details \\
        --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section WarpStateStats python3 experiments/profile_gdn.py > ncu_gdn.csv
    python experiments/profile_gdn.py --summary ncu_gdn.csv   # a markdown table of it

Without the two variables ncu saves and restores the whole preallocated pool at every replay
pass and did not finish one kernel in 200 s.  Inputs as ``bench_gdn_parts.py`` (bf16, H=16,
d=dv=128) at ``--tokens`` (default 16,384: a quarter of the benchmark's, each kernel is replayed
once per counter pass).
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

STEPS = ("ut_fwd", "walk_out", "walk_rev", "grads", "ut_bwd")
METRICS = (("Duration", "µs", 1e-3), ("Registers Per Thread", "regs", 1),
           ("Local Memory Spilling Requests", "spill requests", 1), ("Grid Size", "grid", 1),
           ("Theoretical Occupancy", "occupancy %", 1), ("DRAM Throughput", "DRAM %", 1),
           ("Issue Slots Busy", "issue %", 1), ("Warp Cycles Per Issued Instruction",
                                                "cycles/issue", 1))


def run(tokens: int, T: int):
    """The five steps twice, the second set between the profiler's start and stop."""
    import jax

    from experiments.bench_gdn_parts import steps as gdn_steps
    from experiments.bench_kernels import Shape

    steps = [gdn_steps(max(tokens // T, 1), T, Shape())[0][name] for name in STEPS]
    for f, a in steps:
        jax.block_until_ready(f(*a))
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    for call, args in ((cu.cuDevicePrimaryCtxRetain, (ctypes.byref(ctx), 0)),
                       (cu.cuCtxSetCurrent, (ctx,)), (cu.cuProfilerStart, ())):
        if status := call(*args):
            raise RuntimeError(f"profile_gdn: {call.__name__} failed with CUDA status {status}")
    for f, a in steps:
        jax.block_until_ready(f(*a))
    cu.cuProfilerStop()


def _number(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 or x.is_integer() else f"{x:.3g}"


def summary(path: str) -> str:
    """A markdown table of ncu's ``--csv --page details`` output: one row per step (the kernels
    that are not XLA's own fusions, in launch order)."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    by_id, names = collections.defaultdict(dict), {}
    for r in rows:
        by_id[r["ID"]][r["Metric Name"]] = r["Metric Value"].replace(",", "")
        names[r["ID"]] = r["Kernel Name"]
    ours = [i for i in by_id if "fusion" not in names[i]]
    if len(ours) != len(STEPS):
        raise ValueError(f"profile_gdn: expected {len(STEPS)} kernels of ours in {path}, found "
                         f"{len(ours)}: {[names[i] for i in ours]}")
    from experiments.common import markdown_table

    return markdown_table(
        ["step", "kernel", *(h for _, h, _ in METRICS)],
        [[step, names[i], *(_number(float(by_id[i][m]) * s) if m in by_id[i] else "–"
                            for m, _, s in METRICS)] for step, i in zip(STEPS, ours)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", metavar="CSV", help="print a table of this ncu CSV and stop")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--T", type=int, default=8192)
    a = p.parse_args(argv)
    if a.summary:
        print(summary(a.summary))
    else:
        run(a.tokens, a.T)


if __name__ == "__main__":
    main()
