"""Every Pallas kernel vs the quadratic reference on the GPU: outputs and all gradients.

    python experiments/check_kernels_gpu.py [--kernels hla2,ahla] [--cases 0,3] [--f32_tile 32] [--out DIR]

Kernels: ``hla2``, ``ahla``, ``hla3`` (causal), ``loglinear_mamba2``, ``loglinear_gated_deltanet``
(``hla_jax.kernels.<name>_pallas``, compiled, not interpreted).  Gradients of ``sum(o·w)`` with
respect to every differentiable input (q, k, v, g, and β, λ where the operator has them).
float32 inputs must agree to relative error 2e-3; bf16 inputs (compared with the float32
reference on the same bf16-rounded values) to 3e-2.  Prints one line per case and writes
``kernels_check_gpu.json`` (and ``.txt``) to ``--out`` (default experiments/results).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax import kernels
from hla_jax.kernels import wrap
from hla_jax.ops import fenwick, reference

HLA = ("hla2", "ahla", "hla3")
CASES = [  # kernel, B, T, H, d, dv, gate, normalize, dtype
    *[(n, 2, 300, 2, 64, 64, "token", False, "float32") for n in HLA],
    *[(n, 1, 700, 2, 128, 128, "token", True, "float32") for n in HLA],
    *[(n, 1, 513, 3, 128, 96, None, False, "float32") for n in HLA],
    *[(n, 2, 1000, 2, 128, 128, "head", False, "bfloat16") for n in HLA],
    *[(n, B, T, 2, 128, dv, "token", False, dt) for n in ("loglinear_mamba2", "loglinear_gated_deltanet")
      for B, T, dv, dt in ((2, 300, 64, "float32"), (1, 1000, 128, "float32"), (2, 1000, 128, "bfloat16"))],
]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.all(np.isfinite(a)) else float("inf")


def operands(rng, name, B, T, H, d, dv, gate, dtype):
    """``(args, names)``: the operator's positional inputs (keys L2-normalised and β in (0, 1)
    for Gated DeltaNet, λ with ⌈log2 T⌉+1 levels for the log-linear ones)."""
    dt = jnp.dtype(dtype)
    q, k = (rng.normal(size=(B, T, H, d)) / np.sqrt(d) for _ in range(2))
    if name == "loglinear_gated_deltanet":
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    args = [jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(rng.normal(size=(B, T, H, dv)), dt)]
    names = ["q", "k", "v"]
    if gate is not None:
        shape = (H,) if gate == "head" else (B, T, H)
        args.append(jnp.asarray(-rng.uniform(0, 0.2, shape), jnp.float32))
        names.append("g")
    if name == "loglinear_gated_deltanet":
        args.append(jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32))
        names.append("beta")
    if name.startswith("loglinear"):
        args.append(jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H, fenwick.num_levels(T))), jnp.float32))
        names.append("lam")
    return args, names


def run_case(rng, name, B, T, H, d, dv, gate, normalize, dtype):
    args, names = operands(rng, name, B, T, H, d, dv, gate, dtype)
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    argnums = tuple(range(len(args)))
    kw = dict(normalize=normalize, eps=1e-6) if name in HLA else {}
    oracle = getattr(reference, name)

    def ref(*a):
        a = [x.astype(jnp.float32) for x in a]
        if name in HLA and len(a) == 4:  # the oracles take [B,T,H] gates
            a[3] = jnp.broadcast_to(a[3], a[0].shape[:3])
        return oracle(*a, **kw)

    ker = lambda *a: getattr(kernels, f"{name}_pallas")(*a, **kw)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * w)

    out = {"out": rel(jax.jit(ker)(*args), jax.jit(ref)(*args))}
    gk = jax.jit(jax.grad(loss(ker), argnums))(*args)
    gr = jax.jit(jax.grad(loss(ref), argnums))(*args)
    for n, a, b in zip(names, gk, gr):
        out["d" + n] = rel(a, b)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    p.add_argument("--f32_tile", type=int, default=-1,
                   help="cap of every kernel's chunk/value tiles for float32 at d >= 128 "
                        "(wrap.F32_GPU_TILE; 0: no cap, -1: the library's)")
    a = p.parse_args()
    if a.f32_tile >= 0:
        wrap.F32_GPU_TILE = dict.fromkeys(wrap.F32_GPU_TILE, a.f32_tile or 1 << 30)
    picked = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    if a.kernels:
        picked = [c for c in picked if c[0] in a.kernels.split(",")]
    rng = np.random.default_rng(0)
    rows, lines, ok = [], [], True
    for case in picked:
        t0 = time.perf_counter()
        tol = 2e-3 if case[-1] == "float32" else 3e-2
        try:
            errs = run_case(rng, *case)
            passed = all(e <= tol for e in errs.values())
        except Exception as e:  # record the failure, keep checking the other cases
            errs, passed = {"error": f"{type(e).__name__}: {str(e)[:400]}"}, False
        ok &= passed
        rows.append(dict(case=dict(zip("kernel B T H d dv gate normalize dtype".split(), case)),
                         tol=tol, passed=passed, errors=errs))
        lines.append(f"{'PASS' if passed else 'FAIL'} {case} tol={tol:g} " +
                     " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in errs.items()) + f" ({time.perf_counter() - t0:.0f} s)")
        print(lines[-1], flush=True)
        write(a.out, rows, lines, ok)  # after every case: a run cut short keeps what it checked
    print(write(a.out, rows, lines, ok))


def write(out, rows, lines, ok) -> str:
    info = (f"device={jax.devices()[0].device_kind} jax={jax.__version__} "
            f"f32_tile={wrap.F32_GPU_TILE} all_passed={ok}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels_check_gpu.json"), "w") as f:
        json.dump(dict(info=info, cases=rows), f, indent=1)
    with open(os.path.join(out, "kernels_check_gpu.txt"), "w") as f:
        f.write("\n".join(lines + [info]) + "\n")
    return info


if __name__ == "__main__":
    main()
