"""Data: byte tokenizer, text corpora and token memmaps, synthetic MQAR / NIAH, resumable (and
packed) batches."""

from hla_jax.data.corpus import (
    load_tokens,
    read_bytes,
    read_documents,
    stdlib_documents,
    stdlib_files,
    stdlib_tokens,
    text_files,
)
from hla_jax.data.pipeline import (
                                   EVAL,
                                   KINDS,
                                   TRAIN,
                                   DataIterator,
                                   TextSource,
                                   make_batch,
                                   make_sources,
                                   rows_for_process,
)
from hla_jax.data.synthetic import MQAR, NIAH
from hla_jax.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "DataIterator", "EVAL", "KINDS", "MQAR", "NIAH", "TRAIN", "TextSource",
    "load_tokens", "make_batch", "make_sources", "read_bytes", "read_documents",
    "rows_for_process", "stdlib_documents", "stdlib_files", "stdlib_tokens", "text_files",
]
