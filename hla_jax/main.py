"""Command-line entry: ``python -m hla_jax.main --config=configs/lm.py:size=tiny --workdir=DIR``.

``--config=FILE:ARGS`` calls ``FILE``'s ``get_config(ARGS)``; ``--config.a.b=v`` overrides any
field. Re-running with the same ``--workdir`` resumes from its newest checkpoint. A notebook calls
``hla_jax.train.train_and_evaluate(config, workdir)`` directly.

A bad command line (a flag, the config file, a ``--config.*`` override: errors while parsing
them), a bad setting or damaged data (ValueError), a non-finite loss (FloatingPointError) or a
checkpoint that cannot be written or read (CheckpointError) prints one line to stderr, no
traceback (it is logged at ``--verbosity=1``), and exits with status 1; any other error prints
its type and first line the same way, and Ctrl-C exits with status 130.
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hla_jax.core.errors import root_cause
from hla_jax.train import CheckpointError, train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics go here.", required=True)


class _QuietOrbax(std_logging.Filter):
    """Drop orbax's per-save INFO chatter; its warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def _fail(message: str, status: int = 1):
    logging.debug("traceback (shown with --verbosity=1):", exc_info=True)
    print(message, file=sys.stderr)
    sys.exit(status)


def _parse(argv):
    """absl's flag parsing with each error as one line: the flag and the innermost cause (e.g.
    the ValueError of the config file's ``get_config``), or the unknown ``--config.*`` field."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # flags.Error; a KeyError: an override naming no config field
        root = root_cause(e)
        text = (str(root).strip().splitlines() or [type(root).__name__])[0]
        if isinstance(e, flags.Error):
            flag = str(e).split(": ", 1)[0]
            _fail(f"{flag}: {text}" if root is not e and flag.startswith("flag ") else text)
        if isinstance(root, (KeyError, AttributeError)):
            overrides = " ".join(a for a in argv if a.startswith("--config."))
            _fail(f"no config field {text} (in {overrides}); fields: hla_jax/train/config.py")
        _fail(f"{type(root).__name__}: {text}")


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments: {argv[1:]} (flags are --config=FILE[:ARGS], --config.a.b=V, "
              f"--workdir=DIR)")
    logging.get_absl_handler().addFilter(_QuietOrbax())
    try:
        config = _CONFIG.value
        config.keys()  # a config file that failed to load raises on first use
    except OSError as e:
        _fail(f"--config: {str(root_cause(e)).strip().splitlines()[-1].strip()}")
    try:
        train_and_evaluate(config, _WORKDIR.value)
    except (ValueError, FloatingPointError, CheckpointError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted", status=130)
    except Exception as e:  # e.g. OSError: the disk filled up while writing metrics
        _fail(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]} (the traceback: "
              f"--verbosity=1)")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=_parse)
