"""``--config=configs/mqar.py[:ARGS]``: ``hla_jax/configs/mqar.py``, installed with the package (so the
same flag works from any directory)."""

from hla_jax.configs.mqar import ARGS, get_config

__all__ = ["ARGS", "get_config"]
