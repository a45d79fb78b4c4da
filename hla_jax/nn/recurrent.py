"""The token mixer of every recurrent operator (linear, HLA, SSM), composed from the operator's
``ops.spec.Spec``, and its gates.

    q, k, v = x W_q, x W_k, x W_v                       [B,T,H,d]   (x: [B,T,D], RMS-normalised)
    q, k, v = SiLU(causal_depthwise_conv(q, k, v))       when the mixer has a short conv
    inputs  = features(x, q, k, v)                       q/k normalisation, gates g, β, λ, v = dt·x
    o       = the operator's form, impl=cfg.impl         (ops.sequence.over_time if cfg.seq_axis)
    y       = W_o (RMSNorm_h(o) ∘ act(x W_z))            OutputGate

What the spec says decides the parts (published architectures):

- feature map ``spec.features``: "qk" (linear and HLA): q, k L2-normalised and q scaled by
  ``d**-0.5`` when ``cfg.qk_norm``, the decay gate when ``cfg.hla_decay``, the conv when
  ``cfg.hla_conv``; "mamba2": conv + SiLU on (x, B, C), ``q = C``, ``k = B``,
  ``v = dt·x``, ``g = −exp(A_log)·dt``, plus ``D ∘ x`` skip; "delta" (Gated DeltaNet): conv,
  decay, q, k always L2-normalised (the delta rule needs unit keys);
- ``spec.beta``: ``β = sigmoid(x W_β)``; ``spec.lam``: ``λ = softplus(s · x W_λ)`` with
  ``cfg.num_levels`` levels; ``spec.normalize``: the ratio-normalised readout when
  ``cfg.hla_normalize``.

The output block is shared (``layers.OutputGate``: norm then gate, Gated DeltaNet's order;
Mamba-2 gates before its norm, a difference we accept to share one output block).

Packed documents: ``segment_ids: [B,T]`` go to the conv (no tap across a document start) and to
the op (docs/math.md#packed-documents: each document as if alone); everything else acts per token.

Decoding keeps ``{"conv": last K-1 conv inputs, "state": the operator's decode state}``
(``spec.init_state`` / ``spec.step``).
Prefill is one parallel pass: the op's chunked form (or kernel) returns its outputs and its final
state together (``return_final_state``, the layout of ``spec.init_state``), so
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
from hla_jax.ops import dispatch, sequence
from hla_jax.ops.spec import Call, Spec


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
    """A recurrent operator's token mixer (module docstring): projections, the short conv, the
    feature map and gates that ``spec`` asks for, the operator, the output norm and gate.

    Called as ``mixer(x [B,T,D], segment_ids=None)`` (``segment_ids [B,T]``, checked by the
    model, for packed documents: each document mixed exactly as if alone); decoding through
    ``init_cache``, ``prefill`` and ``step``.  The forward pass shards the operator over
    ``cfg.seq_axis``; prefill runs it unsharded.
    """

    def __init__(self, cfg, spec: Spec, *, rngs, out_std):
        H, d = cfg.n_heads, cfg.head_dim
        gated = spec.features != "qk"  # Mamba-2 and Gated DeltaNet: conv and decay always
        self.cfg, self.spec = cfg, spec
        self.q, self.k, self.v = (head_projection(cfg, rngs=rngs) for _ in range(3))
        self.conv = (ShortConv(cfg.conv_size, H, 3 * d, rngs=rngs)
                     if (gated or cfg.hla_conv) and cfg.conv_size > 0 else None)
        self.output = OutputGate(cfg, rngs=rngs, out_std=out_std)
        self.decay = DecayGate(cfg, rngs=rngs) if gated or cfg.hla_decay else None
        self.beta = (Dense((cfg.d_model,), (H,), ("embed", "heads"), rngs=rngs, std=cfg.init_std)
                     if spec.beta else None)
        self.lam = LevelWeights(cfg, rngs=rngs) if spec.lam else None
        self.skip = (param(rngs, nnx.initializers.ones, (H,), ("heads",))
                     if spec.features == "mamba2" else None)

    @property
    def normalize(self) -> bool:
        return self.spec.normalize and self.cfg.hla_normalize

    def features(self, x, q, k, v) -> dict:
        """The operator's inputs ``q, k, v, g, beta, lam`` (``[B,T,H,...]``, or ``[B,H,...]``
        when decoding; None where it has none)."""
        g = dt = None
        if self.decay is not None:
            g, dt = self.decay(x)
        if self.spec.features == "delta" or (self.spec.features == "qk" and self.cfg.qk_norm):
            q, k = normalize_qk(q, k)
        if self.spec.features == "mamba2":
            v = (dt[..., None] * v.astype(jnp.float32)).astype(v.dtype)
        beta = None if self.beta is None else jax.nn.sigmoid(self.beta(x).astype(jnp.float32))
        lam = None if self.lam is None else self.lam(x)
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "lam": lam}

    def readout(self, o, v):
        """The operator's output plus Mamba-2's skip ``D ∘ v`` (``v`` after the conv)."""
        return o if self.skip is None else o + self.skip[...][:, None] * v.astype(o.dtype)

    def op(self, f: dict, impl: str, seq_axis: str = "", segment_ids=None,
           return_final_state: bool = False):
        """The operator's form ``impl`` on ``f`` (``dispatch.apply`` on a ``Call`` built here:
        the model checked its inputs once, ``ModelConfig.validate`` the settings); with
        ``seq_axis`` through ``ops.sequence.over_time``.  Returns ``(o, final_state or None)``."""
        cfg = self.cfg
        if self.lam is not None:
            level_count_ok(cfg, f["q"].shape[1])

        def call(q, k, v, g=None, beta=None, lam=None, segment_ids=None, seq_axis=None):
            return dispatch.apply(impl, Call(self.spec, q, k, v, g, beta, lam, segment_ids,
                                             None, return_final_state, cfg.chunk_size, seq_axis,
                                             self.normalize))

        arrays = f | {"segment_ids": segment_ids}
        if seq_axis:
            return sequence.over_time(lambda **a: call(**a)[0], seq_axis)(**arrays), None
        return call(**arrays)

    def _project(self, x):
        """``x [..., D] -> [..., H, 3d]`` (q, k, v concatenated, before the conv)."""
        return jnp.concatenate([self.q(x), self.k(x), self.v(x)], axis=-1)

    def __call__(self, x, segment_ids=None):
        """``x: [B,T,D] -> [B,T,D]``; ``segment_ids: [B,T]`` int for packed documents."""
        qkv = self._project(x)
        q, k, v = jnp.split(qkv if self.conv is None else self.conv(qkv, segment_ids), 3, -1)
        o, _ = self.op(self.features(x, q, k, v), self.cfg.impl, self.cfg.seq_axis, segment_ids)
        return self.output(self.readout(o, v), x)

    def init_cache(self, batch, max_len, dtype):
        """``{"conv": the last K-1 conv inputs, "state": spec.init_state}`` (O(1), or O(log T)
        levels, whatever the length)."""
        cfg = self.cfg
        if self.lam is not None:
            level_count_ok(cfg, max_len)
        conv = (None if self.conv is None else
                self.conv.init_state(batch, cfg.n_heads, 3 * cfg.head_dim, dtype))
        state = self.spec.init_state(batch, cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                     normalize=self.normalize,
                                     levels=cfg.num_levels if self.lam is not None else None)
        return {"conv": conv, "state": state}

    def prefill(self, x, cache, segment_ids=None):
        """Outputs over the prompt ``x: [B,T,D]`` (from position 0, empty ``cache``) and the
        decode state after it, both from one call of the op with ``return_final_state``;
        ``segment_ids: [B,T]``: the state (and conv window) of each row's last document."""
        qkv = self._project(x)
        conv = None
        if self.conv is not None:
            conv = self.conv.prefill_state(qkv, segment_ids).astype(cache["conv"].dtype)
            qkv = self.conv(qkv, segment_ids)
        q, k, v = jnp.split(qkv, 3, -1)
        impl = self.cfg.impl if self.cfg.impl in self.spec.state_impls else "auto"
        o, state = self.op(self.features(x, q, k, v), impl, "", segment_ids,
                           return_final_state=True)
        return self.output(self.readout(o, v), x), {"conv": conv, "state": state}

    def step(self, x_t, cache, pos):
        """One token ``x_t: [B,D]`` -> ``(y_t [B,D], cache)``; ``pos`` (the cache slot, which the
        softmax mixer reads) is not needed: the state holds everything, positions included."""
        del pos
        qkv = self._project(x_t)
        conv = cache["conv"]
        if self.conv is not None:
            qkv, conv = self.conv.step(conv, qkv)
        q, k, v = jnp.split(qkv, 3, -1)
        f = self.features(x_t, q, k, v)
        o, state = self.spec.step(cache["state"], f["q"], f["k"], f["v"], f["g"], f["beta"],
                                  f["lam"], normalize=self.normalize)
        return self.output(self.readout(o, v), x_t), {"conv": conv, "state": state}


def level_count_ok(cfg, T: int) -> None:
    """Log-linear mixers need ``T <= 2**(num_levels-1)``."""
    if T > 2 ** (cfg.num_levels - 1):
        raise ValueError(f"log-linear mixer: T={T} needs num_levels >= {int(np.ceil(np.log2(T))) + 1}, "
                         f"config has {cfg.num_levels}")
