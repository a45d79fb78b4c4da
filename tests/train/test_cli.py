"""The command lines as a user meets them: ``--help`` ends with the flags (``main``'s with the
shipped configs' arguments), every error is one line with exit status 1 and the same form in
every command, a misspelled config field names the closest ones, JAX's notice about a missing
TPU backend is not printed, and the shipped configs install with the package and are found by
``--config=configs/NAME.py`` from any directory."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSL_LOG = re.compile(r"[IWEF]\d{4} ")


def run(module: str, *args: str, cwd, pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=pythonpath, JAX_PLATFORMS="")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module, last_flags", [
    ("hla_jax.main", ["configs/niah.py:mixer=hla2", "--config.FIELD=V", "--workdir"]),
    ("hla_jax.sample", ["--top_p", "--workdir"]),
    ("hla_jax.evaluate", ["--tasks", "--text_files", "--workdir"]),
])
def test_help_ends_with_the_flags(module, last_flags, tmp_path):
    proc = run(module, "--help", cwd=tmp_path)  # absl exits with status 1 after --help
    flags = proc.stdout[proc.stdout.rindex("\nflags:\n"):]
    assert all(f in flags for f in last_flags), proc.stdout


@pytest.mark.parametrize("module, args, message", [
    ("hla_jax.main", ["--config=configs/lm.py", "--config.model.mixer=hla2"],
     "no config field 'mixer' (--config.model.mixer); did you mean model.mixer_pattern?"),
    ("hla_jax.main", ["--config=configs/lm.py:mixr=hla2"], "(did you mean mixer?)"),
    ("hla_jax.main", ["--config=configs/lm.py", "stray"], "unexpected arguments: ['stray']"),
    ("hla_jax.sample", ["--prompt=x"], "workdir: "),
    ("hla_jax.sample", ["--prompt=x", "--top_p=2"], "top_p must be in (0, 1]"),
    ("hla_jax.evaluate", ["--text_files=a.txt", "--batch_size=x"], "flag --batch_size=x: "),
])
def test_errors_are_one_line(module, args, message, tmp_path):
    proc = run(module, *args, f"--workdir={tmp_path / 'none'}", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert message in lines[0] and not ABSL_LOG.match(lines[0]), lines[0]


def test_no_tpu_backend_notice(tmp_path):
    """A run that starts JAX's backends (and stops at a bad mesh) prints only its error."""
    proc = run("hla_jax.main", "--config=configs/lm.py", "--config.mesh.data=2",
               f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Unable to initialize backend" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if not ABSL_LOG.match(line)] \
        == [proc.stderr.strip().splitlines()[-1]], proc.stderr


def test_shipped_configs_install_with_the_package(tmp_path):
    """``pip install .`` (into a target folder) ships the configs, and ``--config=configs/lm.py``
    finds them from a directory that has none."""
    source, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hla_jax", source / "hla_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    assert sorted(p.name for p in (target / "hla_jax" / "configs").glob("*.py")) \
        == ["__init__.py", "lm.py", "mqar.py", "niah.py"]
    elsewhere.mkdir()
    proc = run("hla_jax.main", "--config=configs/lm.py:size=huge", f"--workdir={elsewhere / 'r'}",
               cwd=elsewhere, pythonpath=str(target))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("flag --config=configs/lm.py:size=huge: size must be one of "
                                   "('tiny', '30m', 'small', '350m', '1b'), got 'huge'"), proc.stderr
