"""The shipped configs, installed with the package: ``--config=configs/NAME.py[:ARGS]`` finds
``hla_jax/configs/NAME.py`` from any directory (``hla_jax.cli``). Each module has
``get_config(arg)`` and ``ARGS``, its arguments and their defaults."""

SHIPPED = ("lm", "mqar", "niah")
