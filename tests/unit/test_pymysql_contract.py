"""The PyMySQL internals the library relies on, pinned (pyproject bounds PyMySQL <1.3):
``store.Store._fetch_many`` sends each server its query with ``_execute_command`` and
reads it later with ``_read_query_result`` (the two halves of ``Connection.query``), and
``router._idle_ok`` polls ``Connection._sock``, and ``router._shutdown`` shuts that socket
down under a thread blocked reading an answer, which must then get 2013 (the lost
connection the store reports as a write that may have happened). A PyMySQL release
that changes them fails here, before a pipelined page or a promotion silently breaks."""

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


def test_mysql_code_reads_the_drivers_number_through_the_library_own_errors():
    """errors.mysql_code knows the driver's errors by their module (pymysql.err): the
    number of a driver error, raised directly or as the cause or context of the
    library's own DatabaseError; 0 for anything else (an OSError's errno is no MySQL
    error number)."""
    from shardfleet.errors import DatabaseError, mysql_code

    refused = pymysql.err.OperationalError(2003, "Can't connect to MySQL server")
    assert mysql_code(refused) == 2003
    assert mysql_code(pymysql.err.ProgrammingError(1146, "Table doesn't exist")) == 1146

    def wrapped(cause: BaseException, *, explicit: bool) -> DatabaseError:
        try:
            try:
                raise cause
            except pymysql.err.MySQLError as exc:
                if explicit:
                    raise DatabaseError("shard 7: cannot connect") from exc
                raise DatabaseError("shard 7: cannot connect")  # noqa: B904 (the context)
        except DatabaseError as outer:
            return outer

    assert mysql_code(wrapped(refused, explicit=True)) == 2003
    assert mysql_code(wrapped(refused, explicit=False)) == 2003
    assert mysql_code(DatabaseError("no number")) == 0
    assert mysql_code(ConnectionRefusedError(111, "Connection refused")) == 0
    assert mysql_code(pymysql.err.InterfaceError("(0, '')")) == 0


def test_a_socket_shut_down_under_a_blocked_read_raises_2013_at_once():
    """What the router relies on to end a statement in flight on a hung server: its
    thread, blocked in ``_read_packet`` (no answer comes), gets OperationalError 2013 as
    soon as another thread shuts the socket down, and the connection is closed."""
    import socket
    import threading
    import time

    from shardfleet.router import _shutdown

    sock, peer = socket.socketpair()
    conn = pymysql.connections.Connection(defer_connect=True, host="hung", port=1)
    conn._sock, conn._rfile = sock, sock.makefile("rb")
    conn._current_timeout = None  # what connect() sets
    got: list[BaseException] = []

    def read() -> None:
        try:
            conn._read_packet()
        except BaseException as exc:  # noqa: BLE001 - checked below
            got.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(0.1)
    assert t.is_alive(), f"the read did not block: {got}"
    t0 = time.monotonic()
    assert _shutdown(conn)
    t.join(2)
    assert not t.is_alive() and time.monotonic() - t0 < 1
    assert isinstance(got[0], pymysql.err.OperationalError) and got[0].args[0] == 2013, got
    assert not conn.open, "PyMySQL closes the connection it lost"
    assert not _shutdown(conn), "a closed connection has nothing to end"
    peer.close()
