"""Writes whose master stops answering while the map moves on (an emergency promotion).

The map names a master nobody answers on (a refused port, a listener that never
greets, a proxy that dies under a pooled connection); a write starts; the map then
flips to a live server. The write must land there as soon as the map moves, not
after a connect timeout. A connection lost after the statement was sent is another
matter: the insert may have been applied, so it must surface, never be repeated.
A master that hangs (SIGSTOP) with a statement already sent to it: when the map moves
the range off it, the router ends that statement at once instead of waiting out its
read timeout (a write surfaces as may-have-happened, a read is read again).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql
import pytest

from shardfleet import ids
from shardfleet.errors import DatabaseError
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardRange
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer

from .conftest import APP_PASSWORD, APP_USER, make_shards

SHARD = 3  # in [0, 15], the first server's range
TIMEOUT = 20.0  # the router's connect and read timeouts: far above BOUND
BOUND = 3.0  # how long after the flip the write may take


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def set_master(zk: ZooKeeperMapStore, master: str, *, rebuild: str | None = None) -> None:
    """Point the range [0, 15] at *master* (what a promotion's flip does to the map);
    *rebuild*: the old master an emergency's flip marks for rebuild."""
    v = zk.read()
    old = v.map.range_for(SHARD)
    extra = {"rebuild": rebuild} if rebuild else {}
    zk.write(v.map.replace_range(old, ShardRange(old.first, old.last, master, rebuild, "open",
                                                 extra=extra)), v.version)


def rows_tagged(server: Any, tag: str) -> int:
    return int(server.sql(f"SELECT COUNT(*) FROM db{SHARD:05d}.pins "
                          "WHERE JSON_VALUE(body, '$.tag') = %s", (tag,))[0][0])


class Proxy:
    """A TCP proxy to a live server. ``kill()`` closes every socket (the master dies
    under its pooled connections). With ``cut_after_commit`` it relays a client's
    COMMIT, waits for the server's answer (the transaction is committed) and cuts the
    client off instead of relaying it: the client loses its connection after its
    statement was applied."""

    def __init__(self, target: str, *, cut_after_commit: bool = False) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.cut_after_commit = cut_after_commit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.commits = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.create_connection(self.target)
            self.socks += [client, server]
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        """Client to server, whole MySQL packets, so a COMMIT can be recognised."""
        buf = b""
        try:
            while data := client.recv(65536):
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:3], "little"):
                    n = 4 + int.from_bytes(buf[:3], "little")
                    packet, buf = buf[:n], buf[n:]
                    if packet[4:5] == b"\x03" and packet[5:].strip().upper() == b"COMMIT":
                        self.commits += 1
                        if self.cut_after_commit:
                            cut.set()  # whatever the server says next answers the COMMIT
                    server.sendall(packet)
        except OSError:
            pass
        finally:
            _close(server)

    def _down(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if cut.is_set():
                    break  # the COMMIT's answer is dropped
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)

    def kill(self) -> None:
        _close(self.listener)
        for s in self.socks:
            _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class Write:
    """A store.create on SHARD in a thread; records when it was acknowledged, or its error."""

    def __init__(self, store: Store, tag: str) -> None:
        self.id: int | None = None
        self.error: BaseException | None = None
        self.acked_at = 0.0
        self.done = threading.Event()
        near = ids.compose(SHARD, 1, 1)

        def run() -> None:
            try:
                self.id = store.create("pin", {"tag": tag}, near=near)
                self.acked_at = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


class WaitingLog(logging.Handler):
    """Sets ``waiting`` when the store logs that a write waits for the map to name
    another master (the state a test flips the map in)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.waiting = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "shardfleet.store" and "another master" in record.getMessage():
            self.waiting.set()


@pytest.fixture
def zk_map(zookeeper, cluster):
    zk = ZooKeeperMapStore(zookeeper.address, cluster)
    yield zk
    zk.close()


@pytest.fixture
def slow_router(zookeeper, cluster, tmp_path):
    """Made by the test after it pointed the map at the dead master: timeouts far above
    BOUND, so a write that only fails over after a timeout cannot pass."""
    made: list[Router] = []

    def make() -> Store:
        r = Router(ZooKeeperMapStore(zookeeper.address, cluster),
                   cache_file=tmp_path / "map.json", user=APP_USER, password=APP_PASSWORD,
                   frozen_wait=15.0, connect_timeout=TIMEOUT, read_timeout=TIMEOUT)
        made.append(r)
        return Store(r)

    yield make
    for r in made:
        r.close()


@pytest.fixture
def waiting_log():
    h = WaitingLog()
    lg = logging.getLogger("shardfleet.store")
    old = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)
    lg.setLevel(old)


def _flip_and_check(zk_map, live, w: Write, tag: str) -> None:
    set_master(zk_map, live.address)
    flipped = time.monotonic()
    w.done.wait(BOUND)
    assert w.done.is_set(), f"write not acknowledged within {BOUND}s of the flip"
    assert w.error is None, f"write failed: {w.error!r}"
    assert w.acked_at - flipped < BOUND
    assert rows_tagged(live, tag) == 1


def test_write_refused_by_dead_master_lands_on_new_master_when_map_flips(
        zk_map, slow_router, mariadb_pair, waiting_log):
    live = mariadb_pair[0]
    dead = socket.socket()  # bound, never listening: connects are refused, port stays ours
    dead.bind(("127.0.0.1", 0))
    try:
        set_master(zk_map, f"127.0.0.1:{dead.getsockname()[1]}")
        store = slow_router()
        w = Write(store, "refused")
        wait_until(lambda: waiting_log.waiting.is_set() or w.done.is_set(), 30,
                   "the write to fail its connect and wait for the map")
        assert not w.done.is_set(), f"write gave up before the flip: {w.error!r}"
        _flip_and_check(zk_map, live, w, "refused")
    finally:
        dead.close()


def test_write_hung_in_connect_to_silent_master_reroutes_when_map_flips(
        zk_map, slow_router, mariadb_pair):
    live = mariadb_pair[0]
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody greets
    silent.settimeout(30)
    accepted: list[socket.socket] = []
    try:
        set_master(zk_map, f"127.0.0.1:{silent.getsockname()[1]}")
        store = slow_router()
        w = Write(store, "hung")
        accepted.append(silent.accept()[0])  # the write is now waiting for a greeting
        assert not w.done.is_set(), f"write ended before the flip: {w.error!r}"
        _flip_and_check(zk_map, live, w, "hung")
    finally:
        for s in accepted + [silent]:
            s.close()


def test_write_on_pooled_connection_to_killed_master_reroutes_when_map_flips(
        zk_map, slow_router, mariadb_pair, waiting_log):
    live = mariadb_pair[0]
    proxy = Proxy(live.address)
    try:
        set_master(zk_map, proxy.address)
        store = slow_router()
        store.create("pin", {"tag": "warm"}, near=ids.compose(SHARD, 1, 1))  # pools a conn
        proxy.kill()  # the master dies; its pooled connection is closed under the router
        w = Write(store, "pooled")
        wait_until(lambda: waiting_log.waiting.is_set() or w.done.is_set(), 30,
                   "the write to find its master dead and wait for the map")
        assert not w.done.is_set(), f"write gave up before the flip: {w.error!r}"
        _flip_and_check(zk_map, live, w, "pooled")
    finally:
        proxy.kill()


def test_insert_whose_connection_is_lost_after_commit_is_not_retried(
        zk_map, slow_router, mariadb_pair):
    live, other = mariadb_pair
    proxy = Proxy(live.address, cut_after_commit=True)
    try:
        set_master(zk_map, proxy.address)
        store = slow_router()
        t0 = time.monotonic()
        with pytest.raises(DatabaseError) as err:
            store.create("pin", {"tag": "ambiguous"}, near=ids.compose(SHARD, 1, 1))
        assert time.monotonic() - t0 < BOUND, "an ambiguous write waited instead of surfacing"
        cause = err.value.__cause__
        assert isinstance(cause, pymysql.err.OperationalError), repr(cause)
        assert cause.args[0] == 2013, cause  # the lost connection, not a rollback's error
        # applied once, sent once: not repeated on the same master or any other
        assert rows_tagged(live, "ambiguous") == 1
        assert proxy.connections == 1 and proxy.commits == 1
    finally:
        proxy.kill()


# -- a hung master (SIGSTOP: a hung disk or kernel) ---------------------------------------
# Its sockets stay open and the kernel still accepts what is sent; nothing answers. A
# statement already sent waits for its answer until the router's read timeout, unless the
# router ends it when the map moves the range to another master.


@pytest.fixture(scope="module")
def hung_master(tmp_path_factory):
    """A MariaDB server of its own (holding SHARD's database) for the tests to SIGSTOP: the
    session's pair is shared with every other test and must never be left stopped."""
    s = MariaDBServer(tmp_path_factory.mktemp("hung"), server_id=9,
                      extra=["--innodb-file-per-table=0"]).start()
    s.sql(f"CREATE USER '{APP_USER}'@'%%' IDENTIFIED BY %s", (APP_PASSWORD,))
    make_shards(s, [SHARD])
    yield s
    _cont(s)
    s.stop(remove=True)


def _cont(server: MariaDBServer) -> None:
    if server.proc is not None and server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGCONT)


@pytest.fixture
def stopped(hung_master):
    """``stop()`` SIGSTOPs the hung master; it always gets SIGCONT back at teardown."""
    def stop() -> None:
        assert hung_master.proc is not None
        pid = hung_master.proc.pid
        os.kill(pid, signal.SIGSTOP)
        # kill() returns before every thread of the server has stopped: one could still
        # answer the statement the test sends next
        wait_until(lambda: all(_state(pid, t) in ("T", "t", "?")
                               for t in os.listdir(f"/proc/{pid}/task")), 10,
                   "every thread of the hung master to stop")

    yield stop
    _cont(hung_master)


def _state(pid: int, tid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return "?"  # the thread ended
    return stat.rsplit(")", 1)[-1].split()[0]


def blocked_reading(thread: threading.Thread) -> bool:
    """True when *thread* waits for a server's answer inside PyMySQL (its statement sent)."""
    frame = sys._current_frames().get(thread.ident or 0)  # noqa: SLF001 - a test's probe
    while frame is not None:
        if frame.f_code.co_name == "_read_packet" and "pymysql" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Call:
    """*fn()* in a thread; records its result or error and when it returned."""

    def __init__(self, fn: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self.done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            finally:
                self.ended_at = time.monotonic()
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def _sees(store: Store, master: str) -> None:
    wait_until(lambda: store.router.range_for(SHARD).master == master, 10,
               f"the router to route shard {SHARD} to {master}")


def across_the_flip(zk_map: Any, live: Any, what: str, fn: Callable[[], Any]) -> Call:
    """*fn* (a *what*) sent to the hung master; once it waits for the answer the map names
    *live* master and marks the hung one for rebuild, as an emergency promotion's flip
    does; it must end within BOUND of that flip, not the read timeout."""
    c = Call(fn)
    wait_until(lambda: blocked_reading(c.thread) or c.done.is_set(), 10,
               f"the {what} to be sent to the hung master")
    assert not c.done.is_set(), f"{what} ended before the flip: {c.error!r}"
    hung = zk_map.read().map.range_for(SHARD).master
    set_master(zk_map, live.address, rebuild=hung)  # the emergency's flip
    flipped = time.monotonic()
    c.done.wait(TIMEOUT + 5)
    took = c.ended_at - flipped
    assert c.done.is_set() and took < BOUND, (
        f"the {what} in flight on the hung master ended {took:.2f}s after the flip "
        f"(bound {BOUND}s; the router's read timeout is {TIMEOUT}s)")
    return c


def test_write_in_flight_on_hung_master_ends_when_map_flips(
        zk_map, slow_router, mariadb_pair, hung_master, stopped):
    live = mariadb_pair[0]
    near = ids.compose(SHARD, 1, 1)
    set_master(zk_map, hung_master.address)
    store = slow_router()
    store.create("pin", {"tag": "warm"}, near=near)  # a pooled connection to the master
    stopped()
    w = across_the_flip(zk_map, live, "write",
                        lambda: store.create("pin", {"tag": "in-flight"}, near=near))
    # "may have happened": the ambiguous-write error, never retried on the new master
    assert isinstance(w.error, DatabaseError), repr(w.error)
    cause = w.error.__cause__
    assert isinstance(cause, pymysql.err.OperationalError) and cause.args[0] == 2013, cause
    assert rows_tagged(live, "in-flight") == 0, "an ambiguous write was sent again"
    # the caller goes on: its next write lands on the new master at once
    t0 = time.monotonic()
    store.create("pin", {"tag": "after-flip"}, near=near)
    assert time.monotonic() - t0 < BOUND
    assert rows_tagged(live, "after-flip") == 1


def test_read_in_flight_on_hung_master_is_read_again_on_new_master(
        zk_map, slow_router, mariadb_pair, hung_master, stopped):
    live = mariadb_pair[0]
    near = ids.compose(SHARD, 1, 1)
    store = slow_router()
    oid = store.create("pin", {"tag": "read-me"}, near=near)  # on live: the map's master
    set_master(zk_map, hung_master.address)
    _sees(store, hung_master.address)
    store.create("pin", {"tag": "warm"}, near=near)  # a pooled connection to the master
    stopped()
    r = across_the_flip(zk_map, live, "read", lambda: store.get(oid))
    assert r.error is None, f"read failed: {r.error!r}"
    assert r.result == {"tag": "read-me"}
