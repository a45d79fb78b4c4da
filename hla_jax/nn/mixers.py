"""Token mixers by name: ``softmax`` (``attention.SoftmaxAttention``) and one per operator of the
registry (``ops.registry.MIXERS``: ``spec.mixer`` -> spec), each a ``recurrent.RecurrentMixer``
composed from its operator's spec; their names are ``config.MIXERS``.

Every mixer is called as ``mixer(x [B,T,D], segment_ids=None)``; with ``segment_ids [B,T]``
(packed documents) each document is mixed exactly as if it were alone.
"""

from __future__ import annotations

from hla_jax.nn.attention import SoftmaxAttention
from hla_jax.nn.recurrent import RecurrentMixer
from hla_jax.ops import registry


def make_mixer(name: str, cfg, *, rngs, out_std):
    """The mixer ``name`` (one of ``config.MIXERS``) for ``cfg``; ``out_std`` is its output
    projection's initial scale."""
    if name == "softmax":
        return SoftmaxAttention(cfg, rngs=rngs, out_std=out_std)
    return RecurrentMixer(cfg, registry.MIXERS[name], rngs=rngs, out_std=out_std)
