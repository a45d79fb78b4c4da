"""Today's code on one GPU, in priority order, resumable across short calls.

    python -m experiments.gpu_campaign --out .campaign --budget_s 540 --pack $OUT/campaign.tar.gz
    python -m experiments.gpu_campaign --out .campaign --steps decode,lm     # some steps only

Steps (``STEPS``), each a child process writing into ``--out``:

1. ``check``: ``experiments.kernels.check_kernels_gpu``, every case, two processes sharing the
   device (``check.{json,txt}``; a case that ran out of device memory is checked again);
2. ``kernels``: ``experiments.kernels.bench_kernels`` at T = 8K and 32K, its default methods
   (ours, cuDNN, the ``jax-linear-attention`` wheel, our XLA forms) (``kernels.{json,md}``);
3. ``fla``: ``experiments.kernels.bench_fla``, fla's Gated DeltaNet and gated linear attention
   at the same shapes, its table beside step 2's rows (``fla.{json,md}``);
4. ``decode``: ``experiments.bench_decode``, every mixer, 8K / 32K / 128K prompts, batch 1 and 32
   (``bench_decode_gpu.*``);
5. ``lm``: ``experiments.train_throughput`` at T = 8192 for softmax, hla2 and both log-linear
   mixers, in one invocation so their ratios share a run (``train_throughput_<device>.json``).

A step starts only while ``--budget_s`` leaves at least its ``min_s``; a step still running at
the end of the budget is stopped (its process group: SIGTERM, then SIGKILL) and resumes where it
stopped at the next call with the same ``--out`` (each script keeps its finished rows). Each
step's output goes to ``<out>/<step>.log``; ``<out>/campaign.json`` records the environment and
every step's state (``done``, ``partial``, ``failed``) with its seconds. ``--pack FILE`` writes
``--out`` as one ``.tar.gz`` after each step (a device call returns few files). Run it from the
repository root; the wheels the GPU image lacks and the install line are in docs/kernels.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from typing import NamedTuple

from experiments.common import ROOT

DECODE_TAG = "gpu"
LM_MIXERS = "softmax,hla2,loglinear_mamba2,loglinear_gated_deltanet"


class Step(NamedTuple):
    name: str
    min_s: float  # budget a step needs left to start
    args: Callable[[argparse.Namespace, float], list[str]]  # (args, seconds left) -> module + flags
    done: Callable[[pathlib.Path, int], bool]  # (out, exit status) -> finished


def _check_done(out, rc):
    from experiments.kernels.check_kernels_gpu import CASES, out_of_memory
    path = out / "check.json"
    rows = json.loads(path.read_text())["cases"] if path.exists() else []
    return len(rows) == len(CASES) and not any(out_of_memory(r) for r in rows)


STEPS = (
    Step("check", 120,
         lambda a, left: ["experiments.kernels.check_kernels_gpu", "--workers=2", "--resume=1",
                          "--name=check", f"--out={a.out}"],
         _check_done),
    Step("kernels", 180,
         lambda a, left: ["experiments.kernels.bench_kernels", "--T=8192,32768", "--resume=1",
                          "--name=kernels", f"--out={a.out}"],
         lambda out, rc: rc == 0),
    Step("fla", 60,
         lambda a, left: ["experiments.kernels.bench_fla", "--T=8192,32768", "--resume=1", "--name=fla",
                          f"--ours={a.out}/kernels.json", f"--out={a.out}"],
         lambda out, rc: rc == 0),
    Step("decode", 120,
         lambda a, left: ["experiments.bench_decode", f"--tag={DECODE_TAG}", f"--budget_s={left - 15:.0f}",
                          f"--out={a.out}"],
         lambda out, rc: rc == 0 and (out / f"bench_decode_{DECODE_TAG}.json").exists()
         and not (out / f"bench_decode_{DECODE_TAG}.jsonl").exists()),
    Step("lm", 420,
         lambda a, left: ["experiments.train_throughput", f"--mixers={LM_MIXERS}", "--seq_len=8192",
                          "--batch=4", "--steps=40", "--timeout=240", f"--out={a.out}"],
         lambda out, rc: rc == 0 and any(out.glob("train_throughput_*.json"))),
)


def environment() -> dict:
    """The device and the packages the steps import (a missing one named, not raised)."""
    env = {"python": sys.version.split()[0], "commit": os.environ.get("HLA_JAX_COMMIT", "")}
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        env["gpu"] = f"nvidia-smi: {e}"
    for mod in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "ml_collections", "tensorboardX",
                "jla", "torch", "triton", "fla"):
        code = f"import {mod} as m; print(getattr(m, '__version__', 'present'))"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        env[mod] = r.stdout.strip() if r.returncode == 0 else "missing: " + r.stderr.strip()[-160:]
    return env


def run_step(step, a, out, deadline) -> dict:
    """Run ``step`` until it ends or ``deadline``; its state."""
    left = deadline - time.monotonic()
    cmd = [sys.executable, "-m", *step.args(a, left)]
    t0 = time.monotonic()
    with open(out / f"{step.name}.log", "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(left, 1))
            stopped = False
        except subprocess.TimeoutExpired:
            stop(proc)
            rc, stopped = proc.returncode, True
    seconds = time.monotonic() - t0
    state = "done" if not stopped and step.done(out, rc) else "partial" if stopped else "failed"
    return {"state": state, "exit": rc, "seconds": round(seconds, 1)}


def stop(proc):
    """SIGTERM the step's process group, SIGKILL it 10 s later if it lives."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def pack(out, path):
    """``out`` as one ``.tar.gz`` at ``path`` (written beside, then renamed)."""
    tmp = f"{path}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results folder, kept between calls")
    p.add_argument("--budget_s", type=float, default=540, help="seconds for this call")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS),
                   help="comma list, run in this order")
    p.add_argument("--pack", default="", help="write --out as this .tar.gz after each step")
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.budget_s
    names = a.steps.split(",")
    unknown = [n for n in names if n not in {s.name for s in STEPS}]
    if unknown:
        raise SystemExit(f"--steps: unknown {unknown}; known: {[s.name for s in STEPS]}")
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    a.out = str(out)
    state_path = out / "campaign.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"steps": {}, "calls": []}
    state["calls"].append({"start": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "environment": environment()})
    print(json.dumps(state["calls"][-1]["environment"], indent=1), flush=True)
    for step in sorted((s for s in STEPS if s.name in names), key=lambda s: names.index(s.name)):
        if state["steps"].get(step.name, {}).get("state") == "done":
            continue
        left = deadline - time.monotonic()
        if left < step.min_s:
            print(f"{step.name}: {left:.0f} s left, needs {step.min_s:.0f}: next call", flush=True)
            continue
        result = run_step(step, a, out, deadline)
        prior = state["steps"].get(step.name, {})
        result["total_s"] = round(prior.get("total_s", 0) + result["seconds"], 1)
        state["steps"][step.name] = result
        tail = (out / f"{step.name}.log").read_text().splitlines()[-12:]
        print("\n".join([f"{step.name}: {json.dumps(result)}", *("  " + t[:240] for t in tail)]), flush=True)
        state_path.write_text(json.dumps(state, indent=1))
        if a.pack:
            pack(out, a.pack)
    state_path.write_text(json.dumps(state, indent=1))
    if a.pack:
        pack(out, a.pack)
    return 0 if all(state["steps"].get(n, {}).get("state") == "done" for n in names) else 3


if __name__ == "__main__":
    sys.exit(main())
