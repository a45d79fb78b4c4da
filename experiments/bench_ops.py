"""Forward+backward cost of every operator's chunked form at long context.

    python -m experiments.bench_ops                       # every operator at its default shape
    python -m experiments.bench_ops --only hla2,ahla --repeats 5
    python -m experiments.bench_ops --impls chunked,reference,pallas --shape B=1024,H=1,T=256,d=64,dv=64 \
        --tag mqar   # which form is fastest at MQAR's shape (4 stacked models of batch 256)

For each operator: median wall time of ``jax.grad`` of a scalar loss with respect to every
input (forward + backward), and the peak memory XLA's buffer assignment gives the compiled
program (arguments + outputs + temporaries, ``compiled.memory_analysis()``). The chunked form
must never hold a T×T array: at T=16384 one float32 T×T matrix per head is 1 GiB, at
T=65536 it is 16 GiB. Results are written to ``experiments/results/bench_ops_<backend>.json``
(with its provenance) after every operator (a run cut short keeps what it measured) and printed
as a Markdown table.
``--impls`` times each operator in several forms (a form an operator cannot take at that shape
is recorded with its error), ``--shape`` replaces every operator's shape, ``--tag`` names the
file ``bench_ops_<backend>_<tag>.json``.

    python -m experiments.bench_ops --jla --repeats 5   # against jax-linear-attention

``--jla``: our XLA chunked forms (``impl="chunked"``) of mamba2 (``ops.xla.la_chunked``),
gated_deltanet (``ops.xla.gdn_chunked``) and loglinear_mamba2 (``ops.xla.loglinear_blocks``) against the
plain-JAX chunked forms of the optional peer package ``jax-linear-attention`` (``jla``: ``simple_gla``,
``gated_delta_rule``, ``log_linear_simple_gla_chunked``, at ``scale=1``, the same operators) at
T = 4096 and 16384 (B = 1, H = 4, d = dv = 64, chunk 64): forward+backward, the two forms
compiled side by side and timed in alternating rounds (one call each per round, ``--repeats``
rounds, medians), with the relative difference of their outputs and the machine's load average.
Written to ``bench_ops_jla_<backend>[_<tag>].{json,md}``; without ``jla`` installed only our
forms are timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments import common
from hla_jax import ops
from hla_jax.core import fenwick

# name -> (forward+backward target, shape)
HLA = dict(B=1, H=4, T=16384, d=64, dv=64)
LOGLIN = dict(B=1, H=2, T=65536, d=64, dv=64)
OPERATORS = {
    "linear_attention": (lambda q, k, v, g, impl: ops.linear_attention(q, k, v, g, impl=impl), HLA),
    "hla2": (lambda q, k, v, g, impl: ops.hla2(q, k, v, g, impl=impl), HLA),
    "hla2_normalized": (lambda q, k, v, g, impl: ops.hla2(q, k, v, g, normalize=True, impl=impl), HLA),
    "ahla": (lambda q, k, v, g, impl: ops.ahla(q, k, v, g, impl=impl), HLA),
    "hla3": (lambda q, k, v, g, impl: ops.hla3(q, k, v, g, impl=impl), HLA),
    "hla3_paper": (lambda q, k, v, g, impl: ops.hla3(q, k, v, None, mask="paper", impl=impl), HLA),
    "mamba2": (lambda q, k, v, g, impl: ops.mamba2(q, k, v, g, impl=impl), LOGLIN),
    "loglinear_mamba2": (
        lambda q, k, v, g, lam, impl: ops.loglinear_mamba2(q, k, v, g, lam, impl=impl), LOGLIN),
    "gated_deltanet": (
        lambda q, k, v, g, beta, impl: ops.gated_deltanet(q, k, v, g, beta, impl=impl), LOGLIN),
    "loglinear_gated_deltanet": (
        lambda q, k, v, g, beta, lam, impl: ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl=impl),
        LOGLIN),
}
# log-linear operator -> its plain twin, for the cost ratio at the same shape
PLAIN_TWIN = {"loglinear_mamba2": "mamba2", "loglinear_gated_deltanet": "gated_deltanet"}


def make_inputs(name, shape, dtype, seed=0):
    B, H, T, d, dv = (shape[x] for x in ("B", "H", "T", "d", "dv"))
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, H, d)) / np.sqrt(d)
    k = r.normal(size=(B, T, H, d))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.normal(size=(B, T, H, dv))
    g = -r.uniform(0.0, 0.1, size=(B, T, H))
    args = [q, k, v, g]
    if "gated_deltanet" in name:
        args.append(r.uniform(0.1, 0.9, size=(B, T, H)))
    if name.startswith("loglinear"):
        args.append(r.uniform(0.5, 1.5, size=(B, T, H, fenwick.num_levels(T))))
    return [jnp.asarray(a, dtype) for a in args]


def bench(name, shape, dtype, repeats, impl="chunked"):
    fn = functools.partial(OPERATORS[name][0], impl=impl)
    args = make_inputs(name, shape, dtype)
    argnums = tuple(range(len(args)))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2) * 1e-6, argnums=argnums))
    compiled = grad.lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes) if mem is not None else None
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        if not all(bool(jnp.all(jnp.isfinite(x))) for x in out):
            raise FloatingPointError(f"{name}: non-finite gradient")
    return {"op": name, "impl": impl, **shape, "dtype": jnp.dtype(dtype).name,
            "median_s": statistics.median(times),
            "times_s": times, "peak_bytes": peak}


def write(path, rows) -> dict:
    """Add each log-linear row's ratios to its plain twin (same impl) and write the record."""
    by = {(r["op"], r["impl"]): r for r in rows if "error" not in r}
    for r in by.values():
        twin = by.get((PLAIN_TWIN.get(r["op"], ""), r["impl"]))
        if twin is not None:
            r["time_ratio_to_plain"] = r["median_s"] / twin["median_s"]
            r["memory_ratio_to_plain"] = r["peak_bytes"] / twin["peak_bytes"]
    record = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
              "host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    common.write_json(path, record)
    return record


JLA_SHAPE = dict(B=1, H=4, d=64, dv=64)
JLA_T = (4096, 16384)


def jla_pairs():
    """``{operator: (ours, jla's)}``: forward callables on ``make_inputs``' arguments; jla's are
    None when the package is missing."""
    ours = {
        "mamba2": lambda q, k, v, g: ops.mamba2(q, k, v, g, impl="chunked"),
        "gated_deltanet": lambda q, k, v, g, beta: ops.gated_deltanet(q, k, v, g, beta, impl="chunked"),
        "loglinear_mamba2": lambda q, k, v, g, lam: ops.loglinear_mamba2(q, k, v, g, lam, impl="chunked"),
    }
    try:
        from jla.ops import chunked as jla
        from jla.ops.log_linear import log_linear_simple_gla_chunked
    except ImportError:
        print("jla (jax-linear-attention) is not installed: timing our forms only")
        return {name: (f, None) for name, f in ours.items()}
    theirs = {
        "mamba2": lambda q, k, v, g: jla.simple_gla(q, k, v, g, scale=1.0)[0],
        "gated_deltanet": lambda q, k, v, g, beta: jla.gated_delta_rule(q, k, v, g, beta, scale=1.0)[0],
        "loglinear_mamba2": lambda q, k, v, g, lam: log_linear_simple_gla_chunked(
            q, k, v, g, lam, scale=1.0)[0],
    }
    return {name: (f, theirs[name]) for name, f in ours.items()}


def bench_pair(name, shape, fns, rounds):
    """Forward+backward of each form in ``fns`` (None: skipped), compiled side by side and timed
    in alternating rounds (one call each per round, the order reversed every other round)."""
    args = make_inputs(name, shape, jnp.float32)
    argnums = tuple(range(len(args)))
    calls = {}
    with jax.default_matmul_precision("highest"):
        for form, fn in fns.items():
            if fn is not None:
                grad = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2) * 1e-6, argnums=argnums))
                calls[form] = functools.partial(grad.lower(*args).compile(), *args)
                jax.block_until_ready(calls[form]())  # warm-up
        outs = {form: np.asarray(jax.jit(fns[form])(*args), np.float64) for form in calls}
    times = {form: [] for form in calls}
    for r in range(rounds):
        for form in list(calls)[::1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[form]())
            times[form].append(time.perf_counter() - t0)
    row = {"op": name, **shape, "dtype": "float32"}
    for form in fns:
        row[f"{form}_s"] = statistics.median(times[form]) if form in times else None
        row[f"{form}_times_s"] = times.get(form)
    if len(outs) == 2:
        row["ratio"] = row["ours_s"] / row["jla_s"]
        row["output_rel_diff"] = float(np.linalg.norm(outs["ours"] - outs["jla"])
                                       / np.linalg.norm(outs["jla"]))
    return row


def jla_table(rows, rounds) -> str:
    def ms(x):
        return "–" if x is None else f"{1e3 * x:.1f}"

    head = (f"{jax.devices()[0].device_kind} ({jax.default_backend()}), float32, forward+backward, "
            f"median of {rounds} alternating rounds; load average {rows[0]['load']} before, "
            f"{rows[-1]['load_after']} after\n\n")
    return head + common.markdown_table(
        ["op", "T", "ours ms", "jla ms", "ours / jla", "output rel. diff"],
        [[r["op"], r["T"], ms(r["ours_s"]), ms(r["jla_s"]),
          "–" if r.get("ratio") is None else f"{r['ratio']:.2f}",
          "–" if r.get("output_rel_diff") is None else f"{r['output_rel_diff']:.1e}"] for r in rows])


def main_jla(a, names, override, path):
    """``--jla``: our chunked forms against jla's (those of ``names``), written to ``path`` (.json
    and .md)."""
    Ts = [override["T"]] if "T" in override else JLA_T
    rows = []
    for name, (ours, theirs) in jla_pairs().items():
        for T in Ts if name in names else ():
            shape = {**JLA_SHAPE, **override, "T": T}
            load = round(os.getloadavg()[0], 2)
            row = bench_pair(name, shape, {"ours": ours, "jla": theirs}, a.repeats)
            rows.append({**row, "load": load, "load_after": round(os.getloadavg()[0], 2)})
            tqdm.write(f"{name} T={T}: ours {row['ours_s']:.4f} s"
                       + ("" if row["jla_s"] is None else f", jla {row['jla_s']:.4f} s"))
            common.write_json(path + ".json", {"rows": rows})
    print(common.write_markdown(path + ".md", jla_table(rows, a.repeats)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated operator names (default: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--scale", type=float, default=1.0, help="multiply T by this (quick runs)")
    p.add_argument("--impls", default="chunked", help="comma-separated forms (ops' impl=)")
    p.add_argument("--shape", default="", help="e.g. B=1024,H=1,T=256,d=64,dv=64 for every op")
    p.add_argument("--tag", default="", help="file bench_ops_<backend>_<tag>.json")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--jla", action="store_true",
                   help="our chunked forms against jax-linear-attention's (bench_ops_jla_*)")
    a = p.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(OPERATORS)
    unknown = set(names) - set(OPERATORS)
    if unknown:
        p.error(f"unknown operators {sorted(unknown)}; choose from {list(OPERATORS)}")
    impls = [i for i in a.impls.split(",") if i]
    bad = set(impls) - {*ops.registry.IMPLS, "auto"}
    if bad:
        p.error(f"--impls: unknown {sorted(bad)}; choose from {(*ops.registry.IMPLS, "auto")}")
    try:
        override = {k: int(v) for k, v in (kv.split("=") for kv in a.shape.split(",") if kv)}
    except ValueError:
        p.error(f"--shape must look like B=1024,H=1,T=256,d=64,dv=64, got {a.shape!r}")
    if set(override) - {"B", "H", "T", "d", "dv"}:
        p.error(f"--shape takes B, H, T, d, dv; got {sorted(override)}")
    backend = jax.default_backend()
    os.makedirs(a.out, exist_ok=True)
    suffix = f"{backend}{'_' + a.tag if a.tag else ''}"
    if a.jla:
        return main_jla(a, names, override, os.path.join(a.out, f"bench_ops_jla_{suffix}"))
    path = os.path.join(a.out, f"bench_ops_{suffix}.json")
    rows = []
    for name, impl in tqdm([(n, i) for n in names for i in impls], desc="fwd+bwd", unit="op"):
        shape = {**OPERATORS[name][1], **override}
        shape["T"] = int(shape["T"] * a.scale)
        try:
            rows.append(bench(name, shape, jnp.dtype(a.dtype), a.repeats, impl))
            r = rows[-1]
            tqdm.write(f"{name} ({impl}): {r['median_s']:.4f} s, peak {r['peak_bytes'] / 2**20:.0f} MiB")
        except (ValueError, NotImplementedError, FloatingPointError) as e:
            rows.append({"op": name, "impl": impl, **shape, "error": f"{type(e).__name__}: {e}"})
            tqdm.write(f"{name} ({impl}): {rows[-1]['error']}")
        record = write(path, rows)  # after every row: a run cut short keeps what it measured
    print(f"\n{common.provenance_line()}\n\n{record['device']} ({backend}), {a.dtype}, "
          f"forward+backward, median of {a.repeats}")
    print("| op | impl | B | H | T | d | dv | median s | peak MiB | × plain (time / memory) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['op']} | {r['impl']} | {r['B']} | {r['H']} | {r['T']} | {r['d']} | {r['dv']} | "
                  f"{r['error'][:60]} | | |")
            continue
        ratio = (f"{r['time_ratio_to_plain']:.2f} / {r['memory_ratio_to_plain']:.2f}"
                 if "time_ratio_to_plain" in r else "")
        print(f"| {r['op']} | {r['impl']} | {r['B']} | {r['H']} | {r['T']} | {r['d']} | {r['dv']} | "
              f"{r['median_s']:.4f} | {r['peak_bytes'] / 2**20:.0f} | {ratio} |")
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
