"""The operations package stays cheap to change: no file over 500 lines, no function over
60, and no operation imports another (what two operations share lives in the runner,
``operations.types`` or the server modules below: topology, replication, physical,
mapstore, storage)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "src" / "shardfleet" / "operations"
MAX_LINES, MAX_FUNCTION = 500, 60
# what every operation may import: the runner and the shared types
SHARED = {"runner", "types", "journal"}

MODULES = sorted(p for p in OPS.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(OPS).as_posix()


def operation_of(module: str) -> str | None:
    """The operation a dotted module under ``shardfleet.operations`` belongs to (its
    first component), or None for the shared ones."""
    first = module.split(".")[0]
    return None if first in SHARED or not first else first


# the earlier import paths of operations (re-exports): importing one is importing it
SHIMS = {"shardfleet.split": "split", "shardfleet.promote": "promote",
         "shardfleet.backup": "backup"}


def _modules(node: ast.AST, pkg: list[str]) -> list[str]:
    """The dotted modules an import names (``from X import a``: X and X.a, since *a* may
    be a submodule), relative ones made absolute from the package *pkg*."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    module = node.module or ""
    if node.level:
        base = ["shardfleet", "operations", *pkg[:len(pkg) - node.level + 1]]
        module = ".".join([*base, *([module] if module else [])])
    return [module, *(f"{module}.{a.name}" for a in node.names)]


def imported_operations(path: Path, root: Path = OPS) -> set[str]:
    """The operations *path* imports (absolute ``shardfleet.operations.X``, relative, or
    through an earlier import path)."""
    pkg = list(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        for m in _modules(node, pkg):
            if m in SHIMS:
                out.add(SHIMS[m])
            elif m.startswith("shardfleet.operations."):
                op = operation_of(m.removeprefix("shardfleet.operations."))
                if op:
                    out.add(op)
    return out


def test_the_layout_exists():
    for part in ("runner.py", "types.py", "split", "promote", "rebuild.py", "backup.py",
                 "restore.py", "archive.py"):
        assert (OPS / part).exists(), f"operations/{part} is missing"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_files_stay_short(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"operations/{_name(path)} has {n} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_functions_stay_short(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines, line {n.lineno})"
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION]
    assert not long, f"operations/{_name(path)}: functions over {MAX_FUNCTION} lines: {long}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_operation_imports_another(path):
    mine = operation_of(".".join(path.relative_to(OPS).with_suffix("").parts))
    others = imported_operations(path) - {mine}
    assert not others, f"operations/{_name(path)} imports the operations {sorted(others)}"


def test_the_import_scan_sees_an_import(tmp_path):
    ops = tmp_path / "operations"
    (ops / "split").mkdir(parents=True)
    f = ops / "split" / "cutover.py"
    f.write_text("from shardfleet.operations import runner, promote\n"
                 "from ..rebuild import x\nfrom . import check\n"
                 "import shardfleet.operations.backup\nfrom .spec import SplitSpec\n"
                 "from shardfleet.operations.types import Options\n")
    assert imported_operations(f, ops) == {"promote", "rebuild", "split", "backup"}
    g = ops / "archive.py"
    g.write_text("from shardfleet.promote import promote\n")
    assert imported_operations(g, ops) == {"promote"}
