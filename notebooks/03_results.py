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
# # Results: kernels, LM throughput, MQAR, long-context LMs, loss by position, NIAH
#
# Everything here is read from `experiments/results/` (written by the experiment scripts,
# `python -m experiments.NAME`); nothing is trained or timed in this notebook. A result file
# that does not exist yet is named with the command that produces it. `docs/results.md` presents
# the same files with their devices, dates and commits.

# %%
import io
import json
import pathlib
import sys

from IPython.display import Image, Markdown, display

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir())
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"

from experiments import common, long_context, mqar, niah, plot_kernels, position_loss  # noqa: E402


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


def markdown(path):
    """Display a results table (``.md``) or check log (``.txt``) as it was written."""
    text = path.read_text()
    display(Markdown(text if path.suffix == ".md" else f"```text\n{text}```"))


# %% [markdown]
# ## Kernel speed
#
# GPU (H200): our Pallas kernels against cuDNN attention and the `jax-linear-attention` wheel's
# kernels, forward / forward+backward ms at a fixed token budget, one table per benchmark run
# (`python -m experiments.kernels.bench_kernels`), and the time against T of the methods the
# docs compare (`python -m experiments.plot_kernels`).

# %%
for path in load("kernels_bench*.json", "python -m experiments.kernels.bench_kernels"):
    display(Markdown(f"### {path.name}"))
    markdown(path.with_suffix(".md"))
if all((RESULTS / f).exists() for f, _ in plot_kernels.PANELS.values()):
    show(plot_kernels.plot({title: (f, json.loads((RESULTS / f).read_text()), methods)
                            for title, (f, methods) in plot_kernels.PANELS.items()}))

# %% [markdown]
# The kernels against float64 references on the GPU (`python -m experiments.kernels.check_kernels_gpu`):
# every case's verdict per file.

# %%
for path, res in load("kernels_check_gpu*.json", "python -m experiments.kernels.check_kernels_gpu").items():
    cases = res["cases"]
    print(f"{path.name}: {sum(c['passed'] for c in cases)} of {len(cases)} cases pass "
          f"({', '.join(sorted({c['case']['kernel'] for c in cases}))})")

# %% [markdown]
# ## LM throughput
#
# ~150M-parameter byte LMs at context 8192 (`python -m experiments.train_throughput`): every row
# of each device's file; the rows measured together share `run`.

# %%
for path, res in load("train_throughput_*.json", "python -m experiments.train_throughput").items():
    ok = [r for r in res["rows"] if "tokens_per_s" in r]
    name = lambda r: r["mixer"] + ("" if r.get("pack", True) else " (plain rows)")  # noqa: E731
    display(Markdown(f"### {path.name}\n\n" + common.markdown_table(
        ["mixer", "steps", "run", "params", "tokens/s", "MFU", "peak GiB"],
        [[name(r), r["steps"], r.get("run") or "–", f"{r['params'] / 1e6:.1f}M",
          f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%", f"{r['peak_bytes'] / 2**30:.1f}"]
         for r in ok])))

# %% [markdown]
# ## MQAR
#
# Zoology's protocol on the H200, one model per (mixer, dim, lr) on all pair counts: accuracy at
# the best of four learning rates, next to the log-linear paper's numbers (`experiments/mqar.py`
# says how those are read), one file per model dim.

# %%
for path, res in load("mqar_*.json", "python -m experiments.mqar --mixture").items():
    display(Markdown(f"### {path.name}\n\n" + mqar.tables(res)))
    show(mqar.plot(res))

# %% [markdown]
# ## Long-context language modelling
#
# One recipe for every mixer (`configs/lm.py size=30m`, trained at T=4096), evaluated at twice
# the training length: loss by position, code NIAH at T and 2T, the retrieval gain (decoy needle
# minus true needle), and the training curves.

# %%
for path, res in load("long_context_*.json", "python -m experiments.long_context").items():
    display(Markdown(f"### {path.name}\n\n" + long_context.table(res)))
    show(long_context.plot(res))

# %% [markdown]
# ## Loss by position and needle retrieval

# %%
for path, res in load("position_loss_*.json", "python -m experiments.position_loss --train").items():
    display(Markdown(f"### {path.name}\n\n" + position_loss.table(res)))
    show(position_loss.plot(res))

# %%
for path, res in load("niah_*.json", "python -m experiments.niah --train").items():
    display(Markdown(f"### {path.name}\n\n" + niah.table(res)))
    show(niah.plot(res))

# %% [markdown]
# ## CPU costs of the chunked forms, and prefill
#
# Forward+backward time and peak memory of every operator's chunked form
# (`python -m experiments.bench_ops`), and a long prompt's prefill in one parallel pass against
# the serial recurrence (`python -m experiments.bench_prefill`).

# %%
for path, res in load("bench_ops_*.json", "python -m experiments.bench_ops").items():
    if "jla_s" in res["rows"][0]:  # against jax-linear-attention (python -m experiments.bench_ops --jla)
        display(Markdown(f"### {path.name}\n\n" + path.with_suffix(".md").read_text()))
        continue
    display(Markdown(f"### {path.name}: {res['device']}, jax {res['jax']}, {res['cpu_count']} cores\n\n"
                     + common.markdown_table(
                         ["op", "B", "H", "T", "d", "median s", "peak MiB", "× plain (time / memory)"],
                         [[r["op"], r["B"], r["H"], r["T"], r["d"], f"{r['median_s']:.3f}",
                           f"{r['peak_bytes'] / 2**20:.0f}",
                           f"{r['time_ratio_to_plain']:.2f} / {r['memory_ratio_to_plain']:.2f}"
                           if "time_ratio_to_plain" in r else ""] for r in res["rows"]])))

# %%
for path in load("bench_prefill_*.json", "python -m experiments.bench_prefill"):
    display(Markdown(f"### {path.name}"))
    markdown(path.with_suffix(".md"))

# %% [markdown]
# ## Corpus preparation
#
# MB/s of `python -m hla_jax.data.prepare` on the embedded corpus with the byte tokenizer and a
# 32k byte-level BPE (`python -m experiments.bench_prepare`).

# %%
for path in load("bench_prepare_*.json", "python -m experiments.bench_prepare"):
    display(Markdown(f"### {path.name}"))
    markdown(path.with_suffix(".md"))
