"""Servers for the fault campaign: host processes on 127.0.0.1 started as the integration
tier starts them (:mod:`shardfleet.testing`, the kit): one ZooKeeper; a split source and
a target pair (the kit's :class:`SplitFleet`); a promotion pair with semi-sync on, as the
``mysql`` role configures one."""

from __future__ import annotations

import pytest

from shardfleet import provision
from shardfleet.schema import default_schema
from shardfleet.testing import ZooKeeperServer
from shardfleet.testing.kit import APP_USER, make_server, pair_up, wait_pair_synced

PROMOTE_SHARDS = list(range(0, 8))


def pytest_configure(config):
    config.addinivalue_line("markers", "faults: the seeded fault campaign (make faults)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/faults" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    zk = ZooKeeperServer(tmp_path_factory.mktemp("zk")).start()
    yield zk
    zk.stop(remove=True)


@pytest.fixture(scope="session")
def split_servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("split")
    servers = []
    try:
        servers.append(make_server(base, 11))
        servers += [make_server(base, 31, "a"), make_server(base, 32, "b")]
        pair_up(servers[1], servers[2])
    except BaseException:
        for s in servers:
            s.stop(remove=True)
        raise
    yield tuple(servers)
    for s in servers:
        s.stop(remove=True)


SEMISYNC = ["--read-only=ON", "--rpl-semi-sync-master-enabled=ON",
            "--rpl-semi-sync-slave-enabled=ON", "--rpl-semi-sync-master-timeout=1000",
            "--slave-net-timeout=5"]


@pytest.fixture(scope="session")
def promote_pair(tmp_path_factory):
    """Two nodes master-master (GTID, semi-sync), the shards on the first, which is writable."""
    base = tmp_path_factory.mktemp("promote")
    servers = []
    try:
        servers += [make_server(base, 41, "a", SEMISYNC), make_server(base, 42, "b", SEMISYNC)]
        a, b = servers
        pair_up(a, b, connect_retry=1)
        conn = a.connect(client_flag=provision.multi_statement_flags())
        try:
            provision.ensure_shards(conn, PROMOTE_SHARDS, default_schema(), app_user=APP_USER)
        finally:
            conn.close()
        a.sql("SET GLOBAL read_only = OFF")
        wait_pair_synced(a, b)
    except BaseException:
        for s in servers:
            s.stop(remove=True)
        raise
    yield tuple(servers)
    for s in servers:
        s.stop(remove=True)
