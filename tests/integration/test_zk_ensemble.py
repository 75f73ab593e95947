"""The map in a real three-member ZooKeeper quorum: reads through every member, the
leader's loss, and the loss of the quorum."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest

from shardfleet.errors import MapStoreUnavailable, MapWriteUnknown
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore, update
from shardfleet.shardmap import ShardMap
from shardfleet.testing import ZooKeeperEnsemble

pytestmark = pytest.mark.integration

T = TypeVar("T")
SERVING = ("leader", "follower")
BASE = ShardMap.from_ranges([
    {"range": [0, 15], "master": "10.0.0.1:3306", "standby": None, "state": "open"},
    {"range": [16, 31], "master": "10.0.0.2:3306", "standby": None, "state": "open"},
], mod_shard_count=32)


def eventually(fn: Callable[[], T], timeout: float, what: str) -> T:
    """*fn()*, retried while the store is unavailable (but not when a write's outcome is
    unknown: that is a failure here), for at most *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except MapWriteUnknown:
            raise
        except MapStoreUnavailable as exc:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: still unavailable after {timeout}s: {exc}") from exc
            time.sleep(0.2)


def close_range(first: int) -> Callable[[ShardMap], ShardMap]:
    def edit(m: ShardMap) -> ShardMap:
        r = m.range_for(first)
        return m.with_state((r.first, r.last), "closed")
    return edit


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    e = ZooKeeperEnsemble(tmp_path_factory.mktemp("zkq")).start(timeout=120)
    yield e
    e.stop(remove=True)


@pytest.fixture(autouse=True)
def whole_ensemble(ensemble):
    """Every test starts and leaves with all members serving."""
    yield
    for i, m in enumerate(ensemble.members):
        if not m.running:
            ensemble.start_member(i)
    ensemble.wait_quorum(60)


@pytest.fixture
def cluster(ensemble):
    name = "q" + uuid.uuid4().hex[:10]
    store = ZooKeeperMapStore(ensemble.address, name)
    try:
        store.write(BASE, NO_NODE)
    finally:
        store.close()
    return name


def store_on(ensemble: ZooKeeperEnsemble, i: int, cluster: str,
             **kw: float) -> ZooKeeperMapStore:
    """A store given every member's address whose session member *i* created (ZooKeeper
    puts the creating server's myid in a session id's top byte; kazoo picks a random host)."""
    for _ in range(40):
        store = ZooKeeperMapStore(ensemble.address, cluster, **kw)
        if store.client.client_id and store.client.client_id[0] >> 56 == ensemble.members[i].myid:
            return store
        store.close()
    pytest.fail(f"no session on member {i} in 40 tries")


def test_quorum_serves_a_map_written_through_the_ensemble_to_every_member(ensemble, cluster):
    members = ensemble.members
    assert ensemble.address == ",".join(f"127.0.0.1:{m.port}" for m in members)
    ports = [p for m in members for p in (m.port, m.quorum_port, m.election_port)]
    assert len(set(ports)) == 9
    modes = ensemble.modes()
    assert sorted(modes) == ["follower", "follower", "leader"]  # type: ignore[type-var]
    assert ensemble.leader() == modes.index("leader")

    writer = ZooKeeperMapStore(ensemble.address, cluster)
    try:
        done = update(writer, close_range(0))
        assert done.changed and done.version == 1
    finally:
        writer.close()
    for m in members:
        own = ZooKeeperMapStore(m.address, cluster)
        try:
            own.sync()
            v = own.read()
        finally:
            own.close()
        assert (v.map, v.version) == (done.map, 1), m.address
        assert (m.dir / "zk.log").stat().st_size > 0  # ZooKeeper's own log, per member


def test_leader_killed_store_keeps_working_and_member_catches_up(ensemble, cluster):
    old = ensemble.leader()
    store = store_on(ensemble, old, cluster, timeout=5.0)  # its session is on the leader
    try:
        before = store.read()
        t0 = time.monotonic()
        ensemble.kill(old)
        assert not ensemble.members[old].running
        new = ensemble.wait_quorum(60)
        assert new != old
        assert eventually(store.read, 30, "read after the leader died") == before
        done = eventually(lambda: update(store, close_range(16)), 30, "write after failover")
        assert done.changed and done.version == before.version + 1
        assert time.monotonic() - t0 < 30
    finally:
        store.close()

    ensemble.start_member(old)
    assert ensemble.modes()[old] in SERVING
    own = ZooKeeperMapStore(ensemble.members[old].address, cluster)
    try:
        own.sync()
        v = own.read()
    finally:
        own.close()
    assert (v.map, v.version) == (done.map, done.version)


def test_two_of_three_down_no_write_until_one_returns(ensemble, cluster):
    store = ZooKeeperMapStore(ensemble.address, cluster, timeout=2.0)
    try:
        before = store.read()
        leader = ensemble.leader()
        follower, survivor = [i for i in range(3) if i != leader]
        ensemble.stop_member(follower)
        ensemble.kill(leader)
        deadline = time.monotonic() + 30
        while ensemble.members[survivor].mode() in SERVING:  # it leaves: no quorum
            assert time.monotonic() < deadline, "the last member kept serving alone"
            time.sleep(0.1)

        t0 = time.monotonic()
        with pytest.raises(MapStoreUnavailable, match="ZooKeeper"):
            update(store, close_range(0))
        with pytest.raises(MapStoreUnavailable, match="ZooKeeper"):
            store.write(before.map.with_state((0, 15), "closed"), before.version)
        assert time.monotonic() - t0 < 15  # two bounded waits of the store's 2 s timeout

        ensemble.start_member(follower)  # two of three: a quorum again
        assert ensemble.modes()[leader] is None
        done = eventually(lambda: update(store, close_range(0)), 30, "write after quorum")
        assert done.changed and done.version == before.version + 1
        store.sync()
        assert store.read().map == done.map
    finally:
        store.close()
