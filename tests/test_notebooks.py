"""The notebooks run end to end on CPU, and each .ipynb is in sync with its paired .py."""

import pathlib

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PAIRED = sorted(NOTEBOOKS.glob("*.py"))


def _code(nb):
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", PAIRED, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = jupytext.read(path)
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --sync {path.name}`"
    assert _code(nbformat.read(ipynb, as_version=4)) == _code(nb), (
        f"{ipynb.name} is out of sync with {path.name}: run `jupytext --sync {path.name}`")
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
