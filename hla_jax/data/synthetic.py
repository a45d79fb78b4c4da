"""Synthetic recall tasks drawn on the fly, one example per ``np.random.Generator``.

Each source's ``example(rng)`` returns ``(inputs, targets, mask)``, each ``[T]``: ``mask`` (bool)
marks the targets that count in the loss (the answers), so batches carry a loss mask.
``MQAR.batch(key, size)`` draws a whole batch with ``jax.random`` instead (on device, jittable);
``MQARMixture`` mixes the rows of several pair counts in one batch.
"""

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.data.tokenizers import ByteTokenizer


class MQAR:
    """Multi-query associative recall, as in Zoology (Arora et al. 2023) and the log-linear paper.

    ``k1 v1 k2 v2 ... kN vN`` (keys from ``[1, V/2)``, values from ``[V/2, V)``, distinct), then a
    query region of zeros where each key reappears once at an even offset drawn with
    p(gap = i) ∝ i^(power_a − 1); the target after a query key is its value, nothing else counts.
    """

    def __init__(self, seq_len: int, vocab_size: int, num_kv_pairs: int, power_a: float = 0.01):
        space = (seq_len - 2 * num_kv_pairs) // 2
        if num_kv_pairs < 1 or space < num_kv_pairs:
            raise ValueError(f"data.mqar.num_kv_pairs={num_kv_pairs} needs seq_len >= "
                             f"{4 * num_kv_pairs}, got seq_len={seq_len}")
        if vocab_size // 2 - 1 < num_kv_pairs:
            raise ValueError(f"model.vocab_size={vocab_size} too small for "
                             f"{num_kv_pairs} distinct keys")
        if power_a <= 0:
            raise ValueError(f"data.mqar.power_a must be positive, got {power_a}")
        self.seq_len, self.vocab_size, self.num_kv_pairs = seq_len, vocab_size, num_kv_pairs
        p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
        self.gap_p = p / p.sum()

    def example(self, rng: np.random.Generator):
        n, half = self.num_kv_pairs, self.vocab_size // 2
        keys = rng.choice(np.arange(1, half), n, replace=False)
        values = rng.choice(np.arange(half, self.vocab_size), n, replace=False)
        gaps = 2 * rng.choice(len(self.gap_p), n, replace=False, p=self.gap_p)
        inputs = np.zeros(self.seq_len, np.int64)
        inputs[0:2 * n:2], inputs[1:2 * n:2] = keys, values
        inputs[2 * n + gaps] = keys
        targets = np.zeros(self.seq_len, np.int64)
        targets[2 * n + gaps] = values
        mask = np.zeros(self.seq_len, bool)
        mask[2 * n + gaps] = True
        return inputs, targets, mask

    def answer_counts(self, size: int) -> np.ndarray:
        """``[size]``: the answers (loss-mask ones) in each row of a ``batch`` of ``size``."""
        return np.full(size, self.num_kv_pairs)

    def batch(self, key, size: int, positions: int = 0) -> dict:
        """``size`` examples from ``jax.random`` key ``key``, distributed as ``example``'s: dict
        ``inputs, targets`` int32 and ``mask`` float32, each ``[size, T]`` (jittable); with
        ``positions >= num_kv_pairs`` also ``positions [size, positions]`` int32, the answer
        positions padded with 0 (mask 0 there), so a loss reads logits only there
        (``train.steps.scored``).

        ``choice(range(m), n, replace=False)`` is a uniformly random ordered n-subset: the top n
        of m iid 32-bit scores (keys, values). With ``p`` it draws in turn, each next gap ∝ p
        among the unused ones: the top n of ``log p + Gumbel`` in decreasing order (Gumbel-top-k).
        Both exact up to ties of the float32/uint32 scores (probability < 1e-3 per example).
        """
        n, half, T = self.num_kv_pairs, self.vocab_size // 2, self.seq_len
        k_keys, k_values, k_gaps = jax.random.split(key, 3)

        def ordered_subset(k, m):  # [size, n] distinct draws from range(m), uniform order
            return jax.lax.top_k(jax.random.bits(k, (size, m), jnp.uint32), n)[1]

        keys = 1 + ordered_subset(k_keys, half - 1)
        values = half + ordered_subset(k_values, self.vocab_size - half)
        log_p = jnp.asarray(np.log(self.gap_p), jnp.float32)
        gaps = 2 * jax.lax.top_k(log_p + jax.random.gumbel(k_gaps, (size, log_p.size)), n)[1]
        rows, kv, queries = jnp.arange(size)[:, None], 2 * jnp.arange(n), 2 * n + gaps
        zeros = jnp.zeros((size, T), jnp.int32)
        inputs = zeros.at[rows, kv].set(keys).at[rows, kv + 1].set(values)
        out = {"inputs": inputs.at[rows, queries].set(keys),
               "targets": zeros.at[rows, queries].set(values),
               "mask": jnp.zeros((size, T), jnp.float32).at[rows, queries].set(1.0)}
        if positions:
            if positions < n:
                raise ValueError(f"positions={positions} < num_kv_pairs={n}")
            out["positions"] = jnp.pad(queries, ((0, 0), (0, positions - n))).astype(jnp.int32)
        return out


class MQARMixture:
    """Batches that mix several ``MQAR`` sources (pair counts) of one ``seq_len``: row ``r`` comes
    from source ``r mod C``, so every count fills ``size/C`` rows (±1) and every run of ``C``
    consecutive rows (e.g. a micro-batch) holds each count once. ``num_kv_pairs`` is the largest
    count (``positions`` must cover it)."""

    def __init__(self, sources):
        self.sources = list(sources)
        if len({src.seq_len for src in self.sources}) != 1:
            raise ValueError("MQARMixture sources must share seq_len")
        self.seq_len = self.sources[0].seq_len
        self.num_kv_pairs = max(src.num_kv_pairs for src in self.sources)

    def answer_counts(self, size: int) -> np.ndarray:
        """``[size]``: row ``r`` holds source ``r mod C``'s ``num_kv_pairs`` answers."""
        return np.asarray([self.sources[r % len(self.sources)].num_kv_pairs for r in range(size)])

    def batch(self, key, size: int, positions: int = 0) -> dict:
        """``MQAR.batch`` of ``size`` rows, source ``c``'s rows drawn from ``fold_in(key, its
        num_kv_pairs)``."""
        C = len(self.sources)
        if size < C:
            raise ValueError(f"batch of {size} rows cannot hold {C} pair counts")
        parts = [src.batch(jax.random.fold_in(key, src.num_kv_pairs), len(range(c, size, C)),
                           positions) for c, src in enumerate(self.sources)]
        row_of = np.concatenate([np.arange(c, size, C) for c in range(C)])  # concat row -> row
        order = np.argsort(row_of)
        return {k: jnp.concatenate([p[k] for p in parts])[order] for k in parts[0]}


FILLER = (
    b"The grass is green. ", b"The sky is blue. ", b"The sun is yellow. ", b"Here we go. ",
    b"There and back again. ", b"The river runs to the sea. ", b"A cat sleeps on the mat. ",
    b"The wind moves the trees. ", b"Bread is baked in the morning. ", b"Stars come out at night. ",
)


class NIAH:
    """Needle in a haystack (passkey retrieval, byte-level).

    Filler sentences with ``" The magic number is N. "`` at a uniform random depth, then
    ``" What is the magic number? The magic number is N"``; only the digits of the final ``N``
    are targets. ``N`` has ``n_digits`` digits.
    """

    QUESTION = b" What is the magic number? The magic number is "

    def __init__(self, seq_len: int, n_digits: int = 5):
        if n_digits < 1:
            raise ValueError(f"data.niah.n_digits must be >= 1, got {n_digits}")
        self.seq_len, self.n_digits = seq_len, n_digits
        self.room = seq_len + 1 - len(self.QUESTION) - n_digits - len(self._needle("0" * n_digits))
        if self.room < 0:
            raise ValueError(f"data.seq_len={seq_len} too short for a needle and a question")
        self.tok = ByteTokenizer()

    @staticmethod
    def _needle(number: str) -> bytes:
        return b" The magic number is " + number.encode() + b". "

    @staticmethod
    def _filler(rng, n: int) -> bytes:
        parts, size = [], 0
        while size < n:
            parts.append(FILLER[rng.integers(len(FILLER))])
            size += len(parts[-1])
        return b"".join(parts)[:n]

    def example(self, rng: np.random.Generator):
        number = "".join(str(d) for d in rng.integers(0, 10, self.n_digits))
        before = int(rng.integers(0, self.room + 1))
        text = (self._filler(rng, before) + self._needle(number)
                + self._filler(rng, self.room - before) + self.QUESTION + number.encode())
        seq = self.tok.encode(text).astype(np.int64)
        mask = np.zeros(self.seq_len, bool)
        mask[-self.n_digits:] = True
        return seq[:-1], seq[1:], mask
