"""Real servers for the integration tier: two MariaDB servers standing in for two
pairs (16 shards each), a ZooKeeper, all host processes on 127.0.0.1."""

from __future__ import annotations

import uuid

import pytest

from shardfleet import provision
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.schema import default_schema
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer, ZooKeeperServer

from .certs import certs  # noqa: F401 - the session's throwaway CA, for the TLS tests

APP_USER = "sf_app"
APP_PASSWORD = "sf-app-test"
SHARDS_A = list(range(0, 16))
SHARDS_B = list(range(16, 32))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


def make_shards(server: MariaDBServer, shards: list[int]) -> None:
    conn = server.connect(client_flag=provision.multi_statement_flags())
    try:
        provision.ensure_shards(conn, shards, default_schema(), app_user=APP_USER)
    finally:
        conn.close()


@pytest.fixture(scope="session")
def mariadb_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("mariadb")
    servers = [MariaDBServer(base, server_id=i + 1,
                             extra=["--innodb-file-per-table=0"]).start() for i in range(2)]
    for s, shards in zip(servers, (SHARDS_A, SHARDS_B), strict=True):
        s.sql(f"CREATE USER '{APP_USER}'@'%%' IDENTIFIED BY %s", (APP_PASSWORD,))
        make_shards(s, shards)
    yield servers
    for s in servers:
        s.stop(remove=True)


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    zk = ZooKeeperServer(tmp_path_factory.mktemp("zk")).start()
    yield zk
    zk.stop(remove=True)


@pytest.fixture
def base_map(mariadb_pair) -> ShardMap:
    a, b = mariadb_pair
    return ShardMap.from_ranges([
        {"range": [0, 15], "master": a.address, "standby": None, "state": "open"},
        {"range": [16, 31], "master": b.address, "standby": None, "state": "open"},
    ], mod_shard_count=32)  # this test fleet's initial shard count


@pytest.fixture
def cluster(zookeeper, base_map):
    """A fresh cluster name with the base map registered in ZooKeeper."""
    name = "t" + uuid.uuid4().hex[:10]
    store = ZooKeeperMapStore(zookeeper.address, name)
    store.write(base_map, NO_NODE)
    yield name
    store.close()


@pytest.fixture
def router(zookeeper, cluster, tmp_path):
    r = Router(ZooKeeperMapStore(zookeeper.address, cluster), cache_file=tmp_path / "map.json",
               user=APP_USER, password=APP_PASSWORD, frozen_wait=1.0)
    yield r
    r.close()


@pytest.fixture
def store(router):
    s = Store(router)
    yield s
    s.close()


# Cache fixtures (memcached group, Redis, a store with both caches) live in their own module.
from .cache_fixtures import (  # noqa: E402,F401
    cache_router,
    cached_store,
    caches,
    memcached_group,
    redis_server,
)
