"""Multi-GPU runs: sequence-parallel operators, exactness of sharded training, LM throughput.

    python -m experiments.multi_gpu ops     # hla2, loglinear_mamba2 with T sharded over N devices
    python -m experiments.multi_gpu exact   # data × sequence meshes reproduce one-device losses
    python -m experiments.multi_gpu train   # the ~150M LM with mesh.sequence=N

Each part writes ``<out>/multi_gpu_<part>_<device>.json`` and ``.md`` (``<device>``: the device
kind and count, e.g. ``NVIDIA_H200x2``; with their provenance) after every measurement, so a run
cut off keeps what finished, and prints the table at the end. Rows are keyed by ``name``; rows
of an earlier run with other names stay in the file (``train --mixers hla2`` then ``--mixers
loglinear_mamba2`` fill one file). ``--devices N``: the first N local devices (default all);
``--budget S``: no new measurement starts after S seconds (those left are listed under
``not_run``).

ops    ``ops.hla2`` (no decay, as in the LM) and ``ops.loglinear_mamba2``, ``impl="chunked"``,
       ``[B,T,H,d]`` inputs (``--dtype``, default bf16), H=16, d=dv=128, T=131072: forward +
       backward (``jax.grad`` of ``sum(o*w)`` w.r.t. q, k, v; median of ``--repeats``) with the
       time axis sharded over N devices (``jax.shard_map`` over mesh axis "sequence",
       ``seq_axis="sequence"``) against the same call unsharded on one device at T/N (the
       per-device shapes), and the all-gather bytes received per device, read from the lowered
       sharded forward, against ``(P−1)·B·H·|s|·4`` (``|s|``: the floats of one device's summary
       per batch row and head, ``OPS``).
exact  a small float32 LM (``configs/lm.py`` tiny, ``--pattern hla2+loglinear_mamba2``) trained
       ``--steps`` steps on ``mesh.sequence=N`` and, for N >= 4, ``mesh.data=2 ×
       mesh.sequence=N/2``, against one device: max relative loss difference per step, pass
       when <= ``--tol``. Exit status 1 when a mesh fails.
train  the ~150M LM (d_model 1024, 12 layers, 8 heads of 128, bf16 compute; ``--impl chunked``)
       per mixer: ``mesh.sequence=N`` at context T (default 32768); a data-parallel run at the
       same tokens per step (``mesh.data=N``, batch × N rows of T/N), whose step time minus the
       sharded one bounds the time in collectives and imbalance (``method`` in the JSON); with
       ``--compare_one`` one device at the sharded config (loss differences; an out-of-memory
       error is recorded as a row, the run goes on).

Commands on the H200 machines. NVLink multicast stays off: those machines set
``NCCL_NVLS_ENABLE=0``; do not unset it. The times are estimates, not measurements: from the
one-H200 runs of ``train_throughput.py`` (a chunked 150M program compiles in 25-40 s, a run costs
about 50 s besides its steps; log-linear Mamba-2 steps 0.55 s at 32768 tokens on one device) and
the operators' sizes (at 65536 tokens per device XLA's memory analysis on the CPU gives 13 GiB for
the forward+backward of hla2, 32 GiB for loglinear_mamba2). ``--budget`` keeps each command
inside about 8 minutes.

2 × H200: two commands, about 3-4 and 6-7 minutes:

    python -m experiments.multi_gpu ops --budget 300 && python -m experiments.multi_gpu exact
    python -m experiments.multi_gpu train --budget 360

4 × H200: the same two commands, about 3-4 and 6-7 minutes (T=131072 is 32768 tokens per device
for the operators; the LM's context stays 32768, 8192 per device; ``exact`` adds data=2 ×
sequence=2):

    python -m experiments.multi_gpu ops --budget 300 && python -m experiments.multi_gpu exact
    python -m experiments.multi_gpu train --budget 360
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from experiments import common
from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.nn import LM, ModelConfig, param_count
from hla_jax.train import read_metrics, train_and_evaluate

# name -> (operator on (q, k, v, g, lam), |s| per batch row and head as text and as f(d, dv, L))
OPS = {
    "hla2": (lambda q, k, v, g, lam, **kw: ops.hla2(q, k, v, **kw),
             "2 + d² + d·dv", lambda d, dv, L: 2 + d * d + d * dv),
    "loglinear_mamba2": (lambda q, k, v, g, lam, **kw: ops.loglinear_mamba2(q, k, v, g, lam, **kw),
                         "1 + L·d·dv", lambda d, dv, L: 1 + L * d * dv),
}

METHOD = {
    "ops": "forward+backward = one jitted jax.grad of sum(o*w) w.r.t. q, k, v (o float32); the "
           "first call (compilation) is timed apart, then the median of --repeats calls, each "
           "ended by block_until_ready. sharded: jax.shard_map over the 1-D mesh axis 'sequence' "
           "of N devices, inputs generated in place time-sharded; one: the same call unsharded "
           "on one device at T/N (the per-device shapes; lam keeps the L levels of the global "
           "T). bytes: the all-gather operands of the lowered sharded forward (StableHLO) "
           "summed and times (P-1), against (P-1)*B*H*|s|*4.",
    "exact": "train_and_evaluate on configs/lm.py (size tiny, float32, impl chunked, matmuls at "
             "--precision) for --steps steps, metrics every step; the same data and init on "
             "each mesh; rel_diff[step] = |loss - loss_one| / |loss_one|.",
    "train": "tokens/s from the trainer's meter: steps 2..--steps (the first, with its "
             "compilation, excluded), metrics fetched every step (log_every=1) in every run. "
             "step_s = tokens per step / tokens/s. collective_bound_s = step_s(mesh.sequence=N) "
             "- step_s(mesh.data=N at T/N, batch x N): the data-parallel run computes the same "
             "tokens, one shard's worth per device, with the same gradient all-reduce and no "
             "sequence collectives, so the difference is an upper bound on the time in the "
             "sequence-parallel collectives plus load imbalance (it also holds the compute the "
             "sharded program adds: the P-1 summary combines, the log-linear levels of earlier "
             "shards). An estimate from two timings, not a profile: no collective is timed.",
}


class Results:
    """One part's rows in ``<out>/multi_gpu_<part>_<device>.json`` and ``.md``, rewritten on every
    ``add``; ``columns``: ``(header, row -> cell)`` pairs of the Markdown table."""

    def __init__(self, a, part: str, devices, columns):
        tag = f"{devices[0].device_kind}x{len(devices)}".replace(" ", "_")
        self.stem = pathlib.Path(a.out) / f"multi_gpu_{part}_{tag}"
        self.rows = common.read_json(f"{self.stem}.json").get("rows", [])
        self.head = {"part": part, "date": time.strftime("%Y-%m-%d %H:%M"),
                     "device_kind": devices[0].device_kind, "devices": [str(d) for d in devices],
                     "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                     "args": dict(vars(a)), "method": METHOD[part],
                     "not_run": []}
        self.columns = columns
        self.start = time.perf_counter()

    def over_budget(self, name: str, budget: float) -> bool:
        """True (and ``name`` listed as not run) once ``budget`` seconds have passed (0 = never)."""
        if budget and time.perf_counter() - self.start > budget:
            self.head["not_run"].append(name)
            self.write()
            print(f"budget of {budget:.0f} s spent: {name} not run", flush=True)
            return True
        return False

    def add(self, row: dict):
        """Write ``row``, in the place of the row of the same name if there is one."""
        names = [r["name"] for r in self.rows]
        if row["name"] in names:
            self.rows[names.index(row["name"])] = row
        else:
            self.rows.append(row)
        self.write()
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)

    def table(self) -> str:
        return common.markdown_table([h for h, _ in self.columns],
                                     [[cell(r) for _, cell in self.columns] for r in self.rows])

    def write(self):
        common.write_json(f"{self.stem}.json", {**self.head, "rows": self.rows})
        common.write_markdown(f"{self.stem}.md", self.table())


def attempt(measure) -> dict:
    """``measure()``, or ``{"error": ...}`` when it raises (an out-of-memory device, a refused
    configuration): recorded as the row, and the run goes on."""
    try:
        return measure()
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        return {"error": f"{type(e).__name__}: {first[:300]}"}


def num(x, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def ms(seconds) -> str:
    return num(None if seconds is None else 1e3 * seconds, ".1f")


# ---------------------------------------------------------------------------------------- ops


def op_inputs(B, T, H, d, L, dtype, sharding, seed=0):
    """``(q, k, v, g, lam, w)`` made on the devices of ``sharding`` (time axis 1): unit-norm
    ``q, k: [B,T,H,d]``, ``v: [B,T,H,d]``, log-decay ``g: [B,T,H]`` in [−0.5, 0], ``lam:
    [B,T,H,L]`` in [0.2, 1.5], cotangent ``w: [B,T,H,d]`` float32."""
    def make(key):
        kq, kk, kv, kg, kl, kw = jax.random.split(key, 6)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        q = unit(jax.random.normal(kq, (B, T, H, d)))
        k = unit(jax.random.normal(kk, (B, T, H, d)))
        v = jax.random.normal(kv, (B, T, H, d))
        g = -0.5 * jax.random.uniform(kg, (B, T, H))
        lam = jax.random.uniform(kl, (B, T, H, L), minval=0.2, maxval=1.5)
        return (*(x.astype(dtype) for x in (q, k, v, g, lam)), jax.random.normal(kw, (B, T, H, d)))

    return jax.jit(make, out_shardings=sharding)(jax.random.key(seed))


def fwd_bwd(f):
    """Jitted ``(q, k, v, g, lam, w) -> ∇_{q,k,v} sum(f(q, k, v, g, lam) * w)``."""
    loss = lambda q, k, v, g, lam, w: jnp.sum(f(q, k, v, g, lam) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timed(f, args, repeats: int) -> dict:
    """``first_s`` (the call that compiles) and ``median_ms`` of ``repeats`` further calls."""
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "median_ms": 1e3 * statistics.median(times)}


def measure_op(a, name, devices) -> dict:
    """One operator: sharded over ``devices`` at T, one device at T/N, all-gather bytes."""
    entry, text, size = OPS[name]
    n, B, T, H, d = len(devices), a.batch, a.T, a.H, a.d
    L = fenwick.num_levels(T)
    kw = {"impl": "chunked", "chunk_size": a.chunk}
    mesh = jax.make_mesh((n,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    spec = P(None, "sequence")
    sharded = jax.shard_map(functools.partial(entry, seq_axis="sequence", **kw), mesh=mesh,
                            in_specs=(spec,) * 5, out_specs=spec)
    args = op_inputs(B, T, H, d, L, a.dtype, NamedSharding(mesh, spec))
    row = {"sharded": timed(fwd_bwd(sharded), args, a.repeats)}
    measured = ops.sequence.gathered_bytes(jax.jit(sharded).lower(*args[:5]).as_text(), n)
    del args
    one = op_inputs(B, T // n, H, d, L, a.dtype, SingleDeviceSharding(devices[0]))
    row["one"] = timed(fwd_bwd(functools.partial(entry, **kw)), one, a.repeats)
    formula = (n - 1) * B * H * size(d, d, L) * 4
    return row | {"ratio": row["sharded"]["median_ms"] / row["one"]["median_ms"],
                  "bytes_measured": measured, "bytes_formula": formula, "summary": text,
                  "bytes_ok": measured == formula}


def part_ops(a, devices) -> Results:
    n = len(devices)
    res = Results(a, "ops", devices, [
        ("operator", lambda r: r["name"]), ("T", lambda r: r["T"]), ("N", lambda r: r["devices"]),
        ("sharded ms", lambda r: num(r.get("sharded", {}).get("median_ms"), ".2f")),
        ("one device at T/N ms", lambda r: num(r.get("one", {}).get("median_ms"), ".2f")),
        ("sharded / one", lambda r: num(r.get("ratio"), ".3f")),
        ("all-gather bytes per device", lambda r: num(r.get("bytes_measured"), ",")),
        (r"(P−1)·B·H·\|s\|·4", lambda r: rf"{num(r.get('bytes_formula'), ',')} (\|s\| = {r.get('summary')})"),
        ("error", lambda r: r.get("error", ""))])
    for name in a.ops.split(","):
        if res.over_budget(name, a.budget):
            continue
        settings = {"name": name, "T": a.T, "devices": n, "B": a.batch, "H": a.H, "d": a.d,
                    "dv": a.d, "dtype": a.dtype, "chunk": a.chunk, "repeats": a.repeats}
        res.add(settings | attempt(functools.partial(measure_op, a, name, devices)))
    return res


# ------------------------------------------------------------------------------- exact, train


def lm_config(a, pattern: str, size: str, mesh: dict, seq_len: int, batch: int):
    """``configs/lm.py`` at ``size`` with the width, depth, operator and data settings of ``a``,
    quiet (no eval, bar or samples), metrics every step, on ``mesh`` (axis sizes, the others 1);
    the log-linear levels are those of the global ``a.T`` whatever ``seq_len``."""
    c = common.quiet(common.get_config("lm", f"pattern={pattern},size={size}"))
    c.model.update(d_model=a.d_model, n_layers=a.layers, n_heads=max(a.d_model // a.head_dim, 1),
                   chunk_size=a.chunk, impl=a.impl, dtype=a.dtype, max_seq_len=max(seq_len, 2048),
                   num_levels=fenwick.num_levels(a.T))
    c.data.update(seq_len=seq_len, batch_size=batch)
    c.optim.update(warmup_steps=max(a.steps // 2, 1))
    c.train.update(num_steps=a.steps, log_every=1, eval_steps=0)
    c.mesh.update(dict(data=1, fsdp=1, sequence=1, tensor=1) | mesh)
    return c


def train_run(c) -> dict:
    """``train_and_evaluate(c)`` in a temporary workdir: per-step losses, tokens/s, MFU."""
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        out = train_and_evaluate(c, workdir)
        wall = time.perf_counter() - t0
        losses = [r["loss"] for r in read_metrics(workdir, "train")]
    devices = c.mesh.data * c.mesh.sequence
    tokens = c.data.batch_size * c.data.seq_len
    tok_s = out["train"]["tokens_per_s"]
    return {"losses": losses, "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / devices,
            "step_s": tokens / tok_s, "mfu": out["train"]["mfu"], "wall_s": wall}


def rel_diff(losses, ref) -> list:
    return [abs(x - y) / abs(y) for x, y in zip(losses, ref)]


def first_last(r) -> str:
    return f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}" if r.get("losses") else "–"


def part_exact(a, devices) -> Results:
    n = len(devices)
    meshes = {"one device": {}, f"sequence={n}": dict(sequence=n)}
    if n >= 4 and n % 2 == 0:
        meshes[f"data=2 sequence={n // 2}"] = dict(data=2, sequence=n // 2)
    res = Results(a, "exact", devices, [
        ("mesh", lambda r: r["name"]), ("T", lambda r: r["T"]), ("loss step 1 → last", first_last),
        ("max rel. diff to one device", lambda r: num(r.get("max_rel_diff"), ".1e")),
        (f"pass (<= {a.tol:g})", lambda r: r.get("pass", "–")), ("error", lambda r: r.get("error", ""))])
    rows = []
    for name, mesh in meshes.items():
        if res.over_budget(name, a.budget):
            continue
        c = lm_config(a, a.pattern, "tiny", mesh, a.T, a.batch)
        with jax.default_matmul_precision(a.precision):
            row = {"name": name, "mesh": mesh, "T": a.T, "batch": a.batch, "steps": a.steps} | attempt(
                functools.partial(train_run, c))
        if rows and "losses" in rows[0] and "losses" in row:  # rows[0]: one device
            row["rel_diff"] = rel_diff(row["losses"], rows[0]["losses"])
            row["max_rel_diff"] = max(row["rel_diff"])
            row["pass"] = len(row["losses"]) == a.steps and row["max_rel_diff"] <= a.tol
        rows.append(row)
        res.add(row)
    res.head["passed"] = (len(rows) == len(meshes) and all("error" not in r for r in rows)
                          and all(r["pass"] for r in rows[1:]))
    ref = rows[0].get("losses", []) if rows else []
    res.head["losses_moved"] = len(ref) > 1 and ref[-1] != ref[0]
    res.write()
    return res


def compared(a, mixer: str, sharded: dict, data: dict, one: dict) -> dict:
    """The sharded run's row with the parameter count, the bound on collectives + imbalance (its
    step time minus the data-parallel one) and its loss differences to one device."""
    cfg = ModelConfig.from_dict(lm_config(a, mixer, "small", {}, a.T, a.batch).model.to_dict())
    out = sharded | {"params": param_count(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))))}
    if "step_s" in data:
        bound = sharded["step_s"] - data["step_s"]
        out |= {"collective_bound_s": bound, "collective_bound_fraction": bound / sharded["step_s"]}
    if "losses" in one:
        out["rel_diff_one"] = rel_diff(sharded["losses"], one["losses"])
        out["max_rel_diff_one"] = max(out["rel_diff_one"])
    return out


def part_train(a, devices) -> Results:
    n = len(devices)
    res = Results(a, "train", devices, [
        ("run", lambda r: r["name"]), ("T × batch", lambda r: f"{r['T']} × {r['batch']}"),
        ("tokens/s", lambda r: num(r.get("tokens_per_s"), ",.0f")),
        ("per device", lambda r: num(r.get("tokens_per_s_per_device"), ",.0f")),
        ("step ms", lambda r: ms(r.get("step_s"))),
        ("MFU", lambda r: common.fmt(r.get("mfu"))), ("loss step 1 → last", first_last),
        ("max rel. loss diff to one device", lambda r: num(r.get("max_rel_diff_one"), ".1e")),
        ("collectives + imbalance ≤ ms", lambda r: ms(r.get("collective_bound_s"))),
        ("error", lambda r: r.get("error", ""))])
    for mixer in a.mixers.split(","):
        runs = {f"sequence={n}": (dict(sequence=n), a.batch, a.T),
                f"data={n} at T/{n}": (dict(data=n), a.batch * n, a.T // n)}
        if a.compare_one:
            runs["one device"] = ({}, a.batch, a.T)
        done = {}
        for label, (mesh, batch, seq_len) in runs.items():
            name = f"{mixer} {label}"
            if res.over_budget(name, a.budget):
                continue
            c = lm_config(a, mixer, "small", mesh, seq_len, batch)
            done[label] = {"name": name, "mixer": mixer, "mesh": label, "T": seq_len,
                           "batch": batch, "steps": a.steps} | attempt(functools.partial(train_run, c))
            res.add(done[label])
        if "losses" in done.get(f"sequence={n}", {}):
            res.add(compared(a, mixer, done[f"sequence={n}"], done.get(f"data={n} at T/{n}", {}),
                             done.get("one device", {})))
    return res


PARTS = {"ops": part_ops, "exact": part_exact, "train": part_train}


def add_shared(s, T: int, batch: int):
    """The flags every part has."""
    s.add_argument("--devices", type=int, default=0, help="the first N local devices (0 = all)")
    s.add_argument("--out", default=str(common.RESULTS), help="results folder")
    s.add_argument("--budget", type=float, default=0,
                   help="seconds; no new measurement starts after it (0 = no limit)")
    s.add_argument("--chunk", type=int, default=64, help="chunk size of the operators")
    s.add_argument("--T", type=int, default=T, help="global sequence length")
    s.add_argument("--batch", type=int, default=batch, help="batch rows (train: of the sharded run)")


def add_lm(s, steps: int, d_model: int, layers: int, head_dim: int):
    """The flags of the parts that train an LM."""
    s.add_argument("--steps", type=int, default=steps, help=">= 2 (the first step compiles)")
    s.add_argument("--d_model", type=int, default=d_model)
    s.add_argument("--layers", type=int, default=layers)
    s.add_argument("--head_dim", type=int, default=head_dim, help="n_heads = d_model / head_dim")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)

    o = sub.add_parser("ops", help="the sharded operators alone")
    add_shared(o, T=131072, batch=1)
    o.add_argument("--ops", default=",".join(OPS), help=f"comma list of {tuple(OPS)}")
    o.add_argument("--H", type=int, default=16)
    o.add_argument("--d", type=int, default=128, help="d = dv")
    o.add_argument("--dtype", default="bfloat16", help="input dtype")
    o.add_argument("--repeats", type=int, default=10)

    e = sub.add_parser("exact", help="sharded meshes reproduce the one-device losses (float32)")
    add_shared(e, T=2048, batch=4)
    add_lm(e, steps=5, d_model=128, layers=2, head_dim=64)
    e.add_argument("--pattern", default="hla2+loglinear_mamba2", help="mixer pattern of the LM")
    e.add_argument("--tol", type=float, default=1e-4, help="max relative loss difference")
    e.add_argument("--precision", default="highest", help="jax.default_matmul_precision")
    e.set_defaults(impl="chunked", dtype="float32")

    t = sub.add_parser("train", help="the ~150M LM, mesh.sequence=N")
    add_shared(t, T=32768, batch=1)
    add_lm(t, steps=10, d_model=1024, layers=12, head_dim=128)
    t.add_argument("--mixers", default="hla2,loglinear_mamba2", help="one LM per mixer")
    t.add_argument("--impl", default="chunked",
                   help="model.impl of every run, chunked or auto (a sequence-sharded mixer runs "
                        "chunked either way: auto gives only the other runs the Pallas kernels)")
    t.add_argument("--dtype", default="bfloat16", help="compute dtype")
    t.add_argument("--compare_one", action=argparse.BooleanOptionalAction, default=True,
                   help="also train on one device at the sharded config")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if getattr(a, "steps", 2) < 2:
        p.error("--steps must be >= 2: the first step, with its compilation, is not timed")
    local = jax.local_devices()
    devices = local[:a.devices or len(local)]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}: {jax.devices()}; "
          f"using {len(devices)} of them", flush=True)
    if len(devices) < 2 or a.devices > len(local):
        raise SystemExit(f"multi_gpu: needs 2 to {len(local)} devices, got --devices={a.devices} "
                         f"of {len(local)}")
    res = PARTS[a.part](a, devices)
    print("\n" + res.table())
    print(f"written {res.stem}.json and .md")
    return 0 if res.head.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
