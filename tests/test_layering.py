"""Imports point down: every import of a project module, lazy ones included, names a module of
the same layer or a lower one (ops and config at the ground, the model on them, the engines on
the model, the trainer above, the tools and the CLI on top)."""

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
    "diagnostics.overhead": 7,  # tools that run the trainer
    "diagnostics.study": 7,
    "profile": 7,
    "export": 7,
    "import_hf": 7,
    "bench": 8,
    "gpu_check": 9,
    "cli": 9,
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
