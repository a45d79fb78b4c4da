"""Training FLOPs per token, for MFU: ``flops_per_token(cfg, T) = 3 × forward`` (backward ≈ 2×).

Only matmul FLOPs are counted (2 per multiply-add); norms, gates and elementwise work are
ignored.  Notation: ``D`` d_model, ``V`` vocab, ``F`` SwiGLU hidden, ``H`` heads, ``d`` head_dim
(= dv), ``c = min(chunk_size, T)``, ``L`` log-linear levels, ``K`` conv size.

Forward per token = ``2·D·V`` (head) + per layer ``2·3·D·F`` (SwiGLU) + ``2·D·P_mix``
(the mixer's projection widths ``P_mix``: q, k, v, o = 4·H·d for softmax, plus the output gate
``H·d``, decay ``H``, β ``H``, λ ``H·L`` for the recurrent mixers) + ``2·K·3·H·d`` (short conv)
+ ``H ×`` :func:`mixer_core_flops` (the operator itself).
"""

from __future__ import annotations

from hla_jax.nn.config import ModelConfig
from hla_jax.ops import registry


def mixer_core_flops(name: str, T: int, d: int, c: int) -> float:
    """Forward matmul FLOPs per token per head of mixer ``name``'s operator at context ``T``,
    chunk ``c``: causal softmax scores ``t+1`` keys and mixes ``t+1`` values,
    ``2·d·(T+1)/2 · 2 = 2·d·(T+1)``; every other mixer its operator's ``spec.flops`` (the
    count of its chunked form, in its family's module)."""
    if name == "softmax":
        return float(2 * d * (T + 1))
    if name not in registry.MIXERS:
        raise ValueError(f"mixer_core_flops: unknown mixer {name!r}")
    return float(registry.MIXERS[name].flops(T, d, c))


def mixer_projection_width(cfg: ModelConfig, name: str) -> int:
    """Output columns of the mixer's ``D ×`` projections (input and output side together)."""
    hd = cfg.n_heads * cfg.head_dim
    if name == "softmax":
        return 4 * hd
    width = 5 * hd  # q, k, v, output gate, W_o
    if cfg.output_gate == "none":
        width -= hd
    spec = registry.MIXERS[name]
    if spec.features != "qk" or cfg.hla_decay:
        width += cfg.n_heads  # dt / α projection
    if spec.beta:
        width += cfg.n_heads  # β
    if spec.lam:
        width += cfg.n_heads * cfg.num_levels  # λ
    return width


def uses_conv(name: str, cfg: ModelConfig) -> bool:
    """Whether mixer ``name`` has the short conv (``nn.recurrent``): the Mamba-2 and Gated
    DeltaNet feature maps always, the "qk" one (linear, HLA) with ``cfg.hla_conv``."""
    return name != "softmax" and (registry.MIXERS[name].features != "qk" or cfg.hla_conv)


def forward_flops_per_token(cfg: ModelConfig, T: int) -> float:
    """Forward matmul FLOPs per token at context ``T`` (formula in the module docstring)."""
    D, c = cfg.d_model, min(cfg.chunk_size, T)
    total = 2.0 * D * cfg.vocab_size
    for name in cfg.layer_mixers():
        total += 2 * 3 * D * cfg.mlp_dim + 2 * D * mixer_projection_width(cfg, name)
        if uses_conv(name, cfg) and cfg.conv_size > 0:
            total += 2 * cfg.conv_size * 3 * cfg.n_heads * cfg.head_dim
        total += cfg.n_heads * mixer_core_flops(name, T, cfg.head_dim, c)
    return total


def flops_per_token(cfg: ModelConfig, T: int) -> float:
    """Training (forward + backward) FLOPs per token at context ``T``: ``3 × forward``."""
    return 3.0 * forward_flops_per_token(cfg, T)
