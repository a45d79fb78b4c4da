"""What the command lines (``hla_jax.main``, ``hla_jax.sample``, ``hla_jax.evaluate``) share.

- Every error is one line on stderr and exit status 1: a bad flag, a bad ``--config.*`` field
  (with the closest field names, by ``difflib``), a bad setting. The traceback is logged at
  ``--verbosity=1``.
- ``--config=configs/NAME.py[:ARGS]`` that names no file under the current directory is the
  shipped config ``hla_jax/configs/NAME.py``, installed with the package.
- JAX's start-up notice about optional backends it could not load is hidden (``run``).
"""

import difflib
import importlib
import logging as std_logging
import pathlib
import sys

from absl import app, flags, logging

from hla_jax.configs import SHIPPED
from hla_jax.core.errors import message, root_cause
from hla_jax.train.config import base_config

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
FIELDS = "hla_jax/train/config.py"


def fail(message: str, status: int = 1):
    """Print ``message`` as one line on stderr and exit with ``status`` (the traceback of the
    exception being handled, if any, is logged at ``--verbosity=1``)."""
    logging.debug("traceback (shown with --verbosity=1):", exc_info=True)
    print(message, file=sys.stderr)
    sys.exit(status)


def config_help() -> str:
    """``--config``'s help: each shipped config with its arguments' defaults."""
    lines = ["Config file[:ARGS], ARGS as key=value,... The shipped configs (found from any "
             "directory), with their defaults:"]
    for name in SHIPPED:
        module = importlib.import_module(f"hla_jax.configs.{name}")
        lines.append(f"configs/{name}.py:" + ",".join(f"{k}={v}" for k, v in module.ARGS.items()))
    sizes = " | ".join(importlib.import_module("hla_jax.configs.lm").SIZES)
    lines.append(f"mixer: a name of hla_jax.nn.MIXERS; pattern=a+b+c: a hybrid stack; lm's size: "
                 f"{sizes}. Then --config.FIELD=V sets any field ({FIELDS}).")
    return "\n".join(lines)


def shipped_config(arg: str) -> str:
    """``--config=configs/NAME.py[:ARGS]`` with the path resolved to the shipped config when it
    names no file here (any other value unchanged)."""
    path, sep, args = arg.partition(":")
    shipped = CONFIGS / pathlib.Path(path).name
    if pathlib.Path(path).parent == pathlib.Path("configs") and not pathlib.Path(path).exists() \
            and shipped.exists():
        return f"{shipped}{sep}{args}"
    return arg


def field_paths(config, prefix: str = "") -> list[str]:
    """Every dotted field name of ``config`` (the leaves of its nested groups)."""
    out = []
    for key, value in config.items():
        out += field_paths(value, f"{prefix}{key}.") if hasattr(value, "items") else [prefix + key]
    return out


def unknown_field(argv: list[str], key: str) -> str:
    """The message for a ``--config.A.B=V`` override whose field ``key`` does not exist."""
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")]
    named = [o for o in overrides if key in o.split(".")] or overrides
    known = field_paths(base_config())
    close = difflib.get_close_matches(named[0], known, n=3, cutoff=0.7) if named else []
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"no config field {key!r} (--config.{named[0] if named else key}); {hint}fields: {FIELDS}"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with every error one line: the flag and the innermost cause (e.g.
    the ValueError of the config file's ``get_config``), or the unknown ``--config.*`` field
    with the closest names."""
    given, args = {}, []  # given: the resolved --config value -> the one on the command line
    for arg in argv:
        if arg.startswith("--config="):
            value = arg[len("--config="):]
            given[shipped_config(value)] = value
            arg = f"--config={shipped_config(value)}"
        args.append(arg)
    try:
        return flags.FLAGS(args)
    except Exception as e:  # flags.Error; a KeyError: an override naming no config field
        root = root_cause(e)
        if isinstance(root, KeyError) and not isinstance(e, flags.Error):
            fail(unknown_field(argv, str(root.args[0]) if root.args else ""))
        if isinstance(e, flags.Error):
            flag = str(e).split(": ", 1)[0]
            text = (f"{flag}: {message(root)}" if root is not e and flag.startswith("flag ")
                    else message(e))
        else:
            text = f"{type(root).__name__}: {message(root)}"
        for resolved, path in given.items():
            text = text.replace(resolved, path)
        fail(text)


class OptionalBackendNotice(std_logging.Filter):
    """Drops JAX's "Unable to initialize backend 'tpu': ... libtpu.so ..." line.

    At start-up JAX tries every backend it knows and logs, at INFO, each optional one that is
    not installed (the TPU one on any machine without libtpu); absl shows INFO, so every
    command would open with it. Only that record goes: a backend the user asked for
    (``JAX_PLATFORMS``) still fails loudly, since JAX raises instead of logging then, and
    ``jax_platforms`` is left alone (setting it would pick the platforms for the user)."""

    def filter(self, record):
        return not (record.levelno == std_logging.INFO
                    and record.getMessage().startswith("Unable to initialize backend"))


def run(main):
    """``app.run(main)`` with ``parse_flags`` and JAX's optional-backend notice hidden; an
    ``app.UsageError`` is one line too."""
    std_logging.getLogger("jax._src.xla_bridge").addFilter(OptionalBackendNotice())

    def checked(argv):
        if len(argv) > 1:
            fail(f"unexpected arguments: {argv[1:]} (flags only; --help lists them)")
        return main(argv)

    app.run(checked, flags_parser=parse_flags)
