"""Write a pre-tokenized corpus: text files or folders -> one ``.npy`` token memmap.

    python -m hla_jax.data.prepare --output=/data/corpus.npy --pattern='*.txt' /data/text_dir

Tokens are bytes (the byte tokenizer) stored as uint16 (uint32 with ``--vocab_size`` > 65536),
streamed file by file into ``np.lib.format.open_memmap`` so the corpus never sits in memory.
``--separator=ID`` appends token ``ID`` after every file (e.g. ``--separator=256
--vocab_size=257``), so the memmap keeps its document boundaries for packing.
Train with ``--config.data.kind=tokens --config.data.path=/data/corpus.npy`` and either
``--config.data.separator=ID`` (packed documents) or ``--config.data.pack=False``.
"""

import pathlib

import numpy as np
from absl import app, flags, logging

from hla_jax.data.corpus import text_files, token_dtype

_OUTPUT = flags.DEFINE_string("output", None, "Path of the .npy file to write.", required=True)
_PATTERN = flags.DEFINE_string("pattern", "*.txt", "Glob for files inside input folders.")
_VOCAB = flags.DEFINE_integer("vocab_size", 256, "Vocabulary size (chooses uint16/uint32).")
_SEPARATOR = flags.DEFINE_integer("separator", -1, "Token id written after every file (-1: none).")


def write_tokens(paths, output, pattern: str = "*.txt", vocab_size: int = 256,
                 separator: int = -1) -> np.ndarray:
    """Byte-tokenize ``paths`` (files or folders) into the memmap ``output``, each file followed by
    ``separator`` unless it is -1; returns the memmap."""
    if separator != -1 and not 0 <= separator < vocab_size:
        raise ValueError(f"separator must be a token id in [0, vocab_size={vocab_size}) or -1, "
                         f"got {separator}")
    files = text_files(paths, pattern)
    sizes = [f.stat().st_size for f in files]
    n_sep = int(separator != -1)  # one separator per file
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.lib.format.open_memmap(output, mode="w+", dtype=token_dtype(vocab_size),
                                       shape=(sum(sizes) + n_sep * len(files),))
    start = 0
    for f, n in zip(files, sizes):
        tokens[start:start + n] = np.frombuffer(f.read_bytes(), np.uint8)
        start += n
        if n_sep:
            tokens[start] = separator
            start += 1
    tokens.flush()
    return tokens


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give at least one input file or folder")
    tokens = write_tokens(argv[1:], _OUTPUT.value, _PATTERN.value, _VOCAB.value, _SEPARATOR.value)
    logging.info("wrote %d tokens (%s) to %s", tokens.size, tokens.dtype, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
