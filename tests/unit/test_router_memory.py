"""Router and map store behaviour against the in-memory store (no servers)."""
import threading
import time

import pytest

from shardfleet import shardmap
from shardfleet.errors import MapConflictError, MapStoreUnavailable, ShardFrozenError
from shardfleet.mapstore import NO_NODE, MemoryMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap

M1 = ShardMap.from_ranges([{"range": [0, 15], "master": "a:1", "standby": "b:1"},
                           {"range": [16, 31], "master": "c:1", "standby": "d:1"}])


def test_compare_and_set():
    store = MemoryMapStore()
    assert store.read().version == NO_NODE
    v0 = store.write(M1, NO_NODE)
    with pytest.raises(MapConflictError):
        store.write(M1, NO_NODE)
    v1 = store.write(M1.with_state((0, 15), "closed"), v0)
    assert v1 == v0 + 1
    assert store.read().map.range_for(3).state == "closed"


def test_router_follows_watch_and_writes_cache(tmp_path):
    store = MemoryMapStore(M1)
    cache = tmp_path / "map.json"
    r = Router(store, cache_file=cache)
    assert r.range_for(20).master == "c:1"
    v = store.read().version
    store.write(M1.with_state((16, 31), "closed"), v)
    assert r.range_for(20).state == "closed"
    assert r.flush_cache(), "the cache file was not written within 5s"
    assert shardmap.loads(cache.read_bytes()).range_for(20).state == "closed"


def test_router_starts_from_cache_file_when_store_unavailable(tmp_path):
    cache = tmp_path / "map.json"
    cache.write_bytes(M1.to_bytes())
    store = MemoryMapStore(M1.with_state((0, 15), "closed"))
    store.available = False
    r = Router(store, cache_file=cache)
    assert r.source == "cache-file"
    assert r.range_for(0).state == "open"


def test_router_without_map_or_cache_refuses(tmp_path):
    store = MemoryMapStore()
    store.available = False
    with pytest.raises(MapStoreUnavailable, match="no shard map"):
        Router(store, cache_file=tmp_path / "absent.json")


def test_frozen_write_waits_then_fails():
    store = MemoryMapStore(M1.with_state((0, 15), "frozen"))
    r = Router(store, frozen_wait=0.2)
    t0 = time.monotonic()
    with pytest.raises(ShardFrozenError, match="frozen"):
        r.writable_range(3)
    assert time.monotonic() - t0 >= 0.2


def test_frozen_write_proceeds_when_map_moves_on():
    store = MemoryMapStore(M1.with_state((0, 15), "frozen"))
    r = Router(store, frozen_wait=5)
    moved = M1.replace_range(M1.range_for(0), M1.range_for(0).__class__(0, 15, "e:1", "f:1"))

    def flip():
        time.sleep(0.1)
        store.write(moved, store.read().version)

    threading.Thread(target=flip).start()
    assert r.writable_range(3).master == "e:1"


def test_create_waits_for_a_frozen_open_range_instead_of_failing():
    from shardfleet.store import Store

    frozen = ShardMap.from_ranges([{"range": [0, 15], "master": "a:1", "state": "frozen",
                                    "frozen_from": "open"},
                                   {"range": [16, 31], "master": "c:1", "state": "closed"}])
    s = Store(Router(MemoryMapStore(frozen)))
    assert 0 <= s._pick_shard() <= 15
    s.close()


class _StaleReadStore(MemoryMapStore):
    """A store whose next read() returns a version captured earlier: a refresh that read
    the frozen map and lands after the watch delivered the flip."""

    def __init__(self, initial: ShardMap) -> None:
        super().__init__(initial)
        self.stale = None

    def read(self):
        if self.stale is not None:
            v, self.stale = self.stale, None
            return v
        return super().read()


def test_refresh_that_read_an_older_version_does_not_go_back(tmp_path):
    store = _StaleReadStore(M1)
    cache = tmp_path / "map.json"
    r = Router(store, cache_file=cache, frozen_wait=0.2)
    frozen = M1.with_state((0, 15), "frozen")
    store.write(frozen, store.read().version)
    store.stale = store.read()  # the refresh's read: version N, frozen
    flipped = M1.replace_range(M1.range_for(0), M1.range_for(0).__class__(0, 15, "e:1", "f:1"))
    newest = store.write(flipped, store.stale.version)  # the watch delivers N+1
    assert r.version == newest
    assert r.refresh()  # lands with version N
    assert r.version == newest and r.map == flipped
    assert r.writable_range(3).master == "e:1"
    assert r.flush_cache()
    assert shardmap.loads(cache.read_bytes()) == flipped


def test_older_version_from_the_watch_is_ignored_and_not_cached(tmp_path):
    store = MemoryMapStore(M1)
    cache = tmp_path / "map.json"
    r = Router(store, cache_file=cache)
    closed = M1.with_state((16, 31), "closed")
    v1 = store.write(closed, store.read().version)
    r._on_map(M1, v1 - 1)  # a late delivery of the version before
    assert r.version == v1 and r.range_for(20).state == "closed"
    assert r.flush_cache()
    assert shardmap.loads(cache.read_bytes()) == closed


def test_cache_file_map_never_replaces_a_store_map(tmp_path):
    store = MemoryMapStore(M1.with_state((0, 15), "closed"))
    cache = tmp_path / "map.json"
    r = Router(store, cache_file=cache)
    r._swap(M1, -1, "cache-file")
    assert r.source == "store" and r.range_for(0).state == "closed"
    assert r.flush_cache()
    assert shardmap.loads(cache.read_bytes()).range_for(0).state == "closed"


def test_a_slow_cache_file_does_not_hold_the_swap_and_ends_on_the_newest_map(
        tmp_path, monkeypatch):
    """The cache file is written off the watch's thread: while one write hangs, new
    versions are routed at once; the file then gets the newest, never an older one."""
    import os

    store = MemoryMapStore(M1)
    cache = tmp_path / "map.json"
    r = Router(store, cache_file=cache)
    assert shardmap.loads(cache.read_bytes()) == M1, "a started router has its cache file"
    entered, release = threading.Event(), threading.Event()
    real_replace = os.replace
    written = []

    def slow_replace(src, dst):
        entered.set()
        assert release.wait(10), "the test never released the cache write"
        written.append(shardmap.loads(open(src, "rb").read()))
        real_replace(src, dst)

    monkeypatch.setattr("shardfleet.router.os.replace", slow_replace)
    m = M1
    for state in ("closed", "frozen", "open", "closed"):
        m = m.with_state((16, 31), state)
        store.write(m, store.read().version)
        assert r.map == m, "a swap waited for the cache file"
        assert entered.wait(5), "the cache writer did not start"
    assert not r.flush_cache(timeout=0.1), "flush returned while the write hung"
    release.set()
    assert r.flush_cache(), "the cache file was not written within 5s"
    assert shardmap.loads(cache.read_bytes()) == m
    assert written[-1] == m and len(written) <= 2, "versions during a write are written once"
    r.close()
    assert not r._cache_writer.is_alive(), "the cache writer outlived close()"
