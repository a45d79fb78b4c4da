"""Training throughput of ~150M-parameter byte LMs at long context, one mixer per process.

    python -m experiments.train_throughput                          # softmax, hla2, mamba2
    python -m experiments.train_throughput --mixers softmax,hla2,mamba2,ahla,loglinear_mamba2
    python -m experiments.train_throughput --mixers hla2 --seq_len 16384 --batch 2 --steps 100
    python -m experiments.train_throughput --budget 270 --timeout 200   # fits an 8-minute slot

Each mixer trains ``--steps`` steps of ``configs/lm.py`` (d_model 1024, 12 layers, 8 heads of
128, bf16 compute, float32 parameters and optimizer state) on the embedded corpus, in its own
process (``python -m experiments.train_throughput --one MIXER`` from the repository root, so peak
memory is per mixer), with ``model.impl = --impl`` ("auto": the Pallas kernels
on a GPU for bf16, ``ops.spec.kernels_preferred``). Recorded: tokens/s and MFU from the trainer's
meter (the first step, with its compilation, excluded; MFU from ``hla_jax.nn.flops_per_token``
against the bf16 dense peak), peak device memory, final loss. ``--budget`` seconds: no new mixer
starts after it. Results: ``experiments/results/train_throughput_<device>.json``, rewritten after
every mixer (rows of other mixers from earlier runs are kept); each row carries ``run``, the UTC
start of its invocation, so the rows measured together (one process at a time on one device) are
the ones that share it, and its ``provenance`` (commit, device and this command); the printed
table gives each row's ratio to that run's softmax.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from experiments import common

DEFAULT_MIXERS = "softmax,hla2,mamba2"


def run_one(a) -> dict:
    """Train one mixer in this process and return its measurements."""
    import jax
    from flax import nnx

    from hla_jax.nn import LM, ModelConfig, param_count
    from hla_jax.train.trainer import train_and_evaluate

    c = common.get_config("lm", f"mixer={a.one},size=small")
    c.model.update(d_model=a.d_model, n_layers=a.layers, n_heads=a.d_model // 128,
                   max_seq_len=max(a.seq_len, 2048), impl=a.impl)
    c.data.update(seq_len=a.seq_len, batch_size=a.batch, pack=bool(a.pack))
    c.optim.update(warmup_steps=10)
    common.apply_set(c, a.set)
    c.train.update(num_steps=a.steps, log_every=max(a.steps // 2, 1), eval_every=0, eval_steps=0,
                   sample_tokens=0, checkpoint_every=0, async_checkpoint=False, progress_bar=True,
                   tensorboard=False)
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        out = train_and_evaluate(c, workdir)
        wall = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    cfg = ModelConfig.from_dict(c.model.to_dict())
    params = param_count(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))))
    return {"mixer": a.one, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps,
            "d_model": a.d_model, "layers": a.layers, "impl": a.impl, "pack": bool(a.pack),
            "set": list(a.set),
            "params": params,
            "tokens_per_s": out["train"]["tokens_per_s"], "mfu": out["train"]["mfu"],
            "final_loss": out["train"]["loss"], "peak_bytes": stats.get("peak_bytes_in_use"),
            "wall_s": wall, "device": jax.devices()[0].device_kind,
            "provenance": common.provenance()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixers", default=DEFAULT_MIXERS)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--impl", default="auto", help="operator impl (model.impl), e.g. pallas")
    p.add_argument("--pack", type=int, default=1,
                   help="1: packed documents (configs/lm.py's default: segment_ids, which the "
                        "log-linear mixers run on slower paths than whole rows); 0: plain rows")
    p.add_argument("--set", default=[], action="append", metavar="KEY=VALUE",
                   help="config override for every mixer, e.g. model.hla_conv=false (repeatable)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mixer")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds; no new mixer starts after it (0 = no limit)")
    p.add_argument("--logdir", default="", help="per-mixer logs (default: a temporary folder)")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run_one(a)), flush=True)
        return
    rows, path, table = [], None, []
    logdir = a.logdir or tempfile.mkdtemp(prefix="train_throughput_")
    os.makedirs(logdir, exist_ok=True)
    mixers = a.mixers.split(",")
    t_start, run = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for i, mixer in enumerate(mixers):
        if a.budget and time.perf_counter() - t_start > a.budget:
            print(f"budget of {a.budget:.0f} s spent: {', '.join(mixers[i:])} not run", flush=True)
            break
        row = dict(train(mixer, a, logdir), run=run)
        if "provenance" in row:  # the child's commit and device, this (the parent's) command
            row["provenance"]["command"] = common.command_line()
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
        path, table = save(rows, a.out) or (None, rows)
    print("\n".join(["", "| mixer | params | tokens/s | × softmax (same run) | MFU | peak GiB | final loss |",
                     "|---|---|---|---|---|---|---|", *(line(r, table) for r in table)]))
    print(f"written {path or 'nothing (no mixer succeeded)'}; per-mixer logs in {logdir}")


def train(mixer, a, logdir) -> dict:
    """Run ``mixer`` in its own process; its result row, or an error row with the log's tail."""
    cmd = [sys.executable, "-m", "experiments.train_throughput", "--one", mixer] + [
        f"--{k}={getattr(a, k)}" for k in ("seq_len", "batch", "steps", "d_model", "layers", "impl", "pack")
    ] + [f"--set={item}" for item in a.set]
    t0 = time.perf_counter()
    log = os.path.join(logdir, mixer + ("" if a.impl == "auto" else f"_{a.impl}")
                       + ("" if a.pack else "_plain") + ".log")
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=a.timeout,
                           cwd=common.ROOT)
            error = None
        except subprocess.TimeoutExpired:
            error = f"timed out after {a.timeout:.0f} s"
    with open(log) as f:
        lines = f.read().splitlines()
    results = [ln for ln in lines if ln.startswith("RESULT ")]
    row = json.loads(results[-1][7:]) if results else {
        "mixer": mixer, "impl": a.impl, "pack": bool(a.pack), "error": error or "no result",
        "log_tail": lines[-5:]}
    row.setdefault("wall_s", time.perf_counter() - t0)
    return row


def save(rows, out):
    """Write ``rows`` to the device's results file, keeping the rows of other (mixer, impl, pack,
    --set) that are already there; ``(path, all rows written)``, or None while no row names its device
    (every mixer so far failed)."""
    device = next((r["device"] for r in rows if "device" in r), None)
    if device is None:
        return None
    path = os.path.join(out, f"train_throughput_{device.replace(' ', '_')}.json")
    key = lambda r: (r["mixer"], r.get("impl", "auto"), r.get("pack", True), tuple(r.get("set", ())))
    ran = {key(r) for r in rows}
    kept = []
    if os.path.exists(path):  # runs split over several invocations: keep the other mixers' rows
        with open(path) as f:
            kept = [r for r in json.load(f)["rows"] if key(r) not in ran]
    # the parent leaves the GPU to its children: its own provenance without a device
    common.write_json(path, {"date": time.strftime("%Y-%m-%d"), "rows": kept + rows},
                      common.provenance(device=False))
    return path, kept + rows


def line(r, rows) -> str:
    """A Markdown table row of one result; its ratio to the softmax row of its ``run`` with the
    same packing, when there is one."""
    name = (r["mixer"] + ("" if r.get("impl", "auto") == "auto" else f" ({r['impl']})")
            + ("" if r.get("pack", True) else " (plain rows)")
            + "".join(f" {item}" for item in r.get("set", ())))
    if "error" in r:
        return f"| {name} | – | – | – | – | – | {r['error']}: {(r.get('log_tail') or [''])[-1][:120]} |"
    base = [b["tokens_per_s"] for b in rows if b["mixer"] == "softmax" and "error" not in b
            and r.get("run") and b.get("run") == r["run"] and b.get("pack") == r.get("pack")]
    ratio = f"{r['tokens_per_s'] / base[0]:.3f}" if base else "–"
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    return (f"| {name} | {r['params'] or 'n/a'} | {r['tokens_per_s']:.0f} | {ratio} | {mfu} | "
            f"{peak} | {r['final_loss']:.3f} |")


if __name__ == "__main__":
    main()
