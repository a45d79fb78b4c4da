"""Loss against token position for trained LM checkpoints of several mixers.

    python -m experiments.position_loss --workdirs runs/lm-hla2,runs/lm-softmax --tag lm
    python -m experiments.position_loss --train --mixers softmax,mamba2,hla2 --steps 400 --tag tiny

For each checkpoint (the newest in each ``train_and_evaluate`` workdir, restored with the
trainer's ``init_state`` + ``Checkpointer``), the next-token loss of ``--batches`` held-out batches
of its own data config (``--seq_len`` overrides the length, e.g. to probe beyond training) is
averaged per position ``t`` (masked targets only) and in power-of-two buckets
``[2^k, 2^(k+1))`` of the 1-based position, with what the trainer logged (``train``: median
tokens/s, last train and eval loss; ``common.train_summary``). A mixer that uses long context
well keeps lowering its loss at late positions; a fixed-size state flattens out. ``--train`` first trains
``configs/lm.py`` (``size=tiny`` with the overrides below) for each mixer into ``--workroot``.
Writes ``position_loss_<tag>.json``, ``.png`` and ``.md`` under ``--out``, with their provenance.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np

from experiments import common
from hla_jax import data as data_lib


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_train_args(p, "softmax,linear,mamba2,loglinear_mamba2,hla2", 0,
                          "--train length override (0 = the size's)")
    p.add_argument("--size", default="tiny", help="configs/lm.py size when --train")
    p.add_argument("--n_layers", type=int, default=0, help="--train depth override")
    p.add_argument("--seq_len", type=int, default=0, help="eval length (0 = the checkpoint's)")
    p.add_argument("--batch", type=int, default=8, help="eval examples per batch")
    p.add_argument("--batches", type=int, default=8, help="eval batches")
    p.add_argument("--tag", default="lm")
    p.add_argument("--out", default=str(common.RESULTS))
    return p.parse_args(argv)


def train_configs(args) -> dict:
    configs = {}
    for mixer in filter(None, args.mixers.split(",")):
        c = common.apply_train_args(
            common.quiet(common.get_config("lm", f"mixer={mixer},size={args.size}")), args)
        if args.n_layers:
            c.model.n_layers = args.n_layers
        c.data.seq_len = args.train_seq_len or c.data.seq_len
        configs[mixer] = c
    return configs


def position_loss(workdir, seq_len: int, batch: int, batches: int, loaded=None, nll_fn=None) -> dict:
    """Mean masked nll per 0-based position ``t`` over the eval batches of ``workdir``'s data
    (``loaded``: its ``common.load_model`` if already at hand, ``nll_fn`` its
    ``common.token_nll_fn``)."""
    c, model, step = loaded or common.load_model(workdir)
    data = c.data.copy_and_resolve_references()
    data.seq_len = T = seq_len or data.seq_len
    _, source = data_lib.make_sources(data, c.model.vocab_size)
    nll_fn = nll_fn or common.token_nll_fn(model)
    total = np.zeros(T)
    count = np.zeros(T)
    for b in range(batches):
        x = data_lib.make_batch(source, data.seed, data_lib.EVAL, b, np.arange(batch))
        nll, _ = nll_fn({k: jnp.asarray(v) for k, v in x.items()})
        total += np.asarray(nll * x["mask"]).sum(0)
        count += x["mask"].sum(0)
    per_pos = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    buckets = []
    k = 0
    while 2 ** k <= T:
        lo, hi = 2 ** k, min(2 ** (k + 1), T + 1)  # 1-based [lo, hi)
        n = count[lo - 1:hi - 1].sum()
        buckets.append({"lo": lo, "hi": hi, "loss": float(total[lo - 1:hi - 1].sum() / n) if n else None})
        k += 1
    return {"label": common.label(c), "workdir": str(workdir), "step": int(step),
            "seq_len": T, "data": data.kind, "train": common.train_summary(workdir),
            "mean_loss": float(total.sum() / max(count.sum(), 1)),
            "per_position": [None if np.isnan(v) else float(v) for v in per_pos], "buckets": buckets}


def table(res: dict) -> str:
    entries = list(res["runs"].values())
    edges = [(b["lo"], b["hi"]) for b in entries[0]["buckets"]]
    head = ["mixer", "step", "train tok/s", "mean"] + [f"{lo}-{hi - 1}" for lo, hi in edges]
    speed = lambda e: (f"{e['train']['tokens_per_s']:.0f}"  # noqa: E731
                       if (e.get("train") or {}).get("tokens_per_s") else "–")
    rows = [[e["label"], e["step"], speed(e), f"{e['mean_loss']:.3f}"]
            + ["–" if b["loss"] is None else f"{b['loss']:.3f}" for b in e["buckets"]] for e in entries]
    return (f"Eval loss (nats/token) by 1-based position bucket, T={entries[0]['seq_len']}, "
            f"{res['settings']['batches']}x{res['settings']['batch']} examples.\n\n"
            + common.markdown_table(head, rows))


def plot(res: dict):
    (fig, (ax,)) = common.figure(1, figsize=(6, 4))
    for e in res["runs"].values():
        y = np.array([np.nan if v is None else v for v in e["per_position"]])
        ax.plot(np.arange(1, len(y) + 1), y, lw=0.6, alpha=0.35)
        mids = [np.sqrt(b["lo"] * (b["hi"] - 1)) for b in e["buckets"] if b["loss"] is not None]
        ax.plot(mids, [b["loss"] for b in e["buckets"] if b["loss"] is not None], marker="o",
                color=ax.lines[-1].get_color(), label=e["label"])
    ax.set(xscale="log", xlabel="token position", ylabel="eval loss (nats)",
           title="loss vs position (thin: per token, dots: bucket means)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> dict:
    args = parse_args(argv)
    workdirs = {pathlib.Path(w).name: w for w in filter(None, args.workdirs.split(","))}
    if args.train:
        root = args.workroot or tempfile.mkdtemp(prefix="position_loss_")
        workdirs.update(common.train_workdirs(train_configs(args), root))
    if not workdirs:
        raise SystemExit("give --workdirs or --train")
    res = {"tag": args.tag, "settings": {"seq_len": args.seq_len, "batch": args.batch,
                                         "batches": args.batches, "trained_here": args.train},
           "runs": {name: position_loss(w, args.seq_len, args.batch, args.batches)
                    for name, w in workdirs.items()}}
    out = pathlib.Path(args.out)
    common.write_json(out / f"position_loss_{args.tag}.json", res)
    common.save(plot(res), out / f"position_loss_{args.tag}.png")
    print(common.write_markdown(out / f"position_loss_{args.tag}.md", table(res)))
    return res


if __name__ == "__main__":
    main()
