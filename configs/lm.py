"""``--config=configs/lm.py[:ARGS]``: ``hla_jax/configs/lm.py``, installed with the package (so the
same flag works from any directory)."""

from hla_jax.configs.lm import ARGS, get_config

__all__ = ["ARGS", "get_config"]
