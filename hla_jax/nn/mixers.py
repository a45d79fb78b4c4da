"""Token mixers, one class per operator family, and the name -> class registry ``MIXER_CLASSES``.

Feature maps and gates (published architectures):

- ``linear``, ``hla2``, ``ahla``, ``hla3``: q/k L2-normalised, q scaled by ``d**-0.5``
  (``cfg.qk_norm``, default on: keeps second/third-order sums bounded); a learned Mamba-style
  decay (``cfg.hla_decay``) and a short conv on q, k, v (``cfg.hla_conv``), both on by default.
- ``mamba2`` / ``loglinear_mamba2``: short conv + SiLU on (x, B, C); ``q = C``, ``k = B``,
  ``dt = softplus(x W_dt + dt_bias)``, ``g = −exp(A_log)·dt``, ``v = dt·x``, plus ``D ∘ x`` skip.
- ``gated_deltanet`` / ``loglinear_gated_deltanet``: short conv + SiLU on q, k, v; q, k
  L2-normalised (always: the delta rule needs unit keys), ``g`` as above (α = exp g),
  ``β = sigmoid(x W_β)``.
- ``loglinear_*``: ``λ = softplus(s · x W_λ)`` with ``cfg.num_levels`` levels.

All of them end with per-head RMSNorm, an output gate and ``W_o`` (``layers.OutputGate``: norm
then gate, Gated DeltaNet's order; Mamba-2 gates before its norm, a difference we accept to share
one output block).  Decoding: ``init_state``/``step`` of ``ops.hla2_family``, ``ahla_family``,
``hla3_family``, ``linear_family`` and, for the four SSM mixers, ``loglinear_family`` (whose step
with ``beta=None, lam=None`` is the Mamba-2 recurrence).

Every mixer is called as ``mixer(x [B,T,D], segment_ids=None)``; with ``segment_ids [B,T]``
(packed documents) each document is mixed exactly as if it were alone (``attention``,
``recurrent``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hla_jax import ops
from hla_jax.nn.attention import SoftmaxAttention
from hla_jax.nn.layers import Dense, param
from hla_jax.nn.recurrent import (
    DecayGate,
    LevelWeights,
    RecurrentMixer,
    apply_op,
    level_count_ok,
    normalize_qk,
)


class FeatureMapMixer(RecurrentMixer):
    """Linear / HLA mixers: normalised q, k, optional learned decay, ``entry(q, k, v, g)``.

    Subclasses name the op ``entry`` and its ``family`` module (``init_state``/``step``);
    ``hla`` marks the HLA ops, whose entry, ``init_state`` and ``step`` take ``normalize`` (the
    normalised state carries an extra denominator column).
    """

    hla = True

    @property
    def uses_conv(self):
        return self.cfg.hla_conv

    def __init__(self, cfg, *, rngs, out_std):
        super().__init__(cfg, rngs=rngs, out_std=out_std)
        self.decay = DecayGate(cfg, rngs=rngs) if cfg.hla_decay else None

    def features(self, x, q, k, v):
        if self.cfg.qk_norm:
            q, k = normalize_qk(q, k)
        g = None if self.decay is None else self.decay(x)[0]
        return {"q": q, "k": k, "v": v, "g": g}

    def _normalize(self) -> dict:
        return {"normalize": self.cfg.hla_normalize} if self.hla else {}

    def op(self, f, seq_axis="", segment_ids=None, **kw):
        return apply_op(self.entry, f, self.cfg, seq_axis, segment_ids, **self._normalize(), **kw)

    def op_init(self, batch):
        H, d = self.cfg.n_heads, self.cfg.head_dim
        return self.family.init_state(batch, H, d, d, **self._normalize())

    def op_step(self, state, f):
        return self.family.step(state, f["q"], f["k"], f["v"], f["g"], **self._normalize())


class LinearAttention(FeatureMapMixer):
    """``o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s`` (``ops.linear_attention``)."""

    hla = False
    family = ops.linear_family
    entry = staticmethod(ops.linear_attention)


class HLA2(FeatureMapMixer):
    """Second-order HLA ``o_t = Σ_{i≤j≤t} D(t,i)D(t,j)(q_t·k_i)(q_j·k_i) v_j`` (``ops.hla2``)."""

    family = ops.hla2_family
    entry = staticmethod(ops.hla2)


class AHLA(FeatureMapMixer):
    """Asymmetric HLA ``o_t = Σ_{j≤i≤t} D(t,j)(q_t·k_i)(q_i·k_j) v_j`` (``ops.ahla``)."""

    family = ops.ahla_family
    entry = staticmethod(ops.ahla)


class HLA3(FeatureMapMixer):
    """Third-order HLA, causal mask ``o = (((W_g Wᵀ) ∘ Γ) W_g) V`` (``ops.hla3``)."""

    family = ops.hla3_family
    entry = staticmethod(ops.hla3)


class SSMMixer(RecurrentMixer):
    """Mamba-2 / Gated DeltaNet and their log-linear versions (``ops.loglinear`` family).

    Class flags: ``delta`` (Gated DeltaNet: L2-normalised q/k, β gate), ``levels`` (λ weights).
    Without ``delta`` it is Mamba-2: ``v = dt·x`` and the readout adds ``D ∘ x``.
    """

    uses_conv = True
    delta = False
    levels = False

    def __init__(self, cfg, *, rngs, out_std):
        super().__init__(cfg, rngs=rngs, out_std=out_std)
        H = cfg.n_heads
        self.decay = DecayGate(cfg, rngs=rngs)
        self.beta = Dense((cfg.d_model,), (H,), ("embed", "heads"), rngs=rngs,
                          std=cfg.init_std) if self.delta else None
        self.lam = LevelWeights(cfg, rngs=rngs) if self.levels else None
        self.skip = None if self.delta else param(rngs, nnx.initializers.ones, (H,), ("heads",))

    def features(self, x, q, k, v):
        g, dt = self.decay(x)
        f = {"g": g}
        if self.delta:
            q, k = normalize_qk(q, k)
            f["beta"] = jax.nn.sigmoid(self.beta(x).astype(jnp.float32))
        else:
            v = (dt[..., None] * v.astype(jnp.float32)).astype(v.dtype)
        if self.lam is not None:
            f["lam"] = self.lam(x)
        return {"q": q, "k": k, "v": v, **f}

    def readout(self, o, v):
        return o if self.skip is None else o + self.skip[...][:, None] * v.astype(o.dtype)

    def op(self, f, seq_axis="", segment_ids=None, **kw):
        if self.lam is not None:
            level_count_ok(self.cfg, f["q"].shape[1])
        return apply_op(self.entry, f, self.cfg, seq_axis, segment_ids, **kw)

    def init_cache(self, batch, max_len, dtype):
        if self.lam is not None:
            level_count_ok(self.cfg, max_len)
        return super().init_cache(batch, max_len, dtype)

    def op_init(self, batch):
        cfg = self.cfg
        return ops.loglinear_family.init_state(batch, cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                               cfg.num_levels if self.levels else None)

    def op_step(self, state, f):
        return ops.loglinear_family.step(state, f["q"], f["k"], f["v"], f["g"], f.get("beta"),
                                         f.get("lam"))


class Mamba2(SSMMixer):
    """Mamba-2 (SSD): ``o_t = Σ_{s≤t} D(t,s)(C_t·B_s) dt_s x_s + D x_t``."""

    entry = staticmethod(ops.mamba2)


class GatedDeltaNet(SSMMixer):
    """Gated DeltaNet: ``H_t = a_t (I − β_t k_t k_tᵀ) H_{t−1} + β_t k_t v_tᵀ``, ``o_t = H_tᵀ q_t``."""

    delta = True
    entry = staticmethod(ops.gated_deltanet)


class LogLinearMamba2(SSMMixer):
    """Log-linear Mamba-2: Mamba-2 with per-level weights ``λ_t^{ℓ(t,s)}`` (Fenwick levels)."""

    levels = True
    entry = staticmethod(ops.loglinear_mamba2)


class LogLinearGatedDeltaNet(SSMMixer):
    """Log-linear Gated DeltaNet: Gated DeltaNet with per-level weights ``λ_t^{ℓ(t,s)}``."""

    delta = True
    levels = True
    entry = staticmethod(ops.loglinear_gated_deltanet)


MIXER_CLASSES = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "hla2": HLA2,
    "ahla": AHLA,
    "hla3": HLA3,
    "mamba2": Mamba2,
    "gated_deltanet": GatedDeltaNet,
    "loglinear_mamba2": LogLinearMamba2,
    "loglinear_gated_deltanet": LogLinearGatedDeltaNet,
}
