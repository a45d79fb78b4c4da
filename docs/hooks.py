"""mkdocs hook: the files of ``experiments/results`` join the site under ``results-data/``.

So the docs cite a result as ``[name](results-data/name.json)`` or show a plot with
``![caption](results-data/name.png)``, and ``mkdocs build --strict`` fails on any citation of a
file that does not exist."""

import pathlib

from mkdocs.structure.files import File

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.glob("*")):
        if path.is_file():
            f = File.generated(config, f"results-data/{path.name}", abs_src_path=str(path))
            f.is_documentation_page = lambda: False   # a results table is copied as it is, not rendered
            files.append(f)
    return files
