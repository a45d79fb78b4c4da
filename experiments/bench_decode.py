"""Decoding at long context: tokens/s and memory per sequence of the ~150M LM, every mixer.

    python -m experiments.bench_decode                  # 8K, 32K, 128K prompts; batch 1 and 32
    python -m experiments.bench_decode --mixers softmax,hla2 --prompts 32768 --batch 1
    python -m experiments.bench_decode --size tiny --prompts 64,128 --new_tokens 8 --batch 1,2

Each (mixer, prompt length P, batch B) row builds the LM of ``configs/lm.py`` at the size of
``experiments.train_throughput`` (d_model 1024, 12 layers, 8 heads of 128, bf16 compute;
``--size tiny``: the config's tiny model) with every layer that mixer and random weights (speed
does not depend on them), held in the compute dtype as for inference (``--cast_weights 0``:
float32, as trained). It prefills a ``[B, P]`` prompt of random bytes (``LM.prefill``: one
parallel pass, ``impl=--impl``; softmax through cuDNN attention on a GPU) and then decodes
``--new_tokens`` greedy tokens with ``LM.step`` in one jitted ``fori_loop`` (``hla_jax.nn.generate``'s
loop; softmax's step reads its KV cache, preallocated to ``P + new_tokens``). Prefill and
decode are compiled first and timed separately (``block_until_ready``; the median of
``--repeats`` runs after a warm-up run). Recorded per row: decode tokens/s
(``B · new_tokens / decode seconds``), prefill seconds, the decode state per sequence (the
bytes of ``model.init_cache(B, P + new_tokens)`` over ``B``), on a GPU the peak device memory
(``memory_stats``), and the kernels per decode step (launching instructions of the loop body in
XLA's optimised program: with the step time it says whether a step is launch-bound).

Rows run one per child process (``--isolate 1``, the default: each row's own peak memory, an
out-of-memory row recorded as OOM, and a hard stop at ``--budget_s`` seconds). Each finished row
is appended to ``<out>/bench_decode_<tag>.jsonl`` (with its call's provenance) and rows already
there or in ``bench_decode_<tag>.json`` are skipped, so the same command, repeated, resumes until
every row exists; then ``bench_decode_<tag>.{json,md,png}`` are written (the json takes the
rows; the jsonl is removed): decode tokens/s and the ratio to softmax for every cell, where each
mixer's tokens/s crosses softmax's (log-log interpolation between prompt lengths) and the ratio
at ``--ratio_at`` against ``--target``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments import common
from hla_jax.nn import LM, ModelConfig, param_count
from hla_jax.nn.decoding import sample_token

MIXERS = ("softmax,mamba2,loglinear_mamba2,gated_deltanet,loglinear_gated_deltanet,linear,hla2,"
          "ahla,hla3")
# size -> (configs/lm.py size, model overrides): "150m" is experiments.train_throughput's LM
SIZES = {"150m": ("small", {"d_model": 1024, "n_layers": 12, "n_heads": 8}), "tiny": ("tiny", {})}
# settings a JSONL's rows must share to be resumed (the row keys are mixer, prompt, batch)
SHARED = ("size", "new_tokens", "repeats", "impl", "cast_weights")
FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
            "opt-barrier", "partition-id", "replica-id"}


def model_config(size: str, mixer: str, max_len: int, impl: str):
    """The ``ModelConfig`` of ``size`` with every layer ``mixer``, long enough for ``max_len``
    tokens: softmax's ``max_seq_len`` and the log-linear mixers' ``num_levels``
    (``max_len <= 2**(num_levels - 1)``)."""
    name, overrides = SIZES[size]
    c = common.get_config("lm", f"mixer={mixer},size={name}")
    c.model.update(**overrides, impl=impl, max_seq_len=max(c.model.max_seq_len, max_len),
                   num_levels=max(c.model.num_levels, (max_len - 1).bit_length() + 1))
    return ModelConfig.from_dict(c.model.to_dict())


def tree_bytes(tree) -> int:
    """Bytes of the arrays (or shape structs) of ``tree``."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def kernels_per_step(hlo: str) -> int:
    """Kernel launches per iteration of the outermost loop of an optimised HLO module: the
    instructions of its body and condition that run on the device (fusions, library calls,
    copies, ...; tuples, parameters and constants are free), through calls and nested loops
    (counted once)."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$", line)
        if head:
            current = comps.setdefault("ENTRY" if head.group(1) else head.group(2), [])
        elif current is not None and " = " in line:
            op = re.search(r"= .*?([a-z][\w\-]*)\(", line)
            if op:
                current.append((op.group(1), line))

    def called(line):
        return [c for c in re.findall(r"%([\w.\-]+)", line) if c in comps]

    def count(name):
        n = 0
        for op, line in comps.get(name, []):
            if op == "conditional":  # one branch runs
                n += max((count(c) for c in called(line)), default=0)
            elif op in ("while", "call"):
                n += sum(count(c) for c in called(line))
            elif op not in FREE_OPS:
                n += 1
        return n

    loops = [line for op, line in comps.get("ENTRY", []) if op == "while"]
    return max((sum(count(c) for c in called(line)) for line in loops), default=count("ENTRY"))


def is_oom(e: Exception) -> bool:
    """Whether ``e`` is XLA running out of device memory (at compile or run time)."""
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def median_run(fn, runs: int):
    """``(median seconds of runs 2..runs, the last result)`` of ``fn()``, each run to
    ``block_until_ready``; the first run warms up."""
    times, out = [], None
    for _ in range(runs):
        out = None  # the previous result (a prefill's cache) is freed before the next is made
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]), out


def measure(a, mixer: str, prompt: int, batch: int) -> dict:
    """One row (module docstring) in this process: ``status`` "ok", or "oom" with the stage
    (prefill or decode) that did not fit."""
    N = a.new_tokens
    # the decode runs continue one another: positions up to prompt + (repeats + 1) · N
    cfg = model_config(a.size, mixer, prompt + (a.repeats + 1) * N, a.impl)
    model = LM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    if a.cast_weights:
        state = jax.tree.map(lambda x: x.astype(cfg.compute_dtype)
                             if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    cache_shapes = jax.eval_shape(lambda: model.init_cache(batch, prompt + N))
    device = jax.devices()[0]
    row = {"mixer": mixer, "prompt": prompt, "batch": batch, **{k: getattr(a, k) for k in SHARED},
           "params": param_count(model), "num_levels": cfg.num_levels,
           "state_bytes_per_seq": tree_bytes(cache_shapes) // batch,
           "device": device.device_kind, "platform": device.platform,
           "device_count": jax.device_count()}

    def prefill(state, tokens):
        m = nnx.merge(graphdef, state)
        logits, cache = m.prefill(tokens, m.init_cache(batch, prompt + N))
        return logits[:, -1], cache

    def decode(state, logits, cache, pos):
        """``N`` greedy tokens after ``logits [B,V]`` from ``cache`` at slot ``pos``: the tokens
        ``[B,N]``, the last logits and the cache."""
        m = nnx.merge(graphdef, state)

        def body(i, carry):
            logits, cache, out = carry
            tok = sample_token(logits, None, 0.0)  # greedy
            logits, cache = m.step(tok, cache, pos + i)
            return logits, cache, out.at[:, i].set(tok)

        logits, cache, out = jax.lax.fori_loop(
            0, N, body, (logits, cache, jnp.zeros((batch, N), jnp.int32)))
        return out, logits, cache

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt)),
                         jnp.int32)
    pos = jnp.int32(prompt)
    stage = "prefill"
    try:
        t = time.perf_counter()
        prefill_c = jax.jit(prefill).lower(state, tokens).compile()
        row["prefill_compile_s"] = time.perf_counter() - t
        row["prefill_s"], (logits, cache) = median_run(lambda: prefill_c(state, tokens), a.repeats + 1)
        row["prefill_tokens_per_s"] = batch * prompt / row["prefill_s"]
        stage = "decode"
        t = time.perf_counter()
        # the cache is donated: updated in place, never copied (softmax's is most of the memory)
        decode_c = jax.jit(decode, donate_argnums=2).lower(state, logits, cache, pos).compile()
        row["decode_compile_s"] = time.perf_counter() - t
        row["kernels_per_step"] = kernels_per_step(decode_c.as_text())

        def run_decode():  # each run continues from the cache the previous one returned
            nonlocal cache
            out, _, cache = decode_c(state, logits, cache, pos)
            return out

        row["decode_s"], _ = median_run(run_decode, a.repeats + 1)
    except Exception as e:  # noqa: BLE001 - out-of-memory becomes a row, anything else propagates
        if not is_oom(e):
            raise
        return row | {"status": "oom", "oom_stage": stage, "oom_error": str(e).splitlines()[0][:300],
                      "peak_bytes": peak_bytes(device)}
    return row | {"status": "ok", "tokens_per_s": batch * N / row["decode_s"],
                  "step_ms": 1e3 * row["decode_s"] / N,
                  "peak_bytes": peak_bytes(device)}


def peak_bytes(device) -> int | None:
    """The process's peak device memory (None where the backend keeps no statistics: CPU)."""
    return (device.memory_stats() or {}).get("peak_bytes_in_use")


# -- the sweep: rows in child processes, the JSONL, the budget ---------------------------------
def child(a, mixer: str, prompt: int, batch: int, timeout: float) -> dict:
    """``measure`` in a ``python -m experiments.bench_decode --one`` process: its row; a
    ``{"status": "timeout"}`` row when killed after ``timeout`` seconds; RuntimeError with the
    log's tail when it fails otherwise."""
    cmd = [sys.executable, "-m", "experiments.bench_decode", "--one", f"{mixer},{prompt},{batch}",
           *(f"--{k}={getattr(a, k)}" for k in SHARED)]
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # JAX's default pool is 75%
    try:
        proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mixer": mixer, "prompt": prompt, "batch": batch, "status": "timeout",
                "timeout_s": round(timeout)}
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if proc.returncode or not rows:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-8:])
        raise RuntimeError(f"{mixer} P={prompt} B={batch} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(rows[-1][4:])


def read_rows(stem, a) -> dict:
    """``{(mixer, prompt, batch): row}``: the rows of ``<stem>.json`` (a finished grid), then
    those of ``<stem>.jsonl`` (rows of the grid in progress); SystemExit when any row was measured
    with other ``SHARED`` settings."""
    done, progress = stem.with_suffix(".json"), stem.with_suffix(".jsonl")
    found = common.read_json(done).get("rows", [])
    found += [json.loads(line) for line in progress.read_text().splitlines()] if progress.exists() else []
    rows = {}
    for r in found:
        other = {k: r[k] for k in SHARED if k in r and r[k] != getattr(a, k)}
        if other:
            raise SystemExit(f"{stem}.json(l) holds rows measured with {other}: use another --tag "
                             "or --out")
        rows[(r["mixer"], r["prompt"], r["batch"])] = r
    return rows


def append_row(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def sweep(a, grid, stem) -> dict:
    """Measure the rows of ``grid`` not yet in ``stem``'s files, appending each to
    ``<stem>.jsonl`` with this call's provenance, until ``--budget_s``; returns every row."""
    rows = read_rows(stem, a)
    todo = [key for key in grid if key not in rows]
    prov = common.provenance(device=not a.isolate)  # the parent leaves the device to its rows
    t0 = time.perf_counter()
    for i, key in enumerate(tqdm(todo, desc="decode rows", dynamic_ncols=True)):
        left = a.budget_s - (time.perf_counter() - t0) if a.budget_s else None
        if left is not None and left <= 0:
            print(f"--budget_s {a.budget_s:.0f} spent: {len(todo) - i} rows left for the next call",
                  flush=True)
            break
        row = child(a, *key, timeout=left) if a.isolate else measure(a, *key)
        if row["status"] == "timeout" and i > 0:  # cut by the budget: the next call retries it
            print(f"--budget_s {a.budget_s:.0f} spent during {key}: {len(todo) - i} rows left "
                  "for the next call", flush=True)
            break
        devices = {r["device"] for r in rows.values() if "device" in r}
        if "device" in row and devices and row["device"] not in devices:
            raise SystemExit(f"{stem}.json(l) holds rows measured on {sorted(devices)}, this "
                             f"device is {row['device']!r}: use another --tag or --out")
        row["provenance"] = prov
        append_row(stem.with_suffix(".jsonl"), row)
        rows[key] = row
        tqdm.write(f"{key}: {row['status']}" + (f", {row['tokens_per_s']:.0f} tokens/s"
                                                 if row["status"] == "ok" else ""))
    return rows


# -- the results: ratios to softmax, crossings, tables, plot ------------------------------------
def kilo(n: int) -> str:
    """8192 -> "8K", 131072 -> "128K", 100 -> "100"."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def ratio(rows, mixer, prompt, batch) -> float | None:
    """``mixer``'s decode tokens/s over softmax's at one prompt and batch: inf where softmax did
    not fit and ``mixer`` did, None where ``mixer`` has no speed."""
    r, s = rows[(mixer, prompt, batch)], rows[("softmax", prompt, batch)]
    if r["status"] != "ok":
        return None
    return r["tokens_per_s"] / s["tokens_per_s"] if s["status"] == "ok" else math.inf


def crossing(prompts, ratios) -> tuple[float | None, str]:
    """Where a mixer's tokens/s first reaches softmax's (ratio >= 1) over ascending ``prompts``:
    ``(prompt length, text)``, the length interpolated log-log between the last prompt below and
    the first at or above (``None`` with "≤ P" when already there at the shortest, "> P" when
    never, and when the ratios on either side are not both finite)."""
    for i, (p, r) in enumerate(zip(prompts, ratios)):
        if r is None or r < 1:
            continue
        below = ratios[i - 1] if i else None
        if below is None or math.isinf(r):
            return None, (f"≤ {kilo(p)}" if below is None else f"{kilo(prompts[i - 1])}–{kilo(p)}")
        lo, hi = math.log(prompts[i - 1]), math.log(p)
        at = math.exp(lo + (hi - lo) * -math.log(below) / (math.log(r) - math.log(below)))
        return at, f"≈ {at / 1024:.1f}K" if at >= 1024 else f"≈ {at:.0f}"
    return None, f"> {kilo(prompts[-1])}"


def summary(a, rows) -> dict:
    """``{mixer: {batch: {"crossing", "crossing_text", "ratio_at", "softmax_oom_at",
    "meets_target"}}}`` (``ratio_at``: None where either did not fit)."""
    out = {}
    for m in a.mixers:
        if m == "softmax":
            continue
        for b in a.batch:
            rs = [ratio(rows, m, p, b) for p in a.prompts]
            at, text = crossing(a.prompts, rs)
            r = rs[a.prompts.index(a.ratio_at)] if a.ratio_at in a.prompts else None
            out.setdefault(m, {})[str(b)] = {
                "crossing": at, "crossing_text": text,
                "ratio_at": None if r is None or math.isinf(r) else r,
                "softmax_oom_at": r is not None and math.isinf(r),
                "meets_target": None if r is None else r >= a.target}
    return out


def cell(rows, m, p, b) -> str:
    r = rows[(m, p, b)]
    if r["status"] != "ok":
        return r["status"].upper() + (f" ({r['oom_stage']})" if "oom_stage" in r else "")
    x = ratio(rows, m, p, b)
    return f"{r['tokens_per_s']:,.0f}" + ("" if m == "softmax" else
                                          " (softmax OOM)" if math.isinf(x) else f" ({x:.2f}×)")


def gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.1f}"


def markdown(a, rows, summ, device: str) -> str:
    cols = [(b, p) for b in a.batch for p in a.prompts]
    heads = [f"B={b} P={kilo(p)}" for b, p in cols]
    params = {m: rows[(m, a.prompts[0], a.batch[0])].get("params") for m in a.mixers}
    ref = ("" if a.ratio_at not in a.prompts else
           f" and the ratio at {kilo(a.ratio_at)} (target ≥ {a.target:g}×)")
    text = [
        f"Decoding {a.new_tokens} greedy tokens after a [B, P] prompt, {device}: the {a.size} LM "
        f"({', '.join(sorted({f'{v / 1e6:.1f}M' for v in params.values() if v}))} parameters, "
        f"random weights{', held in the compute dtype' if a.cast_weights else ''}), "
        f"impl={a.impl}, median of {a.repeats} runs after a warm-up.",
        "", "Decode tokens/s (× softmax at the same B and P):", "",
        common.markdown_table(["mixer", *heads], [[m, *(cell(rows, m, p, b) for b, p in cols)]
                                                  for m in a.mixers]),
        "", f"Where each mixer's decode tokens/s reaches softmax's (log-log interpolation){ref}:", "",
        common.markdown_table(
            ["mixer", *(f"B={b} crosses at" for b in a.batch),
             *(f"B={b} × at {kilo(a.ratio_at)}" for b in a.batch if a.ratio_at in a.prompts)],
            [[m, *(summ[m][str(b)]["crossing_text"] for b in a.batch),
              *("softmax OOM" if s["softmax_oom_at"] else "–" if s["ratio_at"] is None else
                f"{s['ratio_at']:.2f}" + (" ✓" if s["meets_target"] else "")
                for b in a.batch if a.ratio_at in a.prompts for s in [summ[m][str(b)]])]
             for m in a.mixers if m != "softmax"]),
        "", "Decode step: ms, kernels per step (launching instructions of the loop body in XLA's "
        "optimised program), µs per kernel:", "",
        common.markdown_table(["mixer", *heads], [[m, *(step_cell(rows[(m, p, b)]) for b, p in cols)]
                                                  for m in a.mixers]),
        "", "Prefill seconds (prompt tokens/s):", "",
        common.markdown_table(["mixer", *heads], [[m, *(prefill_cell(rows[(m, p, b)]) for b, p in cols)]
                                                  for m in a.mixers]),
        "", "Decode state per sequence (MiB) at each P; peak device memory (GiB) at each B, P:", "",
        common.markdown_table(
            ["mixer", *(f"state P={kilo(p)}" for p in a.prompts), *(f"peak {h}" for h in heads)],
            [[m, *(f"{rows[(m, p, a.batch[0])]['state_bytes_per_seq'] / 2**20:,.1f}"
                   if "state_bytes_per_seq" in rows[(m, p, a.batch[0])] else "–" for p in a.prompts),
              *(gib(rows[(m, p, b)].get("peak_bytes")) for b, p in cols)] for m in a.mixers]),
    ]
    return "\n".join(text)


def step_cell(r) -> str:
    if r["status"] != "ok":
        return r["status"].upper()
    k = r["kernels_per_step"]
    return f"{r['step_ms']:.2f} · {k} · {1e3 * r['step_ms'] / k:.1f}"


def prefill_cell(r) -> str:
    if "prefill_s" not in r:
        return r["status"].upper()
    return f"{r['prefill_s']:.3g} ({r['prefill_tokens_per_s']:,.0f})"


def plot(a, rows, path):
    fig, axes = common.figure(ncols=len(a.batch), figsize=(5.5 * len(a.batch), 4.2))
    for ax, b in zip(axes, a.batch):
        for m in a.mixers:
            pts = [(p, rows[(m, p, b)]["tokens_per_s"]) for p in a.prompts
                   if rows[(m, p, b)]["status"] == "ok"]
            if pts:
                style = dict(color="black", linestyle="--", linewidth=2) if m == "softmax" else {}
                ax.loglog(*zip(*pts), marker="o", label=m, **style)
        ax.set_xticks(a.prompts, [kilo(p) for p in a.prompts])
        ax.minorticks_off()
        ax.set(title=f"batch {b}", xlabel="prompt tokens", ylabel="decode tokens/s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    common.save(fig, path)


def write_results(a, rows, stem) -> str:
    """The json, md and png of a complete grid; returns the Markdown."""
    grid_rows = {(m, p, b): rows[(m, p, b)] for b in a.batch for p in a.prompts for m in a.mixers}
    first = next((r for r in grid_rows.values() if "device" in r), {})
    prov = common.provenance(device=not a.isolate)  # the parent leaves the device to its rows
    prov.update({k: first[k] for k in ("device", "platform", "device_count") if k in first})
    summ = summary(a, grid_rows)
    settings = {k: getattr(a, k) for k in (*SHARED, "mixers", "prompts", "batch", "ratio_at", "target")}
    # rows of earlier grids (other mixers, prompts or batches) stay in the file after this grid's
    others = [r for key, r in rows.items() if key not in grid_rows]
    common.write_json(stem.with_suffix(".json"), {"settings": settings, "summary": summ,
                                                  "rows": [*grid_rows.values(), *others]}, prov)
    plot(a, grid_rows, stem.with_suffix(".png"))
    return common.write_markdown(stem.with_suffix(".md"),
                                 markdown(a, grid_rows, summ, first.get("device", "?")), prov)


def ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"--{flag} must be a comma list of positive ints, got {text!r}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixers", default=MIXERS, help="comma list; softmax first (the reference)")
    p.add_argument("--size", default="150m", help=f"one of {tuple(SIZES)}")
    p.add_argument("--prompts", default="8192,32768,131072", help="prompt lengths, comma list")
    p.add_argument("--batch", default="1,32", help="batch sizes, comma list")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up run")
    p.add_argument("--impl", default="auto", help="operator impl (model.impl) of the prefill")
    p.add_argument("--cast_weights", type=int, default=1,
                   help="1: weights in the compute dtype (inference); 0: float32 (as trained)")
    p.add_argument("--budget_s", type=float, default=420,
                   help="seconds: no row starts after it and a row still running is stopped "
                        "(retried by the next call); 0 = no limit")
    p.add_argument("--isolate", type=int, default=1,
                   help="1: each row in its own process (own peak memory, OOM contained, hard "
                        "budget); 0: in this process (CPU smoke runs; budget checked between rows)")
    p.add_argument("--ratio_at", type=int, default=32768, help="prompt length of the reported ratio")
    p.add_argument("--target", type=float, default=5.0, help="ratio to softmax at --ratio_at")
    p.add_argument("--tag", default="", help="results name: bench_decode_<tag> (default: --size)")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.size not in SIZES:
        raise SystemExit(f"--size must be one of {tuple(SIZES)}, got {a.size!r}")
    a.prompts, a.batch = sorted(set(ints(a.prompts, "prompts"))), ints(a.batch, "batch")
    if a.new_tokens < 1 or a.repeats < 1:
        raise SystemExit(f"--new_tokens and --repeats must be >= 1, got {a.new_tokens}, {a.repeats}")
    if a.one:
        mixer, prompt, batch = a.one.split(",")
        print("ROW " + json.dumps(measure(a, mixer, int(prompt), int(batch))), flush=True)
        return None
    a.mixers = a.mixers.split(",")
    unknown = [m for m in a.mixers if m not in MIXERS.split(",")]
    if unknown or a.mixers[0] != "softmax":
        raise SystemExit(f"--mixers must start with softmax and name mixers of {MIXERS}, "
                         f"got {','.join(a.mixers)}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_decode_{a.tag or a.size}"
    # fastest comparisons first: every mixer at the smallest batch and prompt, then larger ones
    grid = [(m, p, b) for b in a.batch for p in a.prompts for m in a.mixers]
    rows = sweep(a, grid, stem)
    missing = [key for key in grid if key not in rows]
    if missing:
        print(f"{len(grid) - len(missing)} of {len(grid)} rows in {stem}.jsonl: run the same "
              "command again to continue", flush=True)
        return None
    md = write_results(a, rows, stem)
    stem.with_suffix(".jsonl").unlink(missing_ok=True)  # its rows are in the json now
    print(md)
    return md


if __name__ == "__main__":
    main()
