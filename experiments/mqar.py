"""MQAR sweep in the log-linear paper's setup (Guo et al. 2025, after Zoology, Arora et al. 2023).

    python -m experiments.mqar --tag zoology --time_budget 500  # Zoology's protocol: 9 mixers x
                                # dims 16/32/64 x pairs 4..64 x 4 lrs; stops cleanly before 500 s,
                                # and the same command again goes on exactly where it stopped
    python -m experiments.mqar --protocol quick --mixers hla2,softmax --dims 16 --pairs 4 \\
        --lrs 2.2e-3 --vocab 1024 --tag try     # a smoke test: about 3 CPU minutes
    python -m experiments.mqar --mixture --tag zoology_mix ...  # one model per lr on all pair counts
    python -m experiments.mqar --shard 0/4 ...   # one of 4 processes (every 4th cell)
    python -m experiments.mqar --merge ...       # fold the shard files into mqar_<tag>.json
                                                 # (their mixers and dims pooled)
    python -m experiments.mqar --processes 9 --mps ...  # 9 shard processes on one GPU, then merge

Protocol (``--protocol``, recorded in the JSON settings; ``--steps``, ``--batch``,
``--eval_every`` override its numbers): ``zoology`` (default) is Zoology's MQAR budget: T=256,
vocabulary 8192, batch 256 for 25,000 steps (its 64 epochs of 100k examples), two layers, one
head, AdamW (weight decay 0.1) with warmup (``--warmup``, -1 = min(500, steps/10)) and cosine,
learning rates ``np.logspace(-4, -2, 4)`` (1e-4, 4.6e-4, 2.2e-3, 1e-2), an eval every 500 steps
and early stopping at 99% eval accuracy. Our batches are fresh draws (batch ``step`` a pure
function of (seed, split, step)) where Zoology cycles through a fixed 100k. ``quick``: batch 32,
600 steps: a smoke test of the pipeline, far from converged.

One *cell* = (mixer, dim): its (pairs, lr) models, 5 x 4 = 20 by default, train as ONE jitted
*program* (at most ``--group`` models each; the groups are fixed, so a resumed cell finds its
programs again; a program is named ``mixer/d<dim>[/mix]/lr<its lrs>[/<g>of<n>]``, so a sweep
run one lr per call keeps one checkpoint and one timing per lr). ``hla_jax.train.stacked``
stacks their states along a leading model axis and vmaps the trainer's own step over it: one
compile per program, and 20 tiny models fill the GPU where one left it launch-bound. Each
model is the ``train_and_evaluate`` run of ``configs/mqar.py`` it stands for (init seed 0) at
its own peak lr (exact: the optimizer is linear in the peak, see ``stacked``), except for the
random numbers of its data: batches are drawn on device inside the step by ``MQAR.batch`` (the
distribution of ``MQAR.example``), one per pair count and step, shared by the learning rates of
that count.

Every ``--eval_every`` steps and at the last one, every model still training is evaluated on a
fixed eval set of its pair count (``--eval_steps`` batches of ``--batch`` from the eval key):
``accuracy`` per query (the paper's metric) and ``row_accuracy`` (all queries of an example
right), kept as its ``curve``. Early stopping: a model whose accuracy reaches ``--target``
(0 = never) stops there (``stopped_at``, its accuracy then is its result) and is frozen (update
scale 0 in the stacked step); a model whose loss or gradient norm stops being finite is recorded
as diverged (accuracy 0). A program ends when every model has stopped or diverged. Once at most
half of its models still train and at least ``--compact_steps`` steps are left, it re-compiles
with only those (``stacked.take``), so stopped models stop costing time.

``--mixture``: one model per (mixer, dim, lr) trained on batches whose rows mix all ``--pairs``
counts (``MQARMixture``: row r from count r mod C), evaluated on each count's eval set, stopped
once every count reaches ``--target``; run keys ``mixer/d64/mix4-8-16-32-64/lr...``, a row
``mixer (mix)`` in the tables. This is what makes the budget fit: 5x fewer models per cell
(one per lr instead of one per pair count and lr) for the same steps.

Resume: every ``--save_every`` seconds a program writes its stacked params and optimizer state,
its step (= the position in the data) and each model's bookkeeping to
``<out>/mqar_<tag>.ckpt/<program>.npz``; the same command continues from there exactly (same
batches, same results as an uninterrupted run) and refuses a checkpoint written with other
settings. ``--time_budget S`` stops cleanly before S seconds of wall time (counted from the
start of ``main``): it checkpoints, writes the results so far and exits 0. It keeps
``RESERVE_S`` plus twice the slowest save for that, starts no new program without twice the
slowest setup left on top, and a call always takes at least one step.

Results: ``<out>/mqar_<tag>.json`` (settings; every run, its ``seconds`` the program's time
shared out and the ``provenance`` of the call that finished it; per-program timings, ms/step
included, under ``cells``; the best table, from each run's final or stopped-at accuracy; the
paper's numbers; under ``partial``, the models a --time_budget cut while still training, with
their last eval and ``cut_at``, until a later call finishes them: what a call learnt survives
even when its checkpoint does not), ``mqar_<tag>.png`` (accuracy vs pairs, one panel per dim)
and ``mqar_<tag>.md`` (a provenance line, then the Markdown tables, also printed), written
after every program (a model that stopped early as soon as its
program ends or the budget cuts it).
Runs already recorded (in the tag's JSON or any of its shard files) are skipped. ``--shard i/n``
takes every n-th cell of the grid, the same cells in every call (shards may run together or one
after another; a later call may use another n: the checkpoints are the tag's, not a shard's).
Compiled programs go to a persistent cache (``--jit_cache``), shared by shards.

Paper numbers (assumption, stated because we could not read the paper's appendix here): the
log-linear paper's MQAR table gives ONE accuracy per model dim (16/32/64) for T=256 with 4 to 64
key-value pairs; we read it as the mean over the pair counts (Zoology reports the accuracy over
all its test configurations pooled), so it is compared with our mean over ``--pairs`` of the
best-lr accuracy. Our per-pair table is printed too, so a reader can compare with the 64-pair
column if the paper meant the hardest setting instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from experiments import common
from hla_jax import data as data_lib
from hla_jax.data.synthetic import MQARMixture
from hla_jax.nn import MIXERS
from hla_jax.train import stacked
from hla_jax.train.steps import eval_summary

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
SWEPT = {"mixers": "mixer", "dims": "dim", "lrs": "lr"}   # the settings' sweep axes, a run's keys
PROTOCOLS = {  # Zoology: 64 epochs x 100k examples / batch 256 = 25,000 steps
    "zoology": {"steps": 25_000, "batch": 256, "eval_every": 500},
    "quick": {"steps": 600, "batch": 32, "eval_every": 300},  # a smoke test
}
# --time_budget: seconds kept for the last checkpoint and results (plus twice the slowest save);
# a new program starts only with twice the slowest setup (init + compile) left on top
RESERVE_S = 10.0
SUMMARY = ("accuracy", "row_accuracy", "loss")


def ints(s):
    return [int(x) for x in s.split(",") if x]


def floats(s):
    return [float(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", default="zoology", choices=sorted(PROTOCOLS),
                   help="budget: steps, batch, eval period (the docstring)")
    p.add_argument("--mixers", default=",".join(PAPER_MIXERS), help="comma list from hla_jax.nn.MIXERS")
    p.add_argument("--dims", type=ints, default=[16, 32, 64], help="model dims (d_model)")
    p.add_argument("--pairs", type=ints, default=[4, 8, 16, 32, 64], help="key-value pairs")
    p.add_argument("--lrs", type=floats, default=floats(ZOOLOGY_LRS), help="peak learning rates")
    p.add_argument("--mixture", action="store_true",
                   help="one model per lr trained on all --pairs counts at once, eval per count")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the protocol's)")
    p.add_argument("--warmup", type=int, default=-1, help="warmup steps (-1 = min(config's, steps/10))")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, help="examples per step (default: the protocol's)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (keys from the first half)")
    p.add_argument("--eval_steps", type=int, default=16, help="eval batches of --batch examples")
    p.add_argument("--eval_every", type=int,
                   help="evaluate every N steps (0 = at the end only; default: the protocol's)")
    p.add_argument("--target", type=float, default=0.99,
                   help="a model stops once its eval accuracy reaches this (0 = never)")
    p.add_argument("--compact_steps", type=int, default=2000,
                   help="re-compile without the stopped models once at most half still train and "
                        "at least N steps are left (0 = never)")
    p.add_argument("--group", type=int, default=0,
                   help="at most this many models per program (0 = a whole cell)")
    p.add_argument("--save_every", type=float, default=60.0, help="checkpoint period (seconds)")
    p.add_argument("--time_budget", type=float, default=0.0,
                   help="stop cleanly (checkpoint, results, exit 0) before S seconds (0 = none)")
    p.add_argument("--impl", default="auto", help="operator impl (model.impl)")
    p.add_argument("--set", default=[], action="append", metavar="KEY=VALUE",
                   help="config override, repeatable, e.g. model.hla_decay=true (use its own --tag)")
    p.add_argument("--tag", default="paper", help="results go to <out>/mqar_<tag>.{json,png,md}")
    p.add_argument("--note", default="", help="free text stored in the JSON settings")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th cell of the grid, starting at i")
    p.add_argument("--merge", action="store_true", help="only merge shard files and report")
    p.add_argument("--processes", type=int, default=0,
                   help="run this command as N shard processes at once, then merge (0 = in-process)")
    p.add_argument("--mps", action="store_true",
                   help="with --processes: start the CUDA MPS daemon first (the GPU shared side by side)")
    p.add_argument("--jit_cache", default=os.path.join(tempfile.gettempdir(), "hla_jax_jit_cache"),
                   help="persistent compilation cache shared by runs and shards ('' = off)")
    args = p.parse_args(argv)
    for k, v in PROTOCOLS[args.protocol].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.mixers = [m for m in args.mixers.split(",") if m]
    bad = [m for m in args.mixers if m not in MIXERS]
    if bad:
        p.error(f"unknown mixers {bad}; valid: {MIXERS}")
    if args.processes and (args.merge or args.shard != "0/1"):
        p.error("--processes sets each process's --shard and merges after them: "
                "give neither --shard nor --merge with it")
    if args.mps and not args.processes:
        p.error("--mps starts the CUDA MPS daemon for --processes; give --processes N with it")
    if args.eval_steps < 1 or min(args.eval_every, args.group, args.compact_steps) < 0:
        p.error("--eval_steps must be >= 1, --eval_every, --group and --compact_steps >= 0")
    return args


def counts_of(pairs) -> list[int]:
    """The pair counts of a model: ``[pairs]``, or a mixture's (a tuple or list)."""
    return list(pairs) if isinstance(pairs, (tuple, list)) else [pairs]


def run_key(mixer, dim, pairs, lr) -> str:
    """``mixer/d64/kv16/lr0.001``; a mixture of counts: ``mixer/d64/mix4-8-16/lr0.001``."""
    kv = "mix" + "-".join(map(str, pairs)) if isinstance(pairs, (tuple, list)) else f"kv{pairs}"
    return f"{mixer}/d{dim}/{kv}/lr{lr:g}"


def cell_models(args) -> list[tuple]:
    """A cell's models ``[(pairs, lr)]``: every (count, lr), or (all counts, lr) with --mixture."""
    if args.mixture:
        return [(tuple(args.pairs), lr) for lr in args.lrs]
    return [(p, lr) for p in args.pairs for lr in args.lrs]


def make_config(args, mixer, dim, pairs, lr):
    c = common.get_config("mqar", f"mixer={mixer},d_model={dim},num_kv_pairs={pairs},"
                                  f"seq_len={args.seq_len}")
    c.train.num_steps = args.steps
    warmup = args.warmup if args.warmup >= 0 else min(c.optim.warmup_steps, c.train.num_steps // 10)
    c.optim.update(learning_rate=lr, warmup_steps=warmup)
    c.data.batch_size = args.batch
    c.model.vocab_size = args.vocab
    c.model.impl = args.impl
    c.train.eval_steps = args.eval_steps
    return common.apply_set(common.quiet(c), args.set)


def draw(sources, seed, split, index, pidx, batch, accum, flat=False) -> dict:
    """Batch ``index`` of ``split`` for every model, ``[M, accum, batch/accum, T]``: one batch per
    source (a pair count, or a mixture) from key (seed, split, its num_kv_pairs, index), gathered
    by the models' source index ``pidx [M]`` (so the learning rates of one source see the same
    data).  The logits are read only at the answers: ``positions [M, accum, b, P]`` per row,
    padded to the largest count (what the eval's per-row sums need), or with ``flat``
    ``[M, accum, P]`` flat indices of the micro-batch's answers (``LM.__call__``), padded only to
    the most answers any micro-batch holds: a mixture's rows need no common width (about 2.6x
    fewer logits for counts 4-64)."""
    key = jax.random.fold_in(jax.random.key(seed), split)
    most = 0 if flat else max(src.num_kv_pairs for src in sources)
    per = [src.batch(jax.random.fold_in(jax.random.fold_in(key, src.num_kv_pairs), index), batch, most)
           for src in sources]
    out = {k: jnp.stack([b[k] for b in per])[pidx].reshape(pidx.shape[0], accum, batch // accum, -1)
           for k in per[0]}
    if flat:
        P = max(int(n.sum()) for src in sources
                for n in np.split(src.answer_counts(batch), accum))
        answers = lambda mask: jnp.nonzero(mask.reshape(-1), size=P, fill_value=0)[0]  # 0: a key
        out["positions"] = jax.vmap(jax.vmap(answers))(out["mask"]).astype(jnp.int32)
    return out


class Program:
    """The models ``[(pairs, lr)]`` of cell (mixer, dim) trained as ONE stacked program, resumable
    from its checkpoint ``path`` (which, when it exists, also says which models).

    Per model ``j``: ``stopped_at[j]`` (the eval step where it reached --target, 0: not),
    ``bad_step[j]`` (first non-finite step, 0: none), ``train_loss[j]`` (mean over the last
    checked steps), ``curve[j]`` (``[step, {pairs: summary}]`` at each eval while it trained) and
    ``final[j]`` (the last of those). ``live``: the models in the stacked arrays (all until a
    compaction). ``step``: steps taken; the next batch is batch ``step + 1`` of the data.
    """

    def __init__(self, args, mixer, dim, models, name, path):
        t0 = time.perf_counter()
        self.args, self.mixer, self.dim, self.name, self.path = args, mixer, dim, name, path
        if path.exists():
            with np.load(path) as f:
                models = [(tuple(p) if isinstance(p, list) else p, lr)
                          for p, lr in json.loads(str(f["book"]))["models"]]
        self.models, n = models, len(models)
        self.counts = sorted({p for ps, _ in models for p in counts_of(ps)})
        self.c = c = make_config(args, mixer, dim, max(self.counts), models[0][1])
        self.eval_sources = [data_lib.MQAR(args.seq_len, args.vocab, p, c.data.mqar.power_a)
                             for p in self.counts]
        self.train_sources = [MQARMixture(self.eval_sources)] if args.mixture else self.eval_sources
        self.pidx = np.asarray([0 if args.mixture else self.counts.index(p) for p, _ in models])
        self.lrs = np.asarray([lr for _, lr in models], np.float32)
        # eval round r: model j on its r-th pair count (a round per count for mixtures)
        self.rounds = np.asarray([[self.counts.index(p) for p in counts_of(ps)] for ps, _ in models]).T
        self.graphdef, params, self.rest, opt_state, self.tx = stacked.init(c, n)
        self.state = {"params": params, "opt_state": opt_state}
        self.step, self.live, self.pending = 0, np.arange(n), []
        self.stopped_at, self.bad_step = np.zeros(n, int), np.zeros(n, int)
        self.train_loss, self.curve, self.final = np.full(n, np.nan), [[] for _ in models], [None] * n
        self.timing = {"setup_s": 0.0, "train_s": 0.0, "eval_s": 0.0, "save_s": 0.0, "calls": 1,
                       "compactions": []}
        self.slowest_save = 0.0
        if path.exists():
            self.load()
        self.compile()
        self.setup_s = time.perf_counter() - t0  # this call's
        self.timing["setup_s"] += self.setup_s

    def fingerprint(self) -> str:
        """What a resumed program must share with the one that wrote the checkpoint."""
        a = self.args
        return json.dumps({"config": self.c.to_dict(), "models": self.models, "mixture": a.mixture,
                           "target": a.target, "eval_every": a.eval_every,
                           "eval_steps": a.eval_steps, "compact_steps": a.compact_steps},
                          sort_keys=True, default=str)

    def active(self) -> np.ndarray:
        """``[n]`` bool: neither stopped nor diverged."""
        return (self.stopped_at == 0) & (self.bad_step == 0)

    def compile(self):
        """Jit the train and eval steps for the ``live`` models (inputs of their shapes)."""
        c = self.c
        train_step = stacked.make_train_step(self.graphdef, self.tx)
        eval_step = stacked.make_eval_step(self.graphdef)
        b, accum, seed = c.data.batch_size, c.optim.grad_accum, c.data.seed

        def train(state, rest, scale, pidx, step):
            batch = draw(self.train_sources, seed, data_lib.TRAIN, step, pidx, b, accum, flat=True)
            params, opt_state, metrics = train_step(state["params"], state["opt_state"], rest, scale, batch)
            return {"params": params, "opt_state": opt_state}, metrics

        def evaluate(params, rest, pidx, index):
            return eval_step(params, rest, draw(self.eval_sources, seed, data_lib.EVAL, index, pidx,
                                                b, accum))

        m, i0 = len(self.live), jnp.int32(0)
        scale, pidx = jnp.zeros(m, jnp.float32), jnp.zeros(m, jnp.int32)
        self.train = jax.jit(train, donate_argnums=0).lower(self.state, self.rest, scale, pidx,
                                                            i0).compile()
        self.evaluate = jax.jit(evaluate).lower(self.state["params"], self.rest, pidx, i0).compile()

    def run(self, stop=lambda prog: False) -> bool:
        """Train to the last step or until no model is active: True (done). ``stop(self)`` is
        asked after every step (so each call takes at least one); when True, checkpoint and
        return False. Also checkpoints every --save_every seconds."""
        a, n_steps, log_every = self.args, self.c.train.num_steps, self.c.train.log_every
        bar = tqdm.tqdm(total=n_steps, initial=self.step, desc=self.name, dynamic_ncols=True,
                        leave=False)
        t0, t_save, other0 = time.perf_counter(), time.perf_counter(), self.other_seconds()
        scale, pidx = self.inputs()
        while self.step < n_steps and self.active().any():
            self.step += 1
            self.state, metrics = self.train(self.state, self.rest, scale, pidx, jnp.int32(self.step))
            self.pending.append(metrics)
            bar.update()
            at_eval = self.step == n_steps or (a.eval_every and self.step % a.eval_every == 0)
            if at_eval or self.step % log_every == 0:
                self.check()
                if at_eval:
                    self.eval_point()
                scale, pidx = self.inputs()
                ok = self.active()
                bar.set_postfix(loss=f"{np.mean(self.train_loss[ok]):.4f}" if ok.any() else "–",
                                active=int(ok.sum()))
            if stop(self):
                break
            if time.perf_counter() - t_save >= a.save_every:
                self.save()
                t_save = time.perf_counter()
        bar.close()
        jax.block_until_ready(self.state)
        self.timing["train_s"] += time.perf_counter() - t0 - (self.other_seconds() - other0)
        if not self.done():
            self.save()
        return self.done()

    def inputs(self) -> tuple:
        """The step's per-model ``(update scale [live], source index [live])``: the peak lr of an
        active model, 0 (frozen) for the others."""
        scale = np.where(self.active(), self.lrs, 0.0)[self.live]
        return jnp.asarray(scale, jnp.float32), jnp.asarray(self.pidx[self.live], jnp.int32)

    def other_seconds(self) -> float:
        """Seconds of setup, compiles, evals and saves so far (the rest of the wall is steps)."""
        t = self.timing
        return t["setup_s"] + t["eval_s"] + t["save_s"]

    def check(self):
        """The pending steps' metrics: a model active in them whose loss or gradient norm is not
        finite diverged at the first such step; the others' train loss is their mean."""
        ms = jax.device_get(self.pending)
        self.pending = []
        loss, gnorm = (np.stack([m[k] for m in ms]) for k in ("loss", "grad_norm"))  # [k, live]
        act = self.active()[self.live]
        bad = ~(np.isfinite(loss) & np.isfinite(gnorm))
        new = act & bad.any(0)
        self.bad_step[self.live[new]] = self.step - len(ms) + 1 + bad.argmax(0)[new]
        self.train_loss[self.live[act & ~new]] = loss.mean(0)[act & ~new]

    def eval_point(self):
        """Evaluate the active models: each gets a curve point; one whose accuracy reaches
        --target (at every count of a mixture) stops here. Then maybe compact."""
        t = time.perf_counter()
        act = self.active()[self.live]
        for i, ev in enumerate(self.eval_all()):
            j = self.live[i]
            if act[i]:
                self.curve[j].append([self.step, ev])
                self.final[j] = ev
                if self.args.target and min(e["accuracy"] for e in ev.values()) >= self.args.target:
                    self.stopped_at[j] = self.step
        self.timing["eval_s"] += time.perf_counter() - t
        keep = np.flatnonzero(self.active()[self.live])
        left, at_least = self.c.train.num_steps - self.step, self.args.compact_steps
        if at_least and left >= at_least and 0 < 2 * len(keep) <= len(self.live):
            t = time.perf_counter()
            self.state, self.live = stacked.take(self.state, keep), self.live[keep]
            self.compile()
            self.timing["compactions"].append({"step": self.step, "models": len(keep)})
            self.timing["setup_s"] += time.perf_counter() - t

    def eval_all(self) -> list[dict]:
        """``[{str(pairs): {accuracy, row_accuracy, loss}}]`` per live model, on the fixed eval set
        (--eval_steps batches from the eval key) of each of its pair counts."""
        out = [{} for _ in self.live]
        for r in self.rounds:
            pidx = jnp.asarray(r[self.live], jnp.int32)
            sums = [self.evaluate(self.state["params"], self.rest, pidx, jnp.int32(e))
                    for e in range(self.args.eval_steps)]
            s = eval_summary(jax.tree.map(lambda *xs: sum(xs), *sums))
            for i, j in enumerate(self.live):
                out[i][str(self.counts[r[j]])] = {k: float(s[k][i]) for k in SUMMARY}
        return out

    def save(self):
        """Checkpoint: stacked state, pending metrics and the bookkeeping, in one ``.npz``."""
        t = time.perf_counter()
        ms, m = jax.device_get(self.pending), len(self.live)
        book = {"fingerprint": self.fingerprint(), "models": self.models, "step": self.step,
                "live": self.live.tolist(), "stopped_at": self.stopped_at.tolist(),
                "bad_step": self.bad_step.tolist(), "train_loss": self.train_loss.tolist(),
                "curve": self.curve, "final": self.final, "timing": self.timing}
        pending = {f"pending_{k}": np.asarray([x[k] for x in ms], np.float32).reshape(-1, m)
                   for k in ("loss", "grad_norm")}
        stacked.save(self.path, self.state, book=np.asarray(json.dumps(book)), **pending)
        self.slowest_save = max(self.slowest_save, time.perf_counter() - t)
        self.timing["save_s"] += time.perf_counter() - t

    def load(self):
        """Resume from ``path`` (refused when written with other settings)."""
        self.state, arrays = stacked.restore(self.path, self.state)
        book = json.loads(str(arrays["book"]))
        if book["fingerprint"] != self.fingerprint():
            raise ValueError(f"{self.path} was written with other settings: re-run with those, or "
                             "delete it to train this program afresh")
        self.step, self.live = book["step"], np.asarray(book["live"], int)
        self.stopped_at, self.bad_step = (np.asarray(book[k], int) for k in ("stopped_at", "bad_step"))
        self.train_loss = np.asarray(book["train_loss"], np.float64)
        self.curve, self.final, self.timing = book["curve"], book["final"], book["timing"]
        self.timing["calls"] += 1
        self.pending = [{"loss": x, "grad_norm": g}
                        for x, g in zip(arrays["pending_loss"], arrays["pending_grad_norm"])]

    def done(self) -> bool:
        """At the last step, or no model left to train."""
        return self.step == self.c.train.num_steps or not self.active().any()

    def records(self) -> dict:
        """``{run_key: run}`` of the models that are done (all of them once the program is)."""
        seconds = (self.timing["train_s"] + self.other_seconds()) / len(self.models)
        return {run_key(self.mixer, self.dim, *spec): self.record(j, seconds)
                for j, spec in enumerate(self.models) if self.done() or not self.active()[j]}

    def progress(self) -> dict:
        """``{run_key: run}`` of the models still training that have an eval, as ``record`` gives
        them now plus ``cut_at`` (the step): what a call cut by --time_budget learnt, kept in the
        JSON's ``partial`` even when its checkpoint is lost (a call that finishes the run
        replaces it)."""
        seconds = (self.timing["train_s"] + self.other_seconds()) / len(self.models)
        return {run_key(self.mixer, self.dim, *spec): {**self.record(j, seconds), "cut_at": self.step}
                for j, spec in enumerate(self.models) if self.active()[j] and self.final[j]}

    def record(self, j, seconds) -> dict:
        """Model ``j``'s JSON entry: its last eval (stopped-at or final; mean over the counts of a
        mixture, ``per_pairs`` each); diverged: accuracy 0, no losses."""
        pairs, lr = self.models[j]
        div, stop = bool(self.bad_step[j]), int(self.stopped_at[j])
        final = {str(p): {"accuracy": 0.0, "row_accuracy": 0.0, "loss": None}
                 for p in counts_of(pairs)} if div else self.final[j]
        mean = lambda k: None if div and k == "loss" else float(np.mean([e[k] for e in final.values()]))
        curve = self.curve[j]
        run = {"mixer": self.mixer, "dim": self.dim, "pairs": list(pairs) if self.args.mixture else pairs,
               "lr": lr, "steps": int(self.bad_step[j]) if div else stop or self.step,
               **{k: mean(k) for k in SUMMARY},
               "train_loss": None if div else float(self.train_loss[j]), "diverged": div,
               "stopped_at": stop or None, "seconds": seconds, "provenance": common.provenance(),
               "curve": {"step": [s for s, _ in curve],
                         "accuracy": [float(np.mean([e["accuracy"] for e in ev.values()]))
                                      for _, ev in curve]}}
        if div:
            run["error"] = f"non-finite loss or gradient norm at step {self.bad_step[j]}"
        if self.args.mixture:
            run["per_pairs"] = final
            run["curve"]["per_pairs"] = {p: [ev[p]["accuracy"] for _, ev in curve] for p in final}
        return run

    def timings(self) -> dict:
        """The program's entry under ``cells``: sizes, seconds, ms per train step (all calls)."""
        t, steps = self.timing, self.step
        return {"models": len(self.models), "steps": steps, "max_steps": self.c.train.num_steps,
                "seconds": t["train_s"] + self.other_seconds(), "setup_seconds": t["setup_s"],
                "step_ms": 1e3 * t["train_s"] / max(steps, 1), "eval_seconds": t["eval_s"],
                "save_seconds": t["save_s"], "calls": t["calls"], "compactions": t["compactions"]}


def per_count(run) -> dict:
    """``{str(pairs): {accuracy, row_accuracy, ...}}`` of a run: its one count, or a mixture's."""
    return run["per_pairs"] if isinstance(run["pairs"], list) else {str(run["pairs"]): run}


def row_name(run) -> str:
    """A run's row in the tables: its mixer, or ``mixer (mix)`` for a mixture-trained model."""
    return run["mixer"] + (" (mix)" if isinstance(run["pairs"], list) else "")


def cell_report(name, runs, timing, pairs, lrs) -> str:
    """The program's timing, then accuracy (%) per pair count (rows) and lr (columns);
    ``@step``: stopped there at --target."""
    table = {}
    for r in runs.values():
        for p, e in per_count(r).items():
            table[int(p), r["lr"]] = "div" if r["diverged"] else f"{100 * e['accuracy']:.1f}" + (
                f"@{r['stopped_at']}" if r.get("stopped_at") else "")
    t = timing
    squeezed = "".join(f", compacted to {c['models']} at {c['step']}" for c in t["compactions"])
    lines = [f"{name}: {t['models']} models x {t['steps']}/{t['max_steps']} steps in "
             f"{t['seconds']:.0f} s over {t['calls']} call(s) (setup+compile {t['setup_seconds']:.0f} s, "
             f"{t['step_ms']:.1f} ms/step, eval {t['eval_seconds']:.0f} s{squeezed}); "
             "accuracy % by pairs (rows) and lr (columns):",
             " " * 8 + "".join(f"{lr:>11g}" for lr in lrs)]
    lines += [f"  kv={p:<4}" + "".join(f"{table.get((p, lr), ''):>11}" for lr in lrs) for p in pairs
              if any((p, lr) in table for lr in lrs)]
    return "\n".join(lines)


def best_table(runs: dict) -> dict:
    """``best[row][dim][pairs] = {"accuracy", "row_accuracy", "lr"}`` from each run's final (or
    stopped-at) eval: per pair count, the best lr of the single-count runs; a mixture row is one
    model per lr, so it is the lr with the best mean over its counts, at each count."""
    best, score = {}, {}
    for r in runs.values():
        row, dim = row_name(r), str(r["dim"])
        for p, e in per_count(r).items():
            if r["accuracy"] > score.get((row, dim, p), -1.0):
                score[row, dim, p] = r["accuracy"]
                best.setdefault(row, {}).setdefault(dim, {})[p] = {
                    "accuracy": e["accuracy"], "row_accuracy": e["row_accuracy"], "lr": r["lr"]}
    return best


def mean_over_pairs(best: dict, row: str, dim: str, pairs) -> float | None:
    accs = [best.get(row, {}).get(dim, {}).get(str(p), {}).get("accuracy") for p in pairs]
    return None if any(a is None for a in accs) else float(np.mean(accs))


def table_rows(res: dict) -> list[tuple[str, str]]:
    """``[(row, mixer)]`` present in the best table, in the settings' mixer order."""
    return [(row, m) for m in res["settings"]["mixers"] for row in (m, f"{m} (mix)")
            if row in res["best"]]


def pooled(settings: dict, *more: dict) -> dict:
    """``settings`` with the mixers, dims and lrs of ``more`` added, in the sweep's order: a file
    that calls with other ``--lrs`` (mixers, dims) write holds the union of their sweeps."""
    order = {"mixers": (PAPER_MIXERS + MIXERS).index, "dims": None, "lrs": None}
    return {**settings, **{k: sorted(dict.fromkeys(x for s in (settings, *more) for x in s.get(k, [])),
                                     key=order[k]) for k in SWEPT}}


def fold(into: dict, part: dict) -> dict:
    """``part``'s runs, cells and partial runs folded into ``into`` (a finished run leaves
    ``partial``), the settings ``part``'s with the sweeps pooled; ``into`` returned."""
    for k in ("runs", "cells", "partial"):
        into[k] = {**into.get(k, {}), **part.get(k, {})}
    for key in into["runs"]:
        into["partial"].pop(key, None)
    into["settings"] = pooled(part.get("settings", {}), into.get("settings", {}))
    return into


def tables(res: dict) -> str:
    """Markdown: ours (mean over pairs, best lr) beside the paper, then accuracy per pair count."""
    s, best = res["settings"], res["best"]
    dims, pairs = [str(d) for d in s["dims"]], s["pairs"]

    def paper(m, d):
        v = PAPER.get(m, {}).get(d)
        return "–" if v is None else (("≥" if (m, d) in PAPER_AT_LEAST else "") + f"{v:.1f}")

    budget = f"{s['steps']} steps, batch {s['batch']}"
    if s.get("protocol"):
        budget = (f"protocol {s['protocol']}: at most {budget}"
                  + (f", early stop at {100 * s['target']:g}%" if s.get("target") else ""))
    head = ["mixer"] + [f"d={d} {w}" for d in dims for w in ("ours", "paper")]
    rows = [[row] + [x for d in dims for x in (common.fmt(mean_over_pairs(best, row, d, pairs)),
                                               paper(m, d))] for row, m in table_rows(res)]
    out = [f"MQAR accuracy (%), T={s['seq_len']}, mean over pairs {pairs}, best lr of {s['lrs']}, "
           f"{budget}. {s.get('note', '')}".strip(), "", common.markdown_table(head, rows), ""]
    head = ["mixer", "dim"] + [f"kv={p}" for p in pairs]
    rows = []
    for row, _ in table_rows(res):
        for d in dims:
            cells = [best[row].get(d, {}).get(str(p)) for p in pairs]
            rows.append([row, d] + ["–" if c is None else f"{common.fmt(c['accuracy'])} (lr {c['lr']:g})"
                                    for c in cells])
    out += ["Per pair count (best lr in brackets):", "", common.markdown_table(head, rows)]
    partial = sorted(res.get("partial", {}).values(), key=lambda r: (r["mixer"], r["dim"], r["lr"]))
    if partial:
        rows = [[r["mixer"] + (" (mix)" if isinstance(r["pairs"], list) else ""), r["dim"],
                 f"{r['lr']:g}", r["cut_at"], common.fmt(r["accuracy"])]
                + [cut_cell(r, p) for p in pairs] for r in partial]
        out += ["", "Cut by --time_budget and not resumed yet: still training, their last eval "
                "(not in the tables above):", "",
                common.markdown_table(["mixer", "dim", "lr", "step", "mean"] + head[2:], rows)]
    return "\n".join(out)


def cut_cell(run, pairs) -> str:
    """A partial run's accuracy at ``pairs`` (a mixture's per count), or "–"."""
    if isinstance(run["pairs"], list):
        e = run.get("per_pairs", {}).get(str(pairs))
        return "–" if e is None else common.fmt(e["accuracy"])
    return common.fmt(run["accuracy"]) if run["pairs"] == pairs else "–"


def plot(res: dict):
    """Best-lr accuracy vs key-value pairs, one panel per model dim, one line per table row."""
    s, best = res["settings"], res["best"]
    dims = [str(d) for d in s["dims"]]
    fig, axes = common.figure(len(dims), figsize=(4.2 * len(dims), 3.6))
    for ax, d in zip(axes, dims):
        for row, _ in table_rows(res):
            cell = best[row].get(d, {})
            ps = [p for p in s["pairs"] if str(p) in cell]
            if ps:
                ax.plot(ps, [100 * cell[str(p)]["accuracy"] for p in ps], marker="o", label=row)
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
    return common.write_markdown(out / f"mqar_{tag}.md", tables(res))


def programs_of(args, ckpt_dir, mixer, dim, done) -> list[tuple]:
    """``[(name, todo, path)]``: the cell's programs (fixed groups of at most --group models) with
    runs left to train or a checkpoint to resume; a program is named by its cell and learning
    rates, so calls with other ``--lrs`` on the same tag keep their own checkpoints and timings."""
    models = cell_models(args)
    n_groups = math.ceil(len(models) / (args.group or len(models)))
    out = []
    for g, idx in enumerate(np.array_split(np.arange(len(models)), n_groups)):
        lrs = "+".join(f"{lr:g}" for lr in sorted({models[j][1] for j in idx}))
        name = (f"{mixer}/d{dim}" + ("/mix" if args.mixture else "") + f"/lr{lrs}"
                + (f"/{g + 1}of{n_groups}" if n_groups > 1 else ""))
        path = ckpt_dir / (name.replace("/", "_") + ".npz")
        todo = [models[j] for j in idx if run_key(mixer, dim, *models[j]) not in done]
        if todo or path.exists():
            out.append((name, todo, path))
    return out


def launch(args, argv) -> dict:
    """``--processes n``: the command as ``n`` shard processes at once (``python -m
    experiments.mqar ... --shard i/n`` from the repository root, their output in
    ``<tmp>/mqar_<tag>.shard<i>of<n>.log``, a bar counting the finished ones), then their merge.
    ``--mps`` first starts the CUDA MPS daemon, so the processes' kernels share the GPU side by
    side instead of taking turns (results page: the MQAR runs)."""
    n = args.processes
    rest = [a for j, a in enumerate(argv) if not (
        a in ("--mps", "--processes") or a.startswith("--processes=") or argv[j - 1:j] == ["--processes"])]
    if args.mps:
        common.start_mps()
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}  # n processes on one GPU
    logs = [pathlib.Path(tempfile.gettempdir()) / f"mqar_{args.tag}.shard{i}of{n}.log" for i in range(n)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "a") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "experiments.mqar", *rest, "--shard", f"{i}/{n}"],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=common.ROOT))
    print(f"{n} shard processes, logs {logs[0].parent}/mqar_{args.tag}.shard*of{n}.log")
    with tqdm.tqdm(total=n, desc="shard processes done") as bar:
        while bar.n < n:
            time.sleep(1)
            bar.update(sum(p.poll() is not None for p in procs) - bar.n)
    failed = [str(log) for p, log in zip(procs, logs) if p.returncode]
    if failed:
        raise SystemExit(f"{len(failed)} shard process(es) failed; their logs: {failed}")
    return main(rest + ["--merge"])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.processes:
        return launch(args, argv)
    deadline = time.perf_counter() + (args.time_budget or math.inf)
    common.compilation_cache(args.jit_cache)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    i, n = (int(x) for x in args.shard.split("/"))
    main_path = out / f"mqar_{args.tag}.json"
    path = main_path if n == 1 else out / f"mqar_{args.tag}.shard{i}of{n}.json"
    shard_files = sorted(out.glob(f"mqar_{args.tag}.shard*of*.json"))
    c = make_config(args, args.mixers[0], args.dims[0], max(args.pairs), args.lrs[0])
    settings = {"protocol": args.protocol, "mixers": args.mixers, "dims": args.dims,
                "pairs": args.pairs, "lrs": args.lrs, "mixture": args.mixture,
                "steps": c.train.num_steps, "warmup": c.optim.warmup_steps,
                "schedule": f"warmup + cosine to {c.optim.min_lr_ratio:g} x peak",
                "weight_decay": c.optim.weight_decay, "seq_len": args.seq_len, "batch": args.batch,
                "eval_steps": args.eval_steps, "eval_every": args.eval_every, "target": args.target,
                "compact_steps": args.compact_steps, "group": args.group, "impl": args.impl,
                "set": args.set, "n_layers": c.model.n_layers, "n_heads": c.model.n_heads,
                "vocab_size": args.vocab, "note": args.note}
    res = common.read_json(main_path) or {"tag": args.tag, "runs": {}}
    res.setdefault("cells", {})
    if args.merge:  # settings from the shard files (the sweep's); mixers, dims, lrs and runs pooled
        for shard in shard_files:
            fold(res, {"settings": settings, **common.read_json(shard)})
        runs = [*res["runs"].values(), *res.get("partial", {}).values()]  # each run's mixer, dim, lr
        res["settings"] = pooled(res.get("settings") or settings,
                                 {k: [r[f] for r in runs] for k, f in SWEPT.items()})
        md = finish(res, out, args.tag)
        print(md)
        return res
    res["settings"] = settings
    done = set(res["runs"]) | {k for f in shard_files for k in common.read_json(f).get("runs", {})}
    ckpt_dir = out / f"mqar_{args.tag}.ckpt"
    own = {"runs": {}, "cells": {}, "partial": {}}  # what this call trained

    def write() -> dict:
        """This call's results merged into the file as it is now, written under a lock on the
        output folder: calls on one file at once (other ``--lrs`` of a shard) keep each other's."""
        with common.locked(out):
            cur = fold(common.read_json(path), {**own, "settings": settings})
            cur["tag"] = args.tag
            if path == main_path:
                finish(cur, out, args.tag)
            else:
                common.write_json(path, cur)
        return cur

    # every n-th cell of the grid (fixed, so each call finds its cells and checkpoints again)
    cells = [(m, d) for d in args.dims for m in args.mixers][i::n]
    cells = [(m, d) for m, d in cells if programs_of(args, ckpt_dir, m, d, done)]
    left = lambda: deadline - time.perf_counter()
    setup_s, cut, started = 0.0, False, False
    for k, (mixer, dim) in enumerate(cells):
        for name, todo, ckpt in programs_of(args, ckpt_dir, mixer, dim, done):
            # a call always makes progress: its first program starts whatever the budget
            if cut or (started and left() < RESERVE_S + 2 * setup_s):
                cut = True
                break
            started = True
            prog = Program(args, mixer, dim, todo, f"[{k + 1}/{len(cells)}] {name}", ckpt)
            setup_s = max(setup_s, prog.setup_s)
            finished = prog.run(stop=lambda p: left() < RESERVE_S + 2 * p.slowest_save)
            runs = prog.records()
            own["runs"].update(runs)
            if not finished:
                own["partial"].update(prog.progress())
            own["cells"][name] = prog.timings()
            write()
            tqdm.tqdm.write(cell_report(name, runs, own["cells"][name], args.pairs, args.lrs))
            if finished:
                ckpt.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    ckpt_dir.rmdir()
            else:
                cut = True
                tqdm.tqdm.write(f"{name}: stopped at step {prog.step} for --time_budget "
                                f"(checkpoint {ckpt}); the same command goes on from there")
    if path == main_path:
        res = write()
        print(tables(res))
    return res


if __name__ == "__main__":
    main()
