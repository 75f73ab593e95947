"""The PyMySQL internals the library relies on, pinned (pyproject bounds PyMySQL <1.3):
``store.Store._fetch_many`` sends each server its query with ``_execute_command`` and
reads it later with ``_read_query_result`` (the two halves of ``Connection.query``), and
``router._idle_ok`` polls ``Connection._sock``. A PyMySQL release that changes them fails
here, before a pipelined page silently breaks."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pymysql.connections
from pymysql.constants import COMMAND

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_pymysql_is_within_the_bound_the_package_declares():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"PyMySQL>=([\d.]+),<([\d.]+)"', text).groups()

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

    assert key(low) <= key(version("PyMySQL")) < key(high), version("PyMySQL")


def test_query_is_execute_command_then_read_query_result():
    src = inspect.getsource(pymysql.connections.Connection.query)
    send = src.index("self._execute_command(COMMAND.COM_QUERY, sql)")
    read = src.index("self._affected_rows = self._read_query_result(unbuffered=unbuffered)")
    assert send < read, src
    params = inspect.signature(pymysql.connections.Connection._execute_command).parameters
    assert list(params) == ["self", "command", "sql"], params
    params = inspect.signature(pymysql.connections.Connection._read_query_result).parameters
    assert list(params) == ["self", "unbuffered"], params
    assert COMMAND.COM_QUERY == 3


def test_the_result_and_the_socket_are_the_attributes_read():
    src = inspect.getsource(pymysql.connections.Connection)
    assert "self._result = result" in src, "query results live in Connection._result"
    assert "self._sock = sock" in src or "self._sock = None" in src
    rows = inspect.getsource(pymysql.connections.MySQLResult)
    assert "self.rows" in rows, "MySQLResult.rows holds the fetched rows"
