"""Tokenizers behind one interface: bytes (the default, nothing to install), any Hugging Face
``tokenizers`` ``tokenizer.json`` and any sentencepiece ``.model``.

Every tokenizer has a ``name``, a ``vocab_size`` (ids are in ``[0, vocab_size)``), an ``eod_id``
(the id that ends each document of a prepared corpus, or None) and ``encode`` / ``encode_batch`` /
``decode``. ``encode`` never appends the end-of-document id: ``python -m hla_jax.data.prepare``
writes it after every document. A prepared corpus directory keeps its tokenizer beside the token
memmaps (``save`` / ``load_tokenizer``), so training, evaluation and sampling decode with the
tokenizer that encoded the data.
"""

import importlib
import json
import os
import pathlib
import shutil
from typing import Protocol

import numpy as np

from hla_jax.data.corpus import corpus_info, is_bare_memmap

EOD_TEXT = "<|endoftext|>"   # the end-of-document token of trained BPE and its text for bytes+eod
# end-of-document tokens looked for, in order, in a tokenizer.json that names none
EOD_TOKENS = (EOD_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class Tokenizer(Protocol):
    name: str                # "bytes", "bytes+eod", "hf:<file>", "sentencepiece:<file>"
    vocab_size: int          # ids are in [0, vocab_size)
    eod_id: int | None       # the id that ends each document (None: none)

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> int32 ids ``[n]`` (no end-of-document id appended)."""

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text (in parallel where the tokenizer can)."""

    def decode(self, ids) -> str:
        """Ids (any int array or list) -> text."""

    def save(self, directory) -> dict:
        """Write the tokenizer's file (if any) into ``directory``; returns its ``corpus.json``
        entry, from which ``load_tokenizer(directory)`` rebuilds it."""


def optional_import(module: str):
    """Import an optional dependency of the ``data`` extra, with the install line on failure."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is not installed: pip install '.[data]' in a clone of hla_jax "
                          f"(or pip install {module.split('.')[0]})") from e


class ByteTokenizer:
    """UTF-8 bytes <-> ids in [0, 256); ``eod=True`` adds id 256 as the end-of-document token
    (vocabulary 257). The embedded corpus trains on plain bytes (vocabulary 256, no eod)."""

    def __init__(self, eod: bool = False):
        self.name = "bytes+eod" if eod else "bytes"
        self.vocab_size = 257 if eod else 256
        self.eod_id = 256 if eod else None

    def encode(self, text: str | bytes) -> np.ndarray:
        """``text`` (strings are UTF-8 encoded) -> int32 byte values ``[n]``."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def encode_batch(self, texts) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Ids -> text: ``eod_id`` becomes ``EOD_TEXT``, other ids that are not bytes and invalid
        UTF-8 become U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        cuts = np.flatnonzero(ids == self.eod_id) if self.eod_id is not None else []
        pieces = np.split(ids, cuts)
        texts = [bytes(int(t) if 0 <= t < 256 else 0xFF for t in piece[int(i > 0):])
                 .decode("utf-8", errors="replace") for i, piece in enumerate(pieces)]
        return EOD_TEXT.join(texts)

    def save(self, directory) -> dict:
        return {"kind": "bytes", "eod": self.eod_id is not None, **_describe(self)}


# the GPT-2 pre-tokenization of ``tokenizers.pre_tokenizers.ByteLevel(use_regex=True)``
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_level_chars() -> dict:
    """``{character: byte}``: the byte-level BPE's printable stand-in for each byte (GPT-2's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


def tiktoken_twin(spec: dict):
    """A ``tiktoken`` encoding that gives exactly the ids of the ``tokenizer.json`` ``spec``
    (parsed), or None where that cannot be promised: ``spec`` must be a plain byte-level BPE
    (GPT-2 pre-tokenization, no normalizer, no dropout or affixes, every added token special)
    whose merged tokens' ids rise with their merges' order, since tiktoken merges the pair of
    lowest rank and the BPE the earliest merge; and tiktoken must be installed.  Its encoder
    is several times faster than the ``tokenizers`` library's on the same machine."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    plain = (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
             and pre.get("use_regex", True) and not pre.get("add_prefix_space")
             and model.get("type") == "BPE" and not model.get("dropout")
             and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
             and not model.get("byte_fallback") and not model.get("ignore_merges")
             and all(t.get("special") for t in spec.get("added_tokens", [])))
    try:
        tiktoken = importlib.import_module("tiktoken")
    except ImportError:
        return None
    if not plain:
        return None
    vocab, chars = model["vocab"], _byte_level_chars()
    merged = [vocab.get("".join(m.split(" ") if isinstance(m, str) else m)) for m in model["merges"]]
    if None in merged or any(a >= b for a, b in zip(merged, merged[1:])):
        return None
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(chars[c] for c in token): i for token, i in vocab.items()
                 if token not in special}
    except KeyError:  # a token outside the byte alphabet
        return None
    return tiktoken.Encoding("hla_jax_bpe", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                             special_tokens=special)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` ``tokenizer.json``. The end-of-document token is ``eod``
    (its text) or else the first of ``EOD_TOKENS`` in the vocabulary (None when none is).
    Encoding adds no special tokens (no BOS/EOS of the tokenizer's post-processor)."""

    def __init__(self, path, eod: str | None = None):
        tokenizers = optional_import("tokenizers")
        self.path = pathlib.Path(path)
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ValueError(f"tokenizer: {self.path} is not a tokenizer.json ({e})") from e
        self.name = f"hf:{self.path}"
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if eod is not None and self.tokenizer.token_to_id(eod) is None:
            raise ValueError(f"eod: token {eod!r} is not in the vocabulary of {self.path}")
        found = [t for t in EOD_TOKENS if self.tokenizer.token_to_id(t) is not None]
        self.eod = eod if eod is not None else (found[0] if found else None)
        self.eod_id = None if self.eod is None else self.tokenizer.token_to_id(self.eod)
        self.fast = tiktoken_twin(json.loads(self.tokenizer.to_str()))

    def encode(self, text: str) -> np.ndarray:
        if self.fast is not None:
            return np.asarray(self.fast.encode(text, allowed_special="all"), np.int32)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts) -> list[np.ndarray]:
        """On every core: ``tiktoken_twin``'s encoder where it gives the same ids, else the Rust
        library's (``RAYON_NUM_THREADS`` threads, default all cores).  Special tokens written in
        the text are matched in both, as ``tokenizers`` does."""
        if self.fast is not None:
            ids = self.fast.encode_batch(list(texts), num_threads=os.cpu_count() or 1,
                                         allowed_special="all")
            return [np.asarray(x, np.int32) for x in ids]
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                     skip_special_tokens=False)

    def save(self, directory) -> dict:
        target = pathlib.Path(directory) / "tokenizer.json"
        if target.resolve() != self.path.resolve():
            shutil.copyfile(self.path, target)
        return {"kind": "hf", "file": target.name, "eod": self.eod, **_describe(self)}


class SentencePieceTokenizer:
    """A sentencepiece ``.model``; its end-of-document token is the model's EOS (None when the
    model has none)."""

    def __init__(self, path):
        spm = optional_import("sentencepiece")
        self.path = pathlib.Path(path)
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer: {self.path} is not a sentencepiece model ({e})") from e
        self.name = f"sentencepiece:{self.path}"
        self.vocab_size = self.processor.get_piece_size()
        eos = self.processor.eos_id()
        self.eod_id = eos if eos >= 0 else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.processor.encode(text), np.int32)

    def encode_batch(self, texts) -> list[np.ndarray]:
        ids = self.processor.encode(list(texts), num_threads=os.cpu_count() or 1)
        return [np.asarray(i, np.int32) for i in ids]

    def decode(self, ids) -> str:
        return self.processor.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def save(self, directory) -> dict:
        target = pathlib.Path(directory) / "tokenizer.model"
        if target.resolve() != self.path.resolve():
            shutil.copyfile(self.path, target)
        return {"kind": "sentencepiece", "file": target.name, **_describe(self)}


def _describe(tok) -> dict:
    return {"vocab_size": tok.vocab_size, "eod_id": tok.eod_id}


def train_bpe(texts, vocab_size: int, path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenization, every byte in the base alphabet, so any
    text round-trips) of ``vocab_size`` ids on the strings ``texts`` (any iterable, streamed), with
    ``EOD_TEXT`` as id 0; saves it to ``path`` (a tokenizer.json)."""
    tokenizers = optional_import("tokenizers")
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 1} (the bytes and "
                         f"{EOD_TEXT}) for a byte-level BPE, got {vocab_size}")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TEXT],
                                             initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return HFTokenizer(path, eod=EOD_TEXT)


def _from_entry(entry: dict, directory: pathlib.Path):
    """The tokenizer that ``save`` described by ``entry`` in ``directory``."""
    if entry["kind"] == "bytes":
        tok = ByteTokenizer(eod=entry["eod"])
    elif entry["kind"] == "hf":
        tok = HFTokenizer(directory / entry["file"], eod=entry["eod"])
    elif entry["kind"] == "sentencepiece":
        tok = SentencePieceTokenizer(directory / entry["file"])
    else:
        raise ValueError(f"{directory}: unknown tokenizer kind {entry['kind']!r}")
    if (tok.vocab_size, tok.eod_id) != (entry["vocab_size"], entry["eod_id"]):
        raise ValueError(f"{directory}: the tokenizer file has vocab_size {tok.vocab_size}, "
                         f"eod_id {tok.eod_id}; the corpus was written with "
                         f"{entry['vocab_size']}, {entry['eod_id']}")
    return tok


def load_tokenizer(spec, eod: str | None = None):
    """The tokenizer ``spec`` names: ``"bytes"``, ``"bytes+eod"``, a ``tokenizer.json`` (``eod``:
    its end-of-document token's text, see ``HFTokenizer``), a sentencepiece ``*.model``, or a
    prepared corpus directory (the tokenizer saved there)."""
    if spec in ("bytes", "bytes+eod"):
        return ByteTokenizer(eod=spec == "bytes+eod")
    path = pathlib.Path(spec)
    if path.is_dir():
        return _from_entry(corpus_info(path)["tokenizer"], path)
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path, eod=eod)
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise ValueError(f"tokenizer must be bytes, bytes+eod, an existing tokenizer.json, a "
                     f"sentencepiece .model or a prepared corpus directory, got {str(spec)!r}")


def tokenizer_for_data(data):
    """The tokenizer of a run's ``config.data`` block: bytes for ``kind=text`` and ``niah``, the
    tokenizer saved in the prepared directory ``data.path`` for ``kind=tokens`` (ValueError for
    a bare ``.npy`` memmap, which has none, and for mqar)."""
    if data.kind in ("text", "niah"):
        return ByteTokenizer()
    if data.kind == "tokens" and is_bare_memmap(data.path):
        raise ValueError(f"data.path={data.path} is a bare token memmap without a tokenizer: "
                         f"write a corpus directory with python -m hla_jax.data.prepare, or set "
                         f"train.sample_tokens=0")
    if data.kind == "tokens":
        return _from_entry(corpus_info(data.path)["tokenizer"], pathlib.Path(data.path))
    raise ValueError(f"data.kind={data.kind!r} has no tokenizer (its ids are synthetic); "
                     f"text, niah and tokens data have one")
