"""Objects, mappings, joins and mod-shard lookups through the router, on real MariaDB."""
from __future__ import annotations

import threading

import pytest

from shardfleet import ids
from shardfleet.errors import ObjectNotFound, SchemaError

from .conftest import SHARDS_A, SHARDS_B


def test_create_get_lands_on_open_shards_of_both_servers(store, mariadb_pair):
    made = [store.create("pin", {"n": i}) for i in range(60)]
    shards = {ids.shard_of(i) for i in made}
    assert shards <= set(SHARDS_A + SHARDS_B)
    assert shards & set(SHARDS_A) and shards & set(SHARDS_B), "both pairs get new objects"
    for i, object_id in enumerate(made):
        assert ids.decompose(object_id).type == 1
        assert store.get(object_id) == {"n": i}
    # the row really is in that shard's database on that server
    oid = ids.decompose(made[0])
    server = mariadb_pair[0] if oid.shard in SHARDS_A else mariadb_pair[1]
    rows = server.sql(f"SELECT body FROM db{oid.shard:05d}.pins WHERE local_id=%s", (oid.local,))
    assert rows == [('{"n":0}',)]


def test_near_puts_object_on_the_same_shard(store):
    board = store.create("board", {"title": "x"})
    pins = [store.create("pin", {"i": i}, near=board) for i in range(5)]
    assert {ids.shard_of(p) for p in pins} == {ids.shard_of(board)}


def test_get_many_keeps_caller_order_and_reports_missing(store):
    made = [store.create("pin", {"n": i}) for i in range(40)]
    assert len({ids.shard_of(i) for i in made}) >= 8
    missing = ids.compose(ids.shard_of(made[0]), 1, 10**9)
    order = list(reversed(made)) + [missing]
    res = store.get_many(order)
    assert [i for i, _ in res.items] == list(reversed(made))
    assert [b["n"] for b in res.bodies()] == list(reversed(range(40)))
    assert res.missing == [missing]
    with pytest.raises(ObjectNotFound):
        store.get(missing)


def test_update_is_read_modify_write_under_concurrency(store):
    pin = store.create("pin", {"count": 0, "title": "t"})

    def bump():
        for _ in range(10):
            store.update(pin, lambda b: {**b, "count": b["count"] + 1})

    threads = [threading.Thread(target=bump) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.get(pin) == {"count": 50, "title": "t"}
    assert store.update(pin, {"title": "u"})["title"] == "u"


def test_delete_soft_then_hard(store):
    pin = store.create("pin", {"a": 1})
    assert store.delete(pin)
    with pytest.raises(ObjectNotFound, match="deleted"):
        store.get(pin)
    assert store.get(pin, include_inactive=True) == {"a": 1, "active": False}
    assert store.get_many([pin]).missing == [pin]
    assert store.delete(pin, hard=True)
    with pytest.raises(ObjectNotFound):
        store.get(pin, include_inactive=True)
    assert not store.delete(pin, hard=True)


def test_mappings_newest_first_with_cursor_paging(store):
    board = store.create("board", {})
    pins = [store.create("pin", {"i": i}, near=board) for i in range(7)]
    for seq, p in enumerate(pins):
        store.add("board_has_pins", board, p, sequence=1000 + seq)
    assert store.count("board_has_pins", board) == 7
    page1 = store.list("board_has_pins", board, limit=3)
    assert page1.ids == list(reversed(pins))[:3] and page1.cursor
    page2 = store.list("board_has_pins", board, limit=3, cursor=page1.cursor)
    page3 = store.list("board_has_pins", board, limit=3, cursor=page2.cursor)
    assert page1.ids + page2.ids + page3.ids == list(reversed(pins))
    assert page3.cursor is None
    assert store.remove("board_has_pins", board, pins[0])
    assert not store.remove("board_has_pins", board, pins[0])
    assert store.count("board_has_pins", board) == 6
    objects, _ = store.join("board_has_pins", board, limit=2)
    assert [b["i"] for _, b in objects] == [6, 5]


def test_mapping_type_checks(store):
    board = store.create("board", {})
    user = store.create("user", {})
    with pytest.raises(SchemaError, match="maps from board"):
        store.add("board_has_pins", user, board)
    with pytest.raises(SchemaError, match="maps to pin"):
        store.add("board_has_pins", board, user)
    with pytest.raises(SchemaError, match="unknown mapping"):
        store.add("board_eats_pins", board, board)


def test_mod_shard_lookup(store, router):
    user = store.create("user", {"email": "ada@example.com"})
    store.put("user_by_email", "ada@example.com", user)
    assert store.lookup("user_by_email", "ada@example.com") == user
    assert store.lookup("user_by_email", "bob@example.com") is None
    store.put("ip_data", "10.1.2.3", {"country": "NZ"})
    assert store.lookup("ip_data", "10.1.2.3") == {"country": "NZ"}
    assert router.map.mod_shard("ada@example.com") < 32


def test_get_reads_on_a_pooled_connection_without_polling_it_and_survives_a_killed_one(
        store, mariadb_pair, monkeypatch):
    """The single-row read takes the pool's top connection unchecked (no poll(2)); one the
    server killed fails the read, which is read again on a fresh connection."""
    import select

    pin = store.create("pin", {"v": 1})
    assert store.get(pin) == {"v": 1}
    polls = []
    real_poll = select.poll

    def counting_poll():
        polls.append(1)
        return real_poll()

    monkeypatch.setattr(select, "poll", counting_poll)
    for _ in range(5):
        assert store.get(pin) == {"v": 1}
    assert polls == [], f"the read path polled its connection {len(polls)} times"
    monkeypatch.undo()
    server = mariadb_pair[0] if ids.shard_of(pin) in SHARDS_A else mariadb_pair[1]
    for (pid,) in server.sql(
            "SELECT id FROM information_schema.PROCESSLIST WHERE user='sf_app'"):
        server.sql(f"KILL {int(pid)}")
    assert store.get(pin) == {"v": 1}, "a killed pooled connection costs a retry, not an error"
    assert store.get(pin) == {"v": 1}
