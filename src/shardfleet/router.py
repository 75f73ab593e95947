"""The router: the current shard map, and a small connection pool per master.

A router keeps the last good map in memory and in a local cache file. It starts
from that file when the map's store is unreachable, keeps serving from it while
the store is away, and swaps in each new valid version its watch delivers (the
file follows on a thread of its own: routing does not wait for the disk).
Production reads and writes go to masters only.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import select
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
from pymysql.constants import CR

from shardfleet import shardmap
from shardfleet.errors import (
    MapError,
    MapStoreUnavailable,
    ShardFrozenError,
)
from shardfleet.mapstore import NO_NODE, MapStore
from shardfleet.shardmap import ShardMap, ShardRange
from shardfleet.tls import TLS

log = logging.getLogger(__name__)


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b}]" for a, b in ranges)


def split_hostport(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    return host.strip("[]"), int(port)


def _wait_ready(sock: socket.socket, events: int, deadline: float,
                give_up: Callable[[], bool] | None, poll: float) -> bool:
    """Wait until *sock* is ready for *events*: True; False if *give_up()* turned true;
    TimeoutError at *deadline*."""
    p = select.poll()
    p.register(sock, events)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        if p.poll(1000 * (left if give_up is None else min(left, poll))):
            return True
        if give_up is not None and give_up():
            return False


def _shutdown(conn: pymysql.connections.Connection) -> bool:
    """End whatever *conn* waits for, from any thread: ``shutdown(2)`` both ways, so a
    thread blocked reading its answer gets the end of the stream at once (PyMySQL then
    raises 2013 and closes it) and nothing more can be sent on it. The socket is not
    closed here: its descriptor belongs to the thread using the connection. Called on
    the plain socket (``socket.socket.shutdown``): ``SSLSocket.shutdown`` would also drop
    the TLS object under the thread reading through it. False if it was closed already."""
    sock = conn._sock
    if sock is None:
        return False
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # closed meanwhile by its thread, or never connected
        return False
    return True


def masters_moved(old: ShardMap | None, new: ShardMap) -> dict[str, list[tuple[int, int]]]:
    """``{server: [(first, last), ...]}``: the shards each server was master of in *old*
    and is not in *new* (another master, or no range at all)."""
    lost: dict[str, list[tuple[int, int]]] = {}
    if old is None:
        return lost
    ranges = new.ranges
    lasts = [r.last for r in ranges]
    for r in old.ranges:
        pos, i = r.first, bisect.bisect_left(lasts, r.first)  # first new range ending >= pos
        while pos <= r.last:
            n = ranges[i] if i < len(ranges) else None
            if n is None or n.first > r.last:  # the rest of the old range is in no range
                lost.setdefault(r.master, []).append((pos, r.last))
                break
            if n.first > pos:  # a gap before the next new range
                lost.setdefault(r.master, []).append((pos, n.first - 1))
                pos = n.first
            end = min(n.last, r.last)
            if n.master != r.master:
                lost.setdefault(r.master, []).append((pos, end))
            pos, i = end + 1, i + 1
    return lost


def _idle_ok(conn: pymysql.connections.Connection) -> bool:
    """An idle connection has nothing to read; anything there (EOF, an error packet) means
    the server closed it. One poll(2), no round trip."""
    sock = conn._sock
    if sock is None:
        return False
    p = select.poll()
    p.register(sock, select.POLLIN)
    return not p.poll(0)


class Pool:
    """A small LIFO pool of PyMySQL connections to one server.

    ``deque.append``/``pop`` are atomic, so the pool needs no lock. At most
    *size* idle connections are kept; more are opened on demand and closed when
    returned.

    The pool also knows its connections in use: each one it hands out is
    registered with the shard it serves (None: unknown, several) until it comes
    back through :meth:`put` or :meth:`discard`, so :meth:`end_in_flight` can end
    the statements waiting on a server the map moved off their shards. The
    registry is a dict whose single operations (set, pop, copy) are atomic; no lock.
    """

    def __init__(self, server: str, *, user: str, password: str, size: int = 8,
                 connect_timeout: float = 5.0, read_timeout: float = 30.0,
                 tls: TLS | None = None) -> None:
        self.server = server
        self.host, self.port = split_hostport(server)
        self.connect_timeout = connect_timeout
        self.tls = tls or TLS()
        self._kw = dict(host=self.host, port=self.port, user=user, password=password,
                        charset="utf8mb4", autocommit=True, connect_timeout=connect_timeout,
                        read_timeout=read_timeout, write_timeout=read_timeout,
                        **self.tls.pymysql_kwargs())
        self.size = size
        self._idle: deque[pymysql.connections.Connection] = deque()
        # connections handed out and not yet returned -> the shard each serves (None: any)
        self._busy: dict[pymysql.connections.Connection, int | None] = {}

    def connect(self, shard: int | None = None) -> pymysql.connections.Connection:
        conn = self.connect_unless(None, shard=shard)
        assert conn is not None
        return conn

    def connect_unless(self, give_up: Callable[[], bool] | None, poll: float = 0.05,
                       shard: int | None = None) -> pymysql.connections.Connection | None:
        """A new connection, or None if *give_up()* turned true before the server greeted.

        The TCP connect and the wait for the server's greeting happen here, in
        slices of *poll* seconds, instead of inside PyMySQL: both are bounded by
        the connect timeout (PyMySQL waits for the greeting the read timeout), and
        between slices the caller can give up on a master the map no longer names.
        Nothing has been sent to the server before the greeting, so giving up is
        always safe. Raises OperationalError 2003 when no connection is made.
        The connection is handed out for *shard* (see :meth:`end_in_flight`).
        """
        sock = self._open(give_up, poll)
        if sock is None:
            return None
        conn = pymysql.connections.Connection(defer_connect=True, **self._kw)
        conn.host_info = f"socket {self.host}:{self.port}"
        conn.connect(sock)
        try:
            self.tls.check(conn, self.server)
        except Exception as exc:  # the pool's callers take OperationalError 2003
            raise pymysql.err.OperationalError(CR.CR_CONN_HOST_ERROR, str(exc)) from None
        self._busy[conn] = shard
        return conn

    def _open(self, give_up: Callable[[], bool] | None, poll: float) -> socket.socket | None:
        """A TCP socket to the server with its greeting waiting to be read, or None."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            addrs = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise self._cannot(exc) from None
        last: OSError = OSError(f"no address for {self.host}")
        for family, kind, proto, _, addr in addrs:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                rc = sock.connect_ex(addr)
                if rc not in (0, errno.EINPROGRESS):
                    raise OSError(rc, os.strerror(rc))
                if not _wait_ready(sock, select.POLLOUT, deadline, give_up, poll):
                    sock.close()
                    return None
                rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if rc:
                    raise OSError(rc, os.strerror(rc))
                # a server that accepts but never greets is as dead as one that refuses
                if not _wait_ready(sock, select.POLLIN, deadline, give_up, poll):
                    sock.close()
                    return None
                sock.setblocking(True)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:
                sock.close()
                raise
        raise self._cannot(last)

    def _cannot(self, exc: OSError) -> pymysql.err.OperationalError:
        # the error PyMySQL raises for a failed connect, so callers see one errno
        return pymysql.err.OperationalError(
            CR.CR_CONN_HOST_ERROR, f"Can't connect to MySQL server on {self.server!r} ({exc})")

    def get_idle(self, shard: int | None = None) -> pymysql.connections.Connection | None:
        """An idle connection that is still open, or None.

        A pooled connection whose server went away (killed, restarted) has the
        end of the stream, or an error packet, waiting on its socket; it is
        dropped here, before anything is sent on it, so that a write is not sent
        into a dead connection and left not knowing whether it was applied.
        """
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return None
            if _idle_ok(conn):
                self._busy[conn] = shard
                return conn
            log.info("dropping a pooled connection to %s: the server closed it", self.server)
            self.discard(conn)

    def take_idle(self, shard: int | None = None) -> pymysql.connections.Connection | None:
        """The most recently returned idle connection, unchecked, or None.

        For idempotent reads only: a connection the server closed fails the read
        (PyMySQL raises a MySQLError: 2006/2013, or the error packet waiting on the
        socket), and the caller discards it and reads again on a fresh one. Skipping
        :meth:`get_idle`'s poll(2) saves a system call per read (3-6 us, about a third
        of the routing overhead of a primary-key select on loopback)."""
        try:
            conn = self._idle.pop()
        except IndexError:
            return None
        self._busy[conn] = shard
        return conn

    def idle_count(self) -> int:
        return len(self._idle)

    def in_use(self) -> int:
        return len(self._busy)

    def get(self, shard: int | None = None) -> pymysql.connections.Connection:
        conn = self.get_idle(shard)
        return conn if conn is not None else self.connect(shard)

    def put(self, conn: pymysql.connections.Connection) -> None:
        self._busy.pop(conn, None)
        if len(self._idle) < self.size and conn.open:
            self._idle.append(conn)
        else:
            conn.close()

    def discard(self, conn: pymysql.connections.Connection) -> None:
        self._busy.pop(conn, None)
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - already broken
            pass

    def end_in_flight(self, moved: list[tuple[int, int]]) -> tuple[int, int]:
        """The map moved this server off the shards in *moved* (``(first, last)`` ranges):
        end every statement in flight here for one of them (or for a shard not known),
        and close the idle connections. Returns (ended, closed).

        Safe from any thread (the map's watch calls it): a connection in use is only
        shut down (:func:`_shutdown`), and its thread, blocked on its answer, gets the
        end of the stream at once (PyMySQL raises 2013) instead of waiting out the read
        timeout on a hung server. What that thread's caller makes of it is the store's
        policy: a write may have been applied (never repeated), a read is read again
        where the map now says. A connection handed out after this call began is
        caught by its caller's own look at the map (see :meth:`Router.acquire`)."""
        def hit(shard: int | None) -> bool:
            return shard is None or any(a <= shard <= b for a, b in moved)

        ended = closed = 0
        for conn, shard in self._busy.copy().items():
            # still out for that shard (not returned and handed out again meanwhile)
            if hit(shard) and self._busy.get(conn, -1) == shard and _shutdown(conn):
                ended += 1
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                break
            _shutdown(conn)  # its QUIT below is not waited for either way
            self.discard(conn)
            closed += 1
        return ended, closed

    def close(self) -> None:
        while self._idle:
            self.discard(self._idle.pop())


@dataclass
class RouterStats:
    """What a router counts, read by :mod:`shardfleet.metrics` (or by hand): plain
    integers bumped where they happen, so counting costs nothing measurable."""

    map_changes: int = 0          # maps swapped in (any source)
    map_changed_at: float = 0.0   # time.time() of the last swap (0: never)
    refreshes: int = 0            # reads of the store on demand (refresh())
    refresh_failures: int = 0     # of which the store did not answer
    reroutes: int = 0             # statements retried after a refusal or a lost master
    frozen_waits: int = 0         # writes that found their range frozen and waited
    frozen_wait_seconds: float = 0.0  # their waits, summed
    frozen_errors: int = 0        # ShardFrozenError raised (the wait ran out)
    ended_in_flight: int = 0      # statements ended because the map moved their master off


class Router:
    """Routes a shard to its master, from a map kept fresh by the map store.

    Keyword arguments (all documented defaults):

    * ``store`` — a :class:`~shardfleet.mapstore.MapStore`; None means a fixed map.
    * ``shard_map`` — the map to start from when there is no store.
    * ``cache_file`` — where the last good map is kept (None: no file). It is
      written on a thread of the router's own after each new version;
      :meth:`flush_cache` waits for it, and a started or closed router has done so.
    * ``user`` / ``password`` — the application's MySQL credential.
    * ``tls`` (None: off) — a :class:`~shardfleet.tls.TLS`: ``ca_cert``, ``client_cert``,
      ``client_key``, ``check_hostname`` (community.mysql's names) for every connection
      to a master. A production fleet gives ``TLS(ca_cert=...)`` (the name checked).
    * ``pool_size`` (8) — idle connections kept per master.
    * ``connect_timeout`` (5.0 s) — for the TCP connect and the server's greeting.
    * ``read_timeout`` (30.0 s) — for each statement's answer.
    * ``frozen_wait`` (5.0 s) — how long a write to a frozen shard waits for the
      map to move on before :class:`ShardFrozenError`, and how long a write whose
      master cannot be reached waits for the map to name another master
      (:meth:`wait_for_new_master`).
    * ``frozen_poll`` (0.02 s) — how often those waits, and a connect to a
      master, look at the map again.
    """

    def __init__(self, store: MapStore | None = None, *, shard_map: ShardMap | None = None,
                 cache_file: str | Path | None = None, user: str = "shardfleet_app",
                 password: str = "", pool_size: int = 8, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, frozen_wait: float = 5.0,
                 frozen_poll: float = 0.02, tls: TLS | None = None) -> None:
        self.store = store
        self.cache_file = Path(cache_file) if cache_file else None
        self._pool_kw = dict(user=user, password=password, size=pool_size,
                             connect_timeout=connect_timeout, read_timeout=read_timeout,
                             tls=tls)
        if tls is not None and tls.enabled:
            tls.context  # noqa: B018 - a bad certificate file is refused here, not per pool
        self.frozen_wait = frozen_wait
        self.frozen_poll = frozen_poll
        self._pools: dict[str, Pool] = {}
        self._pools_lock = threading.Lock()
        self._changed = threading.Condition()
        self._cache_lock = threading.Condition()
        self._cache_due = False  # the map held is newer than the cache file
        self._cache_busy = False  # the cache writer is writing
        self._cache_closed = False  # the router is closed: the cache writer stops
        self._cache_writer: threading.Thread | None = None
        self._map: ShardMap | None = None
        self.stats = RouterStats()
        self._version = -2
        self.source = "none"  # "store", "cache-file" or "static"
        if shard_map is not None:
            self._swap(shard_map, -1, "static")
        if store is not None:
            self._start_from_store(store)
        if self._map is None:
            raise MapStoreUnavailable(
                "no shard map: the store is unreachable or empty and no cache file exists"
                + (f" at {self.cache_file}" if self.cache_file else ""))
        self.flush_cache()  # a started router has its cache file

    # -- the map ---------------------------------------------------------
    def _start_from_store(self, store: MapStore) -> None:
        try:
            v = store.read()
            if v.map is not None:
                self._swap(v.map, v.version, "store")
        except (MapStoreUnavailable, MapError) as exc:
            log.warning("map store unavailable at start (%s); trying the cache file", exc)
            cached = self._load_cache()
            if cached is not None:
                self._swap(cached, -1, "cache-file")
        store.watch(self._on_map)

    def _on_map(self, new: ShardMap | None, version: int) -> None:
        if new is None:
            log.warning("the map znode is absent; keeping the last good map")
            with self._changed:
                if self.source == "store":
                    # a re-created znode counts its versions from 0 again; without this
                    # the router would take its first versions for stale ones
                    self._version = NO_NODE
            return
        self._swap(new, version, "store")

    def _swap(self, new: ShardMap, version: int, source: str) -> None:
        """Make *new* the current map, unless the one held is newer.

        A refresh reads the map on its own thread and can land after the watch
        delivered a later version (a refused write refreshes while a promotion
        flips the map): going back would hold writes on a frozen range until the
        next change and put the older map in the cache file. So a store map older
        than the one held is dropped, and a cache-file map (version unknown) never
        replaces a store map.
        """
        with self._changed:
            if self.source == "store" and (source != "store" or version < self._version):
                log.info("ignoring shard map version %s from %s: holding version %s from "
                         "the store", version, source, self._version)
                return
            if self._map == new and self.source == source:
                self._version = version
                return
            old = self._map
            self._map, self._version, self.source = new, version, source
            self.stats.map_changes += 1
            self.stats.map_changed_at = time.time()
            self._changed.notify_all()
        log.info("shard map version %s from %s: %d ranges", version, source, len(new.ranges))
        self._end_moved(old, new, version)
        if source == "store":
            self._save_cache()

    def _end_moved(self, old: ShardMap | None, new: ShardMap, version: int) -> None:
        """End the statements in flight on each server *new* moved off some of its shards
        (:meth:`Pool.end_in_flight`), after *new* is the map held: a connection handed
        out later is seen by its caller's look at the map. On a hung master (a stopped
        process, a hung disk) a statement already sent would otherwise wait out the
        read timeout while the promoted master takes the writes.

        Only a server *new* marks for rebuild (an emergency's flip: it may be hung): a
        split's or a planned promotion's flip moves a live master its operation fenced,
        which refuses a statement still in flight there (the caller reroutes it, never
        executed twice); ending it would report a write that never ran as "may have
        happened"."""
        if not self._pools:
            return
        abandoned = {str(r.extra.get("rebuild")) for r in new.ranges if r.extra.get("rebuild")}
        for server, moved in masters_moved(old, new).items():
            pool = self._pools.get(server)
            if pool is None or server not in abandoned:
                continue
            ended, closed = pool.end_in_flight(moved)
            self.stats.ended_in_flight += ended
            if ended or closed:
                log.log(logging.WARNING if ended else logging.INFO,
                        "shard map version %s moved %s off shards %s: ended %d statement(s) "
                        "in flight there, closed %d idle connection(s)",
                        version, server, _ranges_text(moved), ended, closed)

    def _load_cache(self) -> ShardMap | None:
        if not self.cache_file or not self.cache_file.exists():
            return None
        try:
            return shardmap.loads(self.cache_file.read_bytes())
        except (OSError, MapError) as exc:
            log.error("cache file %s is unusable: %s", self.cache_file, exc)
            return None

    def _save_cache(self) -> None:
        """Have the cache file brought up to the map held.

        The file is written by one thread per router, not by the swap: renaming the
        new file over the old makes ext4 start writing it out, which costs a
        millisecond alone and tens of milliseconds with other writers on the disk,
        and the watch thread delivers the next version meanwhile. The writer always
        writes the map held when it starts, so versions that arrive during a write
        are written once, as the newest, and an older map never lands last.
        """
        if not self.cache_file:
            return
        with self._cache_lock:
            self._cache_due = True
            if self._cache_writer is None:
                self._cache_writer = threading.Thread(
                    target=self._write_cache_files, name="shardfleet-map-cache", daemon=True)
                self._cache_writer.start()
            self._cache_lock.notify_all()

    def _write_cache_files(self) -> None:
        assert self.cache_file is not None
        while True:
            with self._cache_lock:
                while not self._cache_due and not self._cache_closed:
                    self._cache_lock.wait()
                if not self._cache_due:
                    return
                self._cache_due, self._cache_busy = False, True
                m = self._map
            try:
                if m is not None and self.source == "store":
                    self.cache_file.parent.mkdir(parents=True, exist_ok=True)
                    fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, prefix=".map-")
                    with os.fdopen(fd, "wb") as f:
                        f.write(m.to_bytes())
                    os.replace(tmp, self.cache_file)
            except OSError as exc:
                log.warning("could not write map cache %s: %s", self.cache_file, exc)
            except Exception:  # noqa: BLE001 - the writer must outlive one bad write
                log.exception("could not write map cache %s", self.cache_file)
            finally:
                with self._cache_lock:
                    self._cache_busy = False
                    self._cache_lock.notify_all()

    def flush_cache(self, timeout: float = 5.0) -> bool:
        """Wait until the cache file holds the map held; False if it did not within
        *timeout* seconds (a write that failed is logged and counts as done)."""
        deadline = time.monotonic() + timeout
        with self._cache_lock:
            while self._cache_due or self._cache_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cache_lock.wait(left)
        return True

    @property
    def map(self) -> ShardMap:
        m = self._map
        assert m is not None
        return m

    @property
    def version(self) -> int:
        return self._version

    def refresh(self) -> bool:
        """Read the map from the store now; False (keeping the last map) if unreachable."""
        if self.store is None:
            return False
        self.stats.refreshes += 1
        try:
            v = self.store.read()
        except (MapStoreUnavailable, MapError) as exc:
            self.stats.refresh_failures += 1
            log.warning("map refresh failed, keeping version %s: %s", self._version, exc)
            return False
        if v.map is not None:
            self._swap(v.map, v.version, "store")
        return True

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Wait until *predicate(map)* holds (re-checked on each map change)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.map):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, self.frozen_poll * 10))
        return True

    def range_for(self, shard: int) -> ShardRange:
        return self.map.range_for(shard)

    def writable_range(self, shard: int) -> ShardRange:
        """The shard's range, waiting (bounded) while it is frozen."""
        r = self.map.range_for(shard)
        if r.state != "frozen":
            return r
        t0 = time.monotonic()
        ok = self.wait_for(lambda m: m.range_for(shard).state != "frozen", self.frozen_wait)
        self.stats.frozen_waits += 1
        self.stats.frozen_wait_seconds += time.monotonic() - t0
        if not ok:
            self.stats.frozen_errors += 1
            raise ShardFrozenError(
                f"shard {shard} is frozen (range [{r.first}, {r.last}] is being moved or "
                f"promoted); the map did not move on within {self.frozen_wait}s")
        return self.map.range_for(shard)

    def wait_for_new_master(self, shard: int, server: str) -> bool:
        """Wait (bounded by ``frozen_wait``) until the map names a master other than
        *server* for *shard*; False if it did not.

        A write whose master could not be reached waits here the way a write to a
        frozen range waits in :meth:`writable_range`: during an emergency promotion
        the old master is dead until the map flips, and the write should land on
        the new one the moment it does rather than fail. The store is read once
        first, in case the watch lags (an older read cannot win, see :meth:`_swap`).
        """
        def moved(m: ShardMap) -> bool:
            r = m.find(shard)
            return r is None or r.master != server

        if moved(self.map):
            return True
        self.refresh()
        return self.wait_for(moved, self.frozen_wait)

    # -- connections -----------------------------------------------------
    def pools(self) -> dict[str, int]:
        """Idle connections held per server (what :mod:`shardfleet.metrics` reports)."""
        with self._pools_lock:
            return {server: p.idle_count() for server, p in self._pools.items()}

    def pool(self, server: str) -> Pool:
        p = self._pools.get(server)
        if p is None:
            with self._pools_lock:
                p = self._pools.get(server)
                if p is None:
                    p = self._pools[server] = Pool(server, **self._pool_kw)  # type: ignore[arg-type]
        return p

    def acquire(self, server: str, shard: int | None = None
                ) -> pymysql.connections.Connection | None:
        """A connection to *server*: an idle one from its pool, else a new one.

        With *shard*, a new connection is given up (None) as soon as the map no
        longer names *server* as the shard's master, so a write held in a connect
        to a dead or silent master goes to the promoted one when the map flips,
        not after the connect timeout. The map is looked at once more after the
        connection is handed out: a map that moved *server* off the shard before
        that is the caller's to follow (None), and one that moves it after ends the
        connection's statement (:meth:`Pool.end_in_flight`). Nothing was sent when
        None is returned. Raises PyMySQL's OperationalError when no connection
        could be made; nothing was sent then either. Return the connection with
        ``pool(server).put`` (or ``discard`` after an error).
        """
        pool = self.pool(server)
        if shard is None:
            return pool.get()

        def moved() -> bool:
            m = self.map.find(shard)
            return m is None or m.master != server

        conn = pool.get_idle(shard)
        if conn is None:
            conn = pool.connect_unless(moved, self.frozen_poll, shard=shard)
        if conn is not None and moved():
            pool.put(conn)  # unused: nothing was sent on it
            return None
        return conn

    @contextmanager
    def connection(self, server: str) -> Iterator[pymysql.connections.Connection]:
        """A connection to *server* for the block (any shard: a map that moves *server*
        off any of its shards ends the block's statement in flight)."""
        pool = self.pool(server)
        conn = pool.get()
        try:
            yield conn
        except BaseException:
            pool.discard(conn)
            raise
        else:
            pool.put(conn)

    def close(self) -> None:
        for p in list(self._pools.values()):
            p.close()
        if self.store is not None:
            self.store.close()
        if not self.flush_cache():
            log.warning("closing with the map cache %s not yet written", self.cache_file)
        with self._cache_lock:
            self._cache_closed = True
            self._cache_lock.notify_all()
            writer = self._cache_writer
        if writer is not None:
            writer.join(1.0)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        return json.dumps({"version": self._version, "source": self.source,
                           "ranges": len(self.map.ranges)})
