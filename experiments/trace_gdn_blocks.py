"""Where one forward+backward of log-linear Gated DeltaNet's block form (or of another benchmark
method, forward+backward or forward only) spends its time, kernel by kernel, from a profiler trace
(no hardware counters: the GPU's kernel events as the profiler records them), each XLA fusion
named by the JAX operation it came from.

    python experiments/trace_gdn_blocks.py [--method loglinear_gdn_blocks_ut] [--forward]
                                           [--T 8192] [--tokens 65536] [--shape 16,128,128]
                                           [--calls 3] [--name …] [--out DIR]
    python experiments/trace_gdn_blocks.py --summary TRACE.json.gz --hlo HLO.txt [--calls 3]

The gradient is ``bench_kernels.fwd_bwd`` of ``--method`` (one of ``bench_kernels.methods()``;
the default ``ops.loglinear_gdn_blocks.blocks(terms="kernel")``; with ``--forward`` the method
itself) on ``bench_kernels.inputs`` (bf16, H, d, dv of ``--shape``, B·T = ``--tokens``), compiled
and run once, then ``--calls`` times under ``jax.profiler.trace``.  Writes ``<out>/<name>.md`` (one row
per kernel in launch order: µs per call averaged over the calls, the running total, the grid,
the HLO operation's shape and JAX name) and ``<out>/<name>.json``; ``--summary`` prints that
table for a saved Perfetto trace and the compiled module's text.  Needs a GPU.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def op_names(hlo: str) -> dict:
    """``{instruction name as kernels are named ('.' and '-' as '_'): (shape, JAX op name)}`` of
    an optimized HLO module's text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            shape = re.split(r" (?:fusion|custom-call)\(", m.group(2))[0]
            out.setdefault(re.sub(r"[.\-]", "_", m.group(1)), (shape, op.group(1) if op else ""))
    return out


def kernels(events: list, hlo: str, calls: int) -> list[dict]:
    """One row per kernel of one call, in launch order, from a Perfetto trace's events holding
    ``calls`` identical calls: ``us`` (mean over the calls), ``name``, ``grid``, ``shape``,
    ``op``."""
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e.get("args", {}).get("name", "")}
    run = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu),
                 key=lambda e: e["ts"])
    if not run or len(run) % calls:
        raise ValueError(f"trace_gdn_blocks: {len(run)} GPU kernel events do not split into "
                         f"{calls} identical calls")
    n, names = len(run) // calls, op_names(hlo)
    rows = []
    for i, e in enumerate(run[:n]):
        details = e.get("args", {}).get("kernel_details", "")
        grid = re.search(r"grid:(\S+)", details)
        shape, op = names.get(e["name"], ("", ""))
        rows.append({"us": sum(run[i + j * n]["dur"] for j in range(calls)) / calls,
                     "name": e["name"], "grid": grid.group(1) if grid else "", "shape": shape,
                     "op": op})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: the kernels in launch order with the running total, then the total."""
    from experiments.common import markdown_table

    total, body = 0.0, []
    for r in rows:
        total += r["us"]
        body.append([f"{r['us']:.1f}", f"{total:.0f}", r["name"][:40], r["grid"], r["shape"][:60],
                     r["op"][-90:]])
    return (markdown_table(["µs", "running µs", "kernel", "grid", "HLO shape", "JAX op"], body)
            + f"\n\n{len(rows)} kernels, {total / 1e3:.2f} ms a call\n")


def _trace(path: str) -> list:
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def run(a) -> list[dict]:
    import jax

    from experiments.bench_kernels import fwd_bwd, inputs, methods, micro_size
    from hla_jax.ops import common

    if jax.default_backend() != "gpu":
        raise SystemExit("trace_gdn_blocks: needs a GPU (the trace's kernel events)")
    B, T, shape = micro_size(a)
    args = inputs(B, T, shape)
    fn = methods()[a.method]()
    if a.forward:
        f, args = jax.jit(fn), args[:6]
    else:
        f = fwd_bwd(fn)
    with common.matmul_precision(*args[:3]):
        f = f.lower(*args).compile()
        hlo = f.as_text()
        jax.block_until_ready(f(*args))
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                for _ in range(a.calls):
                    jax.block_until_ready(f(*args))
            events = _trace(glob.glob(f"{tmp}/**/*perfetto_trace.json.gz", recursive=True)[0])
    rows = kernels(events, hlo, a.calls)
    os.makedirs(a.out, exist_ok=True)
    head = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, B={B}, T={T}, "
            f"H, d, dv = {tuple(shape)}: one {'forward' if a.forward else 'forward+backward'} of "
            f"{a.method}, mean of {a.calls} calls\n\n")
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(head + table(rows))
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "method": a.method,
                   "pass": "fwd" if a.forward else "fwd_bwd", "B": B, "T": T,
                   "shape": list(shape), "calls": a.calls, "kernels": rows}, f, indent=1)
    return rows


def main(argv=None):
    from experiments.bench_kernels import methods, micro_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    micro_args(p, "trace_gdn_blocks_gpu")
    p.add_argument("--method", default="loglinear_gdn_blocks_ut", choices=sorted(methods()),
                   help="a method of bench_kernels.py")
    p.add_argument("--forward", action="store_true", help="trace the forward only")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--summary", metavar="TRACE", help="print the table of this saved trace")
    p.add_argument("--hlo", help="with --summary: the compiled module's text")
    a = p.parse_args(argv)
    if a.summary:
        if not a.hlo:
            p.error("--summary needs --hlo (the compiled module's text)")
        print(table(kernels(_trace(a.summary), pathlib.Path(a.hlo).read_text(), a.calls)))
    else:
        print(table(run(a)))


if __name__ == "__main__":
    main()
