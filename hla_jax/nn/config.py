"""Model configuration: one frozen dataclass, validated once, on construction.

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, mixer_pattern=("hla2", "hla2", "softmax"))
    cfg = ModelConfig.from_dict({"d_model": 64, "mixer_pattern": ["hla2"]})

Layer ``i`` uses the mixer ``mixer_pattern[i % len(mixer_pattern)]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from hla_jax.ops import registry
from hla_jax.ops.sequence import SEQ_IMPLS

MIXERS = ("softmax", *registry.MIXERS)  # softmax attention and the registry's operators
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
IMPLS = (*registry.IMPLS, "auto")
OUTPUT_GATES = ("silu", "sigmoid", "none")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LM hyper-parameters.

    ``head_dim=0`` means ``d_model // n_heads``.  Every mixer maps ``d_model -> n_heads ×
    head_dim`` and back, so ``n_heads * head_dim`` must equal ``d_model``.
    ``qk_norm`` (L2-normalised q/k, q scaled by ``head_dim**-0.5``) applies to the mixers of the
    "qk" feature map (linear and HLA, ``nn.recurrent``); the Gated DeltaNet mixers always
    L2-normalise (the delta rule needs unit keys), Mamba-2 and softmax follow their published
    forms (no q/k normalisation).
    ``hla_decay`` adds a learned Mamba-style decay gate to the "qk" mixers;
    ``hla_normalize`` uses the ratio-normalised HLA readout; ``hla_conv`` gives them the short
    causal convolution on q, k, v (width ``conv_size``) that the Mamba-2 / Gated DeltaNet
    mixers always have.  ``hla_conv`` and ``hla_decay`` are on by default: without them the HLA
    mixers learn neither language nor MQAR well (see the results page); set them False for the
    bare operators.
    ``seq_axis``: the mesh axis the time axis is sharded over ("" = none; the trainer sets
    "sequence" when ``mesh.sequence > 1``): the recurrent mixers then run their op through
    ``ops.sequence.over_time`` (``impl`` chunked/auto).  Decoding ignores it (unsharded).
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 0
    mixer_pattern: tuple = ("hla2",)
    mlp_hidden: int = 0
    tie_embeddings: bool = True
    dtype: str = "float32"
    chunk_size: int = 64
    max_seq_len: int = 2048
    qk_norm: bool = True
    conv_size: int = 4
    num_levels: int = 16
    impl: str = "auto"
    init_std: float = 0.02
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    output_gate: str = "silu"
    hla_decay: bool = True
    hla_normalize: bool = False
    hla_conv: bool = True
    seq_axis: str = ""

    def __post_init__(self):
        object.__setattr__(self, "mixer_pattern", tuple(self.mixer_pattern))
        if self.head_dim == 0 and self.n_heads > 0 and self.d_model % self.n_heads == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        self.validate()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a dict or ``ml_collections.ConfigDict``; unknown keys raise ValueError."""
        d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def mlp_dim(self) -> int:
        """SwiGLU hidden size: ``mlp_hidden``, or ``8/3 · d_model`` rounded up to a multiple of 64."""
        if self.mlp_hidden:
            return self.mlp_hidden
        hidden = -(-8 * self.d_model // 3)
        return -(-hidden // 64) * 64

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    def layer_mixers(self) -> tuple:
        """The mixer name of every layer."""
        return tuple(self.mixer_pattern[i % len(self.mixer_pattern)] for i in range(self.n_layers))

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "chunk_size", "max_seq_len",
                     "num_levels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not self.mixer_pattern:
            raise ValueError("ModelConfig.mixer_pattern must name at least one mixer")
        bad = [m for m in self.mixer_pattern if m not in MIXERS]
        if bad:
            raise ValueError(f"ModelConfig.mixer_pattern: unknown mixer(s) {bad}; valid: {MIXERS}")
        if self.n_heads * self.head_dim != self.d_model:
            raise ValueError(
                f"ModelConfig: n_heads * head_dim must equal d_model, got {self.n_heads} * "
                f"{self.head_dim} != {self.d_model} (head_dim=0 derives d_model // n_heads)")
        if "softmax" in self.mixer_pattern and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE (softmax), got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"ModelConfig.impl must be one of {IMPLS}, got {self.impl!r}")
        if self.seq_axis and self.impl not in SEQ_IMPLS:
            raise ValueError(f"ModelConfig.impl must be one of {SEQ_IMPLS} with seq_axis="
                             f"{self.seq_axis!r} (sequence parallelism), got {self.impl!r}")
        if self.output_gate not in OUTPUT_GATES:
            raise ValueError(
                f"ModelConfig.output_gate must be one of {OUTPUT_GATES}, got {self.output_gate!r}")
        levels = [m for m in self.mixer_pattern if m != "softmax" and registry.MIXERS[m].lam]
        if levels and self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"ModelConfig.chunk_size must be a power of two with the log-linear "
                             f"mixers {levels}, got {self.chunk_size}")
        if self.conv_size < 0 or self.mlp_hidden < 0:
            raise ValueError("ModelConfig.conv_size and mlp_hidden must be >= 0")
        return self
