"""status.problems and status.trx_behind on reports shaped like status.collect's: what
on-call is told when the servers and the map disagree (the servers are real in
tests/integration/test_fleet_status.py; here every case the rules name)."""
from __future__ import annotations

import copy
from typing import Any

from shardfleet import status

M, S = "10.0.0.1:3306", "10.0.0.2:3306"


def server(addr: str, *, ro: bool, source: str | None, pos: str = "1-1-10,2-2-5",
           io: str = "Yes", sql: str = "Yes") -> dict[str, Any]:
    chans = [] if source is None else [{
        "connection": "", "source": source, "io_running": io, "sql_running": sql,
        "seconds_behind": 0, "gtid_io_pos": "", "last_error": "", "trx_behind": 0,
        "peer": source}]
    return {"server": addr, "reachable": True, "error": None, "read_only": ro,
            "gtid_binlog_pos": pos, "gtid_slave_pos": pos, "semisync_master": True,
            "semisync_status": "ON", "semisync_replica": True, "replicas": chans,
            "shards": 4, "shard_bytes": 0}


def report(**pair_extra: Any) -> dict[str, Any]:
    ms, ss = server(M, ro=False, source=S), server(S, ro=True, source=M)
    pair = {"master": M, "standby": S, "name": "pair001",
            "ranges": [{"range": [0, 3], "state": "open"}], "master_state": ms,
            "standby_state": ss, **pair_extra}
    return {"map": {}, "version": 3, "pairs": [pair], "servers": {M: ms, S: ss},
            "unmapped": [], "labels": {M: {"host": "db-a", "pair": "pair001"}},
            "zookeeper": [{"server": "z:2181", "mode": "follower"}], "operations": []}


def texts(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["severity"], p["text"]) for p in status.problems(r)]


def test_a_healthy_pair_has_no_problem_and_renders_so():
    r = report()
    assert status.problems(r) == []
    assert "PROBLEMS: none" in status.render(r)


def test_two_writable_nodes_and_a_read_only_master_are_critical():
    r = report()
    r["pairs"][0]["standby_state"]["read_only"] = False
    assert texts(r) == [("critical", "pair001 (ranges 0-3): two writable nodes: standby "
                                     f"{S} (per the map) is writable")]
    r = report()
    r["pairs"][0]["master_state"]["read_only"] = True
    assert texts(r) == [("critical", f"pair001 (ranges 0-3): master {M} (db-a) (per the map) "
                                     "is read-only: writes to its ranges fail")]


def test_replication_one_way_only_or_stopped_is_critical():
    r = report()
    r["pairs"][0]["master_state"]["replicas"] = []
    assert texts(r) == [("critical", f"pair001 (ranges 0-3): master {M} (db-a) does not "
                                     f"replicate from {S} (a pair replicates both ways)")]
    r = report()
    r["pairs"][0]["standby_state"]["replicas"][0].update(io_running="Connecting",
                                                         last_error="boom")
    (sev, text), = texts(r)
    assert sev == "critical" and "channel default from" in text and "IO=Connecting" in text \
        and text.endswith("boom")


def test_a_node_marked_for_rebuild_is_a_warning_not_a_failure():
    r = report(ranges=[{"range": [0, 3], "state": "open", "rebuild": S}])
    r["pairs"][0]["standby_state"].update(reachable=False, error="gone")
    r["pairs"][0]["master_state"]["replicas"] = []  # it does not replicate from the dead one
    assert texts(r) == [("warning", f"pair001 (ranges 0-3): standby {S} is marked for rebuild "
                                    "(run rebuild-standby.yml)")]


def test_frozen_ranges_operations_semisync_and_zookeeper_are_warnings():
    r = report(ranges=[{"range": [0, 3], "state": "frozen", "frozen_by": "split-2-3"}])
    r["pairs"][0]["master_state"]["semisync_status"] = "OFF"
    r["operations"] = [{"name": "split-2-3", "kind": "split", "step": "replicate",
                        "servers": [M], "updated_at": 0}]
    r["zookeeper"].append({"server": "y:2181", "mode": "unreachable", "error": "refused"})
    got = texts(r)
    assert {s for s, _ in got} == {"warning"} and len(got) == 4, got
    joined = " | ".join(t for _, t in got)
    assert "range 0-3 is frozen by split-2-3" in joined
    assert "fell back to asynchronous" in joined
    assert "shardfleet ops show split-2-3" in joined
    assert "ZooKeeper y:2181 is unreachable: refused" in joined


def test_critical_problems_come_first():
    r = report()
    r["operations"] = [{"name": "x", "kind": "split", "step": "clone", "servers": [M],
                        "updated_at": 0}]
    r["pairs"][0]["master_state"]["read_only"] = True
    assert [s for s, _ in texts(r)] == ["critical", "warning"]


def test_servers_the_map_does_not_name_are_warned_about_when_writable_or_down():
    r = report()
    other = "10.0.0.9:3306"
    r["unmapped"] = [other]
    r["servers"][other] = server(other, ro=False, source=None)
    assert texts(r) == [("warning", f"{other} (named by no range) is writable")]
    r["servers"][other] = {"server": other, "reachable": False, "error": "refused"}
    assert texts(r) == [("warning", f"{other} (named by no range) is unreachable")]


def test_lag_by_gtid_counts_the_source_transactions_not_applied():
    src = server(M, ro=False, source=None, pos="1-1-100,2-2-50")
    rep = server(S, ro=True, source=None, pos="1-1-40,2-2-50")
    assert status.trx_behind(src, rep) == 60
    rep["gtid_binlog_pos"], rep["gtid_slave_pos"] = "2-2-50", "1-1-90"
    assert status.trx_behind(src, rep) == 10
    assert status.trx_behind(src, {**rep, "gtid_binlog_pos": "", "gtid_slave_pos": ""}) == 150
    assert status.trx_behind(None, rep) is None
    assert status.trx_behind({**src, "gtid_binlog_pos": "junk"}, rep) is None
    r = report()
    r["pairs"][0]["standby_state"]["replicas"][0]["trx_behind"] = status.LAG_WARN_TRX + 1
    assert texts(r) == [("warning", f"pair001 (ranges 0-3): standby {S} is "
                                    f"{status.LAG_WARN_TRX + 1} transactions behind {M} (db-a)")]


def test_render_shows_every_channel_and_what_the_map_marks():
    r = report(ranges=[{"range": [0, 3], "state": "open", "rebuild": S}])
    extra = copy.deepcopy(r["pairs"][0]["master_state"]["replicas"][0])
    extra.update(connection="split_0_3", source="10.0.0.7:3306", io_running="No",
                 sql_running="No", trx_behind=None, peer=None)
    r["pairs"][0]["master_state"]["replicas"].append(extra)
    text = status.render(r)
    assert "PAIR pair001: 0-3 open (rebuild 10.0.0.2:3306)" in text
    assert f"channel default <- {S}: Yes/Yes, 0 trx behind" in text
    assert "channel split_0_3 <- 10.0.0.7:3306: No/No, lag unknown" in text
    assert "CRITICAL" in text and "WARNING" in text


def test_a_channel_is_matched_to_its_source_by_server_id_or_inventory_name():
    """The role names a pair's peer by host name; the map by address: the channel's
    Master_Server_Id, else the inventory name, says which server it reads from."""
    states = {M: {"server_id": 11}, S: {"server_id": 12}}
    names = {S: {"host": "db-b", "pair": "pair001"}}
    peer = status._channel_peer
    assert peer({"source": "db-b:3306", "source_server_id": 12}, states, names) == S
    assert peer({"source": "db-b:3306", "source_server_id": 0}, states, names) == S
    assert peer({"source": "db-b:3307", "source_server_id": 0}, states, names) is None
    assert peer({"source": M, "source_server_id": 0}, states, names) == M
    assert peer({"source": "elsewhere:3306", "source_server_id": 99}, states, names) is None
