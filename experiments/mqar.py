"""MQAR sweep in the log-linear paper's setup (Guo et al. 2025, after Zoology, Arora et al. 2023).

    python experiments/mqar.py                        # full sweep: 9 mixers x dims 16/32/64 x
                                                      # pairs 4..64 x 4 lrs, T=256, 2 layers
    python experiments/mqar.py --mixers hla2,softmax --dims 16 --pairs 4 --steps 200 --tag try
    python experiments/mqar.py --shard 0/4 ...        # one of 4 processes (e.g. two per GPU)
    python experiments/mqar.py --merge ...            # fold the shard files into mqar_<tag>.json

One *cell* = (mixer, dim): all its (pairs, lr) runs, 5 x 4 = 20 models by default (at most
``--group`` per program), train together in ONE jitted step. ``hla_jax.train.stacked`` stacks
their states along a leading model axis and vmaps the trainer's own step over it: one compile
per cell, and 20 tiny models fill the GPU where one left it launch-bound. Each model is the
``train_and_evaluate`` run of ``configs/mqar.py`` it stands for (two layers, one head, vocabulary
8192, batch ``--batch``, init seed 0, AdamW with warmup + cosine) at its own peak lr (exact: the
optimizer is linear in the peak, see ``stacked``), except for the random numbers of its data:
batches are drawn on device inside the step by ``MQAR.batch`` (the distribution of
``MQAR.example``), one per pair count and step, shared by the learning rates of that count. A
model whose loss or gradient norm stops being finite is recorded as diverged (accuracy 0 at that
lr); the others go on.

At the end, and every ``--eval_every`` steps (a ``curve`` per run: was it still learning?), every
model is evaluated on a fixed eval set of its pair count (``--eval_steps`` batches of ``--batch``,
from the eval key): ``accuracy`` per query (the paper's metric) and ``row_accuracy`` (all queries
of an example right). For each (mixer, dim, pairs) the best learning rate is kept. Results:
``<out>/mqar_<tag>.json`` (settings; every run, its ``seconds`` the program's wall time shared
out; per-program timings under ``cells``; the best table; the paper's numbers),
``mqar_<tag>.png`` (accuracy vs pairs, one panel per dim) and ``mqar_<tag>.md`` (the Markdown
tables, also printed). Runs already in the JSON are skipped and a cell trains only its missing
runs, so an interrupted sweep resumes at the cell where it stopped; ``--shard i/n`` takes every
n-th cell. Compiled programs go to a persistent cache (``--jit_cache``), shared by shards.

Learning rates: Zoology's MQAR sweeps ``np.logspace(-4, -2, 4)`` (1e-4, 4.6e-4, 2.2e-3, 1e-2),
which is the default here; the log-linear paper says it follows Zoology and keeps the best lr.

Paper numbers (assumption, stated because we could not read the paper's appendix here): the
log-linear paper's MQAR table gives ONE accuracy per model dim (16/32/64) for T=256 with 4 to 64
key-value pairs; we read it as the mean over the pair counts (Zoology reports the accuracy over
all its test configurations pooled), so it is compared with our mean over ``--pairs`` of the
best-lr accuracy. Our per-pair table is printed too, so a reader can compare with the 64-pair
column if the paper meant the hardest setting instead.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402

from experiments import common  # noqa: E402
from hla_jax import data as data_lib  # noqa: E402
from hla_jax.nn import MIXERS  # noqa: E402
from hla_jax.train import stacked  # noqa: E402
from hla_jax.train.steps import eval_summary  # noqa: E402

PAPER_MIXERS = ("softmax", "mamba2", "loglinear_mamba2", "gated_deltanet",
                "loglinear_gated_deltanet", "linear", "hla2", "ahla", "hla3")
# Log-linear paper, MQAR accuracy (%) at model dims 16/32/64; ">=99" stored as 99.0 with a flag.
PAPER = {
    "softmax": {"16": 99.0, "32": 99.0, "64": 99.0},
    "mamba2": {"16": 46.9, "32": 75.1, "64": 89.6},
    "loglinear_mamba2": {"16": 55.9, "32": 76.5, "64": 92.9},
    "gated_deltanet": {"16": 38.4, "32": 79.0, "64": 99.0},
    "loglinear_gated_deltanet": {"16": 40.0, "32": 84.4, "64": 99.0},
}
PAPER_AT_LEAST = {("softmax", "16"), ("softmax", "32"), ("softmax", "64"),
                  ("gated_deltanet", "64"), ("loglinear_gated_deltanet", "64")}
ZOOLOGY_LRS = "1e-4,4.6e-4,2.2e-3,1e-2"


def ints(s):
    return [int(x) for x in s.split(",") if x]


def floats(s):
    return [float(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixers", default=",".join(PAPER_MIXERS), help="comma list from hla_jax.nn.MIXERS")
    p.add_argument("--dims", type=ints, default=[16, 32, 64], help="model dims (d_model)")
    p.add_argument("--pairs", type=ints, default=[4, 8, 16, 32, 64], help="key-value pairs")
    p.add_argument("--lrs", type=floats, default=floats(ZOOLOGY_LRS), help="peak learning rates")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = configs/mqar.py's)")
    p.add_argument("--warmup", type=int, default=-1, help="warmup steps (-1 = min(config's, steps/10))")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (keys from the first half)")
    p.add_argument("--eval_steps", type=int, default=16, help="eval batches of --batch examples")
    p.add_argument("--eval_every", type=int, default=0,
                   help="also evaluate every N steps: an accuracy curve per run (0 = end only)")
    p.add_argument("--group", type=int, default=0,
                   help="at most this many models per program (0 = a whole cell)")
    p.add_argument("--impl", default="auto", help="operator impl (model.impl)")
    p.add_argument("--set", default=[], action="append", metavar="KEY=VALUE",
                   help="config override, repeatable, e.g. model.hla_decay=true (use its own --tag)")
    p.add_argument("--tag", default="paper", help="results go to <out>/mqar_<tag>.{json,png,md}")
    p.add_argument("--note", default="", help="free text stored in the JSON settings")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th unfinished cell starting at i")
    p.add_argument("--merge", action="store_true", help="only merge shard files and report")
    p.add_argument("--jit_cache", default=os.path.join(tempfile.gettempdir(), "hla_jax_jit_cache"),
                   help="persistent compilation cache shared by runs and shards ('' = off)")
    args = p.parse_args(argv)
    args.mixers = [m for m in args.mixers.split(",") if m]
    bad = [m for m in args.mixers if m not in MIXERS]
    if bad:
        p.error(f"unknown mixers {bad}; valid: {MIXERS}")
    if args.eval_steps < 1 or args.eval_every < 0 or args.group < 0:
        p.error("--eval_steps must be >= 1, --eval_every and --group >= 0")
    return args


def run_key(mixer, dim, pairs, lr) -> str:
    return f"{mixer}/d{dim}/kv{pairs}/lr{lr:g}"


def make_config(args, mixer, dim, pairs, lr):
    c = common.get_config("mqar", f"mixer={mixer},d_model={dim},num_kv_pairs={pairs},"
                                  f"seq_len={args.seq_len}")
    if args.steps:
        c.train.num_steps = args.steps
    warmup = args.warmup if args.warmup >= 0 else min(c.optim.warmup_steps, c.train.num_steps // 10)
    c.optim.update(learning_rate=lr, warmup_steps=warmup)
    c.data.batch_size = args.batch
    c.model.vocab_size = args.vocab
    c.model.impl = args.impl
    c.train.eval_steps = args.eval_steps
    return common.quiet(common.apply_set(c, args.set))


def draw(sources, seed, split, index, pidx, batch, accum) -> dict:
    """Batch ``index`` of ``split`` for every model, ``[M, accum, batch/accum, T]``: one batch per
    source (pair count) from key (seed, split, pairs, index), gathered by the models' source
    index ``pidx [M]`` (so the learning rates of one pair count see the same data)."""
    key = jax.random.fold_in(jax.random.key(seed), split)
    most = max(src.num_kv_pairs for src in sources)  # logits only at the answers (padded to most)
    per = [src.batch(jax.random.fold_in(jax.random.fold_in(key, src.num_kv_pairs), index), batch, most)
           for src in sources]
    return {k: jnp.stack([b[k] for b in per])[pidx].reshape(pidx.shape[0], accum, batch // accum, -1)
            for k in per[0]}


def train_cell(args, mixer, dim, todo, desc="") -> tuple[dict, dict]:
    """Train the runs ``todo = [(pairs, lr), ...]`` of cell (mixer, dim) as one stacked program;
    returns ``({run_key: run}, timings)``."""
    t0 = time.perf_counter()
    c = make_config(args, mixer, dim, *todo[0])
    counts = sorted({p for p, _ in todo})
    sources = [data_lib.MQAR(args.seq_len, args.vocab, p, c.data.mqar.power_a) for p in counts]
    pidx = jnp.asarray([counts.index(p) for p, _ in todo], jnp.int32)
    lrs = jnp.asarray([lr for _, lr in todo], jnp.float32)
    graphdef, params, rest, opt_state, tx = stacked.init(c, len(todo))
    train_step, eval_step = stacked.make_train_step(graphdef, tx), stacked.make_eval_step(graphdef)
    b, accum, seed = c.data.batch_size, c.optim.grad_accum, c.data.seed

    def train(params, opt_state, rest, lrs, pidx, step):
        batch = draw(sources, seed, data_lib.TRAIN, step, pidx, b, accum)
        return train_step(params, opt_state, rest, lrs, batch)

    def evaluate(params, rest, pidx, index):
        return eval_step(params, rest, draw(sources, seed, data_lib.EVAL, index, pidx, b, accum))

    i0 = jnp.int32(0)
    train = jax.jit(train, donate_argnums=(0, 1)).lower(params, opt_state, rest, lrs, pidx, i0).compile()
    evaluate = jax.jit(evaluate).lower(params, rest, pidx, i0).compile()
    setup_s = time.perf_counter() - t0

    def eval_all(params):
        sums = [evaluate(params, rest, pidx, jnp.int32(e)) for e in range(args.eval_steps)]
        return eval_summary(jax.tree.map(lambda *xs: sum(xs), *sums))

    n_steps, n = c.train.num_steps, len(todo)
    pending, curve, eval_s = [], [], 0.0
    bad_step, train_loss = np.zeros(n, int), np.full(n, np.nan)  # first non-finite step (0: none)
    bar = tqdm.tqdm(total=n_steps, desc=f"{desc}{mixer}/d{dim} x{n}", dynamic_ncols=True, leave=False)
    t1 = time.perf_counter()
    for step in range(1, n_steps + 1):
        params, opt_state, m = train(params, opt_state, rest, lrs, pidx, jnp.int32(step))
        pending.append(m)
        bar.update(1)
        if step % c.train.log_every == 0 or step == n_steps:  # the trainer's NaN check and train loss
            ms = jax.device_get(pending)
            loss = np.stack([x["loss"] for x in ms])
            bad = ~(np.isfinite(loss) & np.isfinite(np.stack([x["grad_norm"] for x in ms])))
            first = step - len(ms) + 1 + bad.argmax(0)
            bad_step = np.where((bad_step == 0) & bad.any(0), first, bad_step)
            train_loss, ok = loss.mean(0), bad_step == 0
            pending.clear()
            bar.set_postfix(loss=f"{train_loss[ok].mean():.4f}" if ok.any() else "–",
                            diverged=int(n - ok.sum()))
        if step == n_steps or (args.eval_every and step % args.eval_every == 0):
            t = time.perf_counter()
            curve.append((step, eval_all(jax.block_until_ready(params))))
            eval_s += time.perf_counter() - t
    bar.close()
    seconds = time.perf_counter() - t0
    timing = {"models": n, "steps": n_steps, "seconds": seconds, "setup_seconds": setup_s,
              "step_ms": 1e3 * (time.perf_counter() - t1 - eval_s) / n_steps, "eval_seconds": eval_s}
    runs = {run_key(mixer, dim, pairs, lr): run_record(args, mixer, dim, pairs, lr, n_steps, j, curve,
                                                       train_loss, int(bad_step[j]), seconds / n)
            for j, (pairs, lr) in enumerate(todo)}
    return runs, timing


def run_record(args, mixer, dim, pairs, lr, n_steps, j, curve, train_loss, bad_step, seconds):
    """Model ``j``'s JSON entry from the eval ``curve [(step, eval_summary)]``; diverged (first
    non-finite step ``bad_step`` > 0): accuracy 0 from that step on, no losses."""
    div, final = bad_step > 0, curve[-1][1]
    run = {"mixer": mixer, "dim": dim, "pairs": pairs, "lr": lr, "steps": n_steps,
           "accuracy": 0.0 if div else float(final["accuracy"][j]),
           "row_accuracy": 0.0 if div else float(final["row_accuracy"][j]),
           "loss": None if div else float(final["loss"][j]),
           "train_loss": None if div else float(train_loss[j]), "diverged": div, "seconds": seconds}
    if div:
        run["error"] = f"non-finite loss or gradient norm at step {bad_step}"
    if args.eval_every:
        run["curve"] = {"step": [t for t, _ in curve],
                        "accuracy": [0.0 if div and bad_step <= t else float(ev["accuracy"][j])
                                     for t, ev in curve]}
    return run


def cell_report(mixer, dim, runs, timing, pairs, lrs) -> str:
    """The program's timing, then accuracy (%) per pair count (rows) and lr (columns)."""
    def cell(p, lr):
        r = runs.get(run_key(mixer, dim, p, lr))
        return "" if r is None else "div" if r["diverged"] else f"{100 * r['accuracy']:.1f}"

    t = timing
    lines = [f"{mixer}/d{dim}: {t['models']} models x {t['steps']} steps in {t['seconds']:.0f} s "
             f"(setup+compile {t['setup_seconds']:.0f} s, {t['step_ms']:.1f} ms/step, eval "
             f"{t['eval_seconds']:.0f} s); accuracy % by pairs (rows) and lr (columns):",
             " " * 8 + "".join(f"{lr:>9g}" for lr in lrs)]
    lines += [f"  kv={p:<4}" + "".join(f"{cell(p, lr):>9}" for lr in lrs) for p in pairs
              if any(cell(p, lr) for lr in lrs)]
    return "\n".join(lines)


def best_table(runs: dict) -> dict:
    """``best[mixer][dim][pairs] = {"accuracy", "row_accuracy", "lr"}`` over learning rates."""
    best = {}
    for r in runs.values():
        cell = best.setdefault(r["mixer"], {}).setdefault(str(r["dim"]), {})
        old = cell.get(str(r["pairs"]))
        if old is None or r["accuracy"] > old["accuracy"]:
            cell[str(r["pairs"])] = {"accuracy": r["accuracy"], "row_accuracy": r["row_accuracy"],
                                     "lr": r["lr"]}
    return best


def mean_over_pairs(best: dict, mixer: str, dim: str, pairs) -> float | None:
    accs = [best.get(mixer, {}).get(dim, {}).get(str(p), {}).get("accuracy") for p in pairs]
    return None if any(a is None for a in accs) else float(np.mean(accs))


def tables(res: dict) -> str:
    """Markdown: ours (mean over pairs, best lr) beside the paper, then accuracy per pair count."""
    s, best = res["settings"], res["best"]
    dims, pairs = [str(d) for d in s["dims"]], s["pairs"]
    mixers = [m for m in s["mixers"] if m in best]

    def paper(m, d):
        v = PAPER.get(m, {}).get(d)
        return "–" if v is None else (("≥" if (m, d) in PAPER_AT_LEAST else "") + f"{v:.1f}")

    head = ["mixer"] + [f"d={d} {w}" for d in dims for w in ("ours", "paper")]
    rows = [[m] + [x for d in dims for x in (common.fmt(mean_over_pairs(best, m, d, pairs)),
                                             paper(m, d))] for m in mixers]
    out = [f"MQAR accuracy (%), T={s['seq_len']}, mean over pairs {pairs}, best lr of {s['lrs']}, "
           f"{s['steps']} steps, batch {s['batch']}. {s.get('note', '')}".strip(),
           "", common.markdown_table(head, rows), ""]
    head = ["mixer", "dim"] + [f"kv={p}" for p in pairs]
    rows = []
    for m in mixers:
        for d in dims:
            cells = [best[m].get(d, {}).get(str(p)) for p in pairs]
            rows.append([m, d] + ["–" if c is None else f"{common.fmt(c['accuracy'])} (lr {c['lr']:g})"
                                  for c in cells])
    out += ["Per pair count (best lr in brackets):", "", common.markdown_table(head, rows)]
    return "\n".join(out)


def plot(res: dict):
    """Best-lr accuracy vs key-value pairs, one panel per model dim, one line per mixer."""
    s, best = res["settings"], res["best"]
    dims = [str(d) for d in s["dims"]]
    fig, axes = common.figure(len(dims), figsize=(4.2 * len(dims), 3.6))
    for ax, d in zip(axes, dims):
        for m in s["mixers"]:
            cell = best.get(m, {}).get(d, {})
            ps = [p for p in s["pairs"] if str(p) in cell]
            if ps:
                ax.plot(ps, [100 * cell[str(p)]["accuracy"] for p in ps], marker="o", label=m)
        ax.set(xlabel="key-value pairs", ylabel="accuracy (%)", ylim=(-2, 102),
               title=f"d_model={d}, T={s['seq_len']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["pairs"], [str(p) for p in s["pairs"]])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    if axes[-1].get_legend_handles_labels()[0]:
        axes[-1].legend(fontsize=7, loc="best")
    return fig


def finish(res: dict, out: pathlib.Path, tag: str) -> str:
    """Recompute the best table, write JSON/PNG/MD, return the Markdown."""
    res["best"] = best_table(res["runs"])
    res["paper"] = {"accuracy": PAPER, "at_least": sorted("/".join(k) for k in PAPER_AT_LEAST),
                    "assumption": "paper value per dim read as the mean over pair counts"}
    common.write_json(out / f"mqar_{tag}.json", res)
    common.save(plot(res), out / f"mqar_{tag}.png")
    md = tables(res)
    (out / f"mqar_{tag}.md").write_text(md + "\n")
    return md


def main(argv=None) -> dict:
    args = parse_args(argv)
    common.compilation_cache(args.jit_cache)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    i, n = (int(x) for x in args.shard.split("/"))
    main_path = out / f"mqar_{args.tag}.json"
    path = main_path if n == 1 else out / f"mqar_{args.tag}.shard{i}of{n}.json"
    c = make_config(args, args.mixers[0], args.dims[0], args.pairs[0], args.lrs[0])
    settings = {"mixers": args.mixers, "dims": args.dims, "pairs": args.pairs, "lrs": args.lrs,
                "steps": c.train.num_steps, "warmup": c.optim.warmup_steps,
                "seq_len": args.seq_len, "batch": args.batch, "eval_steps": args.eval_steps,
                "eval_every": args.eval_every, "group": args.group, "impl": args.impl, "set": args.set,
                "n_layers": 2, "vocab_size": args.vocab, "note": args.note}
    res = common.read_json(main_path) or {"tag": args.tag, "runs": {}}
    res.setdefault("cells", {})
    res["settings"] = settings
    if args.merge:  # settings from the shard files (the sweep's), runs pooled
        for shard in sorted(out.glob(f"mqar_{args.tag}.shard*of*.json")):
            part = common.read_json(shard)
            res["runs"].update(part["runs"])
            res["cells"].update(part.get("cells", {}))
            res["settings"] = part.get("settings", settings)
        md = finish(res, out, args.tag)
        print(md)
        return res
    mine = common.read_json(path) if path != main_path else res
    mine.setdefault("runs", {})
    mine.setdefault("cells", {})
    done = res["runs"].keys() | mine["runs"].keys()

    def todo_of(mixer, dim):
        return [(p, lr) for p in args.pairs for lr in args.lrs if run_key(mixer, dim, p, lr) not in done]

    # unfinished cells only, then every n-th: a resumed sweep spreads what is left over the shards
    cells = [(m, d) for d in args.dims for m in args.mixers if todo_of(m, d)][i::n]
    for k, (mixer, dim) in enumerate(cells):
        todo = todo_of(mixer, dim)
        n_groups = math.ceil(len(todo) / (args.group or len(todo)))
        for g, group in enumerate(np.array_split(np.arange(len(todo)), n_groups)):
            runs, timing = train_cell(args, mixer, dim, [todo[j] for j in group],
                                      desc=f"[{k + 1}/{len(cells)}] ")
            mine["runs"].update(runs)
            mine["cells"][f"{mixer}/d{dim}" + (f"/{g + 1}of{n_groups}" if n_groups > 1 else "")] = timing
            tqdm.tqdm.write(cell_report(mixer, dim, runs, timing, args.pairs, args.lrs))
            if path == main_path:
                finish(res, out, args.tag)
            else:
                common.write_json(path, {"tag": args.tag, "settings": settings, **mine})
    if path == main_path:
        print(finish(res, out, args.tag))
    return res


if __name__ == "__main__":
    main()
