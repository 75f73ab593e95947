"""Objects through memcache and mapping pages through Redis, on real servers.

A value "served from the cache" is proven by changing the row behind the
store's back (raw SQL on the shard): the cached store still answers the old
value until a write through the store invalidates it.
"""

from __future__ import annotations

import json
import logging
import random

import pytest

from shardfleet import ids
from shardfleet.cache import MappingCache, ObjectCache
from shardfleet.errors import ObjectNotFound
from shardfleet.store import Store

from .cache_fixtures import BarrierProxies, mapping_cache, object_cache
from .conftest import SHARDS_A


def _server(mariadb_pair, object_id):
    return mariadb_pair[0] if ids.shard_of(object_id) in SHARDS_A else mariadb_pair[1]


def _behind_back(mariadb_pair, object_id, body):
    """Rewrite an object's row directly on its shard, bypassing the store and its caches."""
    oid = ids.decompose(object_id)
    table = {1: "pins", 2: "boards", 3: "users"}[oid.type]
    _server(mariadb_pair, object_id).sql(
        f"UPDATE db{oid.shard:05d}.{table} SET body=%s WHERE local_id=%s",
        (json.dumps(body), oid.local))


def test_get_reads_through_and_update_delete_invalidate(cached_store, caches, mariadb_pair):
    oc, _ = caches
    pin = cached_store.create("pin", {"title": "a"})
    assert cached_store.get(pin) == {"title": "a"}
    assert (oc.stats.hits, oc.stats.misses, oc.stats.fills) == (0, 1, 1), "first get is a miss"
    _behind_back(mariadb_pair, pin, {"title": "changed behind the cache"})
    assert cached_store.get(pin) == {"title": "a"}, "second get must be served from memcache"
    assert oc.stats.hits == 1

    assert cached_store.update(pin, {"title": "b"})["title"] == "b"
    assert cached_store.get(pin) == {"title": "b"}, "update must invalidate the cached body"
    assert cached_store.delete(pin)
    with pytest.raises(ObjectNotFound, match="deleted"):
        cached_store.get(pin)
    assert cached_store.get(pin, include_inactive=True)["active"] is False
    assert cached_store.delete(pin, hard=True)
    with pytest.raises(ObjectNotFound):
        cached_store.get(pin, include_inactive=True)


def test_get_many_one_multiget_then_db_for_misses(cached_store, caches, mariadb_pair):
    oc, _ = caches
    made = [cached_store.create("pin", {"n": i}) for i in range(40)]
    assert len({ids.shard_of(i) for i in made}) >= 8
    warm = made[:10]
    for p in warm:
        cached_store.get(p)
    oc.stats.reset()
    res = cached_store.get_many(made)
    assert [b["n"] for b in res.bodies()] == list(range(40))
    assert (oc.stats.hits, oc.stats.misses) == (10, 30), "10 warm hits, 30 misses from MySQL"
    oc.stats.reset()
    for p in made[:5]:
        _behind_back(mariadb_pair, p, {"n": -1})
    assert [b["n"] for b in cached_store.get_many(made).bodies()] == list(range(40))
    assert (oc.stats.hits, oc.stats.misses) == (40, 0), "all 40 served from memcache"

    cached_store.update(made[1], {"n": 100})
    cached_store.delete(made[2])
    cached_store.delete(made[3], hard=True)
    res = cached_store.get_many(made[:6])
    assert [b["n"] for b in res.bodies()] == [0, 100, 4, 5], "made[0], [4], [5] stay cached"
    assert res.missing == [made[2], made[3]]


def test_multiget_asks_every_memcached_server_before_reading_a_reply(memcached_group):
    """The object multi-get sends its request to every server before it reads any reply:
    behind proxies that hold each reply until both servers were asked, a multi-get
    asking one server after the other gets a reply only when a proxy gives up."""
    proxies = BarrierProxies(memcached_group, hold=2.0)
    # long socket timeouts: a held reply is released by the proxy, never timed out here
    oc = ObjectCache(proxies.addresses, timeout=10.0, connect_timeout=10.0,
                     prefix=f"barrier{random.getrandbits(32)}:o:")
    try:
        bodies = {ids.compose(s, 1, 1): f'{{"s":{s}}}'.encode() for s in range(40)}
        oc.fill_many(bodies)
        assert oc.get_many(bodies) == bodies, "filled bodies read back (proxies not armed)"
        nodes = {oc.client.hasher.get_node(oc.key(i)) for i in bodies}
        assert len(nodes) == 2, "the keys span both servers"
        for _ in range(3):
            proxies.arm()
            assert oc.get_many(bodies) == bodies, "every key is a hit"
            assert proxies.timeouts == 0, (
                f"{proxies.timeouts} memcached replies were awaited before the other "
                "server had been asked: the multi-get asks the servers one after the other")
        assert oc.health.errors == 0
    finally:
        proxies.disarm()
        oc.close()
        proxies.close()


def test_pymemcache_socket_contract(memcached_group):
    """What the parallel multi-get relies on in pymemcache's Client, on a real server:
    ``sock`` is None until a public command (``version``) connects it, then a socket
    with the client's timeout on which raw commands are answered; ``close`` resets it."""
    from pymemcache.client.base import Client

    from shardfleet.cache import _read_values

    who = "pymemcache changed what shardfleet.cache relies on: "
    c = Client(("127.0.0.1", memcached_group[0].port), timeout=3.0, connect_timeout=3.0)
    try:
        assert c.sock is None, who + "a new Client has sock None"
        assert c.version(), who + "version()"
        assert c.sock is not None and c.sock.gettimeout() == 3.0, who + "sock after a command"
        key = f"contract{random.getrandbits(32)}"
        c.sock.sendall(f"add {key} 0 60 2 noreply\r\nv1\r\n".encode())
        c.sock.sendall(f"add {key} 0 60 2 noreply\r\nv2\r\n".encode())  # the first stays
        c.sock.sendall(f"get {key} {key}x\r\n".encode())
        assert _read_values(c.sock) == {key: b"v1"}, "raw get after raw noreply adds"
        assert c.get(key) == b"v1", who + "Client.get reads what a raw add stored (flags 0)"
        assert c.get(key) == b"v1", "the connection is clean after the raw reply"
        c.close()
        assert c.sock is None, who + "close() resets sock"
    finally:
        c.close()


def test_multiget_server_dying_mid_reply_costs_only_its_keys(memcached_group, tmp_path):
    """A server whose reply never completes (killed after the request was sent) is a miss
    for its keys; the other server's hits stay, and its connection is not reused."""
    from shardfleet.testing import MemcachedServer

    group = [memcached_group[0], MemcachedServer(tmp_path).start()]
    oc = object_cache(group, timeout=2.0)
    try:
        bodies = {ids.compose(s, 1, 7): b'{"k":%d}' % s for s in range(40)}
        oc.fill_many(bodies)
        assert oc.get_many(bodies) == bodies
        on_first = {i for i in bodies
                    if oc.client.hasher.get_node(oc.key(i)) == group[0].address}
        assert 0 < len(on_first) < 40
        group[1].kill()
        got = oc.get_many(bodies)
        assert set(got) == on_first, "the live server's hits survive the dead one"
        assert oc.health.errors >= 1
        assert oc.get_many(bodies).keys() == on_first, "and again (the ring skips it)"
    finally:
        oc.close()
        group[1].stop(remove=True)


def test_fill_of_a_body_too_large_for_memcached_leaves_no_stray_reply(memcached_group):
    """A body over memcached's item size is not cached, and costs nothing after: the
    next multi-get on the same connections gets clean replies (no error left over)."""
    oc = object_cache(memcached_group, max_pool_size=1)
    try:
        small = {ids.compose(s, 1, 9): b'{"ok":%d}' % s for s in range(1, 21)}
        huge = {ids.compose(s, 1, 8): b'"' + b"x" * (2 << 20) + b'"' for s in range(1, 5)}
        oc.fill_many({**huge, **small})
        assert oc.get_many(list(small) + list(huge)) == small
        assert oc.health.errors == 0, "a multi-get after the fill failed"
    finally:
        oc.close()


def test_fill_after_invalidation_is_refused(cached_store, caches):
    """The read-fill vs invalidation race: a reader that read the old row before the
    commit tries to fill after the invalidation; the tombstone refuses it."""
    oc, _ = caches
    pin = cached_store.create("pin", {"v": 1})
    assert oc.get(pin) is None
    stale_row = '{"v":1}'  # what the slow reader read from MySQL
    cached_store.update(pin, {"v": 2})  # writer commits and invalidates
    oc.fill(pin, stale_row)  # the slow reader's fill lands late
    assert cached_store.get(pin) == {"v": 2}, "a late fill must not resurrect the old body"
    assert cached_store.get(pin) == {"v": 2}


def test_mapping_page_from_redis_after_add_and_remove(cached_store, caches, mariadb_pair):
    _, mc = caches
    board = cached_store.create("board", {})
    pins = [cached_store.create("pin", {"i": i}, near=board) for i in range(7)]
    for seq, p in enumerate(pins):
        cached_store.add("board_has_pins", board, p, sequence=1000 + seq)
    first = cached_store.list("board_has_pins", board, limit=3)
    assert first.ids == pins[::-1][:3]
    assert (mc.stats.hits, mc.stats.misses, mc.stats.fills) == (0, 1, 1)
    # remove a row behind the store's back: the cached list still shows it
    _server(mariadb_pair, board).sql(
        f"DELETE FROM db{ids.shard_of(board):05d}.board_has_pins WHERE to_id=%s", (pins[6],))
    assert cached_store.list("board_has_pins", board, limit=3).ids == pins[::-1][:3]
    page2 = cached_store.list("board_has_pins", board, limit=3, cursor=first.cursor)
    page3 = cached_store.list("board_has_pins", board, limit=3, cursor=page2.cursor)
    assert page2.ids + page3.ids == pins[::-1][3:] and page3.cursor is None
    assert mc.stats.hits == 3, "pages served from Redis"

    new = cached_store.create("pin", {"i": 7}, near=board)
    cached_store.add("board_has_pins", board, new, sequence=2000)
    assert cached_store.remove("board_has_pins", board, pins[5])
    page = cached_store.list("board_has_pins", board, limit=3)
    assert page.ids == [new, pins[6], pins[4]], "add and remove kept the cached list right"
    assert mc.stats.hits == 4
    objects, _ = cached_store.join("board_has_pins", board, limit=2)
    assert [b["i"] for _, b in objects] == [7, 6]


def test_fill_after_add_is_refused(cached_store, caches):
    _, mc = caches
    board = cached_store.create("board", {})
    a = cached_store.create("pin", {}, near=board)
    cached_store.add("board_has_pins", board, a, sequence=1)
    hit, token = mc.lookup("board_has_pins", board, 10)
    assert hit is None
    stale = [(a, 1)]  # read from MySQL before the next add committed
    b = cached_store.create("pin", {}, near=board)
    cached_store.add("board_has_pins", board, b, sequence=2)
    assert not mc.fill("board_has_pins", board, stale, True, token), "generation moved on"
    assert cached_store.list("board_has_pins", board).ids == [b, a]


def test_fill_of_the_largest_capacity(caches):
    """A fill of ``capacity`` (up to 5,000) entries lands in one script call (the script
    must not pass 10,000 values to one Lua ``unpack``, beyond Lua's stack limit)."""
    _, shared = caches
    big = MappingCache(shared.client, capacity=5000, prefix=shared.prefix + "big:")
    board = ids.compose(3, 2, 1)
    rows = [(ids.compose(4, 1, n + 1), 10_000 - n) for n in range(5000)]
    hit, token = big.lookup("board_has_pins", board, 50)
    assert hit is None
    assert big.fill("board_has_pins", board, rows, True, token), "the fill was refused"
    assert big.health.errors == 0, "the fill failed in Redis"
    hit, _ = big.lookup("board_has_pins", board, 50)
    assert hit is not None and hit.rows == rows[:50] and hit.more


def test_cached_pages_match_the_database_under_random_changes(cache_router, caches):
    """A small capacity (5) forces partial lists: every page of every state must equal
    the uncached store's page, after random adds, re-sequences and removes."""
    oc, shared = caches
    small = MappingCache(shared.client, capacity=5, prefix=shared.prefix + "small:")
    plain = Store(cache_router)
    cached = Store(cache_router, object_cache=oc, mapping_cache=small)
    rng = random.Random(5)
    board = plain.create("board", {})
    pins = [plain.create("pin", {}, near=board) for _ in range(14)]
    try:
        for step in range(60):
            op = rng.random()
            p = rng.choice(pins)
            if op < 0.6:
                cached.add("board_has_pins", board, p, sequence=rng.randrange(1, 40))
            else:
                cached.remove("board_has_pins", board, p)
            limit = rng.choice([1, 2, 3, 5, 7])
            cursor = got_cursor = None
            while True:
                want = plain.list("board_has_pins", board, limit=limit, cursor=cursor)
                got = cached.list("board_has_pins", board, limit=limit, cursor=got_cursor)
                assert (got.ids, got.sequences) == (want.ids, want.sequences), (
                    f"step {step}: cached page differs from MySQL (limit {limit})")
                assert got.cursor == want.cursor
                if want.cursor is None:
                    break
                cursor = got_cursor = want.cursor
        assert small.stats.hits > 20, f"the cache served pages ({small.stats})"
    finally:
        cached.close()
        plain.close()


def test_dead_memcached_degrades_to_the_database(cache_router, tmp_path, caplog):
    from shardfleet.testing import MemcachedServer

    group = [MemcachedServer(tmp_path).start() for _ in range(2)]
    oc = object_cache(group, retry_timeout=0.2, retry_attempts=1, dead_timeout=60)
    s = Store(cache_router, object_cache=oc)
    try:
        made = [s.create("pin", {"n": i}) for i in range(20)]
        assert len(s.get_many(made).items) == 20
        assert len(s.get_many(made).items) == 20 and oc.stats.hits == 20
        group[0].kill()
        with caplog.at_level(logging.WARNING, logger="shardfleet.cache"):
            for _ in range(3):
                res = s.get_many(made)
                assert [b["n"] for b in res.bodies()] == list(range(20)), "DB serves the misses"
                for i, p in enumerate(made[:5]):
                    assert s.get(p) == {"n": i}
            s.update(made[0], {"n": 0, "x": 1})  # invalidation to a dead server: no error
            assert s.get(made[0]) == {"n": 0, "x": 1}
        assert oc.health.errors > 0
        assert any("memcached" in r.getMessage() for r in caplog.records), "failure is logged"
        group[1].kill()  # every server dead: still only misses
        assert len(s.get_many(made).items) == 20
        assert s.get(made[3]) == {"n": 3}
    finally:
        s.close()
        oc.close()
        for g in group:
            g.stop(remove=True)


def test_dead_redis_degrades_to_the_database(cache_router, tmp_path, caplog):
    from shardfleet.testing import RedisServer

    r = RedisServer(tmp_path).start()
    mc = mapping_cache(r, retry_after=0.1)
    s = Store(cache_router, mapping_cache=mc)
    try:
        board = s.create("board", {})
        pins = [s.create("pin", {}, near=board) for _ in range(4)]
        for q, p in enumerate(pins):
            s.add("board_has_pins", board, p, sequence=q + 1)
        assert s.list("board_has_pins", board).ids == pins[::-1]
        assert s.list("board_has_pins", board).ids == pins[::-1] and mc.stats.hits == 1
        r.kill()
        with caplog.at_level(logging.WARNING, logger="shardfleet.cache"):
            assert s.list("board_has_pins", board).ids == pins[::-1]
            assert s.remove("board_has_pins", board, pins[0])
            s.add("board_has_pins", board, pins[0], sequence=10)
            assert s.list("board_has_pins", board, limit=2).ids == [pins[0], pins[3]]
        assert mc.health.errors > 0
        assert any("mapping cache" in rec.getMessage() for rec in caplog.records)
    finally:
        s.close()
        r.stop(remove=True)


def test_cold_join_reads_the_mapping_fill_reply_after_the_objects(cached_store, caches,
                                                                  monkeypatch):
    """A cold page sends the Redis fill before the objects half and reads its reply after
    (the fill runs while the page waits on memcached and MySQL); the page is cached."""
    import redis.connection

    _, mc = caches
    board = cached_store.create("board", {})
    pins = [cached_store.create("pin", {"i": i}, near=board) for i in range(3)]
    for seq, p in enumerate(pins):
        cached_store.add("board_has_pins", board, p, sequence=seq)
    other = cached_store.create("board", {})
    cached_store.add("board_has_pins", other, pins[0], sequence=1)
    cached_store.list("board_has_pins", other)  # Redis holds both scripts from here on
    events: list[str] = []
    read = redis.connection.Connection.read_response
    many = Store.get_many

    def read_response(self, *a, **kw):
        events.append("redis reply")
        return read(self, *a, **kw)

    def get_many(self, *a, **kw):
        events.append("objects")
        return many(self, *a, **kw)

    monkeypatch.setattr(redis.connection.Connection, "read_response", read_response)
    monkeypatch.setattr(Store, "get_many", get_many)
    objects, _ = cached_store.join("board_has_pins", board, limit=10)
    assert [b["i"] for _, b in objects] == [2, 1, 0]
    assert events == ["redis reply", "objects", "redis reply"], (
        f"the lookup's reply, the objects, then the fill's reply: got {events}")
    assert mc.stats.fills == 2
    monkeypatch.undo()
    assert cached_store.list("board_has_pins", board, limit=10).ids == pins[::-1]
    assert mc.stats.hits == 1, "the deferred fill cached the page"


def test_deferred_fill_after_script_flush_and_with_redis_away(cached_store, caches,
                                                              redis_server):
    """The pinned redis-py contract of a deferred fill: NOSCRIPT reloads the script; a
    closed Redis connection is a logged miss, never an error."""
    _, mc = caches
    board = cached_store.create("board", {})
    pin = cached_store.create("pin", {"i": 0}, near=board)
    cached_store.add("board_has_pins", board, pin, sequence=1)
    mc.client.script_flush()
    hit, token = mc.lookup("board_has_pins", board, 10)
    pending = mc.fill_begin("board_has_pins", board, [(pin, 1)], True, token)
    assert pending is not None and pending.wait(), "NOSCRIPT: loaded and run again"
    assert mc.lookup("board_has_pins", board, 10)[0] is not None
    mc.invalidate("board_has_pins", board)
    hit, token = mc.lookup("board_has_pins", board, 10)
    pending = mc.fill_begin("board_has_pins", board, [(pin, 1)], True, token)
    assert pending is not None
    mc.client.client_kill_filter(_type="normal", skipme=True)  # the fill's connection
    assert pending.wait() in (True, False)  # no exception either way
