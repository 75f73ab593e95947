"""Servers for the fault campaign: host processes on 127.0.0.1 started as the integration
tier starts them (:mod:`shardfleet.testing`, the kit): a 3-node ZooKeeper ensemble; a
split source and a target pair (the kit's :class:`SplitFleet`); a promotion pair with
semi-sync on, as the ``mysql`` role configures one; for the backup runs, moto's S3 server
and a scratch server to restore onto (:class:`backups.Shelf`), whose teardown restores
and verifies the newest complete backup of each pair once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardfleet import provision
from shardfleet.schema import default_schema
from shardfleet.testing import MariaDBServer, ZooKeeperEnsemble
from shardfleet.testing.kit import APP_USER, make_server, pair_up, start_all, wait_pair_synced

from .backups import shelf
from .checks import both_ways, read_only

log = logging.getLogger(__name__)

PROMOTE_SHARDS = list(range(0, 8))


def pytest_configure(config):
    config.addinivalue_line("markers", "faults: the seeded fault campaign (make faults)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/faults" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    zk = ZooKeeperEnsemble(tmp_path_factory.mktemp("zk"), size=3).start()
    yield zk
    zk.stop(remove=True)


class Servers:
    """Servers a session keeps, replaced when a run leaves them broken (a wedged run must
    not fail the runs after it): :meth:`heal` checks them and starts fresh ones if needed."""

    def __init__(self, base: Path, start: Callable[[Path], list[MariaDBServer]],
                 healthy: Callable[[list[MariaDBServer]], list[str]]) -> None:
        self.base, self.start, self.healthy = base, start, healthy
        self.replaced = 0
        self.servers: list[MariaDBServer] = self._start(base)

    def _start(self, base: Path) -> list[MariaDBServer]:
        """Start the servers; once more after a failure (on a machine shared with other
        fleets mariadb-install-db or a first start sometimes fails)."""
        try:
            return self.start(base)
        except Exception:  # noqa: BLE001 - the second failure is raised
            log.warning("starting servers failed; trying once more", exc_info=True)
            time.sleep(2)
            return self.start(base / "again")

    def heal(self) -> tuple[MariaDBServer, ...]:
        problems = self.healthy(self.servers)
        if problems:
            log.warning("replacing the servers an earlier run left broken: %s", problems)
            self.stop()
            self.replaced += 1
            self.servers = self._start(self.base / f"fresh{self.replaced}")
        return tuple(self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop(remove=True)


def start_split_servers(base: Path) -> list[MariaDBServer]:
    """A source (a single server) and a target pair, master-master."""
    base.mkdir(parents=True, exist_ok=True)
    servers = start_all([lambda: make_server(base, 11), lambda: make_server(base, 31, "a"),
                          lambda: make_server(base, 32, "b")])
    pair_up(servers[1], servers[2])
    return servers


@pytest.fixture(scope="session")
def split_servers_kept(tmp_path_factory):
    kept = Servers(tmp_path_factory.mktemp("split"), start_split_servers,
                   lambda s: both_ways(s[1], s[2], timeout=10.0))
    yield kept
    kept.stop()


@pytest.fixture
def split_servers(split_servers_kept):
    """(source, target, target's standby): healthy, or fresh ones."""
    return split_servers_kept.heal()


# as the mysql role configures a pair's node: read-only at boot, no replica started at boot
SEMISYNC = ["--read-only=ON", "--skip-slave-start", "--rpl-semi-sync-master-enabled=ON",
            "--rpl-semi-sync-slave-enabled=ON", "--rpl-semi-sync-master-timeout=1000",
            "--slave-net-timeout=5"]


def start_promote_pair(base: Path) -> list[MariaDBServer]:
    """Two nodes master-master (GTID, semi-sync), the shards on the first, which is writable."""
    base.mkdir(parents=True, exist_ok=True)
    servers = start_all([lambda: make_server(base, 41, "a", SEMISYNC),
                          lambda: make_server(base, 42, "b", SEMISYNC)])
    a, b = servers
    pair_up(a, b, connect_retry=1)
    conn = a.connect(client_flag=provision.multi_statement_flags())
    try:
        provision.ensure_shards(conn, PROMOTE_SHARDS, default_schema(), app_user=APP_USER)
    finally:
        conn.close()
    a.sql("SET GLOBAL read_only = OFF")
    wait_pair_synced(a, b)
    return servers


def promote_pair_problems(servers: list[MariaDBServer]) -> list[str]:
    ro = [read_only(s) for s in servers]
    if sorted(ro) != [False, True]:
        return [f"read_only {ro}: not one master and one standby"]
    return both_ways(servers[0], servers[1], timeout=10.0)


@pytest.fixture(scope="session")
def promote_pair_kept(tmp_path_factory):
    kept = Servers(tmp_path_factory.mktemp("promote"), start_promote_pair,
                   promote_pair_problems)
    yield kept
    kept.stop()


@pytest.fixture
def promote_pair(promote_pair_kept):
    """The promotion pair: healthy (one writable master, replicating both ways), or fresh."""
    return promote_pair_kept.heal()


@pytest.fixture(scope="session")
def backup_shelf(tmp_path_factory):
    """The worker's S3 server, bucket and scratch server; at the end of the worker's
    campaign the newest complete backup of each pair restores and verifies (an error at
    teardown of the worker's last test when it does not)."""
    with shelf(tmp_path_factory.mktemp("backups")) as s:
        yield s
        problems = s.final_problems()
        if problems:
            raise AssertionError("the end-of-campaign backup check failed:\n  "
                                 + "\n  ".join(problems))
