"""Benchmark our first-order gated linear-attention kernel, the HLA chains built on it, the Gated
DeltaNet and log-linear kernels against the ``jax-linear-attention`` wheel (``jla``), cuDNN causal
attention and our XLA chunked forms, on one GPU.

    python -m experiments.kernels.bench_kernels              # the default methods at T = 2048 … 65536
    python -m experiments.kernels.bench_kernels --T 2048,8192 --name kernels_bench_short --budget 420
    python -m experiments.kernels.bench_kernels --merge a.json,b.json --name kernels_bench_ab
    python -m experiments.kernels.bench_kernels --methods loglinear_mamba2_pallas --tune 8192

Methods (``methods()``), each ``fn(q, k, v, g, beta, lam)``:

- ``mamba2_pallas``: ``ops.mamba2(impl="pallas")``, i.e. ``hla_jax.kernels.la_pallas``;
- ``hla2_pallas``, ``ahla_pallas``, ``hla3_pallas``: ``ops.<op>(impl="pallas")``, the docs/math.md#chains
  chains of two ``la_pallas`` calls;
- ``gated_deltanet_pallas``: ``ops.gated_deltanet(impl="pallas")``, i.e.
  ``hla_jax.kernels.gated_deltanet_pallas`` (a few long rows cut into pieces, ``default_pieces``);
- ``jla_simple_gla``, ``jla_gated_deltanet``: the wheel's Mosaic GPU kernels at ``scale=1`` (our
  operators do not scale q);
- ``cudnn_causal``: ``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")``;
- ``mamba2_xla_chunked``, ``gated_deltanet_xla_chunked``, ``<op>_xla_chunked``: ``impl="chunked"``;
- only when named in ``--methods``: log-linear Mamba-2's block form (``loglinear_mamba2_blocks``:
  ``impl="chunked"``, ``ops.xla.loglinear_blocks``) and its Pallas kernels (``loglinear_mamba2_pallas``),
  log-linear Gated DeltaNet's kernel and block form (``loglinear_gdn_pallas``,
  ``loglinear_gdn_blocks``: ``impl="chunked"``, ``ops.xla.loglinear_gdn_blocks``; ``loglinear_gdn_blocks_ut``:
  the same block form with its chunk terms from the first-order kernel's UT transform,
  ``terms="kernel"``, which ``impl="auto"`` takes on a Hopper GPU) and the wheel's plain-JAX
  ``jla_log_linear_simple_gla``, which runs out of memory at B·T = 65536, so it and a twin row of
  our kernel (``loglinear_mamba2_pallas_16k``) run at B·T = 16384 (``SMALL_TOKENS``); and the
  two log-linear operators continuing a state at position ``T`` (``loglinear_mamba2_state_pallas``,
  ``loglinear_gdn_state_pallas``: the kernels composed by
  ``ops.levels.from_state``; ``…_state_chunked``: the counter form
  ``impl="auto"`` takes for states).

The default ``--methods`` (``DEFAULT_METHODS``) are the ones ``TARGETS`` compare plus the XLA rows.
A method whose import fails (``jla`` not installed) is reported unavailable and skipped. The targets
are ratios of median times of two methods at the same T, measured in the same process, so runs split
by T (then ``--merge``d) keep every ratio within one run. The methods a target names run first, at
every T, then the others. ``--budget`` seconds: no new (method, T) pair starts after it. The JSON
and Markdown are rewritten after every pair, so a run cut off keeps what finished. ``--tune T``
first picks ``loglinear_mamba2_pallas``'s value tile at that T.

bf16, ``--shape H,d,dv`` (default 16,128,128), B·T = ``--tokens``; q and k L2-normalised per token
and head (the HLA chains' sums grow with their order), per-token log-decays ``g`` in (−0.1, 0].
Forward and forward+backward (gradient of ``sum(o·w)`` w.r.t. q, k, v, g, β, λ, recorded as
``grad_wrt``) median wall times (ms) over
``--repeats`` runs after a warm-up, next to a bf16 ``--matmul_n``³ matmul timed in the same run;
with ``--rounds R`` the methods of each input set are timed ``R`` times, interleaved (one pass
over the methods a round, after all have compiled), and each keeps its rounds and their median
(a single pass can decide a target at its edge: the machine's speed drifts between passes).
Writes ``<out>/<name>.json`` (with its ``provenance``) and ``.md``: one row per method, then the
targets, each met or missed.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments import common
from hla_jax import kernels, ops
from hla_jax.core import fenwick
from hla_jax.core.state import LevelState
from hla_jax.ops.xla import loglinear_gdn_blocks

HLA = ("hla2", "ahla", "hla3")


class Shape(NamedTuple):
    """Heads, key (state) width ``d`` and value width ``dv`` of a benchmark."""
    H: int = 16
    d: int = 128
    dv: int = 128


class Target(NamedTuple):
    """``time(num) / time(den) <cmp> bound`` at ``T`` (None: at every T measured)."""
    num: str
    den: str
    cmp: str
    bound: float
    T: int | None = None

    @property
    def ratio(self) -> str:
        return f"{self.num} / {self.den}"


COMPARE = {"<=": (operator.le, "≤"), ">=": (operator.ge, "≥")}
TARGETS = [
    Target("mamba2_pallas", "jla_simple_gla", "<=", 1.2),
    Target("hla2_pallas", "mamba2_pallas", "<=", 2.1),
    Target("ahla_pallas", "mamba2_pallas", "<=", 2.1),
    Target("hla3_pallas", "mamba2_pallas", "<=", 3.0),
    Target("cudnn_causal", "hla2_pallas", ">=", 3.0, 8192),
    Target("cudnn_causal", "hla2_pallas", ">=", 8.0, 32768),
    Target("gated_deltanet_pallas", "jla_gated_deltanet", "<=", 1.5),
    Target("loglinear_mamba2_pallas", "mamba2_pallas", "<=", 3.0),
    Target("cudnn_causal", "loglinear_mamba2_pallas", ">=", 1.5, 8192),
    Target("loglinear_gdn_pallas", "gated_deltanet_pallas", "<=", 4.0),
    Target("loglinear_gdn_blocks", "gated_deltanet_pallas", "<=", 4.0),
    Target("loglinear_gdn_blocks_ut", "gated_deltanet_pallas", "<=", 4.0),
]
DEFAULT_METHODS = ("mamba2_pallas", "jla_simple_gla", "hla2_pallas", "ahla_pallas", "hla3_pallas",
                   "cudnn_causal", "gated_deltanet_pallas", "jla_gated_deltanet",
                   "mamba2_xla_chunked", "gated_deltanet_xla_chunked", "hla2_xla_chunked",
                   "ahla_xla_chunked", "hla3_xla_chunked")
SMALL_TOKENS = {"jla_log_linear_simple_gla": 16384, "loglinear_mamba2_pallas_16k": 16384}
LOGLINEAR_SETTINGS = [dict(block_v=128, block_v_bwd=128), dict(block_v=64, block_v_bwd=128),
                      dict(block_v=128, block_v_bwd=64)]


def timeit(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def inputs(B, T, shape, seed=0):
    """``q, k, v, g, beta, lam, w``: bf16 q, k (unit rows), v, w and β ∈ (0.1, 0.9); float32
    per-token log-decays ``g ∈ (−0.1, 0]`` and λ ∈ (0.5, 1.5) with ⌈log2 T⌉+1 levels."""
    H, d, dv = shape
    kq, kk, kv, kg, kb, kl, kw = jax.random.split(jax.random.key(seed), 7)

    def unit(key):
        x = jax.random.normal(key, (B, T, H, d), jnp.float32)
        return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)

    return (unit(kq), unit(kk), jax.random.normal(kv, (B, T, H, dv), jnp.bfloat16),
            -jax.random.uniform(kg, (B, T, H), jnp.float32, 0.0, 0.1),
            jax.random.uniform(kb, (B, T, H), jnp.bfloat16, 0.1, 0.9),
            jax.random.uniform(kl, (B, T, H, fenwick.num_levels(T)), jnp.float32, 0.5, 1.5),
            jax.random.normal(kw, (B, T, H, dv), jnp.bfloat16))


def fwd_bwd(fn):
    """``jit(grad)`` of ``sum(fn(q, k, v, g, beta, lam) * w)`` w.r.t. every input (the gates
    train too; a method that ignores one gets zeros for it)."""
    loss = lambda q, k, v, g, beta, lam, w: jnp.sum(fn(q, k, v, g, beta, lam).astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _ready(fn):
    """A method with nothing to import."""
    return lambda: fn


def _op(name, impl):
    """``ops.<name>(q, k, v, g, impl=impl)``."""
    return _ready(lambda q, k, v, g, beta, lam: getattr(ops, name)(q, k, v, g, impl=impl))


def _gdn(impl):
    """``ops.gated_deltanet(q, k, v, g, beta, impl=impl)``."""
    return _ready(lambda q, k, v, g, beta, lam: ops.gated_deltanet(q, k, v, g, beta, impl=impl))


def _jla(kind, impl, gates):
    """``jla.ops.linear_attention(kind, …, scale=1.0)`` with the gates ``gates(q, g, beta, lam)``."""
    def make():
        from jla.ops import linear_attention
        return lambda q, k, v, g, beta, lam: linear_attention(
            kind, q, k, v, scale=1.0, impl=impl, **gates(q, g, beta, lam))[0]
    return make


def _jla_level_scales(q, g, beta, lam):
    """``g`` and λ with the wheel's own level count (λ = 1 on levels it has and we don't)."""
    from jla.ops.log_linear import num_levels

    L = num_levels(q.shape[1])
    scales = lam[..., :L] if lam.shape[-1] >= L else jnp.pad(
        lam, ((0, 0),) * 3 + ((0, L - lam.shape[-1]),), constant_values=1.0)
    return dict(g=g, level_scales=scales)


def _from_state(name, impl):
    """``ops.<name>(…, impl=impl)`` continuing a ``LevelState`` at position ``T`` (a prompt of
    ``T`` tokens before the row: λ gets the one more level that ``2T`` needs), returning the
    output plus the final state's mean (so the backward goes through both)."""
    def fn(q, k, v, g, beta, lam):
        B, T, H, d = q.shape
        lam = jnp.pad(lam, ((0, 0),) * 3 + ((0, 1),), constant_values=1.0)
        H0 = jnp.full((lam.shape[-1], B, H, d, v.shape[-1]), 0.01, jnp.float32)
        state = LevelState(H0, jnp.full((B,), T, jnp.int32))
        extra = (beta,) if name == "loglinear_gated_deltanet" else ()
        o, st = getattr(ops, name)(q, k, v, g, *extra, lam, impl=impl, initial_state=state,
                                   return_final_state=True)
        return o + jnp.mean(st.H)
    return _ready(fn)


def methods(loglinear_kw=None):
    """``{name: make}``: ``make()`` imports what the method needs (ImportError or AttributeError:
    unavailable here) and returns its ``fn(q, k, v, g, beta, lam)``; ``loglinear_kw``: settings
    of ``loglinear_mamba2_pallas`` (``--tune``)."""
    loglinear = _ready(lambda q, k, v, g, beta, lam: kernels.loglinear_mamba2_pallas(
        q, k, v, g, lam, **(loglinear_kw or {})))
    return {
        "mamba2_pallas": _op("mamba2", "pallas"),
        **{f"{op}_pallas": _op(op, "pallas") for op in HLA},
        "jla_simple_gla": _jla("simple_gla", "mosaic_gpu", lambda q, g, beta, lam: dict(g=g)),
        "jla_gated_deltanet": _jla("gated_deltanet", "mosaic_gpu",
                                   lambda q, g, beta, lam: dict(g=g, beta=beta)),
        "cudnn_causal": _ready(lambda q, k, v, g, beta, lam: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")),
        "gated_deltanet_pallas": _gdn("pallas"),
        "mamba2_xla_chunked": _op("mamba2", "chunked"),
        "gated_deltanet_xla_chunked": _gdn("chunked"),
        **{f"{op}_xla_chunked": _op(op, "chunked") for op in HLA},
        "loglinear_mamba2_pallas": loglinear,
        "loglinear_mamba2_pallas_16k": loglinear,
        "loglinear_mamba2_blocks": _ready(lambda q, k, v, g, beta, lam: ops.loglinear_mamba2(
            q, k, v, g, lam, impl="chunked")),
        "loglinear_gdn_pallas": _ready(lambda q, k, v, g, beta, lam:
                                       kernels.loglinear_gated_deltanet_pallas(q, k, v, g, beta, lam)),
        "loglinear_gdn_blocks": _ready(lambda q, k, v, g, beta, lam: ops.loglinear_gated_deltanet(
            q, k, v, g, beta, lam, impl="chunked")),
        "loglinear_gdn_blocks_ut": _ready(lambda q, k, v, g, beta, lam: loglinear_gdn_blocks.blocks(
            q, k, v, g, beta, lam, 64, "kernel")),
        "jla_log_linear_simple_gla": _jla("log_linear_simple_gla", "chunked", _jla_level_scales),
        **{f"{short}_state_{impl}": _from_state(name, impl)
           for short, name in (("loglinear_mamba2", "loglinear_mamba2"),
                               ("loglinear_gdn", "loglinear_gated_deltanet"))
           for impl in ("pallas", "chunked")},
    }


def measure(name, fn, args, B, T, repeats):
    """``(row, timers)``: one result row, forward and forward+backward median ms (or the error),
    and the pair's wall time, compiles included; ``timers`` the two compiled callables
    (``None`` after an error), for ``more_rounds``."""
    row, timers = dict(method=name, T=T, B=B), None
    t0 = time.perf_counter()
    try:
        timers = (jax.jit(fn), fwd_bwd(fn))
        row["fwd_ms"] = timeit(timers[0], *args[:6], repeats=repeats)
        row["fwd_bwd_ms"] = timeit(timers[1], *args, repeats=repeats)
    except Exception as e:  # record it, go on with the next pair
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        timers = None
    row["wall_s"] = time.perf_counter() - t0
    return row, timers


def more_rounds(group, args, rounds: int, repeats: int):
    """Time the ``(row, timers)`` pairs of one input set ``rounds − 1`` more times, the methods
    interleaved round by round; each row keeps every round's medians (``fwd_ms_rounds``,
    ``fwd_bwd_ms_rounds``) and takes their median as its time."""
    for row, _ in group:
        row["fwd_ms_rounds"], row["fwd_bwd_ms_rounds"] = [row["fwd_ms"]], [row["fwd_bwd_ms"]]
    for _ in range(rounds - 1):
        for row, (fwd, grad) in group:
            row["fwd_ms_rounds"].append(timeit(fwd, *args[:6], repeats=repeats))
            row["fwd_bwd_ms_rounds"].append(timeit(grad, *args, repeats=repeats))
    for row, _ in group:
        row["fwd_ms"], row["fwd_bwd_ms"] = (statistics.median(row[k + "_rounds"])
                                            for k in ("fwd_ms", "fwd_bwd_ms"))


def matmul_tflops(n=8192):
    """TFLOP/s of a bf16 ``n×n @ n×n`` matmul."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    ms = timeit(jax.jit(lambda x, y: x @ y), a, a)
    return 2 * n ** 3 / ms / 1e9


def tune(T, tokens, repeats, shape):
    """Time ``LOGLINEAR_SETTINGS`` of ``loglinear_mamba2_pallas`` at one ``T``; the fastest
    forward+backward's settings (``{}`` if none ran)."""
    B = max(tokens // T, 1)
    args = inputs(B, T, shape)
    best = (float("inf"), {})
    for kw in LOGLINEAR_SETTINGS:
        row, _ = measure("loglinear_mamba2_pallas", methods(kw)["loglinear_mamba2_pallas"](), args,
                         B, T, repeats)
        print(f"tune {kw}: {summary(row)}", flush=True)
        if "fwd_bwd_ms" in row:
            best = min(best, (row["fwd_bwd_ms"], kw), key=lambda x: x[0])
    return best[1]


def summary(row) -> str:
    """One line of a row, for the log."""
    head = f"{row['method']} T={row['T']} B={row['B']}:"
    if "error" in row:
        return f"{head} {row['error']} ({row['wall_s']:.0f} s)"
    return (f"{head} fwd {row['fwd_ms']:.2f} ms, fwd+bwd {row['fwd_bwd_ms']:.2f} ms "
            f"({row['wall_s']:.0f} s with compiles)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="2048,8192,32768,65536")
    p.add_argument("--shape", default="16,128,128",
                   help="H,d,dv (e.g. Mamba-2's 48,128,64: 48 heads, state 128, head dim 64)")
    p.add_argument("--name", default="kernels_bench", help="results go to <out>/<name>.{json,md}")
    p.add_argument("--matmul_n", type=int, default=8192, help="size of the reference bf16 matmul")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="time each input set's methods this many times, interleaved; the median round")
    p.add_argument("--tune", type=int, default=0,
                   help="first pick loglinear_mamba2_pallas's settings at this T")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods to run")
    p.add_argument("--skip", default="", help="comma-separated methods to leave out")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds; no new (method, T) pair starts after it (0 = no limit)")
    p.add_argument("--resume", type=int, default=0,
                   help="1: keep the (method, T) rows already in <out>/<name>.json (from the same "
                        "device and shape) and run only the others")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--merge", default="",
                   help="comma-separated result JSONs of runs at one shape: write them as one <name> "
                        "table (nothing is run)")
    a = p.parse_args(argv)
    if a.merge:
        return write(merge(a.merge.split(",")), a.out, a.name, show=True)
    shape = Shape(*(int(x) for x in a.shape.split(",")))
    tuned = tune(a.tune, a.tokens, a.repeats, shape) if a.tune else {}
    known = methods(tuned)
    names = [n for n in a.methods.split(",") if n and n not in a.skip.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {list(known)}")
    fns, unavailable = {}, {}
    for n in names:
        try:
            fns[n] = known[n]()
        except (ImportError, AttributeError) as e:
            unavailable[n] = f"{type(e).__name__}: {e}"
            print(f"{n} unavailable, skipped: {unavailable[n]}", flush=True)
    mm = matmul_tflops(a.matmul_n)
    print(f"bf16 matmul {a.matmul_n}^3: {mm:.0f} TFLOP/s", flush=True)
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, H=shape.H, d=shape.d,
               dv=shape.dv, tokens=a.tokens, dtype="bfloat16", grad_wrt="q, k, v, g, beta, lam",
               repeats=a.repeats, rounds=a.rounds, matmul_tflops=mm,
               loglinear_settings=tuned, unavailable=unavailable, rows=[])
    Ts = [int(t) for t in a.T.split(",")]
    if a.resume:
        res["rows"] = resumed(os.path.join(a.out, f"{a.name}.json"), res)
    targeted = {n for t in TARGETS for n in (t.num, t.den)}
    order = list(fns)
    ran = {(r["T"], r["method"]) for r in res["rows"]}
    pairs = sorted(((T, n) for T in Ts for n in order if (T, n) not in ran),
                   key=lambda x: (x[1] not in targeted, Ts.index(x[0]), order.index(x[1])))
    t_start, current, group = time.perf_counter(), {}, []

    def rounds():  # the current input set's further rounds
        if a.rounds > 1 and group:
            more_rounds(group, *current.values(), a.rounds, a.repeats)
            print(f"after {a.rounds} rounds: " + "; ".join(summary(r) for r, _ in group), flush=True)
            write(res, a.out, a.name)
        group.clear()

    for i, (T, name) in enumerate(pairs):
        if a.budget and time.perf_counter() - t_start > a.budget:
            print(f"budget of {a.budget:.0f} s spent: {len(pairs) - i} (method, T) pairs not run: "
                  + ", ".join(f"{n}@{t}" for t, n in pairs[i:]), flush=True)
            break
        B = max(SMALL_TOKENS.get(name, a.tokens) // T, 1)
        if (B, T) not in current:  # one input set on the device at a time
            rounds()
            current = {(B, T): inputs(B, T, shape)}
        row, timers = measure(name, fns[name], current[(B, T)], B, T, a.repeats)
        if timers:
            group.append((row, timers))
        res["rows"].append(row)
        print(summary(row), flush=True)
        write(res, a.out, a.name)
    rounds()
    write(res, a.out, a.name, show=True)


def resumed(path, res) -> list[dict]:
    """The rows of an earlier run's ``path`` without an error, when it was on this device at this
    shape (a run resumed on another card starts over: its ratios must come from one card)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        old = json.load(f)
    keys = ("device", "H", "d", "dv", "tokens", "dtype", "repeats", "rounds")
    if any(old.get(k) != res[k] for k in keys):
        print(f"--resume: {path} is from another device or settings; starting over", flush=True)
        return []
    return [r for r in old["rows"] if "error" not in r]


def ratios(res) -> list[dict]:
    """Every target at every T it applies to where one of its methods ran: the forward and
    forward+backward time ratios (None where a side is missing) and whether each meets it."""
    Ts = sorted({r["T"] for r in res["rows"]})
    cell = {(r["method"], r["T"]): r for r in res["rows"]}
    out = []
    for t in TARGETS:
        for T in [T for T in Ts if t.T in (None, T)]:
            num, den = cell.get((t.num, T), {}), cell.get((t.den, T), {})
            if not (num or den):
                continue
            row = dict(ratio=t.ratio, cmp=t.cmp, bound=t.bound, T=T)
            for key in ("fwd_ms", "fwd_bwd_ms"):
                x = num[key] / den[key] if key in num and key in den else None
                row[key.replace("_ms", "")] = x
                row[key.replace("_ms", "_met")] = None if x is None else COMPARE[t.cmp][0](x, t.bound)
            out.append(row)
    return out


def write(res, out, name, show=False):
    """``<out>/<name>.json`` (with this call's provenance) and ``.md`` (a provenance line, then
    ``table``)."""
    res = dict(res, ratios=ratios(res))
    common.write_json(os.path.join(out, f"{name}.json"), res)
    md = common.write_markdown(os.path.join(out, f"{name}.md"), table(res))
    if show:
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
                merged=[os.path.basename(p) for p in paths],
                merged_provenance=[part.get("provenance") for part in parts],
                unavailable={k: v for p in parts for k, v in p.get("unavailable", {}).items()},
                rows=[r for p in parts for r in p["rows"]])


def table(res):
    """Markdown: one row per method (``fwd / fwd+bwd`` ms per T), then the targets."""
    Ts = sorted({r["T"] for r in res["rows"]})
    names = list(dict.fromkeys(r["method"] for r in res["rows"]))
    cell = {(r["method"], r["T"]): r for r in res["rows"]}
    lines = [f"{res['device']}, jax {res['jax']}, bf16, H={res['H']}, d={res['d']}, dv={res['dv']}, "
             f"B·T={res['tokens']}; q, k L2-normalised, per-token gates; median ms, fwd / fwd+bwd"
             + (f" (gradient w.r.t. {res['grad_wrt']})" if res.get("grad_wrt") else "")
             + f"; bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s",
             "", "| method | " + " | ".join(f"T={T}" for T in Ts) + " |",
             "|---" * (len(Ts) + 1) + "|"]
    for n in names:
        cs = []
        for T in Ts:
            r = cell.get((n, T), {})
            cs.append(f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.2f}" if "fwd_bwd_ms" in r else
                      "error" if "error" in r else "–")
        small = f" (B·T={SMALL_TOKENS[n]})" if n in SMALL_TOKENS else ""
        lines.append(f"| {n}{small} | " + " | ".join(cs) + " |")
    if res.get("unavailable"):
        lines += ["", "Unavailable here: " + ", ".join(sorted(res["unavailable"]))]
    if res["ratios"]:
        lines += ["", "Targets: ratio of median times at the same T (one run), forward and "
                  "forward+backward.", "", "| ratio | target | T | fwd | fwd+bwd |", "|---|---|---|---|---|"]
    for r in res["ratios"]:
        cs = ["–" if r[k] is None else f"{r[k]:.2f} {'met' if r[k + '_met'] else 'missed'}"
              for k in ("fwd", "fwd_bwd")]
        lines.append(f"| {r['ratio']} | {COMPARE[r['cmp']][1]} {r['bound']:g} | {r['T']} | "
                     + " | ".join(cs) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
