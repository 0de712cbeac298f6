"""Imports point down: every import of a project module, lazy ones included, names a module of
the same layer or a lower one (ops and config at the ground, the model on them, the engines on
the model, the trainer above, the tools and the CLI on top).

The measurement harness (``bench/``, ``gpu_check/``, ``studies/`` beside the package, outside
the wheel) sits above all of it: the package never imports it, it imports the package, and its
own imports form no circle and take no private name from another file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnres_dist"

# layer of each top-level module or package (a dotted name overrides its package's)
LAYERS = {
    "__init__": 0,
    "errors": 0,
    "megatron_jit": 0,
    "megatron_compat": 0,
    "ops": 1,
    "data": 1,
    "generation": 1,
    "config": 2,
    "runtime": 3,
    "model": 4,
    "optim": 4,
    "parallel": 4,
    "hf": 4,
    "diagnostics": 5,  # the collector the trainer reports through
    "checkpoint": 5,
    "pipeline": 5,
    "train": 6,
    "profile": 7,  # tools that run the trainer
    "export": 7,
    "import_hf": 7,
    "cli": 8,
}


def layer(dotted: str) -> int:
    """The layer of ``attnres_dist.<dotted>`` (the most specific entry of LAYERS)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS:
            return LAYERS[name]
    raise KeyError(f"attnres_dist.{dotted} has no layer: add it to LAYERS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def project_imports(tree: ast.AST):
    """(line, imported module relative to attnres_dist) for every import of the project."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attnres_dist."):
                    yield node.lineno, alias.name.removeprefix("attnres_dist.")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "attnres_dist":  # from attnres_dist import x: x is the module
                for alias in node.names:
                    yield node.lineno, alias.name
            elif node.module.startswith("attnres_dist."):
                yield node.lineno, node.module.removeprefix("attnres_dist.")


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert MODULES
    for path in MODULES:
        layer(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p) or "__init__")
def test_imports_point_down(path):
    own = module_name(path) or "__init__"
    upward = [
        f"line {line}: {own} (layer {layer(own)}) imports {target} (layer {layer(target)})"
        for line, target in project_imports(ast.parse(path.read_text()))
        if layer(target) > layer(own)
    ]
    assert not upward, "; ".join(upward)


def test_an_upward_import_is_caught():
    tree = ast.parse("def f():\n    from attnres_dist.train.trainer import Trainer\n")
    (line, target), *_ = project_imports(tree)
    assert (line, target) == (2, "train.trainer")
    assert layer(target) > layer("model.gpt")


# -- the harness beside the package ------------------------------------------------------------

REPO = PACKAGE.parent
HARNESS = ("bench", "gpu_check", "studies")
HARNESS_MODULES = sorted(p for name in HARNESS for p in (REPO / name).rglob("*.py"))


def dotted_name(path: Path) -> str:
    """``bench/run.py`` -> ``bench.run``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, own: str):
    """(line, dotted module name) of every import in ``tree``, lazy ones included; ``from P
    import x`` gives ``P.x`` (x may be a module or a name in P: callers resolve it), relative
    imports resolved against ``own``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = own.split(".")[: -node.level]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def harness_graph() -> dict[str, set[str]]:
    """Each harness module -> the harness modules it imports (lazy imports included)."""
    modules = {dotted_name(p): p for p in HARNESS_MODULES}
    graph = {}
    for name, path in modules.items():
        targets = {
            resolve(t, set(modules)) for _, t in imported_names(ast.parse(path.read_text()), name)
        }
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_harness_is_there():
    names = {dotted_name(p) for p in HARNESS_MODULES}
    assert {"bench.run", "gpu_check.run", "gpu_check.steps", "studies.study"} <= names
    assert not any((PACKAGE / name).exists() for name in HARNESS)  # moved out of the package


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p) or "__init__")
def test_the_package_never_imports_the_harness(path):
    own = module_name(path) or "__init__"
    found = [
        f"line {line}: attnres_dist.{own} imports {target}"
        for line, target in imported_names(ast.parse(path.read_text()), f"attnres_dist.{own}")
        if target.split(".")[0] in HARNESS
    ]
    assert not found, "; ".join(found)


@pytest.mark.parametrize("path", HARNESS_MODULES, ids=dotted_name)
def test_the_harness_imports_the_package_and_itself_only(path):
    """Project imports name the package or a harness folder (never the tests), and no private
    name crosses files."""
    own = dotted_name(path)
    bad = []
    for line, target in imported_names(ast.parse(path.read_text()), own):
        top, last = target.split(".")[0], target.split(".")[-1]
        if top == "tests":
            bad.append(f"line {line}: {own} imports the tests ({target})")
        project = top == "attnres_dist" or top in HARNESS
        if project and last.startswith("_") and not last.startswith("__"):
            bad.append(f"line {line}: {own} imports the private name {target}")
    assert not bad, "; ".join(bad)


def test_the_harness_has_no_import_circle():
    graph = harness_graph()
    assert graph["gpu_check.steps"] >= {"gpu_check.speed_step", "gpu_check.common"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_an_import_circle_is_caught():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    tree = ast.parse("def f():\n    from gpu_check.steps import _step_limit_s\n")
    assert list(imported_names(tree, "gpu_check.speed_step")) == [
        (2, "gpu_check.steps._step_limit_s")
    ]
    assert resolve("gpu_check.steps._step_limit_s", {"gpu_check", "gpu_check.steps"}) == (
        "gpu_check.steps"
    )
