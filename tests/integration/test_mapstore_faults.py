"""The map store on a real ZooKeeper when things go wrong: a slow first session, and a map
write that ZooKeeper applied but whose reply was lost on the way back."""

from __future__ import annotations

import threading
import uuid

import pytest

from shardfleet.errors import MapWriteUnknown
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore, update
from shardfleet.shardmap import freeze_owner
from shardfleet.testing import ZooKeeperServer
from shardfleet.testing.faults import ReplyLosingProxy


def test_a_store_waits_for_its_first_session(tmp_path, base_map):
    """A store whose first connect took longer than its start timeout (a slow ZooKeeper,
    an election, a busy machine) waits up to its timeout for the session on each call
    instead of failing at once."""
    zk = ZooKeeperServer(tmp_path)  # its port is chosen; nothing listens yet
    store = ZooKeeperMapStore(f"127.0.0.1:{zk.port}", "slow", timeout=0.5)
    try:
        assert not store.connected
        store.timeout = 60.0  # the bound of each call from now on
        starter = threading.Thread(target=zk.start, daemon=True)
        starter.start()  # the call below is made before ZooKeeper listens
        assert store.read().version == NO_NODE
        store.write(base_map, NO_NODE)
        assert store.read().map == base_map
        starter.join(60)
    finally:
        store.close()
        zk.stop(remove=True)


@pytest.fixture
def proxied(zookeeper, base_map):
    proxy = ReplyLosingProxy("127.0.0.1", zookeeper.port)
    name = "lost" + uuid.uuid4().hex[:8]
    ZooKeeperMapStore(zookeeper.address, name).write(base_map, NO_NODE)
    store = ZooKeeperMapStore(proxy.address, name, timeout=5.0)
    direct = ZooKeeperMapStore(zookeeper.address, name)
    yield proxy, store, direct
    store.close()
    direct.close()
    proxy.close()


def test_a_lost_reply_after_zookeeper_applied_the_write_is_decided_by_content(proxied):
    proxy, store, direct = proxied
    before = direct.read()
    proxy.lose_reply_to_next()
    res = update(store, lambda m: m.freeze([before.map.ranges[1].bounds], "op-lost"))
    assert proxy.lost.is_set(), "the proxy never cut a reply: the test injected nothing"
    after = direct.read()
    assert res.changed and res.version == after.version == before.version + 1, \
        f"the edit was not written exactly once: {before.version} -> {after.version}"
    assert freeze_owner(after.map.ranges[1]) == "op-lost"


def test_a_lost_reply_and_zookeeper_away_is_an_unknown_outcome(proxied):
    proxy, store, direct = proxied
    before = direct.read()
    proxy.lose_reply_to_next()
    threading.Timer(0.3, proxy.refuse, (True,)).start()  # away right after the cut
    with pytest.raises(MapWriteUnknown, match="may or may not have been applied"):
        update(store, lambda m: m.freeze([before.map.ranges[1].bounds], "op-away"),
               settle_timeout=2.0)
    proxy.refuse(False)
    # it had landed; the rerun of the same edit finds nothing to do
    again = update(store, lambda m: m.freeze([before.map.ranges[1].bounds], "op-away"))
    assert not again.changed and again.version == before.version + 1


@pytest.mark.parametrize("read", ["read", "children", "sync"])
def test_a_read_whose_connection_drops_is_sent_again_on_the_next_session(proxied, read):
    """ZooKeeper is up but the client's connection drops while a read is out (a heartbeat
    missed on a loaded machine: CI saw a promotion refused with "connection lost listing
    .../ops/journal"). A read changes nothing, so the store sends it again once a new
    connection is up, within its timeout, instead of failing the operation."""
    proxy, store, direct = proxied
    before = direct.read()
    # a map read's request is the largest of the three here; each is well above a ping's 12
    proxy.lose_reply_to_next(min_bytes=24, apply_wait=0.2)
    if read == "read":
        got = store.read()
        assert got.map == before.map and got.version == before.version
    elif read == "children":
        assert store.children(store.path.rsplit("/", 1)[0]) == ["map"]
    else:
        store.sync()
    assert proxy.lost.is_set(), "the proxy never cut a request: the test injected nothing"
