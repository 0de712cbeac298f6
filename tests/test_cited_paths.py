"""Every module path and file path that the docs and the code's comments cite exists.

A citation that outlives its target (a renamed module, a moved benchmark) sends a reader
nowhere. Cited, here: a dotted name under the package (``attnres_dist.ops.two_phase``,
``attnres_dist.ops.two_phase.phase1``: a module, or a name defined at the top of one), and a
path ending in a known suffix (``model/depth_state.py``, ``docs/kernels.md``,
``csrc/merge_cpu.c``) whose first folder is one of the project's (a top-level folder or a
package of ``attnres_dist``), resolved against the repository root, the package, and then any
folder of the repository whose path ends with it. Paths into other projects (``torch/...``),
run outputs (``runs/...``) and placeholders (``launch/NAME.sh``) are not the project's files.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "attnres_dist"
SKIP_DIRS = {".git", ".venv", "runs", "bench_results", ".cache", "__pycache__"}
NOT_CITERS = ("docs/gpu_runs/",)  # logs of past runs, kept as they were
# cited on purpose though absent: what a job writes when it runs, a deliberate bad input
ABSENT_ON_PURPOSE = {
    "docs/results-gpu.md",  # the GPU study's report (make gpu-study)
    "docs/results-gpu-2.md",
    "docs/results-gpu-8.md",
    "configs/nope.yaml",  # docs/bad_inputs.md: a config that does not exist
}
DOTTED = re.compile(r"\battnres_dist(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(
    r"(?<![\w./-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|md|c|h|sh|yaml|toml))\b"
)


def _cited_in() -> list[Path]:
    files = []
    for pattern in ("*.py", "*.md", "*.sh", "Makefile", "Dockerfile"):
        for path in ROOT.rglob(pattern):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel == d or rel.startswith(d + "/") for d in SKIP_DIRS):
                continue
            if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts):
                continue
            files.append(path)
    return sorted(set(files))


@cache
def _all_files() -> tuple[str, ...]:
    return tuple(p.relative_to(ROOT).as_posix() for p in _cited_in() + sorted(ROOT.rglob("*.c")))


@cache
def _top_names(module_file: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (classes, functions, assignments)."""
    tree = ast.parse(module_file.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def dotted_exists(name: str) -> bool:
    """A module, or a module followed by a name it defines (and attributes of that name)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = _module_file(parts[:end])
        if module is None:
            continue
        rest = parts[end:]
        return not rest or rest[0] in _top_names(module)
    return False


@cache
def _project_folders() -> frozenset[str]:
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in SKIP_DIRS}
    packages = {p.parent.name for p in (ROOT / PACKAGE).rglob("__init__.py")}
    return frozenset(top | packages | {"csrc"})


def is_projects(cited: str) -> bool:
    """Whether a cited path names a file of this project (not another's, nor a placeholder)."""
    parts = cited.lstrip("./").split("/")
    stem = parts[-1].split(".")[0]
    return parts[0] in _project_folders() and not (stem.isupper() and len(stem) > 1)


def path_exists(cited: str) -> bool:
    cited = cited.lstrip("./")
    for base in (ROOT, ROOT / PACKAGE, ROOT / PACKAGE / "ops"):
        if (base / cited).exists():
            return True
    return any(f == cited or f.endswith("/" + cited) for f in _all_files())


def citations(path: Path):
    """(line number, cited text) of every dotted name and path the file cites."""
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for match in DOTTED.finditer(line):
            yield number, match.group(0).rstrip(".")
        for match in PATH.finditer(line):
            yield number, match.group(1)


def broken(path: Path) -> list[str]:
    out = []
    for number, cited in citations(path):
        if "*" in cited or "<" in cited or cited.startswith(("http", "/")):
            continue
        if cited.startswith(PACKAGE + "."):
            ok = (
                dotted_exists(cited)
                or dotted_exists(cited.rsplit(".", 1)[0])
                and (
                    # a file name written with its suffix: attnres_dist.ops.two_phase.py
                    cited.endswith((".py", ".md"))
                )
            )
        else:
            ok = not is_projects(cited) or cited in ABSENT_ON_PURPOSE or path_exists(cited)
        if not ok:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out.append(f"{where}:{number}: {cited}")
    return out


FILES = [
    p
    for p in _cited_in()
    if p.name != "test_cited_paths.py" and not p.relative_to(ROOT).as_posix().startswith(NOT_CITERS)
]


def test_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert "README.md" in names and "attnres_dist/model/attnres_layer.py" in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_module_and_file_exists(path):
    assert not broken(path)


def test_a_missing_citation_is_found(tmp_path):
    """The check itself: a dangling module path, a dangling name and a dangling file path are
    reported; existing ones are not."""
    text = (
        "see attnres_dist.ops.two_phase.phase1 and model/depth_state.py\n"
        "attnres_dist.bench.kernel_time, attnres_dist.ops.two_phase.no_such_name\n"
        "and model/no_such_file.py\n"
    )
    fake = tmp_path / "fake.md"
    fake.write_text(text)
    found = broken(fake)
    assert [f.split(": ", 1)[1] for f in found] == [
        "attnres_dist.bench.kernel_time",
        "attnres_dist.ops.two_phase.no_such_name",
        "model/no_such_file.py",
    ]
