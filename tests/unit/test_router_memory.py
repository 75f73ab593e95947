"""Router and map store behaviour against the in-memory store (no servers)."""
import threading
import time

import pytest

from shardfleet import metrics, shardmap
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


# -- statements in flight on a server the map moves off their shards ----------------------

def _moved(old, new):
    from shardfleet.router import masters_moved

    return masters_moved(ShardMap.from_ranges(old), ShardMap.from_ranges(new))


def test_masters_moved_names_the_shards_each_master_lost():
    two = [{"range": [0, 15], "master": "a:1"}, {"range": [16, 31], "master": "c:1"}]
    assert _moved(two, two) == {}
    assert _moved(two, [{**two[0], "state": "frozen"}, two[1]]) == {}, "a state is no move"
    flipped = [{"range": [0, 15], "master": "b:1"}, two[1]]
    assert _moved(two, flipped) == {"a:1": [(0, 15)]}
    split = [{"range": [0, 7], "master": "a:1"}, {"range": [8, 15], "master": "e:1"}, two[1]]
    assert _moved(two, split) == {"a:1": [(8, 15)]}
    assert _moved(split, two) == {"e:1": [(8, 15)]}
    assert _moved(two, [two[0]]) == {"c:1": [(16, 31)]}, "a range gone is a range lost"
    gap = [{"range": [0, 3], "master": "a:1"}, {"range": [10, 15], "master": "a:1"}, two[1]]
    assert _moved(two, gap) == {"a:1": [(4, 9)]}
    both = [{"range": [0, 31], "master": "c:1"}]
    assert _moved(two, both) == {"a:1": [(0, 15)]}


class _Blocked:
    """A PyMySQL connection over a socketpair whose peer never answers (a hung server),
    and a thread blocked reading its answer."""

    def __init__(self) -> None:
        import socket

        import pymysql

        self.sock, self.peer = socket.socketpair()
        self.conn = pymysql.connections.Connection(defer_connect=True, host="a", port=1)
        self.conn._sock = self.sock
        self.conn._rfile = self.sock.makefile("rb")
        self.conn._current_timeout = None  # what connect() sets (PyMySQL >= 1.1)
        self.error: BaseException | None = None
        self.ended = threading.Event()

    def read(self) -> None:
        def run() -> None:
            try:
                self.conn._read_packet()
            except BaseException as exc:  # noqa: BLE001 - checked by the test
                self.error = exc
            finally:
                self.ended.set()

        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self.peer.close()
        self.sock.close()


def test_a_map_moving_a_master_off_a_shard_ends_its_statements_in_flight_there():
    """The watch's thread shuts down the connections handed out for a shard the master
    lost (or for no known shard): their readers get 2013 at once, not the read timeout.
    One handed out for a shard the server keeps, and other servers, are left alone; the
    server's idle connections are closed."""
    import pymysql

    m = ShardMap.from_ranges([{"range": [0, 15], "master": "a:1"},
                              {"range": [16, 31], "master": "a:1"}])
    store = MemoryMapStore(m)
    r = Router(store)
    pool = r.pool("a:1")
    lost, kept, unknown, idle = _Blocked(), _Blocked(), _Blocked(), _Blocked()
    try:
        pool.put(lost.conn)
        assert r.acquire("a:1", 3) is lost.conn  # for shard 3, which moves
        pool.put(kept.conn)
        assert pool.take_idle(20) is kept.conn  # for shard 20, which stays
        pool.put(unknown.conn)
        assert pool.get() is unknown.conn  # for no known shard (a batch)
        pool.put(idle.conn)
        assert pool.in_use() == 3 and pool.idle_count() == 1
        for b in (lost, kept, unknown):
            b.read()
        time.sleep(0.05)
        assert not any(b.ended.is_set() for b in (lost, kept, unknown)), [
            b.error for b in (lost, kept, unknown)]
        moved = m.replace_range(m.range_for(0), m.range_for(0).__class__(
            0, 15, "b:1", "a:1", extra={"rebuild": "a:1"}))  # an emergency's flip
        t0 = time.monotonic()
        store.write(moved, store.read().version)
        for b in (lost, unknown):
            assert b.ended.wait(2), "a statement in flight was not ended"
            assert isinstance(b.error, pymysql.err.OperationalError), repr(b.error)
            assert b.error.args[0] == 2013, b.error
        assert time.monotonic() - t0 < 1.0
        assert not kept.ended.wait(0.2), f"a shard a:1 keeps was ended: {kept.error!r}"
        assert pool.idle_count() == 0 and not idle.conn.open, "idle connections stay"
        assert r.stats.ended_in_flight == 2
        ended = [x.value for x in metrics.router_samples(r)
                 if x.name == "shardfleet_router_ended_in_flight_total"]
        assert ended == [2.0], ended
        pool.discard(lost.conn)
        pool.discard(unknown.conn)
        assert pool.in_use() == 1
    finally:
        for b in (lost, kept, unknown, idle):
            b.close()
        r.close()


def test_a_planned_move_leaves_statements_in_flight_on_the_old_master_alone():
    """A split's or a planned promotion's flip moves a live, fenced master off shards: a
    statement in flight there is refused by the fence (and rerouted, never executed
    twice), so the router does not end it as "may have happened". Only a flip that marks
    the old master for rebuild (an emergency: it may be hung) ends them."""
    m = ShardMap.from_ranges([{"range": [0, 15], "master": "a:1", "standby": "b:1"}])
    store = MemoryMapStore(m)
    r = Router(store)
    pool = r.pool("a:1")
    split = _Blocked()
    try:
        pool.put(split.conn)
        assert r.acquire("a:1", 3) is split.conn
        split.read()
        r0 = m.range_for(0)
        store.write(m.replace_range(r0, r0.__class__(0, 15, "b:1", "a:1")),
                    store.read().version)
        assert r.wait_for(lambda mm: mm.range_for(3).master == "b:1", 2)
        assert not split.ended.wait(0.3), f"a planned move ended a statement: {split.error!r}"
        assert r.stats.ended_in_flight == 0
    finally:
        split.close()
        r.close()


def test_a_connection_handed_out_after_the_map_moved_is_not_used():
    """acquire() looks at the map after handing a connection out: if the map no longer
    names the server for the shard, the connection goes back unused (None: route again)."""
    m = ShardMap.from_ranges([{"range": [0, 15], "master": "a:1"}])
    r = Router(shard_map=m)
    pool = r.pool("a:1")
    b = _Blocked()
    try:
        pool.put(b.conn)
        r._map = m.replace_range(m.range_for(0), m.range_for(0).__class__(0, 15, "b:1"))
        assert r.acquire("a:1", 3) is None
        assert pool.idle_count() == 1 and pool.in_use() == 0
    finally:
        b.close()
        r.close()
