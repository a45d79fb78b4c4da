"""fla's Triton kernels at ``bench_kernels``' shapes: Gated DeltaNet and Mamba-2-style gated linear
attention in PyTorch beside ours.

    python -m experiments.kernels.bench_fla                       # T = 8192, 32768
    python -m experiments.kernels.bench_fla --T 2048,8192 --ours experiments/results/kernels_bench.json

Methods: ``fla_gated_deltanet`` (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``) and
``fla_simple_gla`` (``fla.ops.simple_gla.chunk_simple_gla``: one log-decay per token and head,
the gate of ``ops.mamba2``), from the ``fla-core`` wheel, at ``scale=1`` (our operators do not
scale q). Inputs as ``bench_kernels.inputs``: bf16, ``--shape H,d,dv`` (default 16,128,128),
B·T = ``--tokens``, q and k L2-normalised per token and head, log-decays ``g`` in (−0.1, 0]
(float32), β in (0, 1). Forward and forward+backward (gradient of ``sum(o·w)`` w.r.t. q, k, v,
g and β) median times in ms from ``triton.testing.do_bench`` (CUDA events, ``--rep_ms`` of
repeats after its warm-up). A method that raises (fla has refused its gated backward on some
Triton and GPU pairs) records the error; where that refusal is fla's guard for its issue #640
(wrong gated backward with Triton 3.4-3.7.0 on Hopper), ``--bypass_guard 1`` (the default) lifts
it and times the backward anyway, the row marked ``timing_only``: a speed, not a result.

Rows go to ``<out>/<name>.json`` after each one (``--resume 1`` keeps the rows there from the
same device); ``<name>.md`` is the table, with our kernels' rows at the same T from ``--ours``
(a ``bench_kernels`` JSON of the same device, best measured in the same call) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from experiments import common

METHODS = ("fla_gated_deltanet", "fla_simple_gla")
# our rows compared with each fla method: (fla method, ours)
PAIRS = (("fla_gated_deltanet", "gated_deltanet_pallas"), ("fla_gated_deltanet", "jla_gated_deltanet"),
         ("fla_simple_gla", "mamba2_pallas"), ("fla_simple_gla", "jla_simple_gla"))


def inputs(B, T, H, d, dv, seed=0):
    """``(q, k, v, g, beta, w)`` on the GPU, q/k/v bf16, g/β float32, w the output weights."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    def normal(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")
    q = F.normalize(normal(B, T, H, d), dim=-1).bfloat16()
    k = F.normalize(normal(B, T, H, d), dim=-1).bfloat16()
    v = normal(B, T, H, dv).bfloat16()
    g = -0.1 * torch.rand(B, T, H, generator=gen, device="cuda")
    beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16()
    return q, k, v, g, beta, normal(B, T, H, dv).bfloat16()


def method(name):
    """``f(q, k, v, g, beta) -> o`` of fla's kernel ``name``."""
    if name == "fla_gated_deltanet":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)[0]
    from fla.ops.simple_gla import chunk_simple_gla
    return lambda q, k, v, g, beta: chunk_simple_gla(q, k, v, g, scale=1.0)[0]


def measure(name, fn, xs, rep_ms, bypass_guard=False) -> dict:
    """Median forward and forward+backward ms of ``fn`` on ``xs``, or the error it raised."""
    import torch
    from triton.testing import do_bench

    q, k, v, g, beta, w = xs
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    if name == "fla_simple_gla":
        leaves = leaves[:4]

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, g, beta)

    def fwd_bwd():
        args = leaves + [beta] * (5 - len(leaves))
        o = fn(*args)
        return torch.autograd.grad((o.float() * w.float()).sum(), leaves)

    row = {"method": name}
    for key, f in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        try:
            out = f()
            bad = [t for t in (out if isinstance(out, tuple) else (out,)) if not torch.isfinite(t).all()]
            if bad:
                raise FloatingPointError("non-finite output")
            row[key] = do_bench(f, rep=rep_ms, return_mode="median")
        except Exception as e:  # fla's own refusals (e.g. a backward on some Triton and GPU pair)
            row[key.replace("_ms", "_error")] = f"{type(e).__name__}: {str(e)[:300]}"
            if bypass_guard and "#640" in str(e):
                unguard()
                row[key] = do_bench(f, rep=rep_ms, return_mode="median")
                row["timing_only"] = "fla's #640 guard bypassed: its backward may be wrong on this pair"
    return row


def unguard():
    """Lift fla's refusal of its gated backward on Hopper with Triton 3.4-3.7.0 (its issue #640:
    wrong results there), so that its time can be taken; the results are not to be used."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and hasattr(module, "TRITON_ABOVE_3_7_1"):
            module.TRITON_ABOVE_3_7_1 = True


def table(res, ours) -> str:
    """Markdown: fla's rows and ours per T, then each fla method's time over ours."""
    Ts = sorted({r["T"] for r in res["rows"]})
    cell = {(r["method"], r["T"]): r for r in res["rows"]}
    if ours.get("device") == res["device"]:
        cell.update({(r["method"], r["T"]): r for r in ours["rows"]})
    names = [*METHODS, *dict.fromkeys(o for _, o in PAIRS)]

    def show(r, key):
        return f"{r[key]:.2f}" if key in r else "error" if key.replace("_ms", "_error") in r else "–"

    lines = [f"{res['device']}, torch {res['torch']}, triton {res['triton']}, fla {res['fla']}; bf16, "
             f"H={res['H']}, d={res['d']}, dv={res['dv']}, B·T={res['tokens']}; median ms, fwd / fwd+bwd",
             "", "| method | " + " | ".join(f"T={T}" for T in Ts) + " |", "|---" * (len(Ts) + 1) + "|"]
    for n in names:
        if any((n, T) in cell for T in Ts):
            lines.append(f"| {n} | " + " | ".join(
                f"{show(cell.get((n, T), {}), 'fwd_ms')} / {show(cell.get((n, T), {}), 'fwd_bwd_ms')}"
                for T in Ts) + " |")
    pairs = [(fla, mine) for fla, mine in PAIRS if any((mine, T) in cell for T in Ts)]
    if pairs:
        lines += ["", "Ours over fla (below 1: ours faster), fwd / fwd+bwd:", "",
                  "| ours | fla | " + " | ".join(f"T={T}" for T in Ts) + " |",
                  "|---|---" + "|---" * len(Ts) + "|"]
    for fla, mine in pairs:
        cs = []
        for T in Ts:
            a, b = cell.get((mine, T), {}), cell.get((fla, T), {})
            cs.append(" / ".join(f"{a[k] / b[k]:.2f}" if k in a and k in b else "–"
                                 for k in ("fwd_ms", "fwd_bwd_ms")))
        lines.append(f"| {mine} | {fla} | " + " | ".join(cs) + " |")
    errors = [f"- {r['method']} T={r['T']}: {r.get('fwd_error') or r.get('fwd_bwd_error')}"
              for r in res["rows"] if "fwd_error" in r or "fwd_bwd_error" in r]
    return "\n".join(lines + (["", "Errors:", *errors] if errors else [])) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="8192,32768")
    p.add_argument("--shape", default="16,128,128", help="H,d,dv")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rep_ms", type=int, default=200, help="do_bench's repeat time per measure")
    p.add_argument("--ours", default="", help="a bench_kernels JSON of this device: our rows")
    p.add_argument("--resume", type=int, default=0,
                   help="1: keep the rows already in <name>.json that have no error")
    p.add_argument("--bypass_guard", type=int, default=1,
                   help="1: where fla refuses its gated backward (its #640), lift the guard and "
                        "time it anyway, the row marked timing_only")
    p.add_argument("--name", default="kernels_bench_fla")
    p.add_argument("--out", default=str(common.RESULTS))
    a = p.parse_args(argv)
    import fla
    import torch
    import triton

    H, d, dv = (int(x) for x in a.shape.split(","))
    path = os.path.join(a.out, f"{a.name}.json")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               fla=getattr(fla, "__version__", "?"), H=H, d=d, dv=dv, tokens=a.tokens, dtype="bfloat16",
               grad_wrt="q, k, v, g, beta", rows=[])
    old = common.read_json(path) if a.resume else {}
    if old.get("device") == res["device"] and all(old.get(k) == res[k] for k in ("H", "d", "dv", "tokens")):
        res["rows"] = [r for r in old["rows"] if not any(k.endswith("_error") for k in r)]
    ran = {(r["method"], r["T"]) for r in res["rows"]}
    prov = common.provenance(device=False)
    for T in (int(t) for t in a.T.split(",")):
        B, xs = max(a.tokens // T, 1), None
        for name in METHODS:
            if (name, T) in ran:
                continue
            xs = xs or inputs(B, T, H, d, dv)
            t0 = time.perf_counter()
            row = dict(measure(name, method(name), xs, a.rep_ms, a.bypass_guard), T=T, B=B)
            row["wall_s"] = time.perf_counter() - t0
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            common.write_json(path, res, prov)
    ours = common.read_json(a.ours) if a.ours else {}
    print(common.write_markdown(os.path.join(a.out, f"{a.name}.md"), table(res, ours), prov))


if __name__ == "__main__":
    main()
