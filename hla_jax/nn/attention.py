"""Softmax attention mixer: RoPE, causal ``jax.nn.dot_product_attention``, KV-cache decoding.

Packed documents (``segment_ids: [B,T]``): RoPE positions count from each document's first token
and a boolean mask ``same document`` ``[B,1,T,T]`` joins the causal one, so a packed document sees
exactly what it would alone.  jax 0.11.2's ``jax.nn.dot_product_attention`` has no segment
argument: its cuDNN path takes sequence lengths (one sequence per row, padding) or a dense mask,
which it turns into a constant additive bias (no bias gradient).  So the mask goes through cuDNN
flash attention on a GPU for 16-bit activations and through XLA's attention otherwise
(``attention_implementation``); cuDNN's packed ``q_offsets`` layout is not exposed by that API.
The masked cuDNN call is faster than XLA's masked attention, and packed documents match the
documents alone to bf16 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hla_jax.core.documents import doc_positions, same_doc
from hla_jax.nn.layers import Dense, head_projection, rope


def attention_implementation(dtype) -> str | None:
    """cuDNN flash attention on GPU for 16-bit activations, XLA otherwise."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


class SoftmaxAttention(nnx.Module):
    """``o = softmax(q kᵀ / √d + mask) v`` with rotary q, k; ``[B,T,D] -> [B,T,D]``; the mask
    keeps ``s ≤ t`` (and, with ``segment_ids``, ``s`` in ``t``'s document).

    Decoding keeps a KV cache ``{"k", "v": [B, max_len, H, d], "start": [B]}`` preallocated to
    prompt + new tokens; step ``pos`` attends to cache slots ``start..pos`` (``start``: each
    row's document start, so left-padded prompts decode as if alone).
    """

    def __init__(self, cfg, *, rngs, out_std):
        H, d, D = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.cfg = cfg
        self.q, self.k, self.v = (head_projection(cfg, rngs=rngs) for _ in range(3))
        self.out = Dense((H, d), (D,), ("heads", "kv", "embed"), rngs=rngs, std=out_std)

    def _qkv(self, x, positions):
        theta = self.cfg.rope_theta
        return rope(self.q(x), positions, theta), rope(self.k(x), positions, theta), self.v(x)

    def _attend(self, x, segment_ids):
        """``(o, k, v)`` of the masked causal attention over ``x: [B,T,D]`` (module docstring)."""
        T = x.shape[1]
        if segment_ids is None:
            positions, mask = jnp.arange(T), None
        else:
            positions, mask = doc_positions(segment_ids), same_doc(segment_ids)[:, None]
        q, k, v = self._qkv(x, positions)
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                         implementation=attention_implementation(x.dtype))
        return o, k, v

    def __call__(self, x, segment_ids=None):
        """``x: [B,T,D]``; ``segment_ids: [B,T]`` int masks attention across documents."""
        T = x.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"softmax mixer: sequence length {T} > max_seq_len={self.cfg.max_seq_len}")
        return self.out(self._attend(x, segment_ids)[0])

    def init_cache(self, batch, max_len, dtype):
        """``{"k", "v": [B, max_len, H, d], "start": [B]}``: ``start`` is the slot of each row's
        current document's first token (0 until a prefill with ``segment_ids`` says otherwise)."""
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"softmax mixer: cache length {max_len} > max_seq_len={self.cfg.max_seq_len}")
        shape = (batch, max_len, self.cfg.n_heads, self.cfg.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                "start": jnp.zeros((batch,), jnp.int32)}

    def prefill(self, x, cache, segment_ids=None):
        """Full causal forward over the prompt; its keys/values fill cache slots ``0..T-1`` and
        ``start`` becomes the first slot of each row's last document."""
        o, k, v = self._attend(x, segment_ids)
        T = x.shape[1]
        start = (jnp.zeros_like(cache["start"]) if segment_ids is None
                 else T - 1 - doc_positions(segment_ids)[:, -1])
        cache = {"k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), 0, 1),
                 "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), 0, 1),
                 "start": start.astype(jnp.int32)}
        return self.out(o), cache

    def step(self, x_t, cache, pos):
        """One token ``x_t: [B,D]`` in cache slot ``pos`` -> ``(y_t [B,D], cache)``: rotary
        position ``pos − start``, attending to slots ``start..pos`` of its row."""
        start = cache["start"]
        q, k, v = self._qkv(x_t[:, None], (pos - start)[:, None])
        kc = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, 1)
        vc = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, 1)
        s = jnp.einsum("bhd,bshd->bhs", q[:, 0].astype(jnp.float32), kc.astype(jnp.float32))
        s = s * self.cfg.head_dim ** -0.5
        slot = jnp.arange(kc.shape[1])
        s = jnp.where(((slot <= pos) & (slot >= start[:, None]))[:, None], s, -jnp.inf)
        o = jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(s, axis=-1), vc.astype(jnp.float32))
        return self.out(o.astype(x_t.dtype)[:, None])[:, 0], {"k": kc, "v": vc, "start": start}
