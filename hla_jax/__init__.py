"""hla_jax: higher-order and log-linear attention in JAX."""

from hla_jax import ops

__version__ = "0.1.0"
__all__ = ["ops"]
