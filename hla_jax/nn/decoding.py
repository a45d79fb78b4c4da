"""Sampling with each mixer's recurrent decode state.

``prefill`` is one parallel (chunked) forward over the prompt that returns its outputs and every
layer's final decode state together (the ops' ``return_final_state``; no serial pass over the
prompt).  Prompts of different lengths (``prompt_lengths``) are left-aligned to end together,
the padding in front of each is its own document (``segment_ids``), so every state, KV-cache
window and conv window holds only the prompt and each row continues exactly as it would alone.
The decode state is a KV cache preallocated to ``prompt + max_new_tokens`` for softmax, an O(1)
recurrent state (and the short-convolution window) for linear/HLA/SSM mixers, O(log T) level
states for log-linear mixers.
``generate`` produces the new tokens by a ``jax.lax.fori_loop`` of one-token steps inside one
jitted function; ``generate_stream`` runs the same steps one jitted call at a time from the host
and yields each token as it comes (same tokens for the same arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_token(logits, rng, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Sample from ``logits [B,V]`` -> ``[B]`` int32.

    Greedy when ``temperature == 0``; otherwise from ``softmax(logits / temperature)`` restricted
    to the ``top_k`` most likely tokens (``top_k > 0``), then to the nucleus (``top_p < 1``): the
    most likely tokens whose probabilities, renormalised, add up to ``top_p`` (the fewest such
    tokens, and every token tied with the last of them).
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        p = jax.nn.softmax(ranked, axis=-1)
        above = jnp.cumsum(p, axis=-1) - p  # mass of the tokens ranked above each one
        cutoff = jnp.min(jnp.where(above < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _first(model, prompt, segment_ids, max_len, sampling, rng):
    """Prefill ``prompt [B,P]`` into a fresh cache of ``max_len`` slots and sample the first new
    token: ``(token [B], cache, rng)``."""
    cache = model.init_cache(prompt.shape[0], max_len)
    logits, cache = model.prefill(prompt, cache, segment_ids)
    rng, key = jax.random.split(rng)
    return sample_token(logits[:, -1], key, *sampling), cache, rng


def _next(model, token, cache, pos, sampling, rng):
    """Feed ``token [B]`` at cache slot ``pos`` and sample the one after it: ``(token, cache, rng)``."""
    logits, cache = model.step(token, cache, pos)
    rng, key = jax.random.split(rng)
    return sample_token(logits, key, *sampling), cache, rng


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, state, prompt, segment_ids, max_new_tokens, sampling, rng):
    model = nnx.merge(graphdef, state)
    B, P = prompt.shape
    token, cache, rng = _first(model, prompt, segment_ids, P + max_new_tokens, sampling, rng)

    def body(i, carry):
        new, token, cache, rng = carry
        new = jax.lax.dynamic_update_slice_in_dim(new, token[:, None], i, 1)
        return (new, *_next(model, token, cache, P + i, sampling, rng))

    new = jnp.zeros((B, max_new_tokens), jnp.int32)
    new, token, *_ = jax.lax.fori_loop(0, max_new_tokens - 1, body, (new, token, cache, rng))
    return jnp.concatenate([prompt, new.at[:, -1].set(token)], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _start(graphdef, state, prompt, segment_ids, max_len, sampling, rng):
    return _first(nnx.merge(graphdef, state), prompt, segment_ids, max_len, sampling, rng)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _advance(graphdef, state, token, cache, pos, sampling, rng):
    return _next(nnx.merge(graphdef, state), token, cache, pos, sampling, rng)


def _roll_rows(x, shift):
    """Row ``b`` of ``x: [B,N]`` rotated right by ``shift[b]``: ``out[b, t] = x[b, (t − shift_b) mod N]``."""
    N = x.shape[1]
    return jnp.take_along_axis(x, (jnp.arange(N) - shift[:, None]) % N, axis=1)


def check_sampling(max_new_tokens, temperature, top_k, top_p) -> tuple:
    """The ``(temperature, top_k, top_p)`` that ``sample_token`` takes, checked (ValueError
    naming the bad one)."""
    if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1):
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
        raise ValueError(f"generate: top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1] (1 = off), got {top_p}")
    return float(temperature), int(top_k), float(top_p)


def _align(prompt, prompt_lengths):
    """``(prompt, segment_ids, shift)``: the rows rotated so every prompt ends at column ``P``
    (``shift [B]`` columns right), the padding in front of each in segment 0; without
    ``prompt_lengths`` the prompt as given and ``None, None``."""
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: prompt must be [B,P] with P >= 1, got shape {prompt.shape}")
    if prompt_lengths is None:
        return prompt, None, None
    B, P = prompt.shape
    n = np.asarray(prompt_lengths)
    if n.shape != (B,) or not np.issubdtype(n.dtype, np.integer) or n.min() < 1 or n.max() > P:
        raise ValueError(f"generate: prompt_lengths must be {B} ints in [1, P={P}], got "
                         f"{n.dtype}{list(n.shape)} {n.tolist()}")
    shift = jnp.asarray(P - n, jnp.int32)
    segment_ids = (jnp.arange(P) >= shift[:, None]).astype(jnp.int32)  # padding 0, prompt 1
    return _roll_rows(prompt, shift), segment_ids, shift


def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, rng=None,
             prompt_lengths=None, top_p: float = 1.0):
    """Autoregressive sampling: ``prompt [B,P] int -> [B, P + max_new_tokens] int32``.

    ``prompt_lengths [B]`` (``1 <= n_b <= P``; None: all ``P``): row ``b``'s prompt is its first
    ``n_b`` tokens (the rest is ignored), and row ``b`` of the result holds those ``n_b`` tokens,
    then the ``max_new_tokens`` new ones, then zeros.  Each row is continued as it would be alone.
    ``temperature=0`` is greedy decoding; ``top_k > 0`` restricts sampling to the k most likely
    tokens, ``top_p < 1`` to the nucleus of probability ``top_p`` (``sample_token``).  The whole
    prefill + decode loop is one jitted function (recompiled per prompt shape,
    ``max_new_tokens`` and sampling settings).
    """
    aligned, segment_ids, shift = _align(prompt, prompt_lengths)
    sampling = check_sampling(max_new_tokens, temperature, top_k, top_p)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    out = _generate(graphdef, state, aligned, segment_ids, int(max_new_tokens), sampling, rng)
    if shift is None:
        return out
    out = _roll_rows(out, -shift)
    return jnp.where(jnp.arange(out.shape[1]) < jnp.asarray(prompt_lengths)[:, None] + max_new_tokens,
                     out, 0)


def generate_stream(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                    rng=None, prompt_lengths=None, top_p: float = 1.0):
    """The new tokens of ``generate`` (same arguments, same tokens), one step at a time: an
    iterator of ``max_new_tokens`` numpy ``[B]`` int32 arrays, token ``i`` of every row.

    The prefill and the one-token step are each one jitted call (compiled once per prompt shape
    and sampling settings; the position is traced), driven from the host, so a caller can show
    tokens as they come and stop early (stop iterating).  The arguments are checked at the call.
    """
    aligned, segment_ids, _ = _align(prompt, prompt_lengths)
    sampling = check_sampling(max_new_tokens, temperature, top_k, top_p)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    P = aligned.shape[1]

    def tokens():
        token, cache, key = _start(graphdef, state, aligned, segment_ids, P + max_new_tokens,
                                   sampling, rng)
        for i in range(max_new_tokens):
            current = np.asarray(token)
            if i + 1 < max_new_tokens:  # dispatched before the caller handles `current`
                token, cache, key = _advance(graphdef, state, token, cache, P + i, sampling, key)
            yield current

    return tokens()
