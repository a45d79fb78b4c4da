"""Train: ``.venv/bin/python -m hla_jax.main --config=configs/lm.py:size=tiny --workdir=DIR``.

``--config=FILE:ARGS`` calls ``FILE``'s ``get_config(ARGS)`` (``configs/NAME.py`` is found in
the installed package from any directory); ``--config.a.b=v`` overrides any field. Re-running
with the same ``--workdir`` resumes from its newest checkpoint. A notebook calls
``hla_jax.train.train_and_evaluate(config, workdir)`` directly.

A bad command line (a flag, the config file, a ``--config.*`` override: errors while parsing
them), a bad setting (ValueError), a non-finite loss (FloatingPointError) or a checkpoint that
cannot be written or read (CheckpointError) prints one line to stderr, no traceback (it is
logged at ``--verbosity=1``), and exits with status 1.
"""

import logging as std_logging

from absl import flags, logging
from ml_collections import config_flags

from hla_jax import cli
from hla_jax.core.errors import first_line
from hla_jax.train import CheckpointError, train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics go here.", required=True)


class _QuietOrbax(std_logging.Filter):
    """Drop orbax's per-save INFO chatter; its warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    logging.get_absl_handler().addFilter(_QuietOrbax())
    try:
        config = _CONFIG.value
        config.keys()  # a config file that failed to load raises on first use
    except OSError as e:
        cli.fail(f"--config: {str(cli.root_cause(e)).strip().splitlines()[-1].strip()}")
    try:
        train_and_evaluate(config, _WORKDIR.value)
    except (ValueError, FloatingPointError, CheckpointError) as e:
        cli.fail(str(e))
    except KeyboardInterrupt:
        cli.fail("interrupted", status=130)
    except Exception as e:  # e.g. OSError: the disk filled up while writing metrics
        cli.fail(f"{first_line(e)} (the traceback: --verbosity=1)")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    cli.run(main)
