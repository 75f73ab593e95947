"""site.yml's shards play on the container fleet: SHARDS shards (2,048 in CI; the design's
4,096 with SHARDFLEET_E2E_SHARDS=4096) with every table of the
schema, per-shard grants, a valid map in ZooKeeper, and the routing library working."""

from __future__ import annotations

import pytest

from shardfleet import ids
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.schema import default_schema
from shardfleet.store import Store
from tests.e2e.conftest import E2E_TLS, SHARDS, Fleet
from tests.e2e.test_site import mysql

pytestmark = pytest.mark.e2e


def zk_hosts(fleet: Fleet) -> str:
    return ",".join(f"{fleet.ip(n)}:2181" for n in fleet.group("zookeeper"))


def test_map_covers_every_shard_on_side_a_masters(fleet: Fleet) -> None:
    store = ZooKeeperMapStore(zk_hosts(fleet), "default", timeout=10)
    try:
        v = store.read()
    finally:
        store.close()
    assert v.map is not None, "site.yml registered no map"
    m = v.map
    half = SHARDS // 2
    assert [r.bounds for r in m.ranges] == [(0, half - 1), (half, SHARDS - 1)]
    assert m.mod_shard_count == SHARDS
    by_pair: dict[str, dict[str, str]] = {}
    for n in fleet.group("mysql"):
        h = fleet.hosts[n]
        by_pair.setdefault(h["shardfleet_pair"], {})[h["shardfleet_side"]] = f"{fleet.ip(n)}:3306"
    expect = [(p["a"], p["b"]) for _, p in sorted(by_pair.items())]
    assert [(r.master, r.standby) for r in m.ranges] == expect
    assert {r.state for r in m.ranges} == {"open"}


def test_every_node_holds_its_pairs_shards_with_every_table(fleet: Fleet) -> None:
    ntables, half = len(default_schema().tables), SHARDS // 2
    for n in fleet.group("mysql"):
        pair = fleet.hosts[n]["shardfleet_pair"]
        first = 0 if pair == "pair001" else half
        with mysql(fleet, n) as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) AS n, MIN(SCHEMA_NAME) AS lo, MAX(SCHEMA_NAME) AS hi "
                        "FROM information_schema.SCHEMATA WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$'")
            row = cur.fetchone()
            assert (row["n"], row["lo"], row["hi"]) == (
                half, f"db{first:05d}", f"db{first + half - 1:05d}"), f"{n}: {row}"
            cur.execute("SELECT COUNT(*) AS n FROM information_schema.TABLES "
                        "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")
            assert cur.fetchone()["n"] == half * ntables, f"{n} is missing tables"
            cur.execute("SELECT COUNT(*) AS n FROM mysql.db WHERE User='shardfleet_app' "
                        "AND Db REGEXP '^db[0-9]{5}$' AND Select_priv='Y' AND Insert_priv='Y' "
                        "AND Update_priv='Y' AND Delete_priv='Y' AND Create_priv='N' "
                        "AND Drop_priv='N' AND Alter_priv='N'")
            assert cur.fetchone()["n"] == half, f"{n}: app grants are not one per shard"


def test_router_writes_and_reads_through_the_map(fleet: Fleet) -> None:
    router = Router(ZooKeeperMapStore(zk_hosts(fleet), "default", timeout=10),
                    user="shardfleet_app", password=fleet.secrets["vault_mysql_app_password"],
                    tls=E2E_TLS)
    store = Store(router)
    try:
        board = store.create("board", {"title": "e2e"})
        pins = [store.create("pin", {"i": i}, near=board) for i in range(5)]
        for p in pins:
            store.add("board_has_pins", board, p)
        objects, _ = store.join("board_has_pins", board, limit=10)
        assert sorted(b["i"] for _, b in objects) == list(range(5))
        assert ids.shard_of(board) < SHARDS
    finally:
        store.close()
        router.close()
