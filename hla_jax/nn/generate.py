"""Sampling with each mixer's recurrent decode state.

``prefill`` runs the full (chunked) forward over the prompt for its outputs and gets every
layer's final decode state from the family's serial recurrence over the prompt (a ``lax.scan`` of
the op's ``step``: the op functions return outputs only).  The decode state is a KV cache
preallocated to ``prompt + max_new_tokens`` for softmax, an O(1) recurrent state (and the
short-convolution window) for linear/HLA/SSM mixers, O(log T) level states for log-linear mixers.
The new tokens are then produced by a ``jax.lax.fori_loop`` of one-token steps inside one jitted
function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def sample_token(logits, rng, temperature: float, top_k: int):
    """Sample from ``logits [B,V]``: greedy when ``temperature == 0``; top-k when ``top_k > 0``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _generate(graphdef, state, prompt, max_new_tokens, temperature, top_k, rng):
    model = nnx.merge(graphdef, state)
    B, P = prompt.shape
    cache = model.init_cache(B, P + max_new_tokens)
    logits, cache = model.prefill(prompt, cache)
    out = jnp.concatenate([prompt, jnp.zeros((B, max_new_tokens), jnp.int32)], axis=1)

    def body(i, carry):
        out, logits, cache, rng = carry
        rng, key = jax.random.split(rng)
        tok = sample_token(logits, key, temperature, top_k)
        out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], P + i, 1)
        logits, cache = model.step(tok, cache, P + i)
        return out, logits, cache, rng

    out, *_ = jax.lax.fori_loop(0, max_new_tokens, body, (out, logits[:, -1], cache, rng))
    return out


def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, rng=None):
    """Autoregressive sampling: ``prompt [B,P] int -> [B, P + max_new_tokens] int32``.

    All prompts of the batch have the same length ``P`` (no padding).
    ``temperature=0`` is greedy decoding; ``top_k > 0`` restricts sampling to the k most likely
    tokens.  The whole prefill + decode loop is one jitted function (recompiled per prompt
    shape, ``max_new_tokens``, temperature and top_k).
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: prompt must be [B,P] with P >= 1, got shape {prompt.shape}")
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, int(max_new_tokens), float(temperature), int(top_k), rng)
