"""Imports flow one way (docs/architecture.md): no import circle among the modules of ``megatron_dppo`` (the
whole package: engine, trainer, algo, packing, ...), counting every import statement, at module level, under
``TYPE_CHECKING`` and inside functions. Read from the source (``ast``), nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path, root: Path = REPO) -> dict[str, set[str]]:
    """{module: modules of the package it imports} for every ``.py`` file under ``package`` (``root``: the folder
    the module names are counted from)."""
    files = {module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(head + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_reader_counts_every_kind_of_import():
    graph = import_graph(REPO / "megatron_dppo")
    assert "megatron_dppo.megatron.arch" in graph["megatron_dppo.megatron.parallel"]  # module level
    assert "megatron_dppo.run_state" in graph["megatron_dppo.console"]  # under TYPE_CHECKING
    assert "megatron_dppo.megatron.parallel" in graph["megatron_dppo.run"]  # inside a function (setup)
    assert "megatron_dppo.distributed" in graph["megatron_dppo.run"]  # `from megatron_dppo import distributed`
    # the circle this test was generalized for: console.py naming Run from run.py (under TYPE_CHECKING only)
    assert cycles({**graph, "megatron_dppo.console": graph["megatron_dppo.console"] | {"megatron_dppo.run"}}) == [
        ["megatron_dppo.console", "megatron_dppo.run"]]


def test_no_import_circle_in_the_package():
    assert cycles(import_graph(REPO / "megatron_dppo")) == []
