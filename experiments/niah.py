"""Needle-in-a-haystack retrieval at several context lengths for trained ``configs/niah.py``
checkpoints: single needle, and one needle among distractor needles.

    python -m experiments.niah --workdirs runs/niah-hla2,runs/niah-softmax --lengths 512,1024,2048
    python -m experiments.niah --train --mixers softmax,hla2 --train_seq_len 256 --steps 300 --tag tiny

single: ``hla_jax.data.NIAH`` at length T (the training task, possibly longer than trained).
multi:  ``MultiNIAH``: the same haystack and question, plus ``--needles - 1`` distractor needles
(" The lucky number is M. ", other key words, other numbers) at random depths; the model must
return the magic number, not a distractor. The question is unchanged, so a single-needle model
is tested as trained (the trainer has no multi-needle data kind to train on).
``--haystack code``: ``CodeNIAH``, the same test in Python for byte LMs trained on source code
(``configs/lm.py``), zero-shot: windows of the checkpoint's held-out corpus around a line
``MAGIC_NUMBER = N`` (distractors ``LUCKY_NUMBER = M``, ...), then ``assert MAGIC_NUMBER == N``.
Accuracy per digit (``accuracy``) and per whole number (``row_accuracy``), from the trainer's
``make_eval_step`` on ``--examples`` examples per cell. Softmax lengths beyond the checkpoint's
``max_seq_len`` (RoPE table) are recorded as null. ``--train`` first trains ``configs/niah.py``
per mixer into ``--workroot``. Writes ``niah_<tag>.json``, ``.png`` and ``.md`` under ``--out``, with
their provenance.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from hla_jax import data as data_lib
from hla_jax.data.synthetic import NIAH
from hla_jax.train.steps import eval_summary, masked_sums

DISTRACTOR_KEYS = ("lucky", "secret", "special", "hidden", "winning", "chosen", "best", "first")


class MultiNIAH(NIAH):
    """``NIAH`` with ``n_needles - 1`` distractors " The <key> number is M. " (key != magic, M a
    different number) inserted at random depths of the filler; same question and target."""

    def __init__(self, seq_len: int, n_digits: int = 5, n_needles: int = 4):
        super().__init__(seq_len, n_digits)
        if not 1 <= n_needles <= len(DISTRACTOR_KEYS) + 1:
            raise ValueError(f"n_needles must be in [1, {len(DISTRACTOR_KEYS) + 1}], got {n_needles}")
        self.n_needles = n_needles
        longest = max(len(self._distractor(k, "0" * n_digits)) for k in DISTRACTOR_KEYS)
        self.room -= (n_needles - 1) * longest
        if self.room < 0:
            raise ValueError(f"seq_len={seq_len} too short for {n_needles} needles")

    @staticmethod
    def _distractor(key: str, number: str) -> bytes:
        return f" The {key} number is {number}. ".encode()

    def example(self, rng: np.random.Generator):
        digits = lambda: "".join(str(d) for d in rng.integers(0, 10, self.n_digits))  # noqa: E731
        number = digits()
        keys = rng.choice(len(DISTRACTOR_KEYS), self.n_needles - 1, replace=False)
        pieces = [self._needle(number)] + [self._distractor(DISTRACTOR_KEYS[k], digits()) for k in keys]
        pieces = [pieces[j] for j in rng.permutation(len(pieces))]
        budget = self.seq_len + 1 - len(self.QUESTION) - self.n_digits - sum(map(len, pieces))
        cuts = np.sort(rng.integers(0, budget + 1, len(pieces)))
        sizes = np.diff(np.concatenate([[0], cuts, [budget]]))
        text = b"".join(self._filler(rng, int(s)) + p for s, p in zip(sizes[:-1], pieces))
        text += self._filler(rng, int(sizes[-1])) + self.QUESTION + number.encode()
        seq = self.tok.encode(text).astype(np.int64)
        mask = np.zeros(self.seq_len, bool)
        mask[-self.n_digits:] = True
        return seq[:-1], seq[1:], mask


class CodeNIAH(MultiNIAH):
    """``MultiNIAH`` in Python source, for byte LMs trained on code (zero-shot): the haystack is
    windows of ``haystack`` (held-out source bytes, uint8 ``[n]``, each window from a line start),
    the needle a line ``MAGIC_NUMBER = N``, the distractors ``<KEY>_NUMBER = M``, the question
    ``assert MAGIC_NUMBER == N`` (targets: the digits of ``N``); ``n_needles=1``: no distractor.
    ``decoy=True``: the needle holds ``N`` with every digit shifted by 5 (mod 10), so it tells
    nothing about ``N``: the loss there minus the loss with the true needle is the retrieval gain."""

    QUESTION = b"\nassert MAGIC_NUMBER == "
    SLACK = 4096  # bytes searched for a line start

    def __init__(self, seq_len: int, haystack: np.ndarray, n_digits: int = 5, n_needles: int = 1,
                 decoy: bool = False):
        self.decoy = decoy
        super().__init__(seq_len, n_digits, n_needles)
        if haystack.size < seq_len + 2 * self.SLACK:
            raise ValueError(f"CodeNIAH: a haystack of {haystack.size} bytes is too short for "
                             f"seq_len={seq_len} (needs {seq_len + 2 * self.SLACK})")
        self.haystack = haystack

    def _needle(self, number: str) -> bytes:
        if self.decoy:
            number = "".join(str((int(c) + 5) % 10) for c in number)
        return b"\nMAGIC_NUMBER = " + number.encode() + b"\n"

    @staticmethod
    def _distractor(key: str, number: str) -> bytes:
        return f"\n{key.upper()}_NUMBER = {number}\n".encode()

    def _filler(self, rng, n: int) -> bytes:
        start = int(rng.integers(0, self.haystack.size - n - self.SLACK))
        text = self.haystack[start:start + n + self.SLACK].tobytes()
        line = text.find(b"\n", 0, self.SLACK) + 1  # 0 when no line starts in the slack
        return text[line:line + n]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_train_args(p, "softmax,mamba2,loglinear_mamba2,gated_deltanet,hla2", 1024,
                          "--train length (configs/niah.py)")
    p.add_argument("--lengths", default="512,1024,2048,4096", help="eval context lengths")
    p.add_argument("--needles", type=int, default=4, help="needles in the multi-needle test")
    p.add_argument("--haystack", default="text", choices=("text", "code"),
                   help="text: NIAH's filler sentences (the training task of configs/niah.py); "
                        "code: CodeNIAH in the checkpoint's held-out corpus (byte LMs, zero-shot)")
    p.add_argument("--examples", type=int, default=64, help="eval examples per cell")
    p.add_argument("--batch", type=int, default=16, help="eval batch")
    p.add_argument("--tag", default="niah")
    p.add_argument("--out", default=str(common.RESULTS))
    return p.parse_args(argv)


def train_configs(args) -> dict:
    configs = {}
    for mixer in filter(None, args.mixers.split(",")):
        c = common.quiet(common.get_config("niah", f"mixer={mixer},seq_len={args.train_seq_len}"))
        configs[mixer] = common.apply_train_args(c, args)
    return configs


def scores(nll_fn, x) -> dict:
    """The trainer's eval sums (``steps.masked_sums``) of one batch ``x`` (``[b,T]`` arrays)."""
    nll, correct = nll_fn({k: jnp.asarray(v) for k, v in x.items()})
    return jax.device_get(masked_sums(nll, correct, jnp.asarray(x["mask"])))


def retrieval(workdir, lengths, needles: int, examples: int, batch: int, loaded=None,
              haystack: str = "text", nll_fn=None) -> dict:
    """``{kind: {T: {"loss", "accuracy", "row_accuracy"} | None}}`` for one checkpoint, kinds
    "single", "multi" and, in code, "decoy" (``loaded``: its ``common.load_model`` if already at
    hand, ``nll_fn`` its ``common.token_nll_fn``, shared with other evaluations of the same
    shapes; ``haystack``: see ``--haystack``)."""
    c, model, step = loaded or common.load_model(workdir)
    code = data_lib.make_sources(c.data, c.model.vocab_size)[1].tokens if haystack == "code" else None
    nll_fn = nll_fn or common.token_nll_fn(model)
    softmax = "softmax" in c.model.mixer_pattern
    out = {"label": common.label(c), "workdir": str(workdir), "step": int(step),
           "train_seq_len": c.data.seq_len, "haystack": haystack}
    kinds = ("single", "multi") + (("decoy",) if haystack == "code" else ())
    for kind in kinds:
        out[kind] = {}
        for T in lengths:
            if softmax and T > c.model.max_seq_len:
                out[kind][str(T)] = None
                continue
            n_digits = c.data.niah.n_digits
            n = needles if kind == "multi" else 1
            if haystack == "code":
                source = CodeNIAH(T, code, n_digits, n, decoy=kind == "decoy")
            else:
                source = NIAH(T, n_digits) if n == 1 else MultiNIAH(T, n_digits, n)
            sums = [scores(nll_fn, data_lib.make_batch(source, c.data.seed, data_lib.EVAL, b,
                                                        np.arange(batch)))
                    for b in range(-(-examples // batch))]  # examples rounded up to whole batches
            total = {k: sum(s[k] for s in sums) for k in sums[0]}
            out[kind][str(T)] = {k: float(v) for k, v in eval_summary(total).items()}
    return out


def table(res: dict) -> str:
    lengths = res["settings"]["lengths"]
    head = ["mixer", "train T", "test"] + [f"T={T}" for T in lengths]
    rows = []
    for e in res["runs"].values():
        for kind in ("single", "multi", "decoy"):
            if kind not in e:
                continue
            name = {"multi": f"multi ({res['settings']['needles']} needles)",
                    "decoy": "decoy (a needle without the answer)"}.get(kind, kind)
            rows.append([e["label"], e["train_seq_len"], name]
                        + [common.fmt(None if e[kind][str(T)] is None else e[kind][str(T)]["row_accuracy"])
                           for T in lengths])
    return (f"NIAH whole-number accuracy (%), {res['settings']['examples']} examples per cell "
            f"(– = beyond the softmax RoPE table).\n\n" + common.markdown_table(head, rows))


def plot(res: dict):
    lengths = res["settings"]["lengths"]
    fig, axes = common.figure(2, figsize=(9, 3.6), sharey=True)
    for ax, kind in zip(axes, ("single", "multi")):
        for e in res["runs"].values():
            pts = [(T, 100 * e[kind][str(T)]["row_accuracy"]) for T in lengths if e[kind][str(T)]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=e["label"])
        ax.set(xscale="log", xlabel="context length", title=f"{kind} needle"
               + ("" if kind == "single" else f" ({res['settings']['needles']} needles)"))
        ax.set_xticks(lengths, [str(T) for T in lengths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("whole-number accuracy (%)")
    axes[0].set_ylim(-2, 102)
    axes[1].legend(fontsize=8)
    return fig


def main(argv=None) -> dict:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    workdirs = {pathlib.Path(w).name: w for w in filter(None, args.workdirs.split(","))}
    if args.train:
        root = args.workroot or tempfile.mkdtemp(prefix="niah_")
        workdirs.update(common.train_workdirs(train_configs(args), root))
    if not workdirs:
        raise SystemExit("give --workdirs or --train")
    res = {"tag": args.tag, "settings": {"lengths": lengths, "needles": args.needles,
                                         "haystack": args.haystack,
                                         "examples": args.examples, "trained_here": args.train},
           "runs": {name: retrieval(w, lengths, args.needles, args.examples, args.batch,
                                    haystack=args.haystack)
                    for name, w in workdirs.items()}}
    out = pathlib.Path(args.out)
    common.write_json(out / f"niah_{args.tag}.json", res)
    common.save(plot(res), out / f"niah_{args.tag}.png")
    print(common.write_markdown(out / f"niah_{args.tag}.md", table(res)))
    return res


if __name__ == "__main__":
    main()
