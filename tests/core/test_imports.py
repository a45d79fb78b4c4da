"""The import graph of ``hla_jax``, read from the source with ``ast`` (every ``import`` and
``from ... import`` anywhere in a module, inside functions too): imports flow one way,
``core`` → ``kernels`` → ``ops`` → ``nn`` → ``train``, with no cycle between modules; ``core``
imports nothing else of hla_jax, ``kernels`` only ``core`` and itself; and within core, kernels
and ops every module's file name is unique."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hla_jax"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module an imported name lives in: ``name`` itself, or the longest module prefix of it
    (``from pkg import attr`` imports ``pkg``)."""
    while name not in MODULES:
        assert "." in name, f"{name} is not a module of hla_jax"
        name = name.rsplit(".", 1)[0]
    return name


def imports(module: str) -> set[str]:
    """The hla_jax modules ``module`` imports."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names]
    return {resolve(n) for n in names if n.split(".")[0] == "hla_jax"}


GRAPH = {m: imports(m) for m in MODULES}


def in_layer(module: str, *layers: str) -> bool:
    return any(module == f"hla_jax.{x}" or module.startswith(f"hla_jax.{x}.") for x in layers)


def test_no_import_cycle():
    """Tarjan's strongly connected components: every one is a single module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in GRAPH[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or m in GRAPH[m]:
                cycles.append(sorted(component))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_kernels_import_only_core_and_kernels():
    bad = {m: sorted(n for n in deps if not in_layer(n, "core", "kernels"))
           for m, deps in GRAPH.items() if in_layer(m, "kernels")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_core_imports_only_core():
    bad = {m: sorted(n for n in deps if not in_layer(n, "core"))
           for m, deps in GRAPH.items() if in_layer(m, "core")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_module_file_names_are_unique():
    """Within the operator stack (core, kernels, ops) a file's name says what it holds, once."""
    stack = [p for p in MODULES.values() if p.relative_to(PACKAGE).parts[0] in ("core", "kernels", "ops")]
    names = collections.Counter(p.name for p in stack if p.name != "__init__.py")
    dup = {name: sorted(str(p.relative_to(PACKAGE)) for p in stack if p.name == name)
           for name, n in names.items() if n > 1}
    assert not dup, f"file names used more than once in hla_jax: {dup}"


def test_a_package_names_its_modules_once_and_no_function_hides_one():
    """A package's namespace holds a module only under the module's own name (no
    ``ops.linear_family`` beside ``ops.linear``), and no function of it has a submodule's name
    (``ops.hla2`` the function would hide a module ``hla_jax.ops.hla2``)."""
    import importlib
    import inspect

    bad = []
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        for attr, value in vars(package).items():
            if inspect.ismodule(value) and value.__name__.startswith("hla_jax") \
                    and value.__name__ != f"{name}.{attr}":
                bad.append(f"{name}.{attr} is {value.__name__}")
            if callable(value) and not inspect.ismodule(value) and f"{name}.{attr}" in MODULES:
                bad.append(f"{name}.{attr} hides the module {name}.{attr}")
    assert not bad, bad
