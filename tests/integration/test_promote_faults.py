"""Promotion under the faults on-call meets halfway: the master dies during a planned
promotion (the rerun continues it as an emergency), a promoted standby that restarts
before the rebuild (it must not replicate the old master's tail), and a master that is
alive but refuses the admin (it is not dead: an emergency must refuse).

Its own pair (module scope, the fixtures of test_promote.py); every test leaves it whole:
one writable master, one read-only standby, replication running both ways.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from shardfleet import ops, promote, replication
from shardfleet.operations import rebuild
from shardfleet.operations import types as optypes
from shardfleet.promote import PromotionFailed, PromotionRefused
from shardfleet.testing import MariaDBServer
from shardfleet.testing.nemesis import expire_store_session

from . import test_promote as tp
from .test_promote import (
    PAIR,
    REPL_PASSWORD,
    REPL_USER,
    channel,
    nodes,
    opts,
    roles,
    wait_applied,
)

# the promotion tests' fixtures: a pair of this module's own, a fresh map per test
pair, zk_store, writer_store = tp.pair, tp.zk_store, tp.writer_store


def ropts(**kw: Any) -> promote.Options:
    """Options with the replication account (the rebuild recreates a removed channel)."""
    return opts(replication_user=REPL_USER, replication_password=REPL_PASSWORD, **kw)


def count_marked(server: MariaDBServer, marker: str, db: str = "db00001") -> int:
    return int(server.sql(f"SELECT COUNT(*) FROM {db}.pins WHERE body LIKE %s",
                          (f"%{marker}%",))[0][0])


def semisync_acked(master: MariaDBServer) -> int:
    """Transactions the master committed with its standby's semi-sync acknowledgement."""
    with contextlib.closing(master.connect()) as conn:
        return int(replication.semisync_state(conn)["master_yes_tx"])


def wait_semisync_on(master: MariaDBServer, timeout: float = 60.0) -> None:
    """Until the master's semi-sync is on with a replica connected to acknowledge."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.closing(master.connect()) as conn:
            state = replication.semisync_state(conn)
        if state["master_status"] == "ON" and state["master_clients"] >= 1:
            return
        assert time.monotonic() < deadline, f"{master.address}: semi-sync is not on: {state}"
        time.sleep(0.1)


def both_ways(a: MariaDBServer, b: MariaDBServer) -> None:
    """Both nodes replicate from each other: threads running, a write on each side arrives."""
    for s in (a, b):
        deadline = time.monotonic() + 30
        while True:
            rows = promote.replica_status(conn := s.connect())
            conn.close()
            ok = len(rows) == 1 and rows[0]["Slave_IO_Running"] == "Yes" \
                and rows[0]["Slave_SQL_Running"] == "Yes"
            if ok:
                break
            assert time.monotonic() < deadline, f"{s.address} is not replicating: {rows}"
            time.sleep(0.1)
    for src, dst in ((a, b), (b, a)):
        mark = uuid.uuid4().hex
        src.sql("INSERT INTO db00002.pins (body) VALUES (%s)", (f'{{"m": "{mark}"}}',))
        wait_applied(dst, src)
        assert count_marked(dst, mark, "db00002") == 1, f"{src.address} -> {dst.address}"


def rebuild_and_check(zk_store, pair_, old: MariaDBServer, new: MariaDBServer,
                      new_restarted: bool = False) -> None:
    if not old.running:
        old.start()
    rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair_), opts=ropts())
    assert rr.changed, rr.to_dict()
    # a new master that restarted booted read-only: the rebuild makes it writable again
    assert rr.warnings == ([f"the master {new.address} was read_only (it restarted since "
                            "the emergency: every node boots read-only); made writable "
                            "again, the map names it master"] if new_restarted else []), \
        rr.warnings
    m = zk_store.read().map
    assert all(r.master == new.address and r.standby == old.address
               and "rebuild" not in r.extra for r in m.ranges), m.dumps()
    both_ways(old, new)
    for s in (old, new):  # the heartbeat an emergency's "is it dead?" relies on
        assert channel(s)["Slave_heartbeat_period"] == replication.HEARTBEAT_PERIOD, \
            f"{s.address}: {channel(s)['Slave_heartbeat_period']}"


# -- A: a planned promotion whose master dies halfway ------------------------------------

def test_planned_interrupted_by_master_death_continues_as_emergency(pair, zk_store,
                                                                   writer_store, monkeypatch):
    master, standby = roles(pair)
    mark = uuid.uuid4().hex
    real_ro, real_wait = replication.set_read_only, replication.wait_for_gtid
    seen: dict[str, Any] = {}

    def set_read_only(conn: Any, on: bool) -> bool:
        if on and conn.port == master.port and "fenced" not in seen:
            # just before the fence: the standby stops applying, the master takes one
            # more (semi-sync acknowledged: it is in the standby's relay log) write
            seen["fenced"] = True
            standby.sql("STOP SLAVE SQL_THREAD")
            before = semisync_acked(master)
            master.sql("INSERT INTO db00001.pins (body) VALUES (%s)", (f'{{"m": "{mark}"}}',))
            seen["acked"] = semisync_acked(master) - before
        return real_ro(conn, on)

    def wait_for_gtid(conn: Any, position: str, timeout: float) -> None:
        if "fenced" in seen and conn.port == standby.port and "killed" not in seen:
            seen["killed"] = True
            master.kill()  # the master dies while the promotion waits for the standby
        real_wait(conn, position, timeout)

    # the write must be acknowledged by semi-sync (in the standby's relay log when the
    # master dies), not by its 1 s timeout's fallback: a pair that has just started (this
    # is the module's first test) may not have its standby's ack channel up yet
    wait_semisync_on(master)
    monkeypatch.setattr(replication, "set_read_only", set_read_only)
    monkeypatch.setattr(replication, "wait_for_gtid", wait_for_gtid)
    try:
        with pytest.raises(PromotionFailed) as failed:
            promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                            opts=opts(drain_timeout=2))
    finally:
        monkeypatch.undo()
    assert seen == {"fenced": True, "acked": 1, "killed": True}, \
        f"{seen}: the marked write was not acknowledged by semi-sync"
    msg = str(failed.value)
    assert "frozen" in msg.lower() and "mode=emergency" in msg and master.address in msg, msg
    m = zk_store.read().map
    assert all(r.state == "frozen" and r.master == master.address for r in m.ranges)
    j = ops.Journal(zk_store, f"promote-{PAIR}").load()
    assert j and not j["done"] and j.get("failed"), j
    # the plain rerun (planned) says exactly what to run, and changes nothing
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match=r"does not answer.*"
                       rf"promote\.yml -e pair={PAIR} -e mode=emergency"):
        promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    assert zk_store.read().version == v
    # the rerun as an emergency continues the same promotion
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    assert res.changed and res.resumed and res.mode == "emergency", res.to_dict()
    assert (res.old_master, res.new_master) == (master.address, standby.address)
    m = zk_store.read().map
    assert [r.state for r in m.ranges] == ["open", "closed"], m.dumps()
    assert all(r.master == standby.address and r.extra.get("rebuild") == master.address
               and "frozen_from" not in r.extra for r in m.ranges), m.dumps()
    assert count_marked(standby, mark) == 1, "the acknowledged write was lost"
    assert writer_store.router.wait_for(
        lambda m: all(r.master == standby.address for r in m.ranges), 10), "router kept the map"
    oid = writer_store.create("pin", {"after": mark})
    assert writer_store.get(oid)["after"] == mark
    assert ops.Journal(zk_store, f"promote-{PAIR}").load()["done"]
    rebuild_and_check(zk_store, pair, master, standby)


# -- B: the promoted standby keeps no channel to the old master -----------------------------

def test_emergency_removes_the_channel_and_rebuild_recreates_it(pair, zk_store):
    master, standby = roles(pair)
    mark = uuid.uuid4().hex
    # the old master's unacknowledged tail: a write the standby never receives
    standby.sql("STOP SLAVE IO_THREAD")
    master.sql("INSERT INTO db00001.pins (body) VALUES (%s)", (f'{{"tail": "{mark}"}}',))
    tail = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    master.kill()
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    assert res.changed and res.new_master == standby.address
    assert standby.sql("SHOW ALL SLAVES STATUS") == [], "the channel to the old master is left"
    assert res.channel_removed["host"] == "127.0.0.1", res.channel_removed
    assert int(res.channel_removed["port"]) == master.port and \
        res.channel_removed["user"] == REPL_USER, res.channel_removed
    # the old master comes back; the new master restarts before the rebuild
    master.start()
    standby.stop()
    standby.start()
    # it boots read_only like every node: the rebuild makes it writable again
    rows = standby.sql("SHOW ALL SLAVES STATUS")
    if rows:  # (the defect) let it replicate what it would
        standby.sql("SELECT MASTER_GTID_WAIT(%s, 15)", (tail,))
    assert rows == [], "a channel came back after the restart"
    assert count_marked(standby, mark) == 0, "the old master's tail reached the new master"
    rebuild_and_check(zk_store, pair, master, standby, new_restarted=True)
    assert count_marked(master, mark) == 0, "the rebuilt node kept its tail"


def test_a_new_master_restarted_before_the_rebuild_is_made_writable_by_it(pair, zk_store,
                                                                         writer_store):
    """Found by the fault campaign (seeds 3003, 3009, fault restart_new): the new master
    restarts after the emergency and boots read_only, as every node does; the map names it
    master, so every write to the pair fails with 1290. The rebuild, the command the
    runbook names after an emergency, used to finish "nothing required" with the pair
    still read-only. It makes the map's master writable once the node it rebuilds is
    fenced, and says so."""
    master, standby = roles(pair)
    master.kill()
    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    standby.kill()
    master.start()
    standby.start()
    assert standby.sql("SELECT @@GLOBAL.read_only")[0][0] == 1, "it boots read-only"
    rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts())
    assert rr.changed and "master_writable" in rr.steps, rr.to_dict()
    assert any("read_only" in w and standby.address in w for w in rr.warnings), rr.warnings
    assert roles(pair) == (standby, master), "the map's master is not the writable node"
    w = tp.Writer(writer_store, max_seconds=30).start()
    try:
        assert w.wait_acks(20), f"the pair takes no writes\n{w.status()}"
    finally:
        w.stop()
    both_ways(master, standby)
    # a rerun changes nothing
    assert promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts()).changed is False


def test_a_new_master_restarted_after_the_emergency_serves_again_without_semi_sync(
        pair, zk_store, writer_store):
    """Found by the e2e fault schedule (the new master's container restarted after the
    emergency, the old master back): promote.yml -e promote_master=<the map's master> made
    it writable, but the restart had brought back the configured semi-sync ON while its
    only peer awaits a rebuild: nothing can acknowledge, so commits waited out
    rpl_semi_sync_master_timeout. The command turns it off as the emergency did (the
    rebuild turns it on again) and says so; a rerun changes nothing."""
    master, standby = roles(pair)
    master.kill()
    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    master.start()
    standby.stop()
    standby.start()
    assert standby.sql("SELECT @@GLOBAL.read_only, @@GLOBAL.rpl_semi_sync_master_enabled"
                       )[0] == (1, 1), "it boots read-only, semi-sync on as configured"
    looked = promote.promote(zk_store, PAIR, nodes(pair), master=standby.address, opts=opts(),
                             check=True)
    assert looked.changed and any("semi-sync" in s for s in looked.steps), looked.to_dict()
    assert standby.sql("SELECT @@GLOBAL.rpl_semi_sync_master_enabled")[0][0] == 1
    res = promote.promote(zk_store, PAIR, nodes(pair), master=standby.address, opts=opts())
    assert res.changed, res.to_dict()
    assert standby.sql("SELECT @@GLOBAL.read_only, @@GLOBAL.rpl_semi_sync_master_enabled"
                       )[0] == (0, 0), "the master serves with semi-sync waiting for nobody"
    assert master.sql("SELECT @@GLOBAL.read_only")[0][0] == 1, "the old master must stay RO"
    assert channel(master)["Slave_SQL_Running"] == "No", "the marked node was re-attached"
    again = promote.promote(zk_store, PAIR, nodes(pair), master=standby.address, opts=opts())
    assert not again.changed, again.to_dict()
    w = tp.Writer(writer_store, max_seconds=30).start()
    try:
        assert w.wait_acks(20), f"the pair takes no writes\n{w.status()}"
    finally:
        w.stop()
    rebuild_and_check(zk_store, pair, master, standby)
    assert standby.sql("SELECT @@GLOBAL.rpl_semi_sync_master_enabled")[0][0] == 1, \
        "semi-sync not back on after the rebuild"


def test_a_restarted_master_is_made_writable_by_promoting_it_to_itself(pair, zk_store):
    """The map's master restarts (a reboot, no promotion) and boots read_only: the
    promotion to the current master (promote.yml -e promote_master=<it>) makes it writable
    again under the pair's locks, since its peer is read-only; with its peer writable it
    refuses to touch either."""
    master, standby = roles(pair)
    master.stop()
    master.start()
    wait_applied(standby, master)
    assert master.sql("SELECT @@GLOBAL.read_only")[0][0] == 1
    assert channel(master)["Slave_SQL_Running"] == "No", "it starts no replica at boot"
    res = promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
    assert res.changed and any("writable" in s for s in res.steps), res.to_dict()
    assert any(f"started {master.address}'s replication" in s for s in res.steps), res.steps
    assert roles(pair) == (master, standby)
    again = promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
    assert not again.changed and not again.warnings, again.to_dict()
    # the peer writable too: refused, nothing touched
    master.sql("SET GLOBAL read_only=ON")
    standby.sql("SET GLOBAL read_only=OFF")
    try:
        with pytest.raises(PromotionRefused, match="writable"):
            promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
        assert master.sql("SELECT @@GLOBAL.read_only")[0][0] == 1
    finally:
        standby.sql("SET GLOBAL read_only=ON")
        master.sql("SET GLOBAL read_only=OFF")
    both_ways(master, standby)


def test_a_master_back_before_the_emergency_serves_again_by_the_command_it_names(
        pair, zk_store, writer_store):
    """Found by the fault campaign (seed 25011, restart_new before the emergency changed
    anything): the master died, the standby restarted, the master came back. Both nodes
    read_only, no replica running (neither starts one at boot). The emergency refuses (the
    master answers), the planned promotion refuses (the standby does not replicate): the
    pair was wedged. The emergency's refusal now names the command that lets the map's
    master serve again, and that command restarts the stopped replication both ways."""
    master, standby = roles(pair)
    master.kill()
    standby.stop()
    standby.start()
    master.start()
    with pytest.raises(PromotionRefused, match="promote_master=") as refused:
        promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    cmd = str(refused.value)
    assert f"-e pair={PAIR} -e promote_master={master.address}" in cmd, cmd
    res = promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
    assert res.changed, res.to_dict()
    assert roles(pair) == (master, standby)
    both_ways(master, standby)
    w = tp.Writer(writer_store, max_seconds=30).start()
    try:
        assert w.wait_acks(20), f"the pair takes no writes\n{w.status()}"
    finally:
        w.stop()
    again = promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
    assert not again.changed, again.to_dict()


def test_a_second_rebuild_that_waited_for_the_locks_decides_on_the_map_the_first_left(
        pair, zk_store, monkeypatch):
    """Found by the fault campaign (seed 999320, second_op in the rebuild): the same
    rebuild command started beside a running one read the map (the mark still there),
    waited for the locks, then rebuilt the finished standby again: it fenced it (both
    channels stopped) and, when its copy failed, left its journal in flight; every rerun
    said "nothing to do" (no mark) and the pair no longer replicated. It reads the map
    under the locks now, and finds nothing to do."""
    import threading

    master, standby = roles(pair)
    master.kill()
    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    master.start()
    copying, go = threading.Event(), threading.Event()
    real = rebuild.copy_shards

    def slow_copy(*a: Any, **kw: Any) -> None:
        copying.set()
        assert go.wait(60)
        real(*a, **kw)

    monkeypatch.setattr(rebuild, "copy_shards", slow_copy)
    out: dict[str, Any] = {}

    def first() -> None:
        out["first"] = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts())

    def second() -> None:
        try:
            out["second"] = promote.rebuild_standby(zk_store, PAIR, nodes(pair),
                                                    opts=ropts(lock_timeout=60))
        except Exception as exc:  # noqa: BLE001 - judged below
            out["second"] = exc

    t1 = threading.Thread(target=first)
    t1.start()
    assert copying.wait(60), "the first rebuild never reached its copy"
    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.5)  # the second has read the map and waits for the locks
    go.set()
    t1.join(120)
    t2.join(120)
    monkeypatch.undo()
    assert out["first"].changed, out["first"].to_dict()
    second_res = out["second"]
    assert not isinstance(second_res, Exception), second_res
    assert not second_res.changed, second_res.to_dict()
    assert ops.Journal(zk_store, f"rebuild-{PAIR}").load().get("done"), "left in flight"
    both_ways(master, standby)


def test_rebuild_refuses_without_the_replication_password(pair, zk_store):
    """The new master's channel must be recreated: without the replication account the
    rebuild refuses before changing anything (and says which option)."""
    master, standby = roles(pair)
    master.kill()
    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    master.start()
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match="replication_password"):
        promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=opts())
    assert zk_store.read().version == v
    rebuild_and_check(zk_store, pair, master, standby)


# -- D: alive but refusing is not dead ----------------------------------------------------

def _hold_all_connections(server: MariaDBServer) -> list[Any]:
    held = [server.connect()]
    held[0].cursor().execute("SET GLOBAL max_connections = 1")
    for _ in range(20):  # root has one connection beyond max_connections
        try:
            held.append(server.connect())
        except pymysql.err.OperationalError as exc:
            assert exc.args[0] == 1040, exc
            return held
    raise AssertionError("max_connections never refused a connection")


@pytest.mark.parametrize("how", ["too_many_connections", "access_denied"])
def test_emergency_refuses_a_master_that_answers_with_an_error(pair, zk_store, how):
    master, standby = roles(pair)
    before = zk_store.read()
    held: list[Any] = []
    o = opts()
    if how == "too_many_connections":
        held = _hold_all_connections(master)
    else:
        # an admin account the master refuses (1045) and the standby accepts
        for s, pw in ((standby, "sf-admin-x"), (master, "sf-admin-other")):
            tp.local_user(s, "sf_adm", pw, "ALL")
        o = opts(user="sf_adm", password="sf-admin-x")
    try:
        with pytest.raises(PromotionRefused, match=r"(?s)is alive.*planned") as refused:
            promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=o)
    finally:
        if held:
            held[0].cursor().execute("SET GLOBAL max_connections = 500")
        for c in held:
            c.close()
        if how == "access_denied":
            for s in pair:
                conn = s.connect()
                with conn.cursor() as c:
                    c.execute("SET sql_log_bin=0")
                    c.execute("DROP USER IF EXISTS 'sf_adm'@'%'")
                conn.close()
    code = "1040" if how == "too_many_connections" else "1045"
    assert code in str(refused.value), refused.value
    after = zk_store.read()
    assert after.version == before.version and after.map == before.map
    assert roles(pair) == (master, standby), "read_only changed"
    assert standby.sql("SHOW ALL SLAVES STATUS"), "the standby's channel was touched"
    assert ops.Journal(zk_store, f"promote-{PAIR}").load() is None
    both_ways(master, standby)


# -- E: "does not answer" is not "dead" when the standby still hears the master -----------

@contextlib.contextmanager
def cut_off_from_control_node(monkeypatch, server: MariaDBServer) -> Iterator[None]:
    """The promotion's connections to *server* go to a port that completes the TCP
    handshake and then never answers (a blackhole), as across a partition between the
    control node and the master; the standby and the routers still reach *server*."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # never accepted, never answered
    real = optypes.connect

    def connect(addr: str, o: promote.Options) -> Any:
        return real(f"127.0.0.1:{hole.getsockname()[1]}" if addr == server.address else addr,
                    o)

    monkeypatch.setattr(optypes, "connect", connect)
    try:
        yield
    finally:
        monkeypatch.setattr(optypes, "connect", real)
        hole.close()


@pytest.mark.parametrize("load", ["writing", "idle"])
def test_emergency_refuses_a_master_cut_off_from_the_control_node_only(
        pair, zk_store, writer_store, monkeypatch, load):
    """Scenario: the control node cannot reach the master, routers and the standby can.
    Writing, the standby receives events; idle, it counts heartbeats. Either way the
    master is alive, cannot be fenced from here, and an emergency must refuse (even
    forced) and change nothing."""
    master, standby = roles(pair)
    before = zk_store.read()
    w = tp.Writer(writer_store, max_seconds=60).start() if load == "writing" else None
    try:
        if w is not None:
            assert w.wait_acks(50), f"writer made no progress\n{w.status()}"
        with cut_off_from_control_node(monkeypatch, master):
            for force in (False, True):
                with pytest.raises(PromotionRefused,
                                   match=r"(?s)does not answer this control node.*"
                                         r"still receives from it.*nothing changed"):
                    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency",
                                    opts=opts(force=force))
        if w is not None:
            assert w.wait_acks(20), f"writes stopped\n{w.status()}"
    finally:
        if w is not None:
            w.stop()
    after = zk_store.read()
    assert after.version == before.version and after.map == before.map
    assert roles(pair) == (master, standby), "read_only changed"
    assert channel(standby).get("Slave_IO_Running") == "Yes", "the standby's channel was touched"
    assert ops.Journal(zk_store, f"promote-{PAIR}").load() is None
    both_ways(master, standby)


def test_emergency_on_a_silent_master_goes_on_after_the_standby_hears_nothing(
        pair, zk_store, writer_store):
    """A master that neither the control node nor its standby hears (stopped with
    SIGSTOP: its sockets stay open, nothing answers, no heartbeat; as a host that
    vanished) is taken for dead: the promotion goes on, zero acknowledged writes lost."""
    master, standby = roles(pair)
    w = tp.Writer(writer_store, max_seconds=60).start()
    try:
        assert w.wait_acks(50), f"writer made no progress\n{w.status()}"
        assert master.proc is not None
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            assert channel(standby).get("Slave_IO_Running") == "Yes"
            res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
            assert w.wait_acks(20), \
                f"writer did not resume on {standby.address}\n{w.status()}"
        finally:
            master.kill()  # SIGKILL ends a stopped process too
    finally:
        w.stop()
    assert res.changed and res.new_master == standby.address, res.to_dict()
    assert "silence_checked" in res.timings, res.timings
    print(f"\nsilent master: silence checked at {res.timings['silence_checked']}s, "
          f"frozen at {res.timings.get('frozen')}s")
    conn = standby.connect()
    try:
        assert tp.missing_ids(conn, w.acked) == [], "acknowledged writes lost"
    finally:
        conn.close()
    rebuild_and_check(zk_store, pair, master, standby)


def test_a_rebuild_that_lost_the_master_after_clearing_the_mark_is_finished_by_its_rerun(
        pair, zk_store, monkeypatch):
    """Found by the fault campaign in CI (seeds 875687, 875693: a partition between the
    control node and the master during the rebuild): the connection to the master was
    lost after the map write that cleared the mark, while the rebuild checked both
    channels. It failed saying the node was "still marked for rebuild" (it was not), and
    every rerun said "nothing to do: no server of the pair is marked" without finishing
    the journal: the rebuild stayed in flight and the registry refused every later
    operation on the pair. The rerun finishes it now, and the failure says what is left."""
    master, standby = roles(pair)
    master.kill()
    promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    master.start()
    real = rebuild._Rebuild._clear_mark
    killed: dict[str, int] = {}

    def clear_then_lose_the_master(self: Any) -> None:
        real(self)
        # the partition: the rebuild's connection to the master is gone after the write
        killed["id"] = self.mconn.thread_id()
        standby.sql(f"KILL {killed['id']}")

    monkeypatch.setattr(rebuild._Rebuild, "_clear_mark", clear_then_lose_the_master)
    with pytest.raises(PromotionFailed) as failed:
        promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts())
    monkeypatch.undo()
    assert killed, "the rebuild never cleared the mark"
    msg = str(failed.value)
    assert "mark_cleared" in msg and "still marked" not in msg, msg
    assert "rebuild-standby.yml again" in msg, msg
    m = zk_store.read().map
    assert all(r.standby == master.address and "rebuild" not in r.extra for r in m.ranges)
    j = ops.Journal(zk_store, f"rebuild-{PAIR}").load()
    assert j and not j.get("done"), j
    again = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts())
    assert again.changed and again.resumed, again.to_dict()
    assert ops.Journal(zk_store, f"rebuild-{PAIR}").load().get("done"), "left in flight"
    both_ways(master, standby)
    # now it is finished: a rerun changes nothing
    last = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts())
    assert not last.changed, last.to_dict()
    # and the pair takes the next operation (the registry holds nothing in flight)
    res = promote.promote(zk_store, PAIR, nodes(pair), master=master.address, opts=opts())
    assert res.changed, res.to_dict()
    both_ways(master, standby)


# -- a run that lost its ZooKeeper session (its locks) -------------------------------------


def writable(server: MariaDBServer) -> bool:
    return server.sql("SELECT @@GLOBAL.read_only")[0][0] == 0


def test_a_run_that_lost_its_session_acts_no_more(pair, zk_store, zookeeper, monkeypatch):
    """Defect 1: run A's session expires inside a step (its locks vanish); run B, the same
    command, takes the locks, resumes A's journal and finishes the promotion. A must then
    stop before its next action: before the fix its next journal write failed inside a
    step wrapped by the planned rollback, which made the old master writable again after
    B had made the new one writable: two writable masters in one pair."""
    from shardfleet.mapstore import ZooKeeperMapStore

    master, standby = roles(pair)
    real = replication.wait_no_write_transactions
    seen: dict[str, Any] = {}

    def wait_no_write_transactions(conn: Any, timeout: float) -> int:
        left = real(conn, timeout)
        if "b" not in seen:  # A, fencing the master: its session ends, B runs to the end
            seen["b"] = None
            expire_store_session(zk_store)
            other = ZooKeeperMapStore(zookeeper.address, zk_store.cluster)
            try:
                seen["b"] = promote.promote(other, PAIR, nodes(pair), mode="planned",
                                            opts=opts(lock_timeout=30))
            finally:
                other.close()
        return left

    monkeypatch.setattr(replication, "wait_no_write_transactions", wait_no_write_transactions)
    try:
        with pytest.raises(PromotionFailed) as failed:
            promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    finally:
        monkeypatch.undo()
    assert seen["b"] is not None and seen["b"].changed, seen
    assert writable(standby) and not writable(master), \
        (f"after B's promotion: {standby.address} writable={writable(standby)}, "
         f"{master.address} writable={writable(master)} (A rolled back?)")
    assert "lost" in str(failed.value), str(failed.value)
    m = zk_store.read().map
    assert all(r.master == standby.address and r.state != "frozen" for r in m.ranges), m.dumps()
    assert ops.Journal(zk_store, f"promote-{PAIR}").load()["done"]
    wait_applied(master, standby)
    back = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                           expect_master=standby.address, opts=opts())
    assert back.changed and roles(pair) == (master, standby)
    wait_applied(standby, master)


@contextlib.contextmanager
def standby_between_retries(master: MariaDBServer, standby: MariaDBServer,
                            retry: int = 60) -> Iterator[None]:
    """A blip between the standby and its live master: the standby's connection is cut
    and its first reconnect refused, so its I/O thread sits in ``Connecting`` for its
    whole retry period (the fleet's is 10 s) while the master is alive and reachable."""
    standby.sql("STOP SLAVE")
    standby.sql(f"CHANGE MASTER TO MASTER_CONNECT_RETRY = {retry}, "
                f"MASTER_HEARTBEAT_PERIOD = {replication.HEARTBEAT_PERIOD}")
    standby.sql("START SLAVE")
    deadline = time.monotonic() + 30
    while channel(standby).get("Slave_IO_Running") != "Yes":
        assert time.monotonic() < deadline, channel(standby)
        time.sleep(0.05)
    def account(how: str) -> None:  # on the master only (not binlogged)
        conn = master.connect()
        try:
            with conn.cursor() as c:
                c.execute("SET SESSION sql_log_bin=0")
                c.execute(f"ALTER USER '{REPL_USER}'@'%' ACCOUNT {how}")
        finally:
            conn.close()

    account("LOCK")
    try:
        for (tid,) in master.sql("SELECT ID FROM information_schema.PROCESSLIST "
                                 "WHERE COMMAND LIKE 'Binlog Dump%%'"):
            with contextlib.suppress(pymysql.err.MySQLError):
                master.sql(f"KILL {int(tid)}")
        while not (ch := channel(standby)).get("Last_IO_Errno"):
            assert time.monotonic() < deadline, f"the standby did not lose its master: {ch}"
            time.sleep(0.05)
        assert ch.get("Slave_IO_Running") == "Connecting", ch
    finally:
        account("UNLOCK")
    try:
        yield
    finally:
        standby.sql("STOP SLAVE")
        standby.sql("CHANGE MASTER TO MASTER_CONNECT_RETRY = 1, "
                    f"MASTER_HEARTBEAT_PERIOD = {replication.HEARTBEAT_PERIOD}")
        standby.sql("START SLAVE")


def test_emergency_hears_a_standby_that_is_reconnecting_to_a_live_master(
        pair, zk_store, monkeypatch):
    """Defect 7: the control node cannot reach the master, and the standby's I/O thread
    is ``Connecting`` after a blip (between two retries) though the master is alive. One
    sample of that state is no silence: before the fix the emergency read it as "nobody
    hears the master" at once and promoted beside a live master (two masters)."""
    master, standby = roles(pair)
    before = zk_store.read()
    with standby_between_retries(master, standby):
        with cut_off_from_control_node(monkeypatch, master):
            with pytest.raises(PromotionRefused, match=r"(?s)still receives from it"):
                promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    after = zk_store.read()
    assert after.version == before.version and after.map == before.map
    assert roles(pair) == (master, standby), "read_only changed"
    assert ops.Journal(zk_store, f"promote-{PAIR}").load() is None
    both_ways(master, standby)
