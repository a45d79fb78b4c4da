"""Benchmark our Pallas kernels (hla2, ahla, hla3, log-linear Mamba-2 and Gated DeltaNet) against
our XLA chunked paths, cuDNN causal attention and the ``jax-linear-attention`` wheel (``jla``:
first-order Mosaic GPU ``simple_gla`` / ``gated_deltanet`` kernels, plain-JAX
``log_linear_simple_gla``), on one GPU.

    python experiments/bench_kernels.py [--T 2048,8192,32768,65536] [--tokens 65536] [--out DIR]
    python experiments/bench_kernels.py --tune 8192 --T 8192,65536   # pick HLA settings first
    python experiments/bench_kernels.py --methods hla2_pallas,cudnn_causal --budget 300

``jla_log_linear_simple_gla`` runs out of memory at B·T = 65536, so it and a twin row of our
kernel (``loglinear_mamba2_pallas_16k``) run at B·T = 16384.  ``--budget`` seconds: no new
(method, T) pair starts after it (the results so far are written).

bf16, ``--shape H,d,dv`` (default 16,128,128), B·T = ``--tokens``; forward and forward+backward (gradient of
``sum(o·w)`` w.r.t. q, k, v) median wall times (ms) over ``--repeats`` runs after a warm-up;
plus the achieved TFLOP/s of the kernel's matmul work (``kernel_flops``) next to a bf16 ``--matmul_n``³
matmul timed in the same run.  Writes ``kernels_bench.json`` and ``kernels_bench.md``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax import kernels, ops
from hla_jax.ops import fenwick


class Shape(NamedTuple):
    """Heads, key (state) width ``d`` and value width ``dv`` of a benchmark."""
    H: int = 16
    d: int = 128
    dv: int = 128




def timeit(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def kernel_flops(B, T, shape, c=64, bv=64, bv_bwd=64):
    """Matmul FLOPs the HLA2 kernels execute (value tiles repeat the ``S`` work): forward, and
    forward+backward (= forward + ``states`` walk (counted as a forward) + ``dstates`` walk
    (the six matmuls its state cotangents need) + chunk-parallel ``grads``)."""
    H, d, dv = shape
    heads_chunks = B * H * (-(-T // c))

    def fwd(bv):
        return 2 * (2 * c * c * d + 2 * c * d * d + c ** 3 + 3 * c * d * bv + 2 * c * c * bv) * (dv // bv)

    def dstates(bv):
        return 2 * (2 * c * c * bv + 2 * c * d * bv + c * c * d + 2 * c * d * d) * (dv // bv)

    def grads(bv):
        return 2 * (6 * c * c * d + 5 * c * d * d + 3 * c ** 3 + 7 * c * d * bv + 5 * c * c * bv) * (dv // bv)

    f = heads_chunks * fwd(bv)
    return f, 2 * f + heads_chunks * (dstates(bv_bwd) + grads(bv_bwd)), heads_chunks * fwd(dv)


def inputs(B, T, shape, seed=0):
    """``q, k, v, g, beta, lam, w`` (bf16 except the gates; λ with ⌈log2 T⌉+1 levels)."""
    H, d, dv = shape
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.normal(size=(B, T, H, d)) / np.sqrt(d), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16)
    k = (k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True)).astype(jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0.0, 0.1, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.bfloat16)
    lam = jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H, fenwick.num_levels(T))), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16)
    return q, k, v, g, beta, lam, w


def fwd_bwd(fn):
    """``jit(grad)`` of ``sum(fn(q, k, v, g, beta, lam) * w)`` w.r.t. q, k, v (gates are
    arguments: a closed-over gate would be a constant that ``check_gate`` tries to inspect)."""
    loss = lambda q, k, v, g, beta, lam, w: jnp.sum(fn(q, k, v, g, beta, lam).astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


SMALL_TOKENS = {"jla_log_linear_simple_gla": 16384, "loglinear_mamba2_pallas_16k": 16384}


def hla_kernel(family, kw):
    return lambda q, k, v, g, beta, lam: getattr(kernels, f"{family}_pallas")(q, k, v, g, **kw)


def methods(kws):
    """``{name: fn(q, k, v, g, beta, lam)}``; ``kws[family]`` tunes ``<family>_pallas``."""
    out = {
        "hla2_pallas": hla_kernel("hla2", kws.get("hla2", {})),
        "hla2_xla_chunked": lambda q, k, v, g, beta, lam: ops.hla2(q, k, v, g, impl="chunked"),
        "ahla_pallas": hla_kernel("ahla", kws.get("ahla", {})),
        "ahla_xla_chunked": lambda q, k, v, g, beta, lam: ops.ahla(q, k, v, g, impl="chunked"),
        "hla3_pallas": hla_kernel("hla3", kws.get("hla3", {})),
        "hla3_xla_chunked": lambda q, k, v, g, beta, lam: ops.hla3(q, k, v, g, impl="chunked"),
        "loglinear_mamba2_pallas": family_kernel("loglinear_mamba2", kws.get("loglinear_mamba2", {})),
        "loglinear_mamba2_xla_chunked": lambda q, k, v, g, beta, lam: ops.loglinear_mamba2(
            q, k, v, g, lam, impl="chunked"),
        "loglinear_gdn_pallas": lambda q, k, v, g, beta, lam: kernels.loglinear_gated_deltanet_pallas(
            q, k, v, g, beta, lam),
        "loglinear_gdn_xla_chunked": lambda q, k, v, g, beta, lam: ops.loglinear_gated_deltanet(
            q, k, v, g, beta, lam, impl="chunked"),
        "cudnn_causal": lambda q, k, v, g, beta, lam: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"),
    }
    try:
        from jla.ops import linear_attention
        from jla.ops.log_linear import num_levels as jla_levels
    except ImportError as e:
        print("jla not importable:", e)
        return out

    def jla_lam(lam, T):  # the wheel's own level count (λ = 1 on levels it has and we don't)
        L = jla_levels(T)
        return lam[..., :L] if lam.shape[-1] >= L else jnp.pad(
            lam, ((0, 0),) * 3 + ((0, L - lam.shape[-1]),), constant_values=1.0)

    out |= {
        "jla_gated_deltanet": lambda q, k, v, g, beta, lam: linear_attention(
            "gated_deltanet", q, k, v, g=g, beta=beta, impl="mosaic_gpu")[0],
        "jla_simple_gla": lambda q, k, v, g, beta, lam: linear_attention(
            "simple_gla", q, k, v, g=g, impl="mosaic_gpu")[0],
        "jla_log_linear_simple_gla": lambda q, k, v, g, beta, lam: linear_attention(
            "log_linear_simple_gla", q, k, v, g=g, level_scales=jla_lam(lam, q.shape[1]),
            impl="chunked")[0],
        "loglinear_mamba2_pallas_16k": out["loglinear_mamba2_pallas"],
    }
    return out


def matmul_tflops(n=8192):
    """TFLOP/s of a bf16 ``n×n @ n×n`` matmul."""
    a = jnp.asarray(np.random.default_rng(1).normal(size=(n, n)), jnp.bfloat16)
    ms = timeit(jax.jit(lambda x, y: x @ y), a, a)
    return 2 * n ** 3 / ms / 1e9


# kernel settings tried by --tune, per family
_HLA_KEYS = ("block_v", "block_v_bwd", "num_warps", "num_warps_bwd", "parallel_forward")
SETTINGS = {
    "hla2": [dict(zip(_HLA_KEYS, x)) for x in
             [(64, 128, 8, 8, True), (64, 128, 8, 16, True), (64, 64, 8, 8, True), (64, 128, 8, 4, True)]]
    + [dict(chunk_size=32, block_v=64, block_v_bwd=128, num_warps=4, num_warps_bwd=4, parallel_forward=True)],
    "ahla": [dict(zip(_HLA_KEYS, x)) for x in [(64, 64, 8, 8, False), (64, 128, 8, 8, False)]],
    "hla3": [dict(zip(_HLA_KEYS, x)) for x in [(64, 128, 8, 8, True), (64, 64, 8, 8, True)]],
    "loglinear_mamba2": [dict(block_v_bwd=64), dict(block_v_bwd=128), dict(block_v_bwd=32)],
}


def family_kernel(family, kw):
    if family == "loglinear_mamba2":
        return lambda q, k, v, g, beta, lam: kernels.loglinear_mamba2_pallas(q, k, v, g, lam, **kw)
    return hla_kernel(family, kw)


def tune(T, tokens, repeats, families, shape):
    """Time ``SETTINGS`` of each family at one ``T``; ``{family: fastest fwd+bwd's kw}``."""
    B = tokens // T
    args = inputs(B, T, shape)
    picked = {}
    for family in families:
        best = (float("inf"), None)
        for kw in SETTINGS[family]:
            fn = family_kernel(family, kw)
            try:
                t0 = time.perf_counter()
                f = timeit(jax.jit(fn), *args[:6], repeats=repeats)
                fb = timeit(fwd_bwd(fn), *args, repeats=repeats)
                print(f"tune {family} T={T} {kw}: fwd {f:.2f} ms  fwd+bwd {fb:.2f} ms "
                      f"(with compiles {time.perf_counter() - t0:.0f} s)", flush=True)
                best = min(best, (fb, kw), key=lambda x: x[0])
            except Exception as e:
                print(f"tune {family} T={T} {kw}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if best[1]:
            picked[family] = best[1]
    return picked


def phases(family, kw, T, tokens, repeats, shape):
    """Median ms of each HLA kernel of ``family`` on its own (forward walk, ``states``,
    ``outputs``, ``dstates``, ``grads``) with settings ``kw``, bf16, no gate."""
    from hla_jax.kernels import wrap

    B = tokens // T
    q, k, v, *_ = inputs(B, T, shape)
    kw = dict(SETTINGS[family][0]) | kw
    cfg = wrap.Config(family, 64, kw["block_v"], kw["block_v_bwd"], kw["num_warps"], kw["num_warps_bwd"])
    mod = wrap.kernels(cfg)
    b = jnp.zeros((B, shape.H, T), jnp.float32)
    cpu = jax.default_backend() == "cpu"  # interpret mode: a smoke test only
    fw = dict(c=64, bv=cfg.bv_fwd, num_warps=cfg.warps_fwd, interpret=cpu)
    bw = dict(c=64, bv=cfg.bv_bwd, num_warps=cfg.warps_bwd, interpret=cpu)
    saved = jax.block_until_ready(mod.states(q, k, v, b, **fw))
    do = v
    dsaved = jax.block_until_ready(mod.dstates(q, k, v, b, *(saved if family in wrap.BILINEAR else ()),
                                               do, **bw))
    out = {"forward": timeit(lambda: mod.forward(q, k, v, b, **fw), repeats=repeats),
           "states": timeit(lambda: mod.states(q, k, v, b, **fw), repeats=repeats),
           "outputs": timeit(lambda: mod.outputs(q, k, v, b, *saved, **fw), repeats=repeats),
           "dstates": timeit(lambda: mod.dstates(q, k, v, b, *(saved if family in wrap.BILINEAR else ()),
                                                 do, **bw), repeats=repeats),
           "grads": timeit(lambda: mod.grads(q, k, v, b, *saved, do, *dsaved, **bw), repeats=repeats)}
    print(f"phases {family} T={T} {kw}: " + "  ".join(f"{n} {t:.2f} ms" for n, t in out.items()),
          flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", default="2048,8192,32768,65536")
    p.add_argument("--shape", default="16,128,128",
                   help="H,d,dv (e.g. Mamba-2's 48,128,64: 48 heads, state 128, head dim 64)")
    p.add_argument("--name", default="kernels_bench", help="results go to <out>/<name>.{json,md}")
    p.add_argument("--matmul_n", type=int, default=8192, help="size of the reference bf16 matmul")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tune", type=int, default=0, help="first pick HLA kernel settings at this T")
    p.add_argument("--tune_families", default="hla2,ahla,hla3,loglinear_mamba2")
    p.add_argument("--phases", default="", help="time each kernel of these HLA families on its own")
    p.add_argument("--skip", default="", help="comma-separated methods to leave out")
    p.add_argument("--methods", default="", help="comma-separated methods to run (default: all)")
    p.add_argument("--budget", type=float, default=0, help="seconds; 0 = no limit")
    p.add_argument("--block_v", type=int, help="hla2_pallas setting (default: the library's)")
    p.add_argument("--block_v_bwd", type=int, help="hla2_pallas setting (default: the library's)")
    p.add_argument("--num_warps", type=int, help="hla2_pallas setting (default: the library's)")
    p.add_argument("--num_warps_bwd", type=int, help="hla2_pallas setting (default: the library's)")
    p.add_argument("--parallel_forward", type=int, choices=(0, 1),
                   help="hla2_pallas setting (default: the library's)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--merge", default="",
                   help="comma-separated result JSONs of runs at one shape: write them as one <name> "
                        "table (nothing is run)")
    a = p.parse_args(argv)
    if a.merge:
        return write(merge(a.merge.split(",")), a.out, a.name)
    shape = Shape(*(int(x) for x in a.shape.split(",")))
    defaults = {n: x.default for n, x in inspect.signature(kernels.hla2_pallas).parameters.items()}
    kws = {"hla2": {n: defaults[n] if getattr(a, n) is None else type(defaults[n])(getattr(a, n))
                    for n in _HLA_KEYS}}
    if a.tune:
        kws |= tune(a.tune, a.tokens, a.repeats, a.tune_families.split(","), shape)
    phase_ms = {f: phases(f, kws.get(f, {}), a.tune or 8192, a.tokens, a.repeats, shape)
                for f in a.phases.split(",") if f}
    mm = matmul_tflops(a.matmul_n)
    print(f"bf16 matmul {a.matmul_n}^3: {mm:.0f} TFLOP/s", flush=True)
    rows, t_start = [], time.perf_counter()
    chosen = methods(kws)
    if a.methods:
        chosen = {n: f for n, f in chosen.items() if n in a.methods.split(",")}
    for T in (int(t) for t in a.T.split(",")):
        data = {}
        for name, fn in chosen.items():
            if name in a.skip.split(","):
                continue
            if a.budget and time.perf_counter() - t_start > a.budget:
                print(f"budget of {a.budget:.0f} s spent: {name} at T={T} and later not run", flush=True)
                break
            tokens = SMALL_TOKENS.get(name, a.tokens)
            B = max(tokens // T, 1)
            args = data[B] = data.get(B) or inputs(B, T, shape)
            row = dict(method=name, T=T, B=B)
            try:
                row["fwd_ms"] = timeit(jax.jit(fn), *args[:6], repeats=a.repeats)
                row["fwd_bwd_ms"] = timeit(fwd_bwd(fn), *args, repeats=a.repeats)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if name == "hla2_pallas" and "fwd_ms" in row:
                f, fb, useful = kernel_flops(B, T, shape, bv=kws["hla2"]["block_v"],
                                             bv_bwd=kws["hla2"]["block_v_bwd"])
                row["fwd_tflops"] = f / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = fb / row["fwd_bwd_ms"] / 1e9
                row["fwd_tflops_useful"] = useful / row["fwd_ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, H=shape.H, d=shape.d, dv=shape.dv,
               tokens=a.tokens, dtype="bfloat16", matmul_tflops=mm, kernel_settings=kws, phases_ms=phase_ms,
               rows=rows)
    write(res, a.out, a.name)


def write(res, out, name):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)


def merge(paths):
    """One result from the JSONs of several runs at the same shape (rows pooled; the matmul rate
    is the median of the runs')."""
    parts = [json.load(open(p)) for p in paths]
    keys = ("device", "H", "d", "dv", "tokens", "dtype")
    for p, part in zip(paths, parts):
        if any(part[k] != parts[0][k] for k in keys):
            raise ValueError(f"--merge: {p} is not at the shape of {paths[0]} ({keys})")
    return dict(parts[0], matmul_tflops=statistics.median(p["matmul_tflops"] for p in parts),
                merged=[os.path.basename(p) for p in paths], rows=[r for p in parts for r in p["rows"]])


def table(res):
    """Markdown: one row per method, ``fwd / fwd+bwd`` ms per T, then the kernel's rates."""
    Ts = sorted({r["T"] for r in res["rows"]})
    names = list(dict.fromkeys(r["method"] for r in res["rows"]))
    cell = {(r["method"], r["T"]): r for r in res["rows"]}
    lines = [f"{res['device']}, jax {res['jax']}, bf16, H={res['H']}, d={res['d']}, dv={res['dv']}, "
             f"B·T={res['tokens']}; median ms, fwd / fwd+bwd; bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s",
             "", "| method | " + " | ".join(f"T={T}" for T in Ts) + " |",
             "|---" * (len(Ts) + 1) + "|"]
    for n in names:
        cs = []
        for T in Ts:
            r = cell.get((n, T), {})
            cs.append(f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.2f}" if "fwd_bwd_ms" in r else
                      "error" if "error" in r else "–")
        small = f" (B·T={SMALL_TOKENS[n]})" if n in SMALL_TOKENS else ""
        small += " †" if any(r.get("run") == "earlier" for r in res["rows"] if r["method"] == n) else ""
        lines.append(f"| {n}{small} | " + " | ".join(cs) + " |")
    for n in (n for n in names if n.startswith("hla2_pallas")):
        for key in ("fwd_tflops", "fwd_bwd_tflops"):
            cs = [f"{cell[(n, T)][key]:.0f}" if key in cell.get((n, T), {}) else "–" for T in Ts]
            lines.append(f"| {n} {key.replace('_tflops', '')} TFLOP/s | " + " | ".join(cs) + " |")
    if any(r.get("run") == "earlier" for r in res["rows"]):
        lines += ["", f"† from an earlier run of this script on the same machine ({res.get('earlier', '')})"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
