"""Long-context language modelling: one recipe for every mixer, then loss by position up to twice
the training length and needle-in-a-haystack retrieval at it and beyond.

    python -m experiments.long_context --tag h200                 # configs/lm.py size=30m, 8 mixers
    python -m experiments.long_context --mixers softmax,hla2 --tag h200 --budget 400   # resumable
    python -m experiments.long_context --size tiny --steps 20 --mixers softmax,mamba2 --tag try

Each mixer trains ``configs/lm.py`` at ``--size`` (30m: d 512, 10 layers, T=4096, batch 8, 1000
steps, bf16) with the mixer's defaults, the same data, steps, schedule and seed, on plain rows of
the embedded corpus (``data.pack=False``: a row is a window of the concatenated source files, so
position t has t tokens of context; packed rows would restart at each file). Then, from its
checkpoint: the eval loss per token position at ``2T`` (``position_loss.position_loss``: positions
past T are beyond training; softmax's RoPE table covers 2T), and NIAH zero-shot in code, single
and multi-needle, at T and 2T (``niah.CodeNIAH``: held-out source around a line
``MAGIC_NUMBER = N``, then ``assert MAGIC_NUMBER == N``; NIAH's English filler sentences are
out of distribution for a model of source code, and all of them scored 0 there). The
trainer's train-loss curve (every ``train.log_every`` steps), its eval losses (at the end, and
every ``--eval_every`` steps), median tokens/s and final eval loss are kept beside them.

Resumable: results go to ``<out>/long_context_<tag>.json``, ``.png`` and ``.md`` after every mixer
(each mixer's entry with the ``provenance`` of the call that trained it), and a mixer
already in the tag's JSON is skipped (the JSON refuses other settings), so several calls with
``--mixers`` subsets or ``--budget S`` (no mixer starts after S seconds) build one table. A mixer
whose training stops on a non-finite loss is recorded under ``failed`` with the trainer's message
and the later mixers still run; the next call tries it again. A mixer longer than one call: give
a lasting ``--workroot`` and ``--checkpoint_every N``; a call cut off mid-training loses at most N
steps, and the next call resumes from the checkpoint (the entry records ``resumed_at``, and its
``wall_s`` is then the last call's). ``--jit_cache DIR`` keeps compiled programs across calls.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

from experiments import common, niah, position_loss
from hla_jax.data import corpus
from hla_jax.nn.lm import param_count

MIXERS = "softmax,mamba2,loglinear_mamba2,gated_deltanet,loglinear_gated_deltanet,hla2,ahla,hla3"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixers", default=MIXERS)
    p.add_argument("--size", default="30m", help="configs/lm.py size")
    p.add_argument("--steps", type=int, default=0, help="train steps (0 = the size's)")
    p.add_argument("--set", default=[], action="append", metavar="KEY=VALUE",
                   help="config override for every mixer, e.g. model.impl=xla (repeatable)")
    p.add_argument("--eval_batch", type=int, default=8, help="position-loss examples per batch")
    p.add_argument("--eval_batches", type=int, default=8, help="position-loss batches")
    p.add_argument("--needles", type=int, default=4, help="needles in the multi-needle test")
    p.add_argument("--examples", type=int, default=64, help="NIAH examples per cell")
    p.add_argument("--eval_every", type=int, default=0,
                   help="also evaluate every this many steps (0: only at the end)")
    p.add_argument("--budget", type=float, default=0, help="no mixer starts after this many s")
    p.add_argument("--workroot", default="", help="where the workdirs go (default: temp)")
    p.add_argument("--checkpoint_every", type=int, default=0,
                   help="also save every this many steps, so a cut-off run resumes (0: at the end)")
    p.add_argument("--jit_cache", default="", help="persistent compilation cache folder")
    p.add_argument("--tag", default="lm")
    p.add_argument("--out", default=str(common.RESULTS))
    return p.parse_args(argv)


def config(args, mixer: str):
    c = common.quiet(common.get_config("lm", f"mixer={mixer},size={args.size}"), args.eval_every,
                     args.checkpoint_every)
    c.data.pack = False
    if args.steps:
        c.train.num_steps = args.steps
        c.optim.warmup_steps = min(c.optim.warmup_steps, args.steps // 10)
    return common.apply_set(c, args.set)


def settings(args) -> dict:
    c = config(args, "softmax")
    tokens, starts = corpus.text_documents(c.data.path, c.data.pattern)
    name = (f"{c.data.path} ({c.data.pattern})" if c.data.path
            else f"Python {sys.version.split()[0]} standard library sources")
    return {"size": args.size, "seq_len": c.data.seq_len, "batch": c.data.batch_size,
            "steps": c.train.num_steps, "tokens": c.train.num_steps * c.data.batch_size * c.data.seq_len,
            "learning_rate": c.optim.learning_rate, "warmup": c.optim.warmup_steps,
            "dtype": c.model.dtype, "d_model": c.model.d_model, "n_layers": c.model.n_layers,
            "pack": False, "set": list(args.set), "eval_seq_len": 2 * c.data.seq_len,
            "eval_batch": args.eval_batch, "eval_batches": args.eval_batches, "needles": args.needles,
            "niah_examples": args.examples,
            "corpus": f"{name}, {len(starts)} files, {tokens.size} bytes",
            **({"eval_every": args.eval_every} if args.eval_every else {})}


def evaluate(args, workdir, T: int) -> dict:
    loaded = common.load_model(workdir)
    nll_fn = common.token_nll_fn(loaded[1])  # one program per shape: NIAH at 2T reuses this one's
    pl = position_loss.position_loss(workdir, 2 * T, args.eval_batch, args.eval_batches, loaded,
                                     nll_fn)
    nh = niah.retrieval(workdir, [T, 2 * T], args.needles, args.examples, args.eval_batch, loaded,
                        "code", nll_fn)
    curve, evals = ([[r["step"], r["loss"]] for r in common.metrics(workdir, split)]
                    for split in ("train", "eval"))
    return {**pl, "params": param_count(loaded[1]), "curve": curve, "eval_curve": evals,
            "niah": {k: nh[k] for k in ("single", "multi", "decoy")}}


def gain(e: dict, n: int):
    """Retrieval gain at length ``n``: nats/digit of the answer with a decoy needle minus with
    the true one (0: the needle is not used)."""
    single, decoy = e["niah"]["single"].get(str(n)), e["niah"].get("decoy", {}).get(str(n))
    return decoy["loss"] - single["loss"] if single and decoy else None


def span_loss(e: dict, lo: int, hi: int):
    """Mean eval loss over 1-based positions ``[lo, hi]``."""
    v = [x for x in e["per_position"][lo - 1:hi] if x is not None]
    return sum(v) / len(v) if v else None


def best_eval(e: dict) -> str:
    """The lowest of the run's eval losses and its step ("–" with one eval only)."""
    curve = e.get("eval_curve") or []
    if len(curve) < 2:
        return "–"
    step, loss = min(curve, key=lambda r: r[1])
    return f"{loss:.3f} ({step})"


def table(res: dict) -> str:
    s = res["settings"]
    T = s["seq_len"]
    acc = lambda e, kind, n: common.fmt((e["niah"][kind].get(str(n)) or {}).get("row_accuracy"))  # noqa: E731
    num = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    head = ["mixer", "params", "train tok/s", "train loss", "eval loss", "best eval (step)",
            f"loss 1-{T}",
            f"loss {T // 2 + 1}-{T}", f"loss {T + 1}-{2 * T}", f"NIAH T={T}", f"NIAH {2 * T}",
            f"multi T={T}", f"multi {2 * T}", f"gain T={T}", f"gain {2 * T}"]
    rows = [[e["label"], f"{e['params'] / 1e6:.1f}M",
             f"{e['train']['tokens_per_s']:.0f}" if e["train"]["tokens_per_s"] else "–",
             num(e["train"]["train_loss"]), num(e["train"]["eval_loss"]), best_eval(e),
             num(span_loss(e, 1, T)),
             num(span_loss(e, T // 2 + 1, T)), num(span_loss(e, T + 1, 2 * T)),
             acc(e, "single", T), acc(e, "single", 2 * T), acc(e, "multi", T), acc(e, "multi", 2 * T),
             num(gain(e, T)), num(gain(e, 2 * T))]
            for e in res["runs"].values()]
    return (f"Long-context byte LMs ({s['size']}: d {s['d_model']}, {s['n_layers']} layers, {s['dtype']}), "
            f"trained at T={T} for {s['steps']} steps of {s['batch']} rows ({s['tokens'] / 1e6:.3g}M "
            f"tokens, plain rows of {s['corpus']}); eval loss (nats/byte) on "
            f"{s['eval_batch'] * s['eval_batches']} "
            f"held-out rows of {2 * T}; code NIAH whole-number accuracy (%), {s['niah_examples']} "
            f"examples, multi = {s['needles']} needles; gain = loss of the answer's digits with a "
            f"decoy needle minus with the true one (nats/digit).\n\n" + common.markdown_table(head, rows)
            + "\n\n" + position_loss.table({"runs": res["runs"], "settings": {
                "batches": s["eval_batches"], "batch": s["eval_batch"]}})
            + "".join(f"\n\nFailed (retried by the next call): {m}: {f['error']}"
                      for m, f in res.get("failed", {}).items()))


def plot(res: dict):
    """Training curves, then (when the runs evaluated periodically) the held-out loss by step on
    a linear scale with each mixer's lowest starred, loss by position, NIAH accuracy and gain."""
    T = res["settings"]["seq_len"]
    periodic = any(len(e.get("eval_curve") or ()) > 1 for e in res["runs"].values())
    fig, axes = common.figure(4 + periodic, figsize=(19 + 5 * periodic, 4))
    a, b, c, d = axes[:1] + axes[1 + periodic:]
    for e in res["runs"].values():
        steps, losses = zip(*e["curve"])
        line, = a.plot(steps, losses, lw=1, label=e["label"])
        if e.get("eval_curve"):
            a.plot(*zip(*e["eval_curve"]), "o", ms=3, color=line.get_color())
        if periodic and e.get("eval_curve"):
            axes[1].plot(*zip(*e["eval_curve"]), marker="o", ms=3, color=line.get_color())
            axes[1].plot(*min(e["eval_curve"], key=lambda p: p[1]), "*", ms=10,
                         color=line.get_color())
        mids = [np.sqrt(k["lo"] * (k["hi"] - 1)) for k in e["buckets"] if k["loss"] is not None]
        b.plot(mids, [k["loss"] for k in e["buckets"] if k["loss"] is not None], marker="o",
               color=line.get_color(), label=e["label"])
        for kind, style in (("single", "-"), ("multi", "--")):
            pts = [(int(n), 100 * v["row_accuracy"]) for n, v in e["niah"][kind].items() if v]
            if pts:
                c.plot(*zip(*pts), style, marker="o", color=line.get_color())
        pts = [(n, gain(e, n)) for n in (T, 2 * T) if gain(e, n) is not None]
        if pts:
            d.plot(*zip(*pts), marker="o", color=line.get_color())
    a.set(xlabel="step", ylabel="loss (nats/byte)", title="training (line: train, dots: eval)",
          yscale="log")
    if periodic:
        lows = [min(v for _, v in e["eval_curve"]) for e in res["runs"].values()
                if e.get("eval_curve")]
        axes[1].set(xlabel="step", ylabel="eval loss (nats/byte)", ylim=(min(lows) - 0.02,
                    max(lows) + 0.12), title="held-out loss by step (star: lowest)")
    b.axvline(T, color="gray", ls=":", lw=1)
    b.set(xscale="log", xlabel="token position", ylabel="eval loss (nats/byte)",
          title=f"loss by position (bucket means; right of {T}: beyond training)")
    c.set(xscale="log", xlabel="context length", ylabel="whole-number accuracy (%)", ylim=(-2, 102),
          title="NIAH (solid: single, dashed: multi-needle)")
    d.set(xscale="log", xlabel="context length", ylabel="nats/digit",
          title="NIAH retrieval gain (decoy minus true needle)")
    d.axhline(0, color="gray", lw=0.8)
    for ax in (c, d):
        ax.set_xticks([T, 2 * T], [str(T), str(2 * T)])
        ax.minorticks_off()
    for ax in axes:
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    return fig


def write(res: dict, out: pathlib.Path, tag: str) -> str:
    common.write_json(out / f"long_context_{tag}.json", res)
    common.save(plot(res), out / f"long_context_{tag}.png")
    return common.write_markdown(out / f"long_context_{tag}.md", table(res))


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, out = time.perf_counter(), pathlib.Path(args.out)
    res = common.read_json(out / f"long_context_{args.tag}.json")
    want = settings(args)
    if res and {k: v for k, v in res["settings"].items() if k != "device"} != want:
        raise SystemExit(f"{out}/long_context_{args.tag}.json was written with other settings:\n"
                         f"  file: {res['settings']}\n  now:  {want}\nuse another --tag")
    res = res or {"tag": args.tag, "settings": {**want, "device": jax.devices()[0].device_kind},
                  "runs": {}}
    common.compilation_cache(args.jit_cache)
    root = args.workroot or tempfile.mkdtemp(prefix="long_context_")
    md = ""
    for mixer in filter(None, args.mixers.split(",")):
        if mixer in res["runs"]:
            continue
        if args.budget and time.perf_counter() - t0 > args.budget:
            print(f"--budget {args.budget:.0f} s spent: {mixer} and later mixers not started")
            break
        start = time.perf_counter()
        c = config(args, mixer)
        resumed = common.checkpoint_step(pathlib.Path(root) / mixer)
        try:
            workdir = common.train_workdirs({mixer: c}, root)[mixer]
        except FloatingPointError as e:  # recorded, the later mixers still run; retried next call
            spent = time.perf_counter() - start
            res.setdefault("failed", {})[mixer] = {"error": str(e), "wall_s": spent,
                                                   "provenance": common.provenance()}
            md = write(res, out, args.tag)
            print(f"{mixer}: failed after {spent:.0f} s: {e}", flush=True)
            continue
        res["runs"][mixer] = {**evaluate(args, workdir, c.data.seq_len),
                              **({"resumed_at": resumed} if resumed else {}),
                              "wall_s": time.perf_counter() - start,
                              "provenance": common.provenance()}
        res.get("failed", {}).pop(mixer, None)
        md = write(res, out, args.tag)
        print(f"{mixer}: {res['runs'][mixer]['wall_s']:.0f} s", flush=True)
    if res["runs"] or res.get("failed"):
        print(md or write(res, out, args.tag))
    return res


if __name__ == "__main__":
    main()
