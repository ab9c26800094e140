"""Imports flow one way (docs/architecture.md, "Layers"): the packages of ``megatron_dppo`` form layers, stated
below as data (``ALLOWED``: which packages each may import), and no import circle exists among the modules,
counting every import statement, at module level, under ``TYPE_CHECKING`` and inside functions. The package root
holds only ``cli.py``, ``__init__.py`` and packages. Read from the source (``ast``), nothing is imported."""
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
    assert "megatron_dppo.run.state" in graph["megatron_dppo.run.console"]  # under TYPE_CHECKING
    assert "megatron_dppo.megatron.parallel" in graph["megatron_dppo.run.setup"]  # inside a function (setup)
    # `from megatron_dppo.distributed import x`:
    assert "megatron_dppo.distributed.collectives" in graph["megatron_dppo.run.setup"]
    # the circle this test was generalized for: console.py naming Run from setup.py (under TYPE_CHECKING only)
    console, setup = "megatron_dppo.run.console", "megatron_dppo.run.setup"
    assert cycles({**graph, console: graph[console] | {setup}}) == [[console, setup]]


def test_no_import_circle_in_the_package():
    assert cycles(import_graph(REPO / "megatron_dppo")) == []


# --------------------------------------------------------------------------------------------------------------
# The layers, as data: each package and the packages of ours it may import (besides its own modules)
# --------------------------------------------------------------------------------------------------------------
PURE = {"algo", "packing", "config", "distributed", "env"}  # import nothing of ours (config: only the sections owned
# by the code that reads them: env's and the loss's)
ENGINES = {"rewards", "data", "rollout", "megatron", "convert"}
ALLOWED: dict[str, set[str]] = {
    "algo": set(),  # plain torch: advantages, pruning, losses
    "packing": set(),  # plain torch: Dense Prompt Packing, THD batches
    "config": {"env", "algo"},  # typed dataclasses, YAML, overrides; the env section is EnvConfig, defined once where
    # the episode loop reads it (env/config.py), the loss section LossConfig where the loss reads it (algo/losses.py);
    # env and algo import nothing of ours, so config stays below every engine
    "distributed": set(),  # the process layer: launch, collectives, placement, weight/batch transfer, staleness
    "env": set(),  # multi-turn environments, tools, token-in-token-out streams
    "rewards": {"distributed"},
    "data": {"rewards", "env"},  # (gold-answer extraction is the reward's; tool-use traces are the episodes' tokens)
    "rollout": {"distributed", "env"},  # generation engines (HF, vLLM), multi-turn episodes
    "megatron": {"algo", "packing", "distributed", "config"},  # the training engine (its parallel layout is config's
    # parallel section: one class)
    "convert": {"megatron", "distributed"},  # HF <-> Megatron checkpoints
    "run": PURE | ENGINES,  # what a run is built from, its state, lifecycle, console, metrics sinks
    "train": PURE | ENGINES | {"run"},  # the RL loop, its stages, evaluation, the rollout worker
    "cli": PURE | ENGINES | {"run", "train"},  # the command line, on top
    "": set(),  # megatron_dppo/__init__.py
}


def package_of(module: str) -> str:
    """``megatron_dppo.train.loop`` -> ``train``; ``megatron_dppo.cli`` -> ``cli``; the root itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]], allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    """Every import from one package into another that ``allowed`` does not list, and every package it does not
    know (a new package must be placed in the layers)."""
    out = []
    for module, deps in sorted(graph.items()):
        source = package_of(module)
        if source not in allowed:
            out.append(f"{module}: package {source!r} is not placed in the layers")
            continue
        for dep in sorted(deps):
            target = package_of(dep)
            if target != source and target not in allowed[source]:
                out.append(f"{module} imports {dep}: {source!r} may import only {sorted(allowed[source])}")
    return out


def test_the_layer_check_sees_an_import_against_the_layers():
    graph = import_graph(REPO / "megatron_dppo")
    assert layer_violations(graph) == []
    losses = "megatron_dppo.algo.losses"
    planted = {**graph, losses: graph[losses] | {"megatron_dppo.megatron.model"}}
    assert layer_violations(planted) == ["megatron_dppo.algo.losses imports megatron_dppo.megatron.model: 'algo' may "
                                         "import only []"]
    upward = {**graph, "megatron_dppo.run.build": graph["megatron_dppo.run.build"] | {"megatron_dppo.train.loop"}}
    assert any("run.build imports megatron_dppo.train.loop" in v for v in layer_violations(upward))
    assert layer_violations({"megatron_dppo.newpkg.x": set()}) == [
        "megatron_dppo.newpkg.x: package 'newpkg' is not placed in the layers"]


def test_packages_import_only_the_layers_below():
    assert layer_violations(import_graph(REPO / "megatron_dppo")) == []


def test_the_package_root_holds_only_cli_init_and_packages():
    root = REPO / "megatron_dppo"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert modules == ["__init__.py", "cli.py"]
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED) - {"", "cli"}  # every package is placed in the layers, and only packages are


def test_no_module_name_stands_for_a_folder():
    """A module is named for what it is inside its package: no ``config_sections``, ``run_state``, ``dapo_stages``
    (a prefix or suffix naming a package it should live in)."""
    root = REPO / "megatron_dppo"
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if any(p.stem.startswith(f"{pkg}_") or p.stem.endswith(f"_{pkg}") for pkg in packages | {"stages"})]
    assert offenders == []
