"""The notebooks run end to end on CPU by their documented command (``jupyter execute``), and
each .ipynb is in sync with its paired .py."""

import os
import pathlib
import subprocess
import sys

import jupytext
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
PAIRED = sorted(NOTEBOOKS.glob("*.py"))
JUPYTER = pathlib.Path(sys.executable).parent / "jupyter"


def _code(nb):
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", PAIRED, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --sync {path.name}`"
    assert _code(nbformat.read(ipynb, as_version=4)) == _code(jupytext.read(path)), (
        f"{ipynb.name} is out of sync with {path.name}: run `jupytext --sync {path.name}`")
    run = subprocess.run([str(JUPYTER), "execute", str(ipynb)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, MPLBACKEND="Agg"))
    assert run.returncode == 0, f"{ipynb.name} failed:\n{run.stderr[-4000:]}"
