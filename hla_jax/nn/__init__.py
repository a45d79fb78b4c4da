"""Flax NNX models: token mixers, decoder blocks, the LM, generation, FLOPs accounting.

    from hla_jax.nn import ModelConfig, LM, generate, param_count, flops_per_token, MIXERS, make_mixer
"""

from hla_jax.nn.config import MIXERS, ModelConfig
from hla_jax.nn.decoding import generate, generate_stream
from hla_jax.nn.flops import flops_per_token, forward_flops_per_token, mixer_core_flops
from hla_jax.nn.lm import LM, Block, param_count
from hla_jax.nn.mixers import make_mixer

__all__ = [
    "MIXERS", "make_mixer", "ModelConfig", "LM", "Block", "generate", "generate_stream",
    "param_count", "flops_per_token", "forward_flops_per_token", "mixer_core_flops",
]
