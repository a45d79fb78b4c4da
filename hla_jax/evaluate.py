"""Evaluate a trained run: lm-evaluation-harness tasks, and bits per byte on text files.

    .venv/bin/python -m hla_jax.evaluate --workdir=RUN --tasks=lambada_openai,hellaswag
    .venv/bin/python -m hla_jax.evaluate --workdir=RUN --tasks=my_task --include_path=my_tasks/
    .venv/bin/python -m hla_jax.evaluate --workdir=RUN --text_files=a.txt,b.txt

``HarnessLM`` is the harness's model (registered as ``hla_jax``: ``lm_eval.simple_evaluate(
model="hla_jax", model_args="workdir=RUN")`` once this module is imported) over a run's newest
checkpoint (``hla_jax.train.restore``), any mixer or hybrid: ``loglikelihood``,
``loglikelihood_rolling`` and ``generate_until``. Scoring runs in batches of ``batch_size`` rows
right-padded to a few lengths (powers of two up to ``max_length``), so only a few shapes
compile; generation decodes a batch step by step and stops once every row has hit a stop string
or the end-of-document id.

``--text_files``: each file's text, read as one document, is split into windows of
``max_length`` (default: the run's ``data.seq_len``) predictions, every token predicted exactly
once, each window after the first with a full ``max_length`` of context (as the harness's
``loglikelihood_rolling``). Reported: tokens, UTF-8 bytes, bits per byte
(``Σ −log2 p / bytes``) and token perplexity (``exp(Σ −ln p / tokens)``), per file and over all.

A text is scored as if it followed the end-of-document id (for a tokenizer without one, a line
break), which gives its first token a context.
"""

import collections
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import lm_eval
import numpy as np
import tqdm
from absl import flags, logging
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from hla_jax import cli
from hla_jax.nn import generate_stream
from hla_jax.train.restore import load_run

MIN_BUCKET = 16  # the shortest padded length


def bucket(n: int, cap: int) -> int:
    """The padded length of ``n`` tokens: the next power of two (at least ``MIN_BUCKET``), at
    most ``cap`` (``n <= cap``)."""
    return min(cap, max(MIN_BUCKET, 1 << (int(n) - 1).bit_length()))


def rolling_windows(n: int, width: int) -> list[tuple[int, int, int]]:
    """Windows over ``s = [prefix] + text`` (``n`` text tokens, ``s`` has ``n + 1``) that predict
    every text token once: ``(start, end, scored)``, inputs ``s[start:end]``, targets
    ``s[start + 1:end + 1]``, the last ``scored`` of them counted. Windows predict ``width``
    tokens each (the last one the rest) from ``min(width, end)`` inputs: all the context fits."""
    out = []
    for a in range(0, n, width):
        b = min(a + width, n)
        out.append((b - min(width, b), b, b - a))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _score_batch(graphdef, state, inputs, targets, mask):
    """Per row of ``inputs, targets [B,L] int32``, ``mask [B,L] bool``: the summed
    log-probability of the masked targets, and whether each of them is the argmax."""
    logits = nnx.merge(graphdef, state)(inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.sum(jnp.where(mask, picked, 0.0), axis=1), jnp.all(greedy | ~mask, axis=1)


class Scorer:
    """Log-likelihoods of token rows under ``model``, ``batch_size`` rows at a time."""

    def __init__(self, model, batch_size: int, max_length: int):
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        cfg = model.cfg
        if "softmax" in cfg.mixer_pattern and max_length > cfg.max_seq_len:
            raise ValueError(f"max_length={max_length} exceeds the model's max_seq_len="
                             f"{cfg.max_seq_len} (the RoPE table of its softmax layers)")
        self.graphdef, self.state = nnx.split(model)
        self.batch_size, self.max_length = batch_size, max_length

    def score(self, rows, desc: str = "score", disable: bool = False) -> list[tuple[float, bool]]:
        """``rows``: ``(tokens [m + 1], scored)``, ``m <= max_length`` inputs ``tokens[:-1]``
        predicting ``tokens[1:]``, the last ``scored`` counted. Returns per row ``(log p, the
        scored tokens are all greedy)``, in the given order. Longest rows go first, so a batch
        holds rows of similar lengths."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out = [None] * len(rows)
        B = self.batch_size
        for start in tqdm.trange(0, len(order), B, desc=desc, disable=disable, dynamic_ncols=True):
            batch = order[start:start + B]
            L = bucket(max(len(rows[batch[0]][0]) - 1, 1), self.max_length)
            tokens = np.zeros((B, L + 1), np.int32)
            mask = np.zeros((B, L), bool)
            for r, i in enumerate(batch):
                seq, scored = rows[i]
                if not 0 <= scored <= len(seq) - 1 <= L:
                    raise ValueError(f"score: a row of {len(seq)} tokens scoring {scored} does not "
                                     f"fit max_length={self.max_length}")
                tokens[r, :len(seq)] = seq
                mask[r, len(seq) - 1 - scored:len(seq) - 1] = True
            logp, greedy = map(np.asarray, _score_batch(self.graphdef, self.state, tokens[:, :-1],
                                                         tokens[:, 1:], mask))
            for r, i in enumerate(batch):
                out[i] = (float(logp[r]), bool(greedy[r]))
        return out

    def rolling(self, texts: list[np.ndarray], prefix: int, desc: str = "rolling",
                disable: bool = False) -> list[float]:
        """The log-likelihood of each token text ``[n]`` after ``prefix``, over ``rolling_windows``
        of ``max_length``."""
        rows, owner = [], []
        for k, ids in enumerate(texts):
            s = np.concatenate([[prefix], ids]).astype(np.int32)
            for a, b, scored in rolling_windows(len(ids), self.max_length):
                rows.append((s[a:b + 1], scored))
                owner.append(k)
        totals = np.zeros(len(texts))
        for k, (logp, _) in zip(owner, self.score(rows, desc=desc, disable=disable)):
            totals[k] += logp
        return totals.tolist()


GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


@register_model("hla_jax")
class HarnessLM(TemplateLM):
    """An lm-evaluation-harness model over a training run: ``workdir`` (its newest checkpoint,
    or ``step``), or an already loaded ``run`` (``hla_jax.train.restore.load_run``).
    ``max_length`` (0: the run's ``data.seq_len``) caps every scored window and every prompt
    plus its generated tokens; ``seed`` seeds sampling (``do_sample``)."""

    def __init__(self, workdir=None, step=None, batch_size=8, max_length=0, seed=0, run=None):
        super().__init__()
        if (workdir is None) == (run is None):
            raise ValueError("HarnessLM: give workdir or run, not both")
        self.run = load_run(workdir, step) if run is None else run
        self.tokenizer = self.run.tokenizer
        self.max_length = int(max_length) or self.run.seq_len
        self.batch_size = int(batch_size)
        self.scorer = Scorer(self.run.model, self.batch_size, self.max_length)
        self.rng = jax.random.key(int(seed))
        eod = self.tokenizer.eod_id
        self._prefix = int(eod if eod is not None else self.tokenizer.encode("\n")[-1])

    @property
    def eot_token_id(self) -> int:
        """The token an empty context is replaced by (``prefix_token_id``)."""
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``requests``: ``(args, context ids, continuation ids)`` from ``loglikelihood``."""
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"loglikelihood: a continuation of {len(continuation)} tokens is "
                                 f"longer than max_length={self.max_length}")
            seq = np.asarray(context + continuation, np.int32)[-(self.max_length + 1):]
            rows.append((seq, len(continuation)))
        out = self.scorer.score(rows, desc="loglikelihood", disable=disable_tqdm)
        for (args, _, _), result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", args, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [self.tokenizer.encode(r.args[0]) for r in requests]
        out = self.scorer.rolling(texts, self._prefix, desc="loglikelihood_rolling",
                                  disable=disable_tqdm)
        for r, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, result)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each ``(context, gen_kwargs)``: the continuation up to the first ``until`` string, the
        end-of-document id or ``max_gen_toks`` (default 256) tokens; greedy unless
        ``do_sample`` (then ``temperature``, default 1, ``top_k``, ``top_p``)."""
        groups = collections.defaultdict(list)
        for i, r in enumerate(requests):
            groups[json.dumps(r.args[1], sort_keys=True)].append(i)
        out = [None] * len(requests)
        bar = tqdm.tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm,
                        dynamic_ncols=True)
        for key, members in groups.items():
            until, max_new, sampling = self._generation(json.loads(key))
            prompts = [self._prompt(requests[i].args[0], max_new) for i in members]
            order = sorted(range(len(members)), key=lambda j: -len(prompts[j]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                texts = self._generate_batch([prompts[j] for j in batch], until, max_new, sampling)
                for j, text in zip(batch, texts):
                    out[members[j]] = text
                    self.cache_hook.add_partial("generate_until", requests[members[j]].args, text)
                bar.update(len(batch))
        bar.close()
        return out

    def _generation(self, kwargs: dict):
        """``(until strings, max_gen_toks, sampling settings)`` of a task's ``gen_kwargs``."""
        unknown = sorted(set(kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"generate_until: unsupported gen_kwargs {unknown}; supported: {GEN_KWARGS}")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", 256))
        if not 1 <= max_new < self.max_length:
            raise ValueError(f"generate_until: max_gen_toks={max_new} must be in [1, max_length="
                             f"{self.max_length})")
        temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
        sampling = dict(temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                        top_p=float(kwargs.get("top_p") or 1.0))
        return until, max_new, sampling

    def _prompt(self, context: str, max_new: int) -> np.ndarray:
        """The context's ids, its last ``max_length − max_new`` (the prefix id when empty)."""
        ids = self.tokenizer.encode(context)
        return ids[-(self.max_length - max_new):] if ids.size else np.array([self._prefix], np.int32)

    def _generate_batch(self, prompts, until, max_new: int, sampling) -> list[str]:
        n = len(prompts)
        lengths = np.array([p.size for p in prompts] + [1] * (self.batch_size - n))
        tokens = np.zeros((self.batch_size, bucket(lengths.max(), self.max_length - max_new)), np.int32)
        for row, p in zip(tokens, prompts):
            row[:p.size] = p
        self.rng, key = jax.random.split(self.rng)
        eod = self.tokenizer.eod_id
        ids, done = [[] for _ in range(n)], np.zeros(n, bool)
        for step in generate_stream(self.run.model, tokens, max_new, rng=key, prompt_lengths=lengths,
                                    **sampling):
            for r in np.flatnonzero(~done):
                if int(step[r]) == eod:
                    done[r] = True
                    continue
                ids[r].append(int(step[r]))
                done[r] = any(s in self.tokenizer.decode(ids[r]) for s in until)
            if done.all():
                break
        texts = [self.tokenizer.decode(x) for x in ids]
        return [min((t.split(s)[0] for s in until), key=len, default=t) for t in texts]


def score_text_files(run, paths, batch_size: int = 8, max_length: int = 0) -> dict:
    """Per file (by its path) and ``"all"``: ``tokens``, ``bytes``, ``bits_per_byte``,
    ``perplexity`` (module docstring)."""
    scorer = Scorer(run.model, batch_size, max_length or run.seq_len)
    tok = run.tokenizer
    texts = {}
    for p in paths:
        path = pathlib.Path(p)
        if not path.is_file():
            raise ValueError(f"text_files: {p} is not a file")
        try:
            texts[str(p)] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text_files: {p} is not UTF-8 text ({e.reason} at byte {e.start})") from e
        if not texts[str(p)]:
            raise ValueError(f"text_files: {p} is empty")
    ids = tok.encode_batch(list(texts.values()))
    eod = tok.eod_id
    prefix = int(eod if eod is not None else tok.encode("\n")[-1])
    logps = scorer.rolling(ids, prefix, desc="text_files")

    def summary(n_tokens, n_bytes, logp):
        return {"tokens": int(n_tokens), "bytes": int(n_bytes),
                "bits_per_byte": -logp / math.log(2) / n_bytes, "perplexity": math.exp(-logp / n_tokens)}

    sizes = [len(t.encode("utf-8")) for t in texts.values()]
    out = {name: summary(len(i), b, lp) for name, i, b, lp in zip(texts, ids, sizes, logps)}
    out["all"] = summary(sum(len(i) for i in ids), sum(sizes), sum(logps))
    return out


def evaluate(workdir, tasks=(), text_files=(), include_path=None, num_fewshot=None, limit=None,
             batch_size=8, max_length=0, step=None, seed=0, bootstrap_iters=100_000) -> dict:
    """``{"step", "tasks": lm-eval's results per task, "text_files": score_text_files}`` (each
    present when asked for)."""
    if not tasks and not text_files:
        raise ValueError("give --tasks and/or --text_files")
    run = load_run(workdir, step)
    out = {"workdir": str(workdir), "step": run.step}
    if text_files:
        out["text_files"] = score_text_files(run, text_files, batch_size, max_length)
    if tasks:
        lm = HarnessLM(run=run, batch_size=batch_size, max_length=max_length, seed=seed)
        # the harness's own ~15k task configs take seconds to index: only when asked for
        manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
        if manager is None or not set(tasks) <= set(manager.all_tasks):
            manager = TaskManager(include_path=include_path)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise ValueError(f"tasks: unknown lm-eval task(s) {unknown}"
                             + ("" if include_path else " (custom tasks need --include_path)"))
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot,
                                          limit=limit, task_manager=manager, log_samples=False,
                                          bootstrap_iters=bootstrap_iters, random_seed=seed)
        out["tasks"] = results["results"]
        out["table"] = lm_eval.utils.make_table(results)
    return out


def text_table(scores: dict) -> str:
    lines = ["| file | tokens | bytes | bits/byte | perplexity |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {s['tokens']} | {s['bytes']} | {s['bits_per_byte']:.4f} | "
              f"{s['perplexity']:.3f} |" for name, s in scores.items()]
    return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags():
    """The command line (defined when run as a program, so that importing this module next to
    the other entry points defines nothing)."""
    flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
    flags.DEFINE_list("tasks", [], "lm-eval task names (comma list).")
    flags.DEFINE_string("include_path", None, "A folder of extra lm-eval task YAMLs.")
    flags.DEFINE_list("text_files", [], "Text files to score (bits per byte; comma list).")
    flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (default: the task's).")
    flags.DEFINE_float("limit", None, "Examples per task (< 1: a fraction).")
    flags.DEFINE_integer("batch_size", 8, "Rows per compiled call.")
    flags.DEFINE_integer("max_length", 0, "Longest scored window (0: data.seq_len).")
    flags.DEFINE_integer("step", None, "Checkpoint step to load (default: the newest).")
    flags.DEFINE_integer("seed", 0, "Seed of sampled generations.")
    flags.DEFINE_integer("bootstrap_iters", 100_000, "Bootstrap resamples for stderrs (0: none).")
    flags.DEFINE_string("output", None, "Write the results here as JSON.")


def main(argv):
    if not FLAGS["verbosity"].present:  # the harness's and orbax's INFO chatter
        logging.set_verbosity(logging.WARNING)
    try:
        out = evaluate(FLAGS.workdir, FLAGS.tasks, FLAGS.text_files, FLAGS.include_path,
                       FLAGS.num_fewshot, FLAGS.limit, FLAGS.batch_size, FLAGS.max_length, FLAGS.step,
                       FLAGS.seed, FLAGS.bootstrap_iters)
    except (ValueError, OSError) as e:  # OSError: e.g. a task's data file is missing
        cli.fail(str(e))
    print(f"{out['workdir']} step {out['step']}")
    if "text_files" in out:
        print(text_table(out["text_files"]))
    if "tasks" in out:
        print(out.pop("table"))  # the harness's results table; the JSON keeps the numbers
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
