"""Byte-level tokenizer: token = byte value, vocabulary 256, nothing to download."""

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes <-> token ids in [0, 256)."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        """``text`` -> uint8 token ids ``[n]`` (strings are UTF-8 encoded)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        """Token ids -> text; ids that are not bytes or invalid UTF-8 become U+FFFD."""
        ids = np.asarray(tokens).reshape(-1)
        data = bytes(int(t) if 0 <= t < 256 else 0xFF for t in ids)
        return data.decode("utf-8", errors="replace")
