"""Prepare a corpus for training: documents -> tokens -> one directory.

    python -m hla_jax.data.prepare --output=DIR [--tokenizer=bytes|bpe|FILE] INPUT [INPUT ...]

Each INPUT is a text file (one document), a folder (its files matching ``--pattern``, searched
recursively), a JSON-lines file ``*.jsonl`` / ``*.json`` (``.gz`` too; one document per line,
its ``--field``), a Parquet file ``*.parquet`` (one document per row of column ``--field``) or
``hf:NAME``, a ``datasets`` dataset (column ``--field`` of split ``--hf_split``): a folder written
by ``save_to_disk``, a local data file, or a dataset of the Hugging Face hub (streamed). Files in
folders follow the same suffix rules; text is read as UTF-8 (invalid bytes become U+FFFD) and
empty documents are skipped. ``INPUT:FIELD`` (e.g. ``docs.jsonl:body``, ``hf:NAME:content``)
reads that input's text from ``FIELD`` instead of ``--field``; an INPUT that exists as a path
is taken whole. An input that yields no document is an error.

Documents stream through in batches of about ``--batch_bytes`` (the corpus never sits in memory),
are tokenized in parallel (``encode_batch``, overlapped with reading and writing) and each is
followed by the tokenizer's end-of-document id. Each document goes to the validation split with
probability ``--validation_fraction`` (one draw per document from a generator seeded by
``--seed``, so the split is reproducible). ``DIR`` receives ``train.npy`` and ``validation.npy``
(token memmaps, uint8 / uint16 / uint32 by the vocabulary), the tokenizer and ``corpus.json``:
the sources, documents / tokens / bytes / largest id per split, the tokenizer and the split
settings. Everything is written into a temporary sibling of ``DIR`` (created first, so an
unwritable place fails before any input is read) that is renamed to ``DIR`` once complete: a
failed run leaves nothing behind.

``--tokenizer``: ``bytes`` (UTF-8 bytes, id 256 ends a document: vocabulary 257), ``bpe`` (a
byte-level BPE of at most ``--vocab_size`` ids, trained first on at most ``--bpe_bytes`` of the
training documents: one more pass over the inputs; a warning says when the corpus gave fewer),
a Hugging Face ``tokenizer.json`` (``--eod_token`` names its end-of-document token when it has
none of the usual ones) or a sentencepiece ``.model``.
Train with ``--config.data.kind=tokens --config.data.path=DIR --config.model.vocab_size=0``.
"""

import concurrent.futures
import functools
import gzip
import json
import pathlib
import re
import secrets
import shutil
import struct
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tqdm
from absl import app, flags, logging

from hla_jax.core.errors import first_line
from hla_jax.data.corpus import CORPUS_JSON, SPLITS, text_files, token_dtype
from hla_jax.data.tokenizers import load_tokenizer, optional_import, train_bpe

_OUTPUT = flags.DEFINE_string("output", None, "Directory to write (new or empty).", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "bytes | bpe | a tokenizer.json | a "
                                 "sentencepiece .model")
_VOCAB = flags.DEFINE_integer("vocab_size", 32_000, "Vocabulary of the trained BPE (--tokenizer=bpe).")
_BPE_BYTES = flags.DEFINE_integer("bpe_bytes", 2**30, "Train the BPE on at most this many bytes "
                                  "of training documents.")
_EOD = flags.DEFINE_string("eod_token", None, "End-of-document token of a tokenizer.json "
                           "(default: the first of hla_jax.data.tokenizers.EOD_TOKENS it has).")
_PATTERN = flags.DEFINE_string("pattern", "*.txt", "Glob for files inside input folders.")
_FIELD = flags.DEFINE_string("field", "text", "JSONL field, Parquet or datasets column of the text "
                             "(INPUT:FIELD sets one input's).")
_HF_CONFIG = flags.DEFINE_string("hf_config", None, "Configuration of hf:NAME hub datasets.")
_HF_SPLIT = flags.DEFINE_string("hf_split", "train", "Split of hf:NAME datasets.")
_VALIDATION = flags.DEFINE_float("validation_fraction", 0.01, "Probability that a document goes "
                                 "to the validation split, in (0, 1).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the document split.")
_BATCH_BYTES = flags.DEFINE_integer("batch_bytes", 2**22, "Text per tokenizer batch (bytes).")


def _format(path: pathlib.Path) -> str:
    """``jsonl``, ``parquet`` or ``text``, by suffix (``.gz`` aside)."""
    name = path.name.removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise InputError(f"--field={field!r}: {where} has no such field ({keys})")
    if not isinstance(record[field], str | None):
        raise InputError(f"--field={field!r}: {where} holds a {type(record[field]).__name__}, "
                         f"not text")
    return record[field] or ""


class InputError(ValueError):
    """A bad INPUT: the message names it (file, line, field)."""


def _named(where: str, kind: str, documents):
    """``documents`` with every error that does not already name its input (``InputError``)
    turned into one that names ``where``."""
    try:
        yield from documents
    except (InputError, ImportError):  # ImportError: an optional dependency, with its install line
        raise
    except Exception as e:  # OSError, gzip/UTF-8 decoding, pyarrow's, datasets' errors
        raise InputError(f"{where}: cannot be read as {kind} ({first_line(e)})") from e


def read_file(path: pathlib.Path, field: str = "text"):
    """The documents (strings) of one file, by its format (``_format``); InputError naming the
    file on any failure."""
    kind = _format(path)
    reader = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}[kind]
    return _named(str(path), kind, reader(path, field))


def _read_text(path: pathlib.Path, field: str):
    yield path.read_text(encoding="utf-8", errors="replace")


def _read_jsonl(path: pathlib.Path, field: str):
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{line_no} is not a JSON line ({e})") from e
                yield _field(record, field, f"{path}:{line_no}")


def _read_parquet(path: pathlib.Path, field: str):
    parquet = optional_import("pyarrow.parquet")
    table = parquet.ParquetFile(path)
    schema = table.schema_arrow
    if field not in schema.names or not str(schema.field(field).type).endswith("string"):
        raise InputError(f"--field={field!r}: {path} has no such text column "
                         f"({', '.join(schema.names)})")
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        yield from (text or "" for text in batch.column(0).to_pylist())


def read_dataset(name: str, field: str = "text", config: str | None = None,
                 split: str = "train"):
    """The documents of a ``datasets`` dataset: a ``save_to_disk`` folder, a local data file
    (loaded by the builder of its format) or a hub dataset (streamed); InputError naming
    ``hf:NAME`` on any failure."""
    return _named(f"hf:{name}", "a datasets dataset", _read_dataset(name, field, config, split))


def _read_dataset(name: str, field: str, config: str | None, split: str):
    datasets = optional_import("datasets")
    path = pathlib.Path(name)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise InputError(f"--hf_split={split!r}: hf:{name} has splits {sorted(ds)}")
            ds = ds[split]
    elif path.is_file():
        builder = {"jsonl": "json", "parquet": "parquet", "text": "text"}[_format(path)]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    else:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    for batch in ds.iter(batch_size=1000):
        if field not in batch:
            raise InputError(f"--field={field!r}: hf:{name} has no such column ({sorted(batch)})")
        yield from (text or "" for text in batch[field])


class Source(NamedTuple):
    """One INPUT: ``record`` describes it in ``corpus.json``, ``read()`` iterates over its
    documents (again on each call), ``size`` is its files' size in bytes (None: not files)."""
    record: dict
    read: Callable
    size: int | None


def input_field(spec: str, field: str) -> tuple[str, str]:
    """``(input, field)`` of an INPUT argument: ``PATH:FIELD`` / ``hf:NAME:FIELD`` -> that
    field, anything else (a path that exists, no ``:FIELD``) -> ``field``."""
    name = spec.removeprefix("hf:")
    head, sep, tail = name.rpartition(":")
    if sep and head and re.fullmatch(r"[\w.\-]+", tail) and not pathlib.Path(name).exists():
        return spec[:len(spec) - len(tail) - 1], tail
    return spec, field


def open_sources(inputs, pattern: str = "*.txt", field: str = "text",
                 hf_config: str | None = None, hf_split: str = "train") -> list[Source]:
    """A ``Source`` per INPUT (module docstring; ``INPUT:FIELD`` overrides ``field``);
    ValueError on a missing input."""
    out = []
    for spec, own in (input_field(str(i), field) for i in inputs):
        if spec.startswith("hf:"):
            out.append(Source({"input": spec, "format": "datasets", "field": own},
                              functools.partial(read_dataset, spec[3:], own, hf_config, hf_split),
                              None))
        else:
            files = text_files([spec], pattern, what="INPUT")
            kinds = sorted({_format(f) for f in files})
            record = {"input": spec, "format": "+".join(kinds), "files": len(files)}
            if kinds != ["text"]:
                record["field"] = own
            out.append(Source(record, functools.partial(_read_files, files, own),
                              sum(f.stat().st_size for f in files)))
    return out


def _read_files(files, field: str):
    for f in files:
        yield from read_file(f, field)


def batches(sources, fraction: float, seed: int, batch_bytes: int):
    """``(source, texts, sizes, validation)`` per batch of about ``batch_bytes`` of non-empty
    documents in input order: each document's source index, text, UTF-8 size and split (True:
    validation; one draw per document from ``default_rng(seed)``, independent of the batching)."""
    rng = np.random.default_rng(seed)

    def batch(items):
        index, texts, sizes = zip(*items)
        return np.array(index), list(texts), np.array(sizes), rng.random(len(items)) < fraction

    items, size = [], 0
    for i, source in enumerate(sources):
        for text in source.read():
            if text:
                items.append((i, text, len(text.encode("utf-8"))))
                size += items[-1][2]
                if size >= batch_bytes:
                    yield batch(items)
                    items, size = [], 0
    if items:
        yield batch(items)


class TokenWriter:
    """Appends ids to a 1-D ``.npy`` whose length is known only at the end: its version 1.0
    header has a fixed size, ``HEADER`` bytes, and is written again with the final count by
    ``close``."""

    HEADER = 128

    def __init__(self, path, dtype):
        self.dtype, self.count = np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.file.write(self._header())

    def _header(self) -> bytes:
        text = repr({"descr": self.dtype.str, "fortran_order": False, "shape": (self.count,)})
        body = text.encode("latin1").ljust(self.HEADER - 11) + b"\n"
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body

    def append(self, ids: np.ndarray):
        ids.astype(self.dtype, copy=False).tofile(self.file)
        self.count += ids.size

    def close(self):
        self.file.seek(0)
        self.file.write(self._header())
        self.file.close()


def _progress(sources, desc: str, enabled: bool):
    """A tqdm bar over document bytes (MB/s) when ``enabled`` and stderr is a terminal; its total
    is the files' size when all are text."""
    text_only = all(s.record["format"] == "text" for s in sources)
    total = sum(s.size for s in sources) if text_only else None
    return tqdm.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc,
                     disable=None if enabled else True, dynamic_ncols=True)


def _bpe_texts(sources, fraction, seed, batch_bytes, limit, bar):
    """Batches of training documents (the same split as the encoding pass) up to ``limit`` bytes."""
    seen = 0
    for _, texts, sizes, validation in batches(sources, fraction, seed, batch_bytes):
        train = np.flatnonzero(~validation)
        yield [texts[k] for k in train]
        seen += int(sizes[train].sum())
        bar.update(int(sizes.sum()))
        if seen >= limit:
            return


def prepare(inputs, output, tokenizer: str = "bytes", *, vocab_size: int = 32_000,
            bpe_bytes: int = 2**30, eod_token: str | None = None, pattern: str = "*.txt",
            field: str = "text", hf_config: str | None = None, hf_split: str = "train",
            validation_fraction: float = 0.01, seed: int = 0, batch_bytes: int = 2**22,
            progress: bool = True) -> dict:
    """Write the prepared corpus of ``inputs`` into the directory ``output`` (module docstring);
    returns its ``corpus.json``. ValueError naming the flag or the input on bad settings or
    input; on any failure nothing is left at ``output``."""
    if not inputs:
        raise ValueError("give at least one INPUT (a file, a folder or hf:NAME)")
    if not 0 < validation_fraction < 1:
        raise ValueError(f"--validation_fraction must be in (0, 1), got {validation_fraction}")
    if batch_bytes < 1 or bpe_bytes < 1:
        raise ValueError(f"--batch_bytes and --bpe_bytes must be positive, got {batch_bytes}, "
                         f"{bpe_bytes}")
    output = pathlib.Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"--output={output} exists and is not an empty directory")
    staging, created = _staging(output)
    try:
        info = _write(staging, open_sources(inputs, pattern, field, hf_config, hf_split),
                      tokenizer, vocab_size, bpe_bytes, eod_token,
                      (validation_fraction, seed, batch_bytes), progress,
                      {"pattern": pattern, "field": field})
        staging.rename(output)  # replaces an empty ``output``
    except BaseException:
        shutil.rmtree(created or staging, ignore_errors=True)
        raise
    return info


def _staging(output: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None]:
    """``(staging, created)``: a new empty hidden sibling of ``output`` to write into, and the
    outermost parent folder this created (None when they all existed). ValueError naming
    ``--output`` when it cannot be created."""
    created = next((p for p in reversed(output.absolute().parents) if not p.exists()), None)
    staging = output.with_name(f".{output.name}.{secrets.token_hex(4)}.partial")
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise ValueError(f"--output={output} cannot be written ({e.strerror or e}): give a "
                         f"directory on writable storage") from e
    return staging, created


def _write(output: pathlib.Path, sources, tokenizer: str, vocab_size: int, bpe_bytes: int,
           eod_token: str | None, split: tuple, progress: bool, settings: dict) -> dict:
    """The tokenizer, the split memmaps and ``corpus.json`` of ``sources`` in ``output``;
    ``split = (validation_fraction, seed, batch_bytes)``, ``settings`` more entries of
    ``corpus.json``."""
    fraction, seed, _ = split
    split_args = (sources, *split)
    if tokenizer == "bpe":
        with _progress(sources, "BPE training pass", progress) as bar:
            tok = train_bpe(_bpe_texts(*split_args, bpe_bytes, bar), vocab_size,
                            output / "tokenizer.json")
        if tok.vocab_size < vocab_size:
            logging.warning("--vocab_size=%d: the BPE learned only %d ids from these documents "
                            "(every merge they hold); the corpus uses %d", vocab_size,
                            tok.vocab_size, tok.vocab_size)
    else:
        tok = load_tokenizer("bytes+eod" if tokenizer == "bytes" else tokenizer, eod=eod_token)
        if tok.eod_id is None:
            raise ValueError(f"--tokenizer={tokenizer} has no end-of-document token: name one "
                             f"of its tokens with --eod_token")
    dtype = token_dtype(tok.vocab_size)
    writers = {s: TokenWriter(output / f"{s}.npy", dtype) for s in SPLITS}
    stats = {s: {"documents": 0, "tokens": 0, "bytes": 0, "max_id": 0} for s in SPLITS}
    records = [dict(s.record, documents=0, bytes=0) for s in sources]
    eod = np.array([tok.eod_id], np.int32)

    def write(batch, encoded):
        source, _, sizes, validation = batch
        ids = encoded.result()
        for name, docs in zip(SPLITS, (np.flatnonzero(~validation), np.flatnonzero(validation))):
            if docs.size:
                tokens = np.concatenate([x for k in docs for x in (ids[k], eod)])
                writers[name].append(tokens)
                stats[name]["documents"] += docs.size
                stats[name]["tokens"] += tokens.size
                stats[name]["bytes"] += int(sizes[docs].sum())
                stats[name]["max_id"] = max(stats[name]["max_id"], int(tokens.max()))
        for i, n in zip(source, sizes):
            records[i]["documents"] += 1
            records[i]["bytes"] += int(n)
        bar.update(int(sizes.sum()))

    # one encoding thread: batch k is tokenized (in parallel, without the GIL) while batch k+1
    # is read and batch k-1 written
    try:
        with (_progress(sources, f"tokenizing ({tok.name})", progress) as bar,
              concurrent.futures.ThreadPoolExecutor(1) as pool):
            pending = None
            for batch in batches(*split_args):
                encoded = pool.submit(tok.encode_batch, batch[1])
                if pending:
                    write(*pending)
                pending = batch, encoded
            if pending:
                write(*pending)
    finally:
        for w in writers.values():
            w.close()
    for record in records:
        if not record["documents"]:
            raise InputError(f"no documents in {record['input']}")
    for name in SPLITS:
        if not stats[name]["documents"]:
            raise ValueError(f"--validation_fraction={fraction} (--seed={seed}) left the {name} "
                             f"split without documents out of "
                             f"{sum(s['documents'] for s in stats.values())}: change it or add data")
    info = {"sources": records, "tokenizer": tok.save(output), "dtype": dtype.name,
            "splits": stats, "validation_fraction": fraction, "seed": seed, **settings}
    (output / CORPUS_JSON).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv):
    try:
        info = prepare(argv[1:], _OUTPUT.value, _TOKENIZER.value, vocab_size=_VOCAB.value,
                       bpe_bytes=_BPE_BYTES.value, eod_token=_EOD.value, pattern=_PATTERN.value,
                       field=_FIELD.value, hf_config=_HF_CONFIG.value, hf_split=_HF_SPLIT.value,
                       validation_fraction=_VALIDATION.value, seed=_SEED.value,
                       batch_bytes=_BATCH_BYTES.value)
    except (ValueError, ImportError, OSError) as e:  # OSError: e.g. the disk filled up
        sys.exit(f"prepare: {e}")
    tok = info["tokenizer"]
    print(f"{_OUTPUT.value}: vocab_size {tok['vocab_size']}, eod_id {tok['eod_id']}, {info['dtype']}")
    for split, s in info["splits"].items():
        print(f"  {split}: {s['documents']} documents, {s['tokens']} tokens, {s['bytes']} bytes")


if __name__ == "__main__":
    app.run(main)
