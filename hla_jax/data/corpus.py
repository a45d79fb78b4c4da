"""Text corpora as token arrays: the embedded default corpus, text files or folders, and
prepared corpus directories (``python -m hla_jax.data.prepare``: ``train.npy`` and
``validation.npy`` token memmaps, the tokenizer and ``corpus.json``).
Text corpora also give each file's first offset: one file is one document (``data.pack``).
"""

import functools
import json
import pathlib
import sysconfig

import numpy as np

from hla_jax.core.errors import first_line

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
CORPUS_JSON = "corpus.json"          # a prepared corpus's description (sources, splits, tokenizer)
SPLITS = ("train", "validation")     # a prepared corpus's memmaps, <split>.npy


def stdlib_files() -> list[pathlib.Path]:
    """The embedded default corpus: the ``*.py`` files of this Python's standard library, sorted.

    Found through ``sysconfig.get_paths()["stdlib"]``; installed third-party packages are skipped.
    Deterministic for a given Python build (another Python version gives another corpus).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def text_files(paths, pattern: str = "*.txt", what: str = "data.path") -> list[pathlib.Path]:
    """Files named by ``paths`` (a path, a comma-separated string or a list); folders are searched
    recursively for ``pattern``, files are taken as given. Sorted within each folder.

    Raises ValueError, naming the setting ``what``, when a path does not exist or a folder holds
    no matching file.
    """
    if isinstance(paths, (str, pathlib.Path)):
        paths = [p for p in str(paths).split(",") if p]
    files = []
    for path in map(pathlib.Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not found:
                raise ValueError(f"{what}: folder {path} holds no file matching {pattern!r}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{what}: {path} does not exist")
    return files


def read_documents(files) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, starts)``: the concatenated bytes of ``files`` as byte tokens, uint8 ``[n]``, and
    the offset of each file's first byte in them, int64 ``[len(files)]`` (one file, one document)."""
    parts = [pathlib.Path(f).read_bytes() for f in files]
    starts = np.cumsum([0] + [len(b) for b in parts[:-1]], dtype=np.int64)
    return np.frombuffer(b"".join(parts), np.uint8), starts


def read_bytes(files) -> np.ndarray:
    """Concatenated bytes of ``files`` as byte tokens, uint8 ``[n]``."""
    return read_documents(files)[0]


@functools.lru_cache(maxsize=1)
def stdlib_documents() -> tuple[np.ndarray, np.ndarray]:
    """``read_documents`` of the embedded default corpus (cached per process; about 30 MB)."""
    return read_documents(stdlib_files())


def text_documents(path="", pattern: str = "*.txt") -> tuple[np.ndarray, np.ndarray]:
    """``read_documents`` of the files ``path`` names (``text_files``), or of the embedded
    default corpus when ``path`` is empty (``data.path`` / ``data.pattern`` of a text config)."""
    return read_documents(text_files(path, pattern)) if path else stdlib_documents()


def stdlib_tokens() -> np.ndarray:
    """Byte tokens of the embedded default corpus."""
    return stdlib_documents()[0]


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest memmap dtype for ``vocab_size`` ids: uint8 up to 256, uint16 up to 65536, else
    uint32."""
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16
                    else np.uint32)


def is_bare_memmap(path) -> bool:
    """Whether a ``data.kind=tokens`` path names a bare ``.npy`` token memmap (no tokenizer, no
    splits) rather than a prepared corpus directory."""
    return str(path).endswith(".npy")


def _damaged(directory, path, error: Exception) -> ValueError:
    return ValueError(f"data.path={directory}: {path} is damaged ({first_line(error)}); prepare "
                      f"the corpus again (python -m hla_jax.data.prepare)")


def corpus_info(directory) -> dict:
    """The ``corpus.json`` of a prepared corpus directory (ValueError naming ``data.path`` when
    ``directory`` is not one, and the file when it does not parse or lacks an entry)."""
    meta = pathlib.Path(directory) / CORPUS_JSON
    if not meta.is_file():
        raise ValueError(f"data.path must be a corpus directory written by python -m "
                         f"hla_jax.data.prepare (with {CORPUS_JSON}), got {str(directory)!r}")
    try:
        info = json.loads(meta.read_text())
        for key in ("kind", "vocab_size", "eod_id"):
            info["tokenizer"][key]
        np.dtype(info["dtype"])
        for split in SPLITS:
            int(info["splits"][split]["tokens"])
    except (ValueError, KeyError, TypeError, OSError) as e:  # JSON errors are ValueErrors
        raise _damaged(directory, meta, e) from e
    return info


def load_tokens(path, what: str = "data.path", expected: dict | None = None) -> np.ndarray:
    """A pre-tokenized ``.npy`` file, memory-mapped read-only (1-D, unsigned integer ids).

    Args:
      path: the ``.npy`` file.
      what: the setting that named it, for errors.
      expected: ``{"dtype", "tokens"}`` the file must hold (a prepared split's ``corpus.json``).

    Raises:
      ValueError: naming ``what`` and the file when it is missing, does not parse, is truncated
        or longer than its header says, or holds other ids than expected.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: token file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"{what}: {path} is not a .npy file (it does not start with the "
                             f"NumPy magic)")
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:  # a damaged header, a truncated body
        raise ValueError(f"{what}: {path} is not a readable .npy token file ({e})") from e
    if tokens.ndim != 1 or tokens.dtype.kind != "u":
        raise ValueError(f"{what}: {path} must hold a 1-D unsigned integer array, "
                         f"got {tokens.dtype}{list(tokens.shape)}")
    if expected is not None and (tokens.dtype.name, tokens.size) != (expected["dtype"],
                                                                    expected["tokens"]):
        raise ValueError(f"{what}: {path} holds {tokens.size} {tokens.dtype} ids, its "
                         f"{CORPUS_JSON} says {expected['tokens']} {expected['dtype']}")
    size = path.stat().st_size
    if size != tokens.offset + tokens.nbytes:
        raise ValueError(f"{what}: {path} is {size} bytes, its header says "
                         f"{tokens.offset + tokens.nbytes}")
    return tokens
