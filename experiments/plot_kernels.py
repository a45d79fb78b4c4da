"""Kernel time against sequence length, from kernel-benchmark results: one panel per results
file (the methods of one run, so the ratios between lines are measured in one process), median
forward+backward ms against T at a fixed B·T, log-log.

    python -m experiments.plot_kernels          # PANELS: the three benchmark files of the docs
    python -m experiments.plot_kernels --files kernels_bench.json --out /tmp/kernels.png

Only methods ``experiments.kernels.bench_kernels`` knows are drawn (a results file may hold rows
of other methods). Writes ``--out`` (default ``experiments/results/kernels_time_vs_T.png``).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from matplotlib.ticker import FuncFormatter, NullLocator

from experiments import common
from experiments.kernels import bench_kernels

# title -> (file, the methods drawn from it: None = every method bench_kernels knows)
PANELS = {
    "LA kernel and HLA chains": ("kernels_bench.json", (
        "cudnn_causal", "jla_simple_gla", "mamba2_pallas", "hla2_pallas", "ahla_pallas",
        "hla3_pallas")),
    "log-linear Mamba-2": ("kernels_bench_loglinear_targets_2.json", (
        "cudnn_causal", "jla_simple_gla", "mamba2_pallas", "loglinear_mamba2_pallas")),
    "Gated DeltaNet": ("kernels_bench_gdn_split.json", (
        "jla_gated_deltanet", "gated_deltanet_pallas", "loglinear_gdn_blocks_ut")),
}
LABELS = {  # method -> (legend, colour)
    "cudnn_causal": ("cuDNN causal attention", "tab:gray"),
    "jla_simple_gla": ("jla simple_gla", "tab:olive"),
    "jla_gated_deltanet": ("jla gated_deltanet", "tab:cyan"),
    "mamba2_pallas": ("ours: LA kernel (Mamba-2)", "tab:blue"),
    "hla2_pallas": ("ours: hla2 chain", "tab:orange"),
    "ahla_pallas": ("ours: ahla chain", "tab:green"),
    "hla3_pallas": ("ours: hla3 chain", "tab:red"),
    "loglinear_mamba2_pallas": ("ours: log-linear Mamba-2", "tab:purple"),
    "gated_deltanet_pallas": ("ours: Gated DeltaNet", "tab:brown"),
    "loglinear_gdn_blocks_ut": ("ours: log-linear Gated DeltaNet", "tab:pink"),
}


def plot(panels: dict):
    """``{title: (file name, bench_kernels result, methods or None)}`` -> a Figure, one panel
    each."""
    known = bench_kernels.methods()
    fig, axes = common.figure(len(panels), figsize=(5.2 * len(panels), 4.4))
    for ax, (title, (name, res, methods)) in zip(axes, panels.items()):
        for method in methods or dict.fromkeys(r["method"] for r in res["rows"]):
            pts = sorted((r["T"], r["fwd_bwd_ms"]) for r in res["rows"]
                         if r["method"] == method and "fwd_bwd_ms" in r)
            if method in known and pts:
                label, colour = LABELS.get(method, (method, None))
                ax.plot(*zip(*pts), marker="o", color=colour, label=label,
                        ls="--" if method.startswith(("jla", "cudnn")) else "-")
        Ts = sorted({r["T"] for r in res["rows"]})
        ax.set(xscale="log", yscale="log", xlabel=f"T (B·T = {res['tokens']})",
               ylabel="forward+backward ms", title=f"{title}\n({name})")
        ax.set_xticks(Ts, [str(T) for T in Ts])
        ax.xaxis.set_minor_locator(NullLocator())
        for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_format(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:g}"[0] in "1235" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = next(iter(panels.values()))[1]
    fig.suptitle(f"{first['device']}, bf16, H={first['H']}, d={first['d']}, dv={first['dv']}: median "
                 "forward+backward ms (dashed: baselines; each panel one run)", fontsize=9)
    return fig


def main(argv=None) -> pathlib.Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="", help="comma-separated bench_kernels JSONs (names under "
                   "--results, or paths), one panel each with every method (default: PANELS)")
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--out", default=str(common.RESULTS / "kernels_time_vs_T.png"))
    a = p.parse_args(argv)
    spec = ({f: (f, None) for f in a.files.split(",") if f} if a.files else PANELS)
    panels = {}
    for title, (f, methods) in spec.items():
        path = pathlib.Path(f) if pathlib.Path(f).exists() else pathlib.Path(a.results) / f
        panels[title] = (path.name, json.loads(path.read_text()), methods)
    common.save(plot(panels), a.out)
    print(f"written {a.out}")
    return pathlib.Path(a.out)


if __name__ == "__main__":
    main()
