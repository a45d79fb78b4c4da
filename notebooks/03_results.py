# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Results: MQAR, kernel benchmarks, long-context LMs, loss by position, NIAH
#
# Everything here is read from `experiments/results/` (written by the scripts in
# `experiments/`); nothing is trained or timed in this notebook. A result file that does not
# exist yet is named with the command that produces it.

# %%
import io
import json
import pathlib
import sys

import matplotlib.pyplot as plt
from IPython.display import Image, Markdown, display

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir())
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"

from experiments import common, long_context, mqar, niah, position_loss  # noqa: E402


def load(pattern, command):
    """``{path: json}`` of the result files matching ``pattern``; one line naming ``command``
    when there are none yet."""
    paths = sorted(p for p in RESULTS.glob(pattern) if ".shard" not in p.name)
    if not paths:
        print(f"{pattern}: not produced yet; run `{command}`")
    return {p: json.loads(p.read_text()) for p in paths}


def show(fig):
    """Display a pyplot-free ``matplotlib.figure.Figure`` (what the experiment scripts return)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    display(Image(buf.getvalue()))


# %% [markdown]
# ## MQAR
#
# Accuracy per query at the best learning rate, next to the log-linear paper's numbers
# (see `experiments/mqar.py` for how those are read). `mqar_h200` is the H200 sweep at 2000
# steps (all 27 cells); `mqar_h200_hla_conv` the linear and HLA mixers with a short conv;
# `mqar_h200_hla_decay` hla2 with a learned decay; `mqar_zoology_*` Zoology's budget with early
# stopping (`mqar_zoology_mix_bf16`, `_d32`, `_d16`: bf16, one lr, d=64, 32, 16); `mqar_probe_*` cut short;
# `mqar_cpu_*` and `mqar_h200_probe` are small pipeline checks, not the paper's setup.

# %%
for path, res in load("mqar_*.json", "python experiments/mqar.py").items():
    display(Markdown(f"### {path.name}\n\n" + mqar.tables(res)))
    show(mqar.plot(res))

# %% [markdown]
# ## Kernel benchmarks
#
# GPU (H200): our Pallas kernels against our XLA chunked paths, cuDNN attention and the `jla`
# wheel's kernels, forward / forward+backward ms at a fixed token budget.

# %%
for res in load("kernels_bench.json", "python experiments/bench_kernels.py").values():
    md = RESULTS / "kernels_bench.md"
    display(Markdown(md.read_text() if md.exists() else res["note"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in res["rows"]):
        pts = sorted((r["T"], r["fwd_bwd_ms"]) for r in res["rows"]
                     if r["method"] == method and "fwd_bwd_ms" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=method)
    ax.set(xscale="log", yscale="log", xlabel="T (B·T fixed)", ylabel="fwd+bwd ms",
           title=f"{res['device']}, {res['dtype']}, H={res['H']}, d={res['d']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plt.show()

# %% [markdown]
# ## Training throughput
#
# ~150M-parameter byte LMs at context 8192, 100 steps each (`experiments/train_throughput.py`).

# %%
for res in load("train_throughput_*.json", "python experiments/train_throughput.py").values():
    ok = [r for r in res["rows"] if "tokens_per_s" in r]
    name = lambda r: r["mixer"] + ("" if r.get("pack", True) else " (plain rows)")  # noqa: E731
    display(Markdown(common.markdown_table(
        ["mixer", "params", "tokens/s", "MFU", "peak GiB", "final loss"],
        [[name(r), f"{r['params'] / 1e6:.1f}M", f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%",
          f"{r['peak_bytes'] / 2**30:.1f}", f"{r['final_loss']:.3f}"] for r in ok])))
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([name(r) for r in ok], [r["tokens_per_s"] for r in ok])
    ax.set(xlabel=f"tokens/s ({ok[0]['device']}, T={ok[0]['seq_len']})")
    ax.invert_yaxis()
    plt.show()

# %% [markdown]
# CPU (2 cores): each operator's chunked form, median seconds of one forward.

# %%
for res in load("bench_ops_cpu.json", "python experiments/bench_ops.py").values():
    rows = res["rows"]
    table = common.markdown_table(
        ["op", "B", "H", "T", "d", "median s", "peak MB"],
        [[r["op"], r["B"], r["H"], r["T"], r["d"], f"{r['median_s']:.3f}",
          f"{r.get('peak_bytes', 0) / 2**20:.0f}"] for r in rows])
    display(Markdown(f"{res['device']}, jax {res['jax']}, {res['cpu_count']} cores\n\n{table}"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh([f"{r['op']} (T={r['T']}, H={r['H']})" for r in rows], [r["median_s"] for r in rows])
    ax.set(xlabel="median s")
    ax.invert_yaxis()
    plt.show()

# %% [markdown]
# ## Long-context language modelling
#
# One recipe for every mixer (`configs/lm.py size=30m`, trained at T=4096), evaluated at twice
# the training length: loss by position, code NIAH at T and 2T, the retrieval gain (decoy needle
# minus true needle), and the training curves.

# %%
for path, res in load("long_context_*.json", "python experiments/long_context.py").items():
    display(Markdown(f"### {path.name}\n\n" + long_context.table(res)))
    show(long_context.plot(res))

# %% [markdown]
# ## Loss by position and needle retrieval

# %%
for path, res in load("position_loss_*.json", "python experiments/position_loss.py --train").items():
    display(Markdown(f"### {path.name}\n\n" + position_loss.table(res)))
    show(position_loss.plot(res))

# %%
for path, res in load("niah_*.json", "python experiments/niah.py --train").items():
    display(Markdown(f"### {path.name}\n\n" + niah.table(res)))
    show(niah.plot(res))
