"""Building blocks: parameters with logical axis names, dense maps, RMSNorm, SwiGLU, short causal
depthwise convolution, rotary embeddings and the output norm/gate shared by the mixers.

Parameters are float32; every layer casts them to the activation dtype at use.
Logical axis names: "vocab", "embed", "heads", "kv", "mlp", "levels", "conv", None.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hla_jax.core.documents import doc_positions


def param(rngs: nnx.Rngs, init, shape, names) -> nnx.Param:
    """A float32 ``nnx.Param`` whose metadata carries the logical axis ``names``."""
    if len(names) != len(shape):
        raise ValueError(f"param: {len(names)} axis names {names} for shape {shape}")
    init = nnx.with_partitioning(init, tuple(names), eager_sharding=False)
    return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32))


def const_init(value: float):
    return lambda key, shape, dtype=jnp.float32: jnp.full(shape, value, dtype)


class Dense(nnx.Module):
    """``y = x · W (+ b)`` contracting the trailing ``in_shape`` axes: ``[..., *in] -> [..., *out]``."""

    def __init__(self, in_shape, out_shape, names, *, rngs, std=0.02, bias=False, bias_init=0.0):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.kernel = param(rngs, nnx.initializers.normal(std), self.in_shape + self.out_shape, names)
        self.bias = (param(rngs, const_init(bias_init), self.out_shape, names[len(self.in_shape):])
                     if bias else None)

    def __call__(self, x):
        n = len(self.in_shape)
        y = jnp.tensordot(x, self.kernel[...].astype(x.dtype), axes=n)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def rms_norm(x, scale, eps):
    """``x / sqrt(mean(x²) + eps) · scale`` over the last axis, computed in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale of shape ``shape`` (init 1)."""

    def __init__(self, shape, names, *, rngs, eps=1e-6):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones, tuple(shape), names)

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def l2_normalize(x, eps=1e-6):
    """``x / sqrt(|x|² + eps)`` over the last axis, computed in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class SwiGLU(nnx.Module):
    """``W_down (silu(x W_gate) ∘ x W_up)``: ``[..., D] -> [..., D]``."""

    def __init__(self, d_model, hidden, *, rngs, std=0.02, out_std=0.02):
        self.gate = Dense((d_model,), (hidden,), ("embed", "mlp"), rngs=rngs, std=std)
        self.up = Dense((d_model,), (hidden,), ("embed", "mlp"), rngs=rngs, std=std)
        self.down = Dense((hidden,), (d_model,), ("mlp", "embed"), rngs=rngs, std=out_std)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class ShortConv(nnx.Module):
    """Causal depthwise convolution over time, ``y_t = Σ_j w_j ∘ x_{t-K+1+j}``, then SiLU.

    ``x: [B,T,H,c]``; kernel ``[K,H,c]``.  With ``segment_ids: [B,T]`` (packed documents) a tap
    whose source ``t-K+1+j`` lies in an earlier document than ``t`` contributes nothing, i.e. it
    is kept only where ``p_t ≥ K-1-j`` (``p_t``: position of ``t`` in its document), so each
    document is convolved as if alone.  The decode state is the last ``K-1`` inputs
    ``[B,K-1,H,c]`` (zeros before the first token).
    """

    def __init__(self, size, heads, width, *, rngs):
        self.size = size
        self.kernel = param(rngs, nnx.initializers.normal(1.0 / math.sqrt(size)),
                            (size, heads, width), ("conv", "heads", "kv"))

    def _window(self, xs, doc_pos=None):
        """``Σ_j w_j xs[:, j : j + T']`` for padded ``xs: [B, T'+K-1, H, c]``; with ``doc_pos:
        [B,T']`` (document positions of the outputs) only the taps inside each document."""
        w = self.kernel[...].astype(xs.dtype)
        K = self.size
        T = xs.shape[1] - K + 1
        taps = [w[j] * xs[:, j:j + T] for j in range(K)]
        if doc_pos is not None:
            taps = [jnp.where((doc_pos >= K - 1 - j)[..., None, None], tap, 0)
                    for j, tap in enumerate(taps)]
        return jax.nn.silu(sum(taps))

    def __call__(self, x, segment_ids=None):
        doc_pos = None if segment_ids is None else doc_positions(segment_ids)
        return self._window(jnp.pad(x, ((0, 0), (self.size - 1, 0), (0, 0), (0, 0))), doc_pos)

    def init_state(self, batch, heads, width, dtype):
        return jnp.zeros((batch, self.size - 1, heads, width), dtype)

    def prefill_state(self, x, segment_ids=None):
        """The decode state after the sequence ``x: [B,T,H,c]``: its last ``K-1`` inputs, those
        before the last document's start zeroed (``segment_ids: [B,T]``)."""
        K = self.size
        xs = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0), (0, 0)))[:, x.shape[1]:]
        if segment_ids is None:
            return xs
        last = doc_positions(segment_ids)[:, -1:]  # position of the last token in its doc
        age = jnp.arange(K - 2, -1, -1)  # slot j holds the input K-2-j tokens before the last
        return jnp.where((age <= last)[..., None, None], xs, 0)

    def step(self, state, x_t):
        """One token ``x_t: [B,H,c]`` -> ``(y_t, new_state)``."""
        xs = jnp.concatenate([state, x_t[:, None].astype(state.dtype)], axis=1)
        return self._window(xs)[:, 0], xs[:, 1:]


def rope(x, positions, theta=10000.0):
    """Rotary embedding (rotate-half) of ``x: [B,T,H,d]`` at integer ``positions: [T]`` or ``[B,T]``."""
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = jnp.asarray(positions, jnp.float32)[..., None] * freq  # [..., T, d/2]
    if ang.ndim == 2:
        ang = ang[None]
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def head_projection(cfg, *, rngs) -> Dense:
    """``x W``: ``[B,T,D] -> [B,T,H,d]`` (the q, k, v and gate projections), ``W ~ N(0, init_std²)``."""
    return Dense((cfg.d_model,), (cfg.n_heads, cfg.head_dim), ("embed", "heads", "kv"), rngs=rngs,
                 std=cfg.init_std)


class OutputGate(nnx.Module):
    """Per-head RMSNorm of the mixer output, then a gate from the layer input, then ``W_o``.

    ``y = W_o (RMSNorm_h(o) ∘ act(x W_z))`` with ``act`` = SiLU | sigmoid, or no gate ("none").
    ``o: [B,T,H,dv]``, ``x: [B,T,D]`` -> ``[B,T,D]``.
    """

    def __init__(self, cfg, *, rngs, out_std):
        H, d, D = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.kind = cfg.output_gate
        self.norm = RMSNorm((H, d), ("heads", "kv"), rngs=rngs, eps=cfg.norm_eps)
        self.gate = None if self.kind == "none" else head_projection(cfg, rngs=rngs)
        self.out = Dense((H, d), (D,), ("heads", "kv", "embed"), rngs=rngs, std=out_std)

    def __call__(self, o, x):
        y = self.norm(o.astype(x.dtype))
        if self.gate is not None:
            z = self.gate(x)
            y = y * (jax.nn.silu(z) if self.kind == "silu" else jax.nn.sigmoid(z))
        return self.out(y)
