"""shardfleet.metrics: a router's counters as it meets a frozen range, the text format,
and the prometheus_client adapter (the fleet exporter runs on real servers in
tests/integration/test_fleet_status.py)."""
from __future__ import annotations

import pytest

from shardfleet import metrics
from shardfleet.errors import ShardFrozenError
from shardfleet.mapstore import NO_NODE, MemoryMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap

A = "127.0.0.1:1"


def frozen_map() -> ShardMap:
    return ShardMap.from_ranges([
        {"range": [0, 7], "master": A, "state": "open"},
        {"range": [8, 15], "master": A, "state": "frozen"}], mod_shard_count=16)


def value(samples, name, **labels):
    want = tuple(sorted((k, str(v)) for k, v in labels.items()))
    got = [s.value for s in samples if s.name == name and s.labels == want]
    assert len(got) == 1, (name, labels, samples)
    return got[0]


def test_a_router_counts_frozen_waits_errors_and_map_changes():
    store = MemoryMapStore()
    store.write(frozen_map(), NO_NODE)
    r = Router(store, frozen_wait=0.2, frozen_poll=0.01)
    try:
        before = metrics.router_samples(r)
        assert value(before, "shardfleet_router_map_changes_total") == 1
        assert value(before, "shardfleet_router_map_version") == r.version
        r.writable_range(3)  # open: no wait
        with pytest.raises(ShardFrozenError):
            r.writable_range(9)
        s = metrics.router_samples(r)
        assert value(s, "shardfleet_router_frozen_waits_total") == 1
        assert value(s, "shardfleet_router_frozen_errors_total") == 1
        assert value(s, "shardfleet_router_frozen_wait_seconds_total") >= 0.2
        # a thaw is a new map: counted, and the router's map age starts again
        v = store.read()
        store.write(v.map.with_state((8, 15), "open"), v.version)
        assert r.wait_for(lambda m: m.range_for(9).state == "open", 5)
        s = metrics.router_samples(r, now=r.stats.map_changed_at + 3)
        assert value(s, "shardfleet_router_map_changes_total") == 2
        assert value(s, "shardfleet_router_map_age_seconds") == pytest.approx(3)
        r.refresh()
        assert value(metrics.router_samples(r), "shardfleet_router_refreshes_total") == 1
    finally:
        r.close()


def test_render_is_the_text_exposition_format():
    text = metrics.render([metrics.Sample("shardfleet_ranges", 2.0, (("state", "open"),)),
                           metrics.Sample("shardfleet_ranges", 0.0, (("state", 'a"b'),)),
                           metrics.Sample("shardfleet_up", 1.0)])
    assert text.splitlines() == [
        "# HELP shardfleet_ranges Ranges of the map by state",
        "# TYPE shardfleet_ranges gauge",
        'shardfleet_ranges{state="open"} 2.0',
        'shardfleet_ranges{state="a\\"b"} 0.0',
        "# HELP shardfleet_up 1 when the exporter read the map from ZooKeeper",
        "# TYPE shardfleet_up gauge",
        "shardfleet_up 1.0"]


def test_register_router_on_a_prometheus_client_registry():
    from prometheus_client import CollectorRegistry, generate_latest

    store = MemoryMapStore()
    store.write(frozen_map(), NO_NODE)
    r = Router(store, frozen_wait=0.05, frozen_poll=0.01)
    reg = CollectorRegistry()
    try:
        metrics.register_router(r, registry=reg)
        with pytest.raises(ShardFrozenError):
            r.writable_range(9)
        out = generate_latest(reg).decode()
        assert "shardfleet_router_frozen_errors_total 1.0" in out
        assert "# TYPE shardfleet_router_frozen_errors_total counter" in out
        assert f"shardfleet_router_map_version {float(r.version)}" in out
    finally:
        r.close()


def test_fleet_samples_from_a_report_and_the_frozen_clock():
    report = {"version": 7, "pairs": [{
        "master": "m:1", "standby": "s:1", "name": "pair001",
        "ranges": [{"range": [0, 3], "state": "frozen"}, {"range": [4, 7], "state": "open"}]}],
        "servers": {"m:1": {"reachable": True, "read_only": False, "semisync_master": True,
                            "semisync_status": "OFF", "replicas": [
                                {"connection": "", "source": "s:1", "peer": "s:1",
                                 "io_running": "Yes", "sql_running": "No",
                                 "seconds_behind": None, "trx_behind": 4}]},
                    "s:1": {"reachable": True, "read_only": False, "replicas": []}},
        "labels": {}, "operations": [{"name": "split-0-3", "kind": "split", "step": "clone",
                                      "servers": ["m:1"], "updated_at": 90.0}],
        "problems": [{"severity": "critical", "text": "x"}]}
    clock = metrics.FrozenClock()
    metrics.fleet_samples(report, clock=clock, now=100.0)
    s = metrics.fleet_samples(report, map_mtime=40.0, clock=clock, now=130.0)
    assert value(s, "shardfleet_map_age_seconds") == 90
    assert value(s, "shardfleet_range_frozen_seconds", range="0-3") == 30
    assert value(s, "shardfleet_ranges", state="frozen") == 1
    assert value(s, "shardfleet_pair_writable_nodes", pair="pair001") == 2
    assert value(s, "shardfleet_replication_running", server="m:1", channel="default",
                 source="s:1") == 0
    assert value(s, "shardfleet_replication_lag_transactions", server="m:1",
                 channel="default", source="s:1") == 4
    assert value(s, "shardfleet_semisync_master_on", server="m:1") == 0
    assert value(s, "shardfleet_operation_journal_age_seconds", operation="split-0-3") == 40
    assert value(s, "shardfleet_problems", severity="critical") == 1
    assert metrics.fleet_samples(None) == [metrics.Sample("shardfleet_up", 0.0)]


def test_rebuild_marks_semisync_enabled_and_zookeeper_modes():
    """The series the alert rules need beyond status's problems: how long a node has been
    marked for rebuild (from the map's last change at the earliest, so an exporter restart
    does not start a day's clock again), semi-sync enabled apart from active, and each
    ZooKeeper node's srvr mode."""
    report = {"version": 3, "pairs": [
        {"master": "b:1", "standby": None, "name": "pair001",
         "ranges": [{"range": [0, 7], "state": "open", "rebuild": "a:1"}]},
        {"master": "c:1", "standby": "d:1", "name": "pair002",
         "ranges": [{"range": [8, 15], "state": "open"}]}],
        "servers": {"b:1": {"reachable": True, "read_only": False, "semisync_master": True,
                            "semisync_status": "OFF", "replicas": []},
                    "c:1": {"reachable": True, "read_only": False, "semisync_master": False,
                            "semisync_status": "", "replicas": []}},
        "labels": {}, "operations": [], "problems": [],
        "zookeeper": [{"server": "z1:2181", "mode": "leader"},
                      {"server": "z2:2181", "mode": "follower"},
                      {"server": "z3:2181", "mode": "unreachable", "error": "refused"}]}
    marks = metrics.MarkClock()
    s = metrics.fleet_samples(report, map_mtime=1000.0, marks=marks, now=5000.0)
    assert value(s, "shardfleet_rebuild_mark_seconds", pair="pair001", server="a:1") == 4000
    assert not [x for x in s if x.name == "shardfleet_rebuild_mark_seconds"
                and ("server", "c:1") in x.labels], "only the marked node has a mark age"
    # a later map change (the mark stays) does not move the mark's start
    s = metrics.fleet_samples(report, map_mtime=6000.0, marks=marks, now=7000.0)
    assert value(s, "shardfleet_rebuild_mark_seconds", pair="pair001", server="a:1") == 6000
    # the mark lifted, then set again: a new clock
    cleared = {**report, "pairs": [{**report["pairs"][0], "ranges": [
        {"range": [0, 7], "state": "open"}]}, report["pairs"][1]]}
    s = metrics.fleet_samples(cleared, map_mtime=8000.0, marks=marks, now=8000.0)
    assert not [x for x in s if x.name == "shardfleet_rebuild_mark_seconds"]
    s = metrics.fleet_samples(report, map_mtime=9000.0, marks=marks, now=9100.0)
    assert value(s, "shardfleet_rebuild_mark_seconds", pair="pair001", server="a:1") == 100
    assert value(s, "shardfleet_semisync_master_enabled", server="b:1") == 1
    assert value(s, "shardfleet_semisync_master_on", server="b:1") == 0
    assert value(s, "shardfleet_semisync_master_enabled", server="c:1") == 0
    assert value(s, "shardfleet_zookeeper_serving", node="z2:2181") == 1
    assert value(s, "shardfleet_zookeeper_serving", node="z3:2181") == 0
    assert value(s, "shardfleet_zookeeper_leader", node="z1:2181") == 1
    assert value(s, "shardfleet_zookeeper_leader", node="z2:2181") == 0


def test_finished_operations_count_by_kind_and_the_latest_end_rises():
    """A promotion takes seconds, less than the exporter's interval: it shows after the
    fact as its kind's count of finished journals and the latest one's end (a pair's
    promotion journal is reused, so the count may stay and the time rises)."""
    report = {"version": 9, "pairs": [], "servers": {}, "labels": {}, "operations": [],
              "problems": [], "finished_operations": [
                  {"name": "promote-pair001", "kind": "promotion (planned)",
                   "updated_at": 500.0},
                  {"name": "promote-pair002", "kind": "promotion (planned)",
                   "updated_at": 700.0},
                  {"name": "split-0-3", "kind": "split", "updated_at": 100.0}]}
    s = metrics.fleet_samples(report, now=1000.0)
    assert value(s, "shardfleet_operations_finished", kind="promotion (planned)") == 2
    assert value(s, "shardfleet_operation_last_finished_timestamp_seconds",
                 kind="promotion (planned)") == 700
    assert value(s, "shardfleet_operation_last_finished_timestamp_seconds", kind="split") == 100
    assert not [x for x in s if x.name == "shardfleet_operations_in_flight"]
    text = metrics.render(s)
    assert 'shardfleet_operations_finished{kind="promotion (planned)"} 2' in text
