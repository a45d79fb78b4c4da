"""Where one call of a kernel-benchmark method spends its time, kernel by kernel: a
``jax.profiler`` trace of the method at one shape, and a table of the device's kernel events in
it, each XLA fusion named by the JAX operation it came from.

    python -m experiments.kernels.profile_kernels --method gated_deltanet_pallas --T 8192
    python -m experiments.kernels.profile_kernels --method loglinear_gdn_blocks_ut --forward \\
        --trace_dir /tmp/trace                # keep the trace (TensorBoard / xprof, Perfetto UI)
    python -m experiments.kernels.profile_kernels --summary TRACE.json.gz --hlo HLO.txt

``--method`` is any method of ``bench_kernels.methods()``, run forward+backward
(``bench_kernels.fwd_bwd``; ``--forward``: the forward only) on ``bench_kernels.inputs`` (bf16,
``--shape`` H,d,dv, B·T = ``--tokens``), compiled and run once, then ``--calls`` times under
``jax.profiler.trace``. The table has one row per kernel of one call, in launch order: µs (the
mean over the calls), the running total, the grid (GPU), the HLO instruction's shape and the JAX
operation it came from. The kernel events are those of the trace's GPU processes on a GPU, and
the XLA thunks named after HLO instructions elsewhere, so the tool runs on a CPU too (where the
Pallas kernels run in their interpreters: their rows then say little). ``--out DIR`` also writes
``DIR/<name>.md`` and ``.json`` (with their provenance); ``--summary`` prints the table of a saved
Perfetto trace and the compiled module's text (``--hlo``).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import pathlib
import re
import tempfile

import jax

from experiments import common
from experiments.kernels import bench_kernels
from hla_jax.ops.common import matmul_precision


def _key(name: str) -> str:
    """An HLO instruction's name as kernels and thunks are named (``.`` and ``-`` as ``_``)."""
    return re.sub(r"[.\-]", "_", name)


def op_names(hlo: str) -> dict:
    """``{_key(instruction): (shape, JAX op name)}`` of an optimized HLO module's text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            shape = re.split(r" (?:fusion|custom-call)\(", m.group(2))[0]
            out.setdefault(_key(m.group(1)), (shape, op.group(1) if op else ""))
    return out


def kernels(events: list, hlo: str, calls: int) -> list[dict]:
    """One row per kernel of one call, in launch order, from a Perfetto trace's events holding
    ``calls`` identical calls: ``us`` (mean over the calls), ``name``, ``grid``, ``shape``, ``op``.
    Kernels: the events of the GPU processes when the trace has any, else the events named
    after an instruction of ``hlo``."""
    names = op_names(hlo)
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e.get("args", {}).get("name", "")}
    mine = (lambda e: e.get("pid") in gpu) if gpu else (lambda e: _key(e.get("name", "")) in names)
    run = sorted((e for e in events if e.get("ph") == "X" and mine(e)), key=lambda e: e["ts"])
    if not run or len(run) % calls:
        raise ValueError(f"profile_kernels: {len(run)} kernel events do not split into {calls} "
                         "identical calls")
    n = len(run) // calls
    rows = []
    for i, e in enumerate(run[:n]):
        grid = re.search(r"grid:(\S+)", e.get("args", {}).get("kernel_details", ""))
        shape, op = names.get(_key(e["name"]), ("", ""))
        rows.append({"us": sum(run[i + j * n]["dur"] for j in range(calls)) / calls,
                     "name": e["name"], "grid": grid.group(1) if grid else "", "shape": shape,
                     "op": op})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: the kernels in launch order with the running total, then the total."""
    total, body = 0.0, []
    for r in rows:
        total += r["us"]
        body.append([f"{r['us']:.1f}", f"{total:.0f}", r["name"][:40], r["grid"], r["shape"][:60],
                     r["op"][-90:]])
    return (common.markdown_table(["µs", "running µs", "kernel", "grid", "HLO shape", "JAX op"], body)
            + f"\n\n{len(rows)} kernels, {total / 1e3:.3f} ms a call\n")


def read_trace(path: str) -> list:
    """The events of a saved Perfetto trace (``*.json.gz``)."""
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile(method: str, B: int, T: int, shape, forward: bool = False, calls: int = 3,
            trace_dir: str = "") -> tuple[list[dict], str]:
    """``(rows, hlo)``: ``kernels`` of ``calls`` calls of ``method`` traced into ``trace_dir``
    (a temporary folder when empty), and the compiled module's text."""
    args = bench_kernels.inputs(B, T, shape)
    fn = bench_kernels.methods()[method]()
    f, args = (jax.jit(fn), args[:6]) if forward else (bench_kernels.fwd_bwd(fn), args)
    with matmul_precision(*args[:3]), tempfile.TemporaryDirectory() as tmp:
        compiled = f.lower(*args).compile()
        hlo = compiled.as_text()
        jax.block_until_ready(compiled(*args))
        with jax.profiler.trace(trace_dir or tmp, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        trace = sorted(glob.glob(f"{trace_dir or tmp}/**/*perfetto_trace.json.gz", recursive=True),
                       key=os.path.getmtime)[-1]
        return kernels(read_trace(trace), hlo, calls), hlo


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="gated_deltanet_pallas", choices=sorted(bench_kernels.methods()),
                   help="a method of bench_kernels")
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=65536, help="B·T (B = max(tokens // T, 1))")
    p.add_argument("--shape", default="16,128,128", help="H,d,dv")
    p.add_argument("--forward", action="store_true", help="the forward only")
    p.add_argument("--calls", type=int, default=3, help="traced calls, averaged")
    p.add_argument("--trace_dir", default="", help="keep the trace here (default: a temporary folder)")
    p.add_argument("--out", default="", help="also write <out>/<name>.{md,json}")
    p.add_argument("--name", default="", help="default: profile_<method>_T<T>[_fwd]")
    p.add_argument("--summary", metavar="TRACE", help="print the table of this saved trace (needs --hlo)")
    p.add_argument("--hlo", help="with --summary: the compiled module's text")
    a = p.parse_args(argv)
    if a.summary:
        if not a.hlo:
            p.error("--summary needs --hlo (the compiled module's text)")
        rows = kernels(read_trace(a.summary), pathlib.Path(a.hlo).read_text(), a.calls)
        print(table(rows))
        return rows
    B, shape = max(a.tokens // a.T, 1), bench_kernels.Shape(*(int(x) for x in a.shape.split(",")))
    rows, _ = profile(a.method, B, a.T, shape, a.forward, a.calls, a.trace_dir)
    head = (f"{jax.devices()[0].device_kind}: one {'forward' if a.forward else 'forward+backward'} "
            f"of {a.method}, bf16, B={B}, T={a.T}, H, d, dv = {tuple(shape)}, mean of {a.calls} calls")
    if a.out:
        name = a.name or f"profile_{a.method}_T{a.T}" + ("_fwd" if a.forward else "")
        common.write_json(pathlib.Path(a.out) / f"{name}.json", {
            "method": a.method, "pass": "fwd" if a.forward else "fwd_bwd", "B": B, "T": a.T,
            "shape": list(shape), "calls": a.calls, "kernels": rows})
        common.write_markdown(pathlib.Path(a.out) / f"{name}.md", head + "\n\n" + table(rows))
    print(head + "\n\n" + table(rows))
    return rows


if __name__ == "__main__":
    main()
