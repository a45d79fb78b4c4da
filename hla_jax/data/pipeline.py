"""Deterministic, resumable batches: batch ``step`` is a pure function of (seed, split, step).

Row ``r`` of global batch ``step`` is drawn from ``np.random.default_rng([seed, split, step, r])``,
so a run resumes from one saved integer (the iterator position) and every host builds only its
own rows (``rows_for_process``) while all hosts agree on the global batch.
Batches are dicts of numpy arrays ``inputs, targets`` int32 and ``mask`` float32, ``[accum,b,T]``.
"""

import numpy as np

from hla_jax.data import corpus
from hla_jax.data.synthetic import MQAR, NIAH

TRAIN, EVAL = 0, 1
KINDS = ("text", "tokens", "mqar", "niah")


class TextSource:
    """Random windows of ``seq_len + 1`` tokens from a 1-D token array (array or memmap)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "corpus"):
        if tokens.size < seq_len + 2:
            raise ValueError(f"{name} has {tokens.size} tokens, fewer than data.seq_len + 2 = "
                             f"{seq_len + 2}")
        self.tokens, self.seq_len = tokens, seq_len

    def example(self, rng: np.random.Generator):
        start = int(rng.integers(0, self.tokens.size - self.seq_len))
        window = np.asarray(self.tokens[start:start + self.seq_len + 1], np.int64)
        return window[:-1], window[1:], np.ones(self.seq_len, bool)


def make_sources(data, vocab_size: int):
    """``(train, eval)`` sources for the ``config.data`` block; ValueError on bad settings."""
    if data.kind not in KINDS:
        raise ValueError(f"data.kind must be one of {KINDS}, got {data.kind!r}")
    if data.seq_len < 1:
        raise ValueError(f"data.seq_len must be positive, got {data.seq_len}")
    if data.kind == "mqar":
        mqar = data.mqar
        return (MQAR(data.seq_len, vocab_size, mqar.num_kv_pairs, mqar.power_a),) * 2
    if data.kind == "niah":
        return (NIAH(data.seq_len, data.niah.n_digits),) * 2
    if data.kind == "tokens":
        tokens = corpus.load_tokens(data.path)
    elif data.path:
        tokens = corpus.read_bytes(corpus.text_files(data.path, data.pattern))
    else:
        tokens = corpus.stdlib_tokens()
    if vocab_size < (256 if data.kind == "text" else 0):
        raise ValueError(f"byte-level text needs model.vocab_size >= 256, got {vocab_size}")
    if not 0 < data.eval_fraction < 1:
        raise ValueError(f"data.eval_fraction must be in (0, 1), got {data.eval_fraction}")
    split = int(tokens.size * (1 - data.eval_fraction))
    return (TextSource(tokens[:split], data.seq_len, "the training split"),
            TextSource(tokens[split:], data.seq_len, "the eval split"))


def rows_for_process(batch_size: int, accum: int = 1, process_index: int = 0,
                     process_count: int = 1) -> np.ndarray:
    """Row indices ``[accum, b]`` that host ``process_index`` loads: global batch ``step`` is
    ``accum`` micro-batches of ``batch_size / accum`` rows, each split evenly over the hosts."""
    if batch_size % (accum * process_count):
        raise ValueError(f"data.batch_size={batch_size} is not divisible by optim.grad_accum="
                         f"{accum} x {process_count} processes")
    micro = batch_size // accum
    per = micro // process_count
    return (np.arange(accum)[:, None] * micro + process_index * per + np.arange(per)[None, :])


def make_batch(source, seed: int, split: int, step: int, rows) -> dict:
    """Rows ``rows`` (any int array shape ``S``) of global batch ``step``: arrays ``[*S, T]``."""
    rows = np.asarray(rows)
    examples = [source.example(np.random.default_rng([seed, split, step, int(r)]))
                for r in rows.reshape(-1)]
    inputs, targets, mask = (np.stack(x).reshape(rows.shape + (-1,)) for x in zip(*examples))
    return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
            "mask": mask.astype(np.float32)}


class DataIterator:
    """``next(it)`` gives this host's rows ``[accum, b, T]`` of the next global batch;
    ``position`` (an int) is the whole state: ``DataIterator(..., position=p)`` continues exactly
    where another iterator stopped at ``p``."""

    def __init__(self, source, batch_size: int, seed: int, *, accum: int = 1, split: int = TRAIN,
                 position: int = 0, process_index: int = 0, process_count: int = 1):
        self.source, self.seed, self.split, self.position = source, seed, split, position
        self.rows = rows_for_process(batch_size, accum, process_index, process_count)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = make_batch(self.source, self.seed, self.split, self.position, self.rows)
        self.position += 1
        return batch
