"""The map in a real ZooKeeper: compare-and-set, validation, watches, and outages."""
from __future__ import annotations

import time

import pytest

from shardfleet import ids, shardmap
from shardfleet.errors import MapConflictError, MapError, MapStoreUnavailable, ShardFrozenError
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.schema import default_schema
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import ZooKeeperServer, free_port

from .conftest import APP_PASSWORD, APP_USER, make_shards


def wait_until(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_compare_and_set_and_validation(zookeeper, cluster, base_map):
    s1 = ZooKeeperMapStore(zookeeper.address, cluster)
    s2 = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        v = s1.read()
        assert v.map == base_map
        closed = base_map.with_state((0, 15), "closed")
        s1.write(closed, v.version)
        with pytest.raises(MapConflictError, match="another writer"):
            s2.write(base_map, v.version)
        assert s2.read().map == closed
        with pytest.raises(MapConflictError):
            s2.write(base_map, NO_NODE)
        # an invalid map never reaches ZooKeeper
        bad = ShardMap(base_map.ranges + base_map.ranges[:1])
        before = s1.read()
        with pytest.raises(MapError, match="overlaps"):
            s1.write(bad, before.version)
        assert s1.read() == before
    finally:
        s1.close()
        s2.close()


def test_second_router_sees_map_change_through_watch(zookeeper, cluster, router, tmp_path):
    other = Router(ZooKeeperMapStore(zookeeper.address, cluster), user=APP_USER,
                   password=APP_PASSWORD)
    try:
        writer = ZooKeeperMapStore(zookeeper.address, cluster)
        v = writer.read()
        writer.write(v.map.with_state((16, 31), "closed"), v.version)
        wait_until(lambda: other.range_for(20).state == "closed", what="watch delivery")
        wait_until(lambda: router.range_for(20).state == "closed", what="watch delivery")
        assert other.version == v.version + 1
        writer.close()
    finally:
        other.close()


def test_router_refuses_a_version_one_bad_line_away_from_its_map(zookeeper, cluster, router,
                                                                 caplog):
    """The router holds every line of its map, checked; a version whose one changed line is
    bad (written past the store's own check) is refused through the watch and the last
    good map kept; the next good version is taken."""
    writer = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        v = writer.read()
        good = v.map.to_bytes()
        bad = good.replace(b'"state": "open"}', b'"state": "melting"}', 1)
        assert bad != good and bad.count(b"\n") == good.count(b"\n")
        with pytest.raises(MapError, match="melting"):
            shardmap.loads(bad)
        caplog.set_level("ERROR", logger="shardfleet.mapstore")
        refused = writer.write_raw(writer.path, bad, v.version)
        wait_until(lambda: any(f"invalid map version {refused}" in r.getMessage()
                               for r in caplog.records), what="the watch to refuse it")
        assert router.version == v.version and router.range_for(3).state == "open"
        writer.write(v.map.with_state((16, 31), "closed"), refused)
        wait_until(lambda: router.range_for(20).state == "closed", what="the next version")
        assert router.version == refused + 1 and router.range_for(3).state == "open"
    finally:
        writer.close()


def test_unreachable_zookeeper_is_a_clear_error():
    t0 = time.monotonic()
    store = ZooKeeperMapStore(f"127.0.0.1:{free_port()}", "x", timeout=1.0)
    try:
        with pytest.raises(MapStoreUnavailable, match="unreachable"):
            store.read()
    finally:
        store.close()
    assert time.monotonic() - t0 < 10


def test_router_serves_while_zookeeper_is_away_and_starts_from_cache(
        tmp_path, mariadb_pair, base_map):
    zk = ZooKeeperServer(tmp_path).start()
    cache = tmp_path / "map.json"
    try:
        ZooKeeperMapStore(zk.address, "c1").write(base_map, NO_NODE)
        r = Router(ZooKeeperMapStore(zk.address, "c1", timeout=2.0), cache_file=cache,
                   user=APP_USER, password=APP_PASSWORD)
        s = Store(r)
        pin = s.create("pin", {"before": True})
        assert cache.exists()
        zk.stop()  # ZooKeeper goes away
        assert s.get(pin) == {"before": True}
        during = s.create("pin", {"during": True})
        s.update(pin, {"during": True})
        assert s.get(during) == {"during": True}
        # a new process starts while ZooKeeper is still down: from the cache file
        r2 = Router(ZooKeeperMapStore(zk.address, "c1", timeout=1.0), cache_file=cache,
                    user=APP_USER, password=APP_PASSWORD)
        assert r2.source == "cache-file"
        assert Store(r2).get(during) == {"during": True}
        # ZooKeeper comes back (same data, same port): the watch delivers new versions
        zk.start()
        writer = ZooKeeperMapStore(zk.address, "c1")
        v = writer.read()
        writer.write(v.map.with_state((0, 15), "closed"), v.version)
        wait_until(lambda: r2.range_for(3).state == "closed", 30, "r2 to follow after outage")
        wait_until(lambda: r.range_for(3).state == "closed", 30, "r to follow after outage")
        assert r2.source == "store"
        writer.close()
        r.close()
        r2.close()
    finally:
        zk.stop(remove=True)


class _NoWatchStore(ZooKeeperMapStore):
    """A router behind on the map: it learns only when it refreshes."""

    def watch(self, callback):
        pass


def test_fenced_shard_refreshes_map_and_retries_once(zookeeper, cluster, mariadb_pair,
                                                     base_map):
    a, b = mariadb_pair
    make_shards(b, [5])  # shard 5 is "moved" from a to b
    stale = Router(_NoWatchStore(zookeeper.address, cluster), user=APP_USER,
                   password=APP_PASSWORD)
    s = Store(stale)
    board = ids.compose(5, 2, 1)
    writer = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        v = writer.read()
        m = v.map
        r = m.range_for(5)
        moved = m.replace_range(
            r, r.__class__(0, 4, r.master), r.__class__(5, 5, b.address),
            r.__class__(6, 15, r.master))
        writer.write(moved, v.version)
        a.sql(f"REVOKE SELECT, INSERT, UPDATE, DELETE ON `db00005`.* FROM '{APP_USER}'@'%'")
        assert stale.range_for(5).master == a.address  # still stale
        pin = s.create("pin", {"fenced": "no"}, near=board)
        assert stale.range_for(5).master == b.address  # refreshed after the refusal
        rows = b.sql("SELECT COUNT(*) FROM db00005.pins WHERE local_id=%s",
                     (ids.decompose(pin).local,))
        assert rows == [(1,)]
        assert a.sql("SELECT COUNT(*) FROM db00005.pins WHERE body LIKE %s",
                     ('%"fenced"%',))[0][0] == 0, "the fenced server took the write"
    finally:
        a.sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON `db00005`.* TO '{APP_USER}'@'%'")
        writer.close()
        stale.close()


def test_write_to_frozen_shard_waits_then_fails(zookeeper, cluster, router, store):
    writer = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        # the session's servers are shared: another module's store may have created this
        # board (the store picks a shard at random) and mapped pins to it
        board = ids.compose(16, 2, 1)
        before = store.count("board_has_pins", board)
        v = writer.read()
        writer.write(v.map.with_state((16, 31), "frozen"), v.version)
        wait_until(lambda: router.range_for(16).state == "frozen")
        t0 = time.monotonic()
        with pytest.raises(ShardFrozenError, match="frozen"):
            store.add("board_has_pins", board, ids.compose(16, 1, 1))
        assert time.monotonic() - t0 >= router.frozen_wait
        # reads still work on a frozen shard, and the refused write added nothing
        assert store.count("board_has_pins", board) == before
    finally:
        writer.close()


def test_schema_tables_exist_on_both_servers(mariadb_pair):
    for server in mariadb_pair:
        n = server.sql("SELECT COUNT(*) FROM information_schema.TABLES "
                       "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")[0][0]
        assert n >= 16 * len(default_schema().tables)


def test_get_many_refreshes_after_a_fence_and_retries(zookeeper, cluster, mariadb_pair):
    a, b = mariadb_pair
    make_shards(b, [6])  # shard 6 is "moved" from a to b, with its row
    b.sql("INSERT INTO db00006.pins (body) VALUES ('{\"moved\": 1}')")
    moved = ids.compose(6, 1, int(b.sql("SELECT MAX(local_id) FROM db00006.pins")[0][0]))
    stale = Router(_NoWatchStore(zookeeper.address, cluster), user=APP_USER,
                   password=APP_PASSWORD)
    s = Store(stale)
    other = s.create("pin", {"on": "b"}, near=ids.compose(20, 2, 1))
    writer = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        v = writer.read()
        r = v.map.range_for(6)
        writer.write(v.map.replace_range(
            r, r.__class__(0, 5, r.master), r.__class__(6, 6, b.address),
            r.__class__(7, 15, r.master)), v.version)
        a.sql(f"REVOKE SELECT, INSERT, UPDATE, DELETE ON `db00006`.* FROM '{APP_USER}'@'%'")
        assert stale.range_for(6).master == a.address  # still stale
        res = s.get_many([moved, other])  # a's refusal: refresh, regroup, one retry
        assert res.bodies() == [{"moved": 1}, {"on": "b"}] and res.missing == []
        assert stale.range_for(6).master == b.address
    finally:
        a.sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON `db00006`.* TO '{APP_USER}'@'%'")
        writer.close()
        stale.close()
