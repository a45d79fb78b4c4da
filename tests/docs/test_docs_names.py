"""Every library name the README and the docs mention exists: ``hla_jax.a.b`` anywhere in the
text, the short ``ops.x``, ``core.x``, ``kernels.x`` and ``nn.x`` in backticks (read as
``hla_jax.ops.x`` ...), and every ``hla_jax/...`` file path."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"\bhla_jax(?:\.[A-Za-z_]\w*)+")
SHORT = re.compile(r"`((?:ops|core|kernels|nn)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"\bhla_jax(?:/[\w.-]+)+")


def resolve(name: str):
    """The object ``name`` (``package.module.attr...``) names; raises if there is none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name != ".".join(parts[:cut]) and not ".".join(parts[:cut]).startswith(e.name + "."):
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def names(path: pathlib.Path) -> set[str]:
    text = path.read_text()
    return ({m.rstrip(".") for m in DOTTED.findall(text)}
            | {f"hla_jax.{m}" for m in SHORT.findall(text)})


def test_names_are_found():
    """The patterns see names the pages use (a changed pattern cannot silently pass)."""
    assert "hla_jax.main" in names(ROOT / "README.md")
    assert {"hla_jax.ops.families.hla2", "hla_jax.core.checks.check_gate"} <= names(ROOT / "docs" / "math.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_objects_exist(page):
    missing = []
    for name in sorted(names(page)):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    paths = {p.rstrip(".") for p in PATH.findall(page.read_text())}
    missing += [f"{p} (no such file)" for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, f"{page.name} names what does not exist:\n" + "\n".join(missing)
