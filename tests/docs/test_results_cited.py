"""``experiments/results`` holds exactly what the documentation cites: every results file named in
README.md or docs/ (as ``results-data/NAME`` or ``experiments/results/NAME``) or in the code
(``experiments/results/NAME`` in hla_jax/, experiments/, notebooks/) exists, and every file in
``experiments/results`` is cited by README.md or docs/.

A citation is a full file name; a brace form ``stem.{json,md,png}`` stands for each of its
names. Names with placeholders (``mqar_<tag>.json``, ``kernels_*``) are patterns, not citations."""

import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
EXTENSIONS = ("json", "md", "png", "txt", "csv", "log")
CITATION = re.compile(r"(?:results-data|experiments/results)/((?:[\w.\-]|\{[\w.,\-]*\})+)")


def expand(name: str) -> list[str]:
    """The names a citation stands for: each brace group ``{a,b}`` expanded, a trailing ``.``
    (the sentence's) dropped, only names with a results file's extension kept."""
    parts = re.split(r"(\{[^}]*\})", name)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    names = ("".join(c).rstrip(".") for c in itertools.product(*options))
    return [n for n in names if n.rsplit(".", 1)[-1] in EXTENSIONS and "." in n]


def citations(text: str) -> set[str]:
    return {n for m in CITATION.finditer(text) for n in expand(m.group(1))}


def cited_in(paths) -> dict[str, set[str]]:
    """``{results file name: the files citing it}``."""
    out = {}
    for path in paths:
        for name in citations(path.read_text(encoding="utf-8")):
            out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return out


def docs_files():
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if p.exists()]


def code_files():
    return [p for d in ("hla_jax", "experiments", "notebooks") for p in sorted((ROOT / d).rglob("*.py"))]


def test_citations_are_expanded_and_patterns_ignored():
    text = ("[a](results-data/mqar_d16.json), `experiments/results/kernels_check_gpu_la.{json,txt}`."
            " ![p](results-data/plot.png) `experiments/results/mqar_<tag>.json`, "
            "`experiments/results/kernels_*`, `experiments/results/`")
    assert citations(text) == {"mqar_d16.json", "kernels_check_gpu_la.json",
                               "kernels_check_gpu_la.txt", "plot.png"}


def test_every_cited_results_file_exists():
    cited = {**cited_in(code_files())}
    for name, where in cited_in(docs_files()).items():
        cited.setdefault(name, set()).update(where)
    missing = {name: sorted(where) for name, where in cited.items() if not (RESULTS / name).is_file()}
    assert not missing, f"cited but not in experiments/results: {missing}"


def test_every_results_file_is_cited_by_the_docs():
    cited = cited_in(docs_files())
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    uncited = [name for name in files if name not in cited]
    assert files and not uncited, (
        f"in experiments/results but cited in neither README.md nor docs/: {uncited}")
