"""Decoder-only language model: embedding, pre-norm blocks (RMSNorm, mixer, SwiGLU), final norm,
tied or separate head.  ``LM(cfg, rngs=nnx.Rngs(0))(tokens [B,T]) -> logits [B,T,V] float32``;
``segment_ids [B,T]`` (packed documents) make every layer treat each document as if alone.

Decoding API (used by :func:`hla_jax.nn.generate`): ``init_cache(batch, max_len)``,
``prefill(tokens, cache, segment_ids=None) -> (logits, cache)`` and
``step(token [B], cache, pos) -> (logits [B,V], cache)`` (``pos``: the cache slot, shared by the
rows; each mixer's state knows its row's position in its document).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hla_jax.core.checks import check_segment_ids
from hla_jax.nn.config import ModelConfig
from hla_jax.nn.layers import Dense, RMSNorm, SwiGLU, param
from hla_jax.nn.mixers import make_mixer


class Block(nnx.Module):
    """``x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x))``."""

    def __init__(self, cfg: ModelConfig, mixer: str, *, rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.mixer_name = mixer
        self.norm1 = RMSNorm((cfg.d_model,), ("embed",), rngs=rngs, eps=cfg.norm_eps)
        self.mixer = make_mixer(mixer, cfg, rngs=rngs, out_std=out_std)
        self.norm2 = RMSNorm((cfg.d_model,), ("embed",), rngs=rngs, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_dim, rngs=rngs, std=cfg.init_std, out_std=out_std)

    def __call__(self, x, segment_ids=None):
        x = x + self.mixer(self.norm1(x), segment_ids)
        return x + self.mlp(self.norm2(x))

    def prefill(self, x, cache, segment_ids=None):
        y, cache = self.mixer.prefill(self.norm1(x), cache, segment_ids)
        x = x + y
        return x + self.mlp(self.norm2(x)), cache

    def step(self, x_t, cache, pos):
        y, cache = self.mixer.step(self.norm1(x_t), cache, pos)
        x_t = x_t + y
        return x_t + self.mlp(self.norm2(x_t)), cache


class LM(nnx.Module):
    """Token embedding -> ``n_layers`` blocks (mixers from ``cfg.mixer_pattern``) -> logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"))
        self.blocks = nnx.List([Block(cfg, m, rngs=rngs) for m in cfg.layer_mixers()])
        self.norm = RMSNorm((cfg.d_model,), ("embed",), rngs=rngs, eps=cfg.norm_eps)
        self.head = (None if cfg.tie_embeddings else
                     Dense((cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), rngs=rngs,
                           std=cfg.init_std))

    def _embed(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.compute_dtype)

    def _logits(self, x):
        x = self.norm(x)
        w = self.embed[...].T if self.head is None else self.head.kernel[...]
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None, segment_ids=None):
        """``tokens: [B,T] int -> logits [B,T,vocab] float32``; with ``positions: [B,P] int``
        only the logits there, ``[B,P,vocab]`` (a loss read at a few positions skips the rest
        of the vocabulary projection); ``positions: [P] int`` are flat indices ``b·T + t`` into
        the batch (rows with different numbers of scored positions, no padding per row),
        ``[P,vocab]``.  ``segment_ids: [B,T] int``: packed documents (consecutive equal ids form
        one document, docs/math.md#packed-documents), checked here once for every layer; each
        document's logits are those it would get alone."""
        segment_ids = check_segment_ids(segment_ids, *tokens.shape, name="LM")
        x = self._embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids)
        if positions is not None and positions.ndim == 1:
            x = x.reshape(-1, x.shape[-1])[positions]
        elif positions is not None:
            x = jnp.take_along_axis(x, positions[..., None], axis=1)
        return self._logits(x)

    def init_cache(self, batch: int, max_len: int):
        """Per-layer decode state for ``batch`` sequences of at most ``max_len`` tokens."""
        dtype = self.cfg.compute_dtype
        return [b.mixer.init_cache(batch, max_len, dtype) for b in self.blocks]

    def prefill(self, tokens, cache, segment_ids=None):
        """One parallel forward over the prompt ``[B,T]``: its logits and the decode state after
        it (every mixer's final state from the same pass).  ``segment_ids [B,T]``: the state of
        each row's last document (left-padded prompts: padding in its own segment)."""
        segment_ids = check_segment_ids(segment_ids, *tokens.shape, name="LM.prefill")
        x = self._embed(tokens)
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.prefill(x, c, segment_ids)
            new.append(c)
        return self._logits(x), new

    def step(self, token, cache, pos):
        """One token ``[B]`` at position ``pos`` -> ``(logits [B,V], cache)``."""
        x = self._embed(token)
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.step(x, c, pos)
            new.append(c)
        return self._logits(x), new


def param_count(model: nnx.Module) -> int:
    """Number of scalars in all ``nnx.Param`` of ``model``."""
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
