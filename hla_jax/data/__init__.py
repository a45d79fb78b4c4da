"""Data: tokenizers (bytes, Hugging Face, sentencepiece), text corpora, prepared token corpora,
synthetic MQAR / NIAH, resumable (and packed) batches."""

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
                                   data_vocab_size,
                                   make_batch,
                                   make_sources,
                                   rows_for_process,
)
from hla_jax.data.synthetic import MQAR, NIAH
from hla_jax.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_for_data,
)

__all__ = [
    "ByteTokenizer", "DataIterator", "EVAL", "HFTokenizer", "KINDS", "MQAR", "NIAH",
    "SentencePieceTokenizer", "TRAIN", "TextSource", "Tokenizer", "data_vocab_size",
    "load_tokenizer", "load_tokens", "make_batch", "make_sources", "read_bytes", "read_documents",
    "rows_for_process", "stdlib_documents", "stdlib_files", "stdlib_tokens", "text_files",
    "tokenizer_for_data",
]
