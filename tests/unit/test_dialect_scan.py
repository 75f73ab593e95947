"""One source of truth for the SQL dialect: replication and server-state statements are
written in :mod:`shardfleet.topology` and :mod:`shardfleet.replication` only; the
operations chain those primitives. This scan reads the operation modules' string
literals (docstrings aside) and fails on a replication or dialect statement."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "shardfleet"

STATEMENT = re.compile(r"\b(SELECT|SET|SHOW|RESET|STOP|START|CHANGE|FLUSH|KILL|PURGE)\b")
DIALECT = re.compile(
    r"\b(SLAVES?|MASTER|REPLICA|gtid_\w+|read_only|rpl_semi_sync\w*|sql_log_bin|"
    r"BINARY\s+LOGS|BINLOG|CONSISTENT\s+SNAPSHOT)\b", re.I)

OPERATIONS = [*(m for m in ("backup.py", "ops.py", "promote.py", "split.py") if (SRC / m).exists()),
              *sorted(p.relative_to(SRC).as_posix() for p in (SRC / "operations").rglob("*.py"))]


def dialect_literals(path: Path) -> list[str]:
    """``line: text`` of every non-docstring string literal that is a dialect statement."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            docs.add(id(body[0].value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and STATEMENT.search(node.value) \
                and DIALECT.search(node.value):
            out.append(f"{node.lineno}: {node.value[:80]}")
    return out


def test_the_scan_finds_a_dialect_statement(tmp_path):
    f = tmp_path / "op.py"
    f.write_text('"""SHOW ALL SLAVES STATUS in a docstring is prose."""\n'
                 'Q = "SHOW ALL SLAVES STATUS"\nR = f"SET GLOBAL read_only = {1}"\n'
                 'M = "the master is read_only"\n')
    assert [x.split(":")[0] for x in dialect_literals(f)] == ["2", "3"]


@pytest.mark.parametrize("module", OPERATIONS)
def test_operations_write_no_dialect_sql(module):
    found = dialect_literals(SRC / module)
    assert not found, (f"{module} writes replication/dialect SQL itself; move it to "
                       f"topology/replication and call that: {found}")
