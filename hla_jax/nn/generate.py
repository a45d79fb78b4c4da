"""Sampling with each mixer's recurrent decode state.

``prefill`` is one parallel (chunked) forward over the prompt that returns its outputs and every
layer's final decode state together (the ops' ``return_final_state``; no serial pass over the
prompt).  Prompts of different lengths (``prompt_lengths``) are left-aligned to end together,
the padding in front of each is its own document (``segment_ids``), so every state, KV-cache
window and conv window holds only the prompt and each row continues exactly as it would alone.
The decode state is a KV cache
preallocated to ``prompt + max_new_tokens`` for softmax, an O(1) recurrent state (and the
short-convolution window) for linear/HLA/SSM mixers, O(log T) level states for log-linear mixers.
The new tokens are then produced by a ``jax.lax.fori_loop`` of one-token steps inside one jitted
function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _generate(graphdef, state, prompt, segment_ids, max_new_tokens, temperature, top_k, rng):
    model = nnx.merge(graphdef, state)
    B, P = prompt.shape
    cache = model.init_cache(B, P + max_new_tokens)
    logits, cache = model.prefill(prompt, cache, segment_ids)
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


def _roll_rows(x, shift):
    """Row ``b`` of ``x: [B,N]`` rotated right by ``shift[b]``: ``out[b, t] = x[b, (t − shift_b) mod N]``."""
    N = x.shape[1]
    return jnp.take_along_axis(x, (jnp.arange(N) - shift[:, None]) % N, axis=1)


def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, rng=None,
             prompt_lengths=None):
    """Autoregressive sampling: ``prompt [B,P] int -> [B, P + max_new_tokens] int32``.

    ``prompt_lengths [B]`` (``1 <= n_b <= P``; None: all ``P``): row ``b``'s prompt is its first
    ``n_b`` tokens (the rest is ignored), and row ``b`` of the result holds those ``n_b`` tokens,
    then the ``max_new_tokens`` new ones, then zeros.  Each row is continued as it would be alone.
    ``temperature=0`` is greedy decoding; ``top_k > 0`` restricts sampling to the k most likely
    tokens.  The whole prefill + decode loop is one jitted function (recompiled per prompt
    shape, ``max_new_tokens``, temperature and top_k).
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: prompt must be [B,P] with P >= 1, got shape {prompt.shape}")
    B, P = prompt.shape
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    args = (int(max_new_tokens), float(temperature), int(top_k), rng)
    if prompt_lengths is None:
        return _generate(graphdef, state, prompt, None, *args)
    n = np.asarray(prompt_lengths)
    if n.shape != (B,) or not np.issubdtype(n.dtype, np.integer) or n.min() < 1 or n.max() > P:
        raise ValueError(f"generate: prompt_lengths must be {B} ints in [1, P={P}], got "
                         f"{n.dtype}{list(n.shape)} {n.tolist()}")
    shift = jnp.asarray(P - n, jnp.int32)
    segment_ids = (jnp.arange(P) >= shift[:, None]).astype(jnp.int32)  # padding 0, prompt 1
    out = _generate(graphdef, state, _roll_rows(prompt, shift), segment_ids, *args)
    out = _roll_rows(out, -shift)
    return jnp.where(jnp.arange(out.shape[1]) < jnp.asarray(n)[:, None] + max_new_tokens, out, 0)
