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

import math

from hla_jax.nn.config import ModelConfig
from hla_jax.ops import registry


def mixer_core_flops(name: str, T: int, d: int, c: int, levels: int = 0) -> float:
    """Forward matmul FLOPs per token per head of each operator at context ``T``.

    Dense ``c×c`` products inside a chunk are counted in full (masking does not save them);
    cross-chunk work is the per-chunk state product divided by ``c``.

    - softmax (causal): token t scores ``t+1`` keys and mixes ``t+1`` values:
      ``2·d·(T+1)/2 · 2 = 2·d·(T+1)``.
    - linear / mamba2 (SSD chunk form): ``QKᵀ`` and ``(·)V`` inside the chunk ``4·c·d``;
      prefix read ``Q H₀`` and chunk state ``Kᵀ V``: ``4·d²``.
    - hla2 (docs/math.md#hla2, chunk form): ``QKᵀ, Q S₀ Qᵀ`` ``4cd``, ``W_g Wᵀ`` ``2c²``, two ``(·)V``
      ``4cd``; ``Q S₀, Q U₀`` ``4d²``; summaries ``KᵀK, QᵀV`` ``4d²``, own ``G`` ``4cd + 2d²``;
      combine ``S_B C_A`` ``2d³/c``.
    - ahla (docs/math.md#ahla): ``QKᵀ`` ``2cd``, ``W_g W_g`` ``2c²``, ``(·)V, A_L(QP₀), W_g V`` ``6cd``;
      ``Q E₀, Q P₀`` ``4d²``; summaries ``KᵀV, KᵀQ, Kᵀ(W_gV)`` ``6d²``; combine ``R_B P_A`` ``2d³/c``.
    - hla3 (docs/math.md#hla3, causal): ``QKᵀ, Q S₀ Qᵀ`` ``4cd``, ``A W_gᵀ, W_g A_Lᵀ`` ``4c²``, ``W_g V`` and
      four ``(c×c)(c×d)`` products ``10cd``; ``Q S₀, Q P₀, Q F₀`` ``6d²``; summaries
      ``S, P, Q2, X, Y, F`` ``12d²``; combine (five ``d×d·d×d`` products) ``10d³/c``.
    - gated_deltanet (UT/WY chunk form, docs/math.md#loglinear): ``KKᵀ, QKᵀ`` ``4cd``, triangular solve
      ``c²/3``, ``W = T K``, ``U = T V``, ``(QKᵀ∘Γ) T``, ``M V`` ``4cd + 2c²``; prefix
      ``Q H, W H, (QKᵀ∘Γ)(WH)`` ``4d² + 2cd``; state ``K̃ᵀ(WH), K̃ᵀU`` ``4d²``.
    - loglinear_mamba2: mamba2 + per active chunk level (``n = ⌈log2⌈T/c⌉⌉``) a read ``Q H_ℓ``: ``2d²·n``.
    - loglinear_gated_deltanet: gated_deltanet + per active level ``Q H_ℓ, W H_ℓ, K̃ᵀ(W H_ℓ)``
      ``6d²`` and ``(QKᵀ∘Γ)(W H_ℓ)`` ``2cd``.
    """
    n = math.ceil(math.log2(max(1, math.ceil(T / c)))) if levels else 0
    core = {
        "softmax": lambda: 2 * d * (T + 1),
        "linear": lambda: 4 * c * d + 4 * d * d,
        "hla2": lambda: 12 * c * d + 2 * c * c + 10 * d * d + 2 * d ** 3 / c,
        "ahla": lambda: 8 * c * d + 2 * c * c + 10 * d * d + 2 * d ** 3 / c,
        "hla3": lambda: 14 * c * d + 4 * c * c + 18 * d * d + 10 * d ** 3 / c,
        "gated_deltanet": lambda: 10 * c * d + 2 * c * c + c * c / 3 + 8 * d * d,
    }
    base = {"mamba2": "linear", "loglinear_mamba2": "linear",
            "loglinear_gated_deltanet": "gated_deltanet"}.get(name, name)
    if base not in core:
        raise ValueError(f"mixer_core_flops: unknown mixer {name!r}")
    extra = {"loglinear_mamba2": 2 * d * d * n,
             "loglinear_gated_deltanet": (6 * d * d + 2 * c * d) * n}.get(name, 0)
    return float(core[base]() + extra)


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
        total += cfg.n_heads * mixer_core_flops(name, T, cfg.head_dim, c, cfg.num_levels)
    return total


def flops_per_token(cfg: ModelConfig, T: int) -> float:
    """Training (forward + backward) FLOPs per token at context ``T``: ``3 × forward``."""
    return 3.0 * forward_flops_per_token(cfg, T)
