"""Fixtures of the cache tests: real memcached and Redis host processes on 127.0.0.1.

Imported by the test_cache*.py modules (``from .cache_fixtures import ...``); the
shared conftest is left as it is.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from shardfleet.cache import MappingCache, ObjectCache, redis_options
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import MemcachedServer, RedisServer


@pytest.fixture(scope="session")
def memcached_group(tmp_path_factory):
    """Two memcached servers: the object cache's group (shared by the session)."""
    base = tmp_path_factory.mktemp("memcached")
    servers = [MemcachedServer(base).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop(remove=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    r = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield r
    r.stop(remove=True)


def object_cache(servers, prefix: str | None = None, **kw) -> ObjectCache:
    kw.setdefault("retry_timeout", 0.2)
    return ObjectCache([s.address for s in servers],
                       prefix=prefix or f"t{uuid.uuid4().hex[:8]}:o:", **kw)


def mapping_cache(server, prefix: str | None = None, **kw) -> MappingCache:
    client = redis.Redis(host="127.0.0.1", port=server.port, **redis_options())
    return MappingCache(client, prefix=prefix or f"t{uuid.uuid4().hex[:8]}:m:", **kw)


@pytest.fixture
def caches(memcached_group, redis_server):
    """A fresh key prefix per test, so tests never see each other's entries."""
    oc, mc = object_cache(memcached_group), mapping_cache(redis_server)
    yield oc, mc
    oc.close()
    mc.close()


@pytest.fixture
def cache_router(mariadb_pair):
    """A router over both servers with a fixed map in which shard 5 takes no new objects.

    test_map_zookeeper's fence test counts every pin in db00005 on the first
    server and expects none; the cache tests create objects on random open
    shards and run before it, so shard 5 is left out of the open ranges here.
    """
    from .conftest import APP_PASSWORD, APP_USER

    a, b = mariadb_pair
    m = ShardMap.from_ranges([
        {"range": [0, 4], "master": a.address, "state": "open"},
        {"range": [5, 5], "master": a.address, "state": "closed"},
        {"range": [6, 15], "master": a.address, "state": "open"},
        {"range": [16, 31], "master": b.address, "state": "open"},
    ], mod_shard_count=32)
    r = Router(shard_map=m, user=APP_USER, password=APP_PASSWORD)
    yield r
    r.close()


@pytest.fixture
def cached_store(cache_router, caches):
    oc, mc = caches
    s = Store(cache_router, object_cache=oc, mapping_cache=mc)
    yield s
    s.close()


class BarrierProxies:
    """TCP proxies in front of memcached servers that, while armed, hold every reply
    until each proxy of the group has received a request.

    A client that asks the servers in parallel (every request sent before any reply
    is read) passes at once. A client that waits for one server's reply before asking
    the next gets it only when the proxy gives up holding (*hold* seconds); each such
    release is counted in :attr:`timeouts`, which is how a test tells the two apart
    without measuring any time.
    """

    def __init__(self, servers, hold: float = 2.0) -> None:
        import socket
        import threading

        self.hold = hold
        self.timeouts = 0
        self._cond = threading.Condition()
        self._armed = False
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._socks: list = []
        self.listeners = []
        for i, s in enumerate(servers):
            ls = socket.create_server(("127.0.0.1", 0))
            self.listeners.append(ls)
            threading.Thread(target=self._accept, args=(i, ls, s.port), daemon=True,
                             name=f"barrier-accept-{i}").start()
        self.addresses = [f"127.0.0.1:{ls.getsockname()[1]}" for ls in self.listeners]

    def arm(self) -> None:
        """From now on, replies wait until every proxy has seen a request."""
        with self._cond:
            self._armed, self._seen = True, set()
            self.timeouts = 0

    def disarm(self) -> None:
        with self._cond:
            self._armed = False
            self._cond.notify_all()

    def _accept(self, i: int, ls, port: int) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                client, _ = ls.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            self._socks += [client, upstream]
            threading.Thread(target=self._requests, args=(i, client, upstream),
                             daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client),
                             daemon=True).start()

    def _requests(self, i: int, client, upstream) -> None:
        try:
            while data := client.recv(65536):
                with self._cond:
                    self._seen.add(i)
                    self._cond.notify_all()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            upstream.close()

    def _replies(self, upstream, client) -> None:
        n = len(self.listeners)
        try:
            while data := upstream.recv(65536):
                with self._cond:
                    if self._armed and not self._cond.wait_for(
                            lambda: not self._armed or len(self._seen) == n, self.hold):
                        self.timeouts += 1
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self.disarm()
        for s in self.listeners + self._socks:
            s.close()
