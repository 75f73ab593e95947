"""The router: the current shard map, and a small connection pool per master.

A router keeps the last good map in memory and in a local cache file. It starts
from that file when the map's store is unreachable, keeps serving from it while
the store is away, and swaps in each new valid version its watch delivers.
Production reads and writes go to masters only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pymysql

from shardfleet import shardmap
from shardfleet.errors import (
    MapError,
    MapStoreUnavailable,
    ShardFrozenError,
)
from shardfleet.mapstore import NO_NODE, MapStore
from shardfleet.shardmap import ShardMap, ShardRange

log = logging.getLogger(__name__)


def split_hostport(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    return host.strip("[]"), int(port)


class Pool:
    """A small LIFO pool of PyMySQL connections to one server.

    ``deque.append``/``pop`` are atomic, so the pool needs no lock. At most
    *size* idle connections are kept; more are opened on demand and closed when
    returned.
    """

    def __init__(self, server: str, *, user: str, password: str, size: int = 8,
                 connect_timeout: float = 5.0, read_timeout: float = 30.0) -> None:
        self.server = server
        self.host, self.port = split_hostport(server)
        self._kw = dict(host=self.host, port=self.port, user=user, password=password,
                        charset="utf8mb4", autocommit=True, connect_timeout=connect_timeout,
                        read_timeout=read_timeout, write_timeout=read_timeout)
        self.size = size
        self._idle: deque[pymysql.connections.Connection] = deque()

    def connect(self) -> pymysql.connections.Connection:
        return pymysql.connect(**self._kw)

    def get(self) -> pymysql.connections.Connection:
        try:
            return self._idle.pop()
        except IndexError:
            return self.connect()

    def put(self, conn: pymysql.connections.Connection) -> None:
        if len(self._idle) < self.size and conn.open:
            self._idle.append(conn)
        else:
            conn.close()

    def discard(self, conn: pymysql.connections.Connection) -> None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - already broken
            pass

    def close(self) -> None:
        while self._idle:
            self.discard(self._idle.pop())


class Router:
    """Routes a shard to its master, from a map kept fresh by the map store.

    Keyword arguments (all documented defaults):

    * ``store`` — a :class:`~shardfleet.mapstore.MapStore`; None means a fixed map.
    * ``shard_map`` — the map to start from when there is no store.
    * ``cache_file`` — where the last good map is kept (None: no file).
    * ``user`` / ``password`` — the application's MySQL credential.
    * ``pool_size`` (8) — idle connections kept per master.
    * ``frozen_wait`` (5.0 s) — how long a write to a frozen shard waits for the
      map to move on before :class:`ShardFrozenError`.
    """

    def __init__(self, store: MapStore | None = None, *, shard_map: ShardMap | None = None,
                 cache_file: str | Path | None = None, user: str = "shardfleet_app",
                 password: str = "", pool_size: int = 8, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, frozen_wait: float = 5.0,
                 frozen_poll: float = 0.02) -> None:
        self.store = store
        self.cache_file = Path(cache_file) if cache_file else None
        self._pool_kw = dict(user=user, password=password, size=pool_size,
                             connect_timeout=connect_timeout, read_timeout=read_timeout)
        self.frozen_wait = frozen_wait
        self.frozen_poll = frozen_poll
        self._pools: dict[str, Pool] = {}
        self._pools_lock = threading.Lock()
        self._changed = threading.Condition()
        self._cache_lock = threading.Lock()
        self._map: ShardMap | None = None
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
            self._map, self._version, self.source = new, version, source
            self._changed.notify_all()
        log.info("shard map version %s from %s: %d ranges", version, source, len(new.ranges))
        if source == "store":
            self._save_cache(new)

    def _load_cache(self) -> ShardMap | None:
        if not self.cache_file or not self.cache_file.exists():
            return None
        try:
            return shardmap.loads(self.cache_file.read_bytes())
        except (OSError, MapError) as exc:
            log.error("cache file %s is unusable: %s", self.cache_file, exc)
            return None

    def _save_cache(self, m: ShardMap) -> None:
        """Write *m* to the cache file if it is still the current map.

        Two swaps save outside the map lock; checking under the file lock that *m*
        is still current keeps a slower save of an older map from landing last.
        """
        if not self.cache_file:
            return
        with self._cache_lock:
            if self._map is not m:
                return
            try:
                self.cache_file.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, prefix=".map-")
                with os.fdopen(fd, "wb") as f:
                    f.write(m.to_bytes())
                os.replace(tmp, self.cache_file)
            except OSError as exc:
                log.warning("could not write map cache %s: %s", self.cache_file, exc)

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
        try:
            v = self.store.read()
        except (MapStoreUnavailable, MapError) as exc:
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
        ok = self.wait_for(lambda m: m.range_for(shard).state != "frozen", self.frozen_wait)
        if not ok:
            raise ShardFrozenError(
                f"shard {shard} is frozen (range [{r.first}, {r.last}] is being moved or "
                f"promoted); the map did not move on within {self.frozen_wait}s")
        return self.map.range_for(shard)

    # -- connections -----------------------------------------------------
    def pool(self, server: str) -> Pool:
        p = self._pools.get(server)
        if p is None:
            with self._pools_lock:
                p = self._pools.get(server)
                if p is None:
                    p = self._pools[server] = Pool(server, **self._pool_kw)  # type: ignore[arg-type]
        return p

    @contextmanager
    def connection(self, server: str) -> Iterator[pymysql.connections.Connection]:
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

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        return json.dumps({"version": self._version, "source": self.source,
                           "ranges": len(self.map.ranges)})
