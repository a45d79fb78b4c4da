"""The shared skeleton of every recurrent (linear, HLA, SSM) token mixer, and its gates.

    q, k, v = x W_q, x W_k, x W_v                       [B,T,H,d]   (x: [B,T,D], RMS-normalised)
    q, k, v = SiLU(causal_depthwise_conv(q, k, v))       when the family uses a short conv
    inputs  = features(x, q, k, v)                       q/k normalisation, gates g, β, λ, v = dt·x, ...
    o       = op(inputs)                                 hla_jax.ops entry, impl=cfg.impl
                                                         (ops.sequence.over_time if cfg.seq_axis)
    y       = W_o (RMSNorm_h(o) ∘ act(x W_z))            OutputGate

Packed documents: ``segment_ids: [B,T]`` go to the conv (no tap across a document start) and to
the op (docs/math.md#packed-documents: each document as if alone); everything else acts per token.

Decoding keeps ``{"conv": last K-1 conv inputs, "state": the family's recurrent state}``.
Prefill is one parallel pass: the op's chunked form (or kernel) returns its outputs and its final
state together (``return_final_state``, the layout of the family's ``init_state``/``step``), so
decoding continues from exactly that state with no serial pass over the prompt.  With
``segment_ids`` (e.g. left-padded prompts of different lengths) the state is that of each row's
last document.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hla_jax.nn.layers import Dense, OutputGate, ShortConv, head_projection, l2_normalize, param
from hla_jax.ops import sequence


class DecayGate(nnx.Module):
    """Mamba-2 style decay: ``dt = softplus(x W_dt + dt_bias)``, ``g = −exp(A_log)·dt ≤ 0``.

    ``A = exp(A_log)`` is initialised uniformly in [1, 16] and ``dt`` log-uniformly in
    [1e-3, 1e-1] (through ``dt_bias = softplus⁻¹(dt)``), as in Mamba-2 and Gated DeltaNet.
    Returns ``(g, dt)``, both float32 ``[..., H]``.
    """

    def __init__(self, cfg, *, rngs):
        H = cfg.n_heads

        def a_log_init(key, shape, dtype=jnp.float32):
            return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))

        def dt_bias_init(key, shape, dtype=jnp.float32):
            dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(1e-1)))
            return dt + jnp.log(-jnp.expm1(-dt))  # softplus⁻¹(dt)

        self.proj = Dense((cfg.d_model,), (H,), ("embed", "heads"), rngs=rngs, std=cfg.init_std)
        self.A_log = param(rngs, a_log_init, (H,), ("heads",))
        self.dt_bias = param(rngs, dt_bias_init, (H,), ("heads",))

    def __call__(self, x):
        dt = jax.nn.softplus(self.proj(x).astype(jnp.float32) + self.dt_bias[...])
        return -jnp.exp(self.A_log[...]) * dt, dt


class LevelWeights(nnx.Module):
    """Log-linear level weights ``λ_{h,ℓ} = softplus(s_{h,ℓ} · (x W_λ)_{h,ℓ})``, float32 ``[..., H, L]``.

    ``s`` is a learned per-head, per-level scale initialised to 1; ``L = cfg.num_levels``.
    """

    def __init__(self, cfg, *, rngs):
        H, L = cfg.n_heads, cfg.num_levels
        self.proj = Dense((cfg.d_model,), (H, L), ("embed", "heads", "levels"), rngs=rngs,
                          std=cfg.init_std)
        self.scale = param(rngs, nnx.initializers.ones, (H, L), ("heads", "levels"))

    def __call__(self, x):
        return jax.nn.softplus(self.scale[...] * self.proj(x).astype(jnp.float32))


def normalize_qk(q, k):
    """L2-normalise q and k over the head dimension and scale q by ``d**-0.5``."""
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


class RecurrentMixer(nnx.Module):
    """Projections, optional short conv, op, output norm/gate; subclasses define the family.

    Subclasses set ``uses_conv`` and implement ``features(x, q, k, v) -> dict`` (the op's inputs,
    shapes ``[B,T,H,...]`` or, when decoding, ``[B,H,...]``), ``op(f, seq_axis, segment_ids)``
    (through ``apply_op``), ``op_init(batch)`` and ``op_step(state, f_t) -> (o_t, state)`` (a
    log-linear state carries its rows' positions); ``readout(o, v)`` may add a skip term.  The
    forward pass shards the op over ``cfg.seq_axis``; prefill runs it unsharded.
    """

    uses_conv = False

    def __init__(self, cfg, *, rngs, out_std):
        H, d = cfg.n_heads, cfg.head_dim
        self.cfg = cfg
        self.q, self.k, self.v = (head_projection(cfg, rngs=rngs) for _ in range(3))
        self.conv = (ShortConv(cfg.conv_size, H, 3 * d, rngs=rngs)
                     if self.uses_conv and cfg.conv_size > 0 else None)
        self.output = OutputGate(cfg, rngs=rngs, out_std=out_std)

    def readout(self, o, v):
        """The op output plus any skip term (``v`` after the conv); identity by default."""
        return o

    # -- shared machinery -----------------------------------------------------------------
    def _split(self, qkv):
        return tuple(jnp.split(qkv, 3, axis=-1))

    def _project(self, x):
        """``x [..., D] -> [..., H, 3d]`` (q, k, v concatenated, before the conv)."""
        return jnp.concatenate([self.q(x), self.k(x), self.v(x)], axis=-1)

    def __call__(self, x, segment_ids=None):
        """``x: [B,T,D] -> [B,T,D]``; ``segment_ids: [B,T]`` int for packed documents."""
        qkv = self._project(x)
        q, k, v = self._split(qkv if self.conv is None else self.conv(qkv, segment_ids))
        o = self.op(self.features(x, q, k, v), self.cfg.seq_axis, segment_ids)
        return self.output(self.readout(o, v), x)

    def init_cache(self, batch, max_len, dtype):
        del max_len  # O(1) (or O(log T) level) state whatever the length
        conv = (None if self.conv is None else
                self.conv.init_state(batch, self.cfg.n_heads, 3 * self.cfg.head_dim, dtype))
        return {"conv": conv, "state": self.op_init(batch)}

    def prefill(self, x, cache, segment_ids=None):
        """Outputs over the prompt ``x: [B,T,D]`` (from position 0, empty ``cache``) and the
        decode state after it, both from one call of the op with ``return_final_state``;
        ``segment_ids: [B,T]``: the state (and conv window) of each row's last document."""
        qkv = self._project(x)
        conv = None
        if self.conv is not None:
            conv = self.conv.prefill_state(qkv, segment_ids).astype(cache["conv"].dtype)
            qkv = self.conv(qkv, segment_ids)
        q, k, v = self._split(qkv)
        f = self.features(x, q, k, v)
        o, state = self.op(f, "", segment_ids, return_final_state=True,
                           impl=prefill_impl(self.cfg.impl))
        return self.output(self.readout(o, v), x), {"conv": conv, "state": state}

    def step(self, x_t, cache, pos):
        """One token ``x_t: [B,D]`` -> ``(y_t [B,D], cache)``; ``pos`` (the cache slot, which the
        softmax mixer reads) is not needed: the state holds everything, positions included."""
        del pos
        qkv = self._project(x_t)
        conv = cache["conv"]
        if self.conv is not None:
            qkv, conv = self.conv.step(conv, qkv)
        q, k, v = self._split(qkv)
        o, state = self.op_step(cache["state"], self.features(x_t, q, k, v))
        return self.output(self.readout(o, v), x_t), {"conv": conv, "state": state}


def apply_op(entry, f: dict, cfg, seq_axis: str = "", segment_ids=None, **kw):
    """``entry(**f, segment_ids=segment_ids, impl=cfg.impl, chunk_size=cfg.chunk_size, **kw)``
    (``segment_ids`` only when given; ``kw`` may override ``impl``); with ``seq_axis`` through
    ``ops.sequence.over_time`` (the time axis of every array, ``segment_ids`` included, sharded
    over that mesh axis, mesh from ``jax.set_mesh``; the other mesh axes stay automatic)."""
    if segment_ids is not None:
        f = f | {"segment_ids": segment_ids}
    kw = {"impl": cfg.impl, "chunk_size": cfg.chunk_size} | kw
    if seq_axis:
        return sequence.over_time(entry, seq_axis, **kw)(**f)
    return entry(**f, **kw)


def prefill_impl(impl: str) -> str:
    """The impl a prefill runs: ``impl`` when it returns final states (recurrent, chunked,
    pallas, auto), "auto" for the stateless reference and scan forms."""
    return impl if impl in ("recurrent", "chunked", "pallas", "auto") else "auto"


def level_count_ok(cfg, T: int) -> None:
    """Log-linear mixers need ``T <= 2**(num_levels-1)``."""
    if T > 2 ** (cfg.num_levels - 1):
        raise ValueError(f"log-linear mixer: T={T} needs num_levels >= {int(np.ceil(np.log2(T))) + 1}, "
                         f"config has {cfg.num_levels}")
