"""Softmax attention mixer: RoPE, causal ``jax.nn.dot_product_attention``, KV-cache decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hla_jax.nn.layers import Dense, head_projection, rope


def attention_implementation(dtype) -> str | None:
    """cuDNN flash attention on GPU for 16-bit activations, XLA otherwise."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


class SoftmaxAttention(nnx.Module):
    """``o = softmax(q kᵀ / √d + causal mask) v`` with rotary q, k; ``[B,T,D] -> [B,T,D]``.

    Decoding keeps a KV cache ``{"k", "v": [B, max_len, H, d]}`` preallocated to
    prompt + new tokens; step ``pos`` attends to cache slots ``0..pos``.
    """

    def __init__(self, cfg, *, rngs, out_std):
        H, d, D = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.cfg = cfg
        self.q, self.k, self.v = (head_projection(cfg, rngs=rngs) for _ in range(3))
        self.out = Dense((H, d), (D,), ("heads", "kv", "embed"), rngs=rngs, std=out_std)

    def _qkv(self, x, positions):
        theta = self.cfg.rope_theta
        return rope(self.q(x), positions, theta), rope(self.k(x), positions, theta), self.v(x)

    def __call__(self, x):
        T = x.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"softmax mixer: sequence length {T} > max_seq_len={self.cfg.max_seq_len}")
        q, k, v = self._qkv(x, jnp.arange(T))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=attention_implementation(x.dtype))
        return self.out(o)

    def init_cache(self, batch, max_len, dtype):
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"softmax mixer: cache length {max_len} > max_seq_len={self.cfg.max_seq_len}")
        shape = (batch, max_len, self.cfg.n_heads, self.cfg.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def prefill(self, x, cache):
        """Full causal forward over the prompt; its keys/values fill cache slots ``0..T-1``."""
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=attention_implementation(x.dtype))
        cache = {"k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), 0, 1),
                 "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), 0, 1)}
        return self.out(o), cache

    def step(self, x_t, cache, pos):
        """One token ``x_t: [B,D]`` at position ``pos`` -> ``(y_t [B,D], cache)``."""
        q, k, v = self._qkv(x_t[:, None], jnp.reshape(pos, (1,)))
        kc = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, 1)
        vc = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, 1)
        s = jnp.einsum("bhd,bshd->bhs", q[:, 0].astype(jnp.float32), kc.astype(jnp.float32))
        s = s * self.cfg.head_dim ** -0.5
        s = jnp.where(jnp.arange(kc.shape[1]) <= pos, s, -jnp.inf)
        o = jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(s, axis=-1), vc.astype(jnp.float32))
        return self.out(o.astype(x_t.dtype)[:, None])[:, 0], {"k": kc, "v": vc}
