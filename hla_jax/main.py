"""Command-line entry: ``python -m hla_jax.main --config=configs/lm.py:size=tiny --workdir=DIR``.

``--config=FILE:ARGS`` calls ``FILE``'s ``get_config(ARGS)``; ``--config.a.b=v`` overrides any
field. Re-running with the same ``--workdir`` resumes from its newest checkpoint. A notebook calls
``hla_jax.train.train_and_evaluate(config, workdir)`` directly.
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hla_jax.train import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics go here.", required=True)


class _QuietOrbax(std_logging.Filter):
    """Drop orbax's per-save INFO chatter; its warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietOrbax())
    try:
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except FloatingPointError as e:
        logging.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
