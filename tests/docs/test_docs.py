"""The README's and the docs' Python snippets run, so the quickstarts cannot rot; so do the
examples of the public entries' docstrings (the operators of the registry and the kernels).

Every ```python block of a Markdown file runs, in order, in one fresh interpreter per file
(blocks of one file share a namespace, as a reader pasting them into a notebook would); output
listings are ```text blocks and commands ```bash blocks, which are not run."""

import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hla_jax import kernels
from hla_jax.ops import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_blocks_are_found():
    """The pattern sees the README's quickstart (a renamed fence would silently skip it)."""
    assert python_blocks(ROOT / "README.md")


@pytest.mark.parametrize("path", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(path, tmp_path):
    code = "\n".join(python_blocks(path))
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{path.name}'s snippets failed:\n{run.stderr[-4000:]}"


ENTRIES = {**registry.ENTRIES, **{name: getattr(kernels, name) for name in (
    "la_pallas", "gated_deltanet_pallas", "loglinear_mamba2_pallas",
    "loglinear_gated_deltanet_pallas")}}


@pytest.mark.parametrize("name", ENTRIES)
def test_public_entries_document_and_run_their_example(name):
    """Each public entry has a Google-style docstring (Args, Returns, Raises, Example) whose
    example runs as written."""
    entry = ENTRIES[name]
    for section in ("Args:", "Returns:", "Raises:", "Example:"):
        assert section in entry.__doc__, f"{name}: no {section}"
    test = doctest.DocTestFinder().find(entry, name, globs={})[0]
    result = doctest.DocTestRunner(verbose=False).run(test)
    assert result.failed == 0 and result.attempted > 0
