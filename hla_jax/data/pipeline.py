"""Deterministic, resumable batches: batch ``step`` is a pure function of (seed, split, step).

Row ``r`` of global batch ``step`` is drawn from ``np.random.default_rng([seed, split, step, r])``,
so a run resumes from one saved integer (the iterator position) and every host builds only its
own rows (``rows_for_process``) while all hosts agree on the global batch.
Batches are dicts of numpy arrays ``inputs, targets`` int32 and ``mask`` float32, ``[accum,b,T]``;
packed text batches also carry ``segment_ids`` int32 ``[accum,b,T]``.

Token corpora (``data.kind=tokens``) are directories written by ``python -m hla_jax.data.prepare``:
training reads ``train.npy``, evaluation ``validation.npy``, and the model's vocabulary must cover
the tokenizer's (``data_vocab_size``). Text corpora, and a bare ``.npy`` token memmap (no
tokenizer: ids unchecked, documents only by an explicit ``data.separator``), hold out their tail
(``data.eval_fraction``).

Packing (``data.pack``, text and token corpora): a row is a random window of ``T + 1``
consecutive tokens of the corpus (its documents concatenated, so no padding), each token labelled
with its document. Documents are the files of a text corpus, or the runs of a token memmap that
each end with ``data.separator`` (default: the tokenizer's end-of-document id; the separator
belongs to the document it ends). In a row, ``segment_ids`` number the input tokens' documents
from 0 (a document cut by the row's start is just a document that starts at position 0) and
``mask`` is 0 where a target lies in another document than its input token, so the first token
of a document is never predicted from the previous one.
"""

import pathlib

import numpy as np

from hla_jax.data import corpus
from hla_jax.data.synthetic import MQAR, NIAH
from hla_jax.data.tokenizers import tokenizer_for_data

TRAIN, EVAL = 0, 1
KINDS = ("text", "tokens", "mqar", "niah")
FIELDS = ("inputs", "targets", "mask", "segment_ids")  # an example's arrays, in order


class TextSource:
    """Random windows of ``seq_len + 1`` tokens from a 1-D token array (array or memmap).

    Packed when the documents are known, by ``doc_starts`` (sorted offsets of their first
    tokens, e.g. file starts) or by ``separator`` (the id that ends each document): examples then
    carry ``segment_ids`` and mask targets across document starts (module docstring).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "corpus", *,
                 doc_starts=None, separator: int | None = None):
        if tokens.size < seq_len + 2:
            raise ValueError(f"{name} has {tokens.size} tokens, fewer than data.seq_len + 2 = "
                             f"{seq_len + 2}")
        if doc_starts is not None and separator is not None:
            raise ValueError("TextSource: give doc_starts or separator, not both")
        self.tokens, self.seq_len, self.separator = tokens, seq_len, separator
        self.doc_starts = None if doc_starts is None else np.asarray(doc_starts, np.int64)
        self.packed = doc_starts is not None or separator is not None

    def example(self, rng: np.random.Generator):
        return self.window(int(rng.integers(0, self.tokens.size - self.seq_len)))

    def window(self, start: int):
        """``(inputs, targets, mask)`` ``[T]`` of the window at token ``start``, and
        ``segment_ids`` when packed."""
        window = np.asarray(self.tokens[start:start + self.seq_len + 1], np.int64)
        if not self.packed:
            return window[:-1], window[1:], np.ones(self.seq_len, bool)
        doc = self.documents(start, window)
        return window[:-1], window[1:], doc[1:] == doc[:-1], doc[:-1]

    def documents(self, start: int, window: np.ndarray) -> np.ndarray:
        """``[T+1]`` document number of each token of ``window`` (taken at ``start``), from 0."""
        if self.separator is None:
            doc = np.searchsorted(self.doc_starts, np.arange(start, start + window.size), "right")
        else:
            doc = np.concatenate([[0], np.cumsum(window[:-1] == self.separator)])
        return doc - doc[0]


def _bare_memmap(data) -> bool:
    return data.kind == "tokens" and corpus.is_bare_memmap(data.path)


def data_vocab_size(data) -> int | None:
    """The vocabulary ``config.data`` needs: 256 for bytes (text, niah), the tokenizer's for a
    prepared corpus (tokens), None for mqar and a bare memmap (unknown: any size)."""
    if data.kind == "mqar" or _bare_memmap(data):
        return None
    if data.kind == "tokens":
        return corpus.corpus_info(data.path)["tokenizer"]["vocab_size"]
    return 256


def _check_packing(data, vocab_size: int) -> tuple[bool, int]:
    """``(pack, separator)`` of ``config.data`` (configs saved before these fields existed read
    as unpacked; separator -1: the corpus's own document ends); ValueError naming the field on a
    setting that cannot apply."""
    pack, separator = bool(data.get("pack", False)), int(data.get("separator", -1))
    if pack and data.kind not in ("text", "tokens"):
        raise ValueError(f"data.pack=True packs the documents of a corpus (data.kind text or "
                         f"tokens); data.kind={data.kind!r} has none: set data.pack=False")
    if separator != -1 and not (pack and data.kind == "tokens"):
        raise ValueError(f"data.separator={separator} marks document ends for data.pack=True with "
                         f"data.kind=tokens only (text files are one document each); got "
                         f"data.pack={pack}, data.kind={data.kind!r}")
    if separator != -1 and not 0 <= separator < vocab_size:
        raise ValueError(f"data.separator must be a token id in [0, model.vocab_size="
                         f"{vocab_size}), or -1 (the tokenizer's end of document), got {separator}")
    if pack and separator == -1 and _bare_memmap(data):
        raise ValueError("data.pack=True with a bare .npy memmap needs data.separator (the token "
                         "id that ends each document) or data.pack=False")
    return pack, separator


def make_sources(data, vocab_size: int):
    """``(train, eval)`` sources for the ``config.data`` block; ValueError on bad settings."""
    if data.kind not in KINDS:
        raise ValueError(f"data.kind must be one of {KINDS}, got {data.kind!r}")
    if data.seq_len < 1:
        raise ValueError(f"data.seq_len must be positive, got {data.seq_len}")
    pack, separator = _check_packing(data, vocab_size)
    if data.kind == "mqar":
        mqar = data.mqar
        return (MQAR(data.seq_len, vocab_size, mqar.num_kv_pairs, mqar.power_a),) * 2
    if data.kind == "niah":
        return (NIAH(data.seq_len, data.niah.n_digits),) * 2
    needed = data_vocab_size(data)
    if needed is not None and vocab_size < needed:
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than the data's vocabulary "
                         f"({needed}, {'its tokenizer' if data.kind == 'tokens' else 'bytes'}): "
                         f"set model.vocab_size=0 (the data's) or >= {needed}")
    if data.kind == "tokens" and not _bare_memmap(data):
        return _prepared_sources(data, pack, separator)
    starts = None
    if data.kind == "tokens":
        tokens = corpus.load_tokens(data.path)
    else:
        tokens, starts = corpus.text_documents(data.path, data.pattern)
    if not 0 < data.eval_fraction < 1:
        raise ValueError(f"data.eval_fraction must be in (0, 1), got {data.eval_fraction}")
    split = int(tokens.size * (1 - data.eval_fraction))
    train_docs = eval_docs = {}
    if pack and starts is not None:  # file starts, those of the eval split relative to it
        train_docs = {"doc_starts": starts[starts < split]}
        eval_docs = {"doc_starts": starts[starts >= split] - split}
    elif pack:
        train_docs = eval_docs = {"separator": separator}
    return (TextSource(tokens[:split], data.seq_len, "the training split", **train_docs),
            TextSource(tokens[split:], data.seq_len, "the eval split", **eval_docs))


def _prepared_sources(data, pack: bool, separator: int):
    """``(train, validation)`` sources of the prepared corpus directory ``data.path``, checked
    whole first: ``corpus.json`` parses, each split's memmap holds the dtype and length it
    records, the tokenizer loads and its vocabulary holds every id (the largest id recorded in
    ``corpus.json``, or read from a memmap that predates it). ValueError naming ``data.path``
    and the file otherwise."""
    directory = pathlib.Path(data.path)
    info = corpus.corpus_info(directory)
    where = f"data.path={directory}"
    splits = {s: corpus.load_tokens(directory / f"{s}.npy", where,
                                    {"dtype": info["dtype"], **info["splits"][s]})
              for s in corpus.SPLITS}
    try:
        vocab = tokenizer_for_data(data).vocab_size
    except (ValueError, ImportError) as e:
        raise ValueError(f"{where}: its tokenizer does not load: {e}") from e
    for name, tokens in splits.items():
        top = info["splits"][name].get("max_id")
        top = int(tokens.max(initial=0)) if top is None else top
        if top >= vocab:
            raise ValueError(f"{where}: {directory / f'{name}.npy'} holds id {top}, outside its "
                             f"tokenizer's vocabulary of {vocab}; prepare the corpus again")
    if pack and separator == -1:
        separator = info["tokenizer"]["eod_id"]
    docs = {"separator": separator} if pack else {}
    return tuple(TextSource(tokens, data.seq_len, f"the {name} split of {directory}", **docs)
                 for name, tokens in splits.items())


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
    """Rows ``rows`` (any int array shape ``S``) of global batch ``step``: arrays ``[*S, T]``
    named by ``FIELDS`` (``segment_ids`` from packed sources only)."""
    rows = np.asarray(rows)
    examples = [source.example(np.random.default_rng([seed, split, step, int(r)]))
                for r in rows.reshape(-1)]
    stacked = (np.stack(x).reshape(rows.shape + (-1,)) for x in zip(*examples))
    return {name: x.astype(np.float32 if name == "mask" else np.int32)
            for name, x in zip(FIELDS, stacked)}


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
