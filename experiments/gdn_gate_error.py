"""How the Gated DeltaNet kernel's errors grow with the sequence length: ``check_kernels_gpu``'s
``gated_deltanet`` case (bf16, B=2, H=1, d=dv=128, from an initial state) at several T, each
output's and gradient's relative error against the float64 recurrence.  On a CPU the kernels
run in Pallas' interpreters (bf16 operands as on the GPU, float32 where the GPU takes TF32);
on a Hopper GPU compiled.

    python experiments/gdn_gate_error.py [--T 640,2560,8192] [--gate token] [--name NAME] [--out DIR]

Writes ``<out>/<name>.json`` and a markdown table ``<name>.md`` (one row per T).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import check_kernels_gpu as ck  # noqa: E402
from experiments.bench_kernels import micro_write  # noqa: E402
from experiments.common import markdown_table  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="640,2560,8192", help="comma-separated sequence lengths")
    p.add_argument("--gate", default="token", choices=("token", "reset", "aligned"))
    p.add_argument("--name", default=None, help="default: gdn_gate_error_<backend>_<gate>")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    a.name = a.name or f"gdn_gate_error_{jax.default_backend()}_{a.gate}"
    rows = []
    for T in (int(t) for t in a.T.split(",")):
        case = ck.Case(kernel="gated_deltanet", B=2, T=T, H=1, d=128, dv=128, gate=a.gate,
                       normalize=False, dtype="bfloat16", backend=None)
        t0 = time.perf_counter()
        errs = ck.run_case(np.random.default_rng(0), case)
        rows.append(dict(T=T, rel={k: v["rel"] for k, v in errs.items()},
                         seconds=time.perf_counter() - t0))
        print(f"T={T}: " + " ".join(f"{k}={v:.2e}" for k, v in rows[-1]["rel"].items()), flush=True)
    res = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), gate=a.gate,
               case="gated_deltanet B=2 H=1 d=dv=128 bf16, from an initial state", rows=rows)
    micro_write(a, res)
    names = list(rows[0]["rel"])
    table = markdown_table(["T", *names],
                           [[r["T"], *(f"{r['rel'][n]:.2e}" for n in names)] for r in rows])
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(f"{res['device']} ({res['backend']}), {res['case']}, gate={a.gate}; relative "
                f"error against the float64 recurrence\n\n{table}\n")
    return res


if __name__ == "__main__":
    main()
