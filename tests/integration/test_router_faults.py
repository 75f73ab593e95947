"""Writes whose master stops answering while the map moves on (an emergency promotion).

The map names a master nobody answers on (a refused port, a listener that never
greets, a proxy that dies under a pooled connection); a write starts; the map then
flips to a live server. The write must land there as soon as the map moves, not
after a connect timeout. A connection lost after the statement was sent is another
matter: the insert may have been applied, so it must surface, never be repeated.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pymysql
import pytest

from shardfleet import ids
from shardfleet.errors import DatabaseError
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardRange
from shardfleet.store import Store

from .conftest import APP_PASSWORD, APP_USER

SHARD = 3  # in [0, 15], the first server's range
TIMEOUT = 20.0  # the router's connect and read timeouts: far above BOUND
BOUND = 3.0  # how long after the flip the write may take


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def set_master(zk: ZooKeeperMapStore, master: str) -> None:
    """Point the range [0, 15] at *master* (what a promotion's flip does to the map)."""
    v = zk.read()
    old = v.map.range_for(SHARD)
    zk.write(v.map.replace_range(old, ShardRange(old.first, old.last, master, None, "open")),
             v.version)


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
