"""``--config=configs/niah.py[:ARGS]``: ``hla_jax/configs/niah.py``, installed with the package (so the
same flag works from any directory)."""

from hla_jax.configs.niah import ARGS, get_config

__all__ = ["ARGS", "get_config"]
