"""Promotion on a real MariaDB master-master GTID pair (semi-sync on) and ZooKeeper:
planned and emergency under a live writer (zero acknowledged writes lost), check mode,
idempotent reruns, refusals with nothing changed, the lock, errant transactions, and
re-attaching a rebuilt old master.

The pair is shared by the module's tests (starting MariaDB twice per test is too slow
for CI); every test leaves it whole: one writable master, one read-only standby,
replication running both ways. Its map is registered afresh in a new cluster per test.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import pytest

from shardfleet import ids, ops, promote, replication
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.promote import Options, PromotionRefused
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer, kit

from .conftest import APP_PASSWORD, APP_USER, make_shards

SHARDS = list(range(0, 8))
REPL_USER, REPL_PASSWORD = "sf_repl", "sf-repl-test"
PAIR = "pair009"


# -- a bounded writer through the routing library (also used by the e2e test) --------------

def Writer(store: Store, max_seconds: float = 120.0, near: int | None = None,  # noqa: N802
           max_writes: int = 200_000) -> kit.Writer:
    """The kit's writer as the promotion tests (and bench/promote.py, the e2e test) use it:
    one thread creating pins on *near*'s shard (any open shard without it), logging every
    acknowledged ID and when it was acknowledged (the stall). *max_seconds* is the bound
    that ends it: a writer on an asynchronous master on tmpfs acknowledges ~700 creates a
    second, so a smaller count bound ran out before a loaded machine's physical copy was
    done (the writer ended, not stalled)."""
    return kit.Writer(store, [ids.shard_of(near)] if near is not None else None, threads=1,
                      seconds=max_seconds, max_ops=max_writes, updates=0.0)


def local_user(server: MariaDBServer, user: str, password: str, privileges: str) -> None:
    """*user* with *privileges* on every database of *server* only (not binlogged, so the
    peer does not get it): a per-node account for refusal tests."""
    conn = server.connect()
    try:
        with conn.cursor() as c:
            c.execute("SET sql_log_bin=0")
            c.execute(f"CREATE USER IF NOT EXISTS '{user}'@'%%' IDENTIFIED BY %s", (password,))
            c.execute(f"GRANT {privileges} ON *.* TO '{user}'@'%'")
    finally:
        conn.close()


def missing_ids(server_conn: Any, ids_: list[int]) -> list[int]:
    """Acknowledged object IDs (pins) not present on a server."""
    from shardfleet import ids as idmod

    by_shard: dict[int, list[int]] = {}
    for oid in ids_:
        d = idmod.decompose(oid)
        by_shard.setdefault(d.shard, []).append(d.local)
    missing = []
    with server_conn.cursor() as c:
        for shard, locals_ in by_shard.items():
            found: set[int] = set()
            for i in range(0, len(locals_), 500):
                chunk = locals_[i:i + 500]
                c.execute(f"SELECT local_id FROM db{shard:05d}.pins WHERE local_id IN "
                          f"({','.join(['%s'] * len(chunk))})", chunk)
                found |= {int(r[0]) for r in c.fetchall()}
            missing += [idmod.compose(shard, 1, x) for x in locals_ if x not in found]
    return missing


# -- the pair ----------------------------------------------------------------------------

def _start(base, i: int) -> MariaDBServer:
    return MariaDBServer(base, server_id=10 + i, extra=[
        # as the mysql role configures a node: read-only and no replica started at boot
        "--innodb-file-per-table=0", "--read-only=ON", "--skip-slave-start",
        "--rpl-semi-sync-master-enabled=ON",
        "--rpl-semi-sync-slave-enabled=ON", "--rpl-semi-sync-master-timeout=1000",
        "--auto-increment-increment=2", f"--auto-increment-offset={i}",
        "--slave-net-timeout=5"]).start()


def attach(replica: MariaDBServer, source: MariaDBServer, pos: str | None = None) -> None:
    """Point *replica* at *source* starting from *source*'s binlog position (or *pos*)."""
    pos = source.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0] if pos is None else pos
    replica.sql("STOP SLAVE")
    replica.sql("SET GLOBAL gtid_slave_pos = %s", (pos,))
    conn = replica.connect()
    try:  # as the mysql role and the operations do: GTID, the fleet's heartbeat period
        replication.change_master(conn, "127.0.0.1", source.port, REPL_USER, REPL_PASSWORD,
                                  connect_retry=1)
    finally:
        conn.close()
    replica.sql("START SLAVE")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("promote")
    servers = kit.start_all([lambda: _start(base, 1), lambda: _start(base, 2)], _wire)
    yield servers
    for s in servers:
        s.stop(remove=True)


def _wire(a: MariaDBServer, b: MariaDBServer) -> None:
    """Users, master-master GTID replication, the shards on *a*, *a* writable."""
    for s in (a, b):
        for stmt, args in (
                (f"CREATE USER '{REPL_USER}'@'%%' IDENTIFIED BY %s", (REPL_PASSWORD,)),
                (f"GRANT REPLICATION SLAVE ON *.* TO '{REPL_USER}'@'%%'", ()),
                (f"CREATE USER '{APP_USER}'@'%%' IDENTIFIED BY %s", (APP_PASSWORD,))):
            conn = s.connect()
            with conn.cursor() as c:
                c.execute("SET sql_log_bin=0")
                c.execute(stmt, args)
            conn.close()
    attach(a, b)
    attach(b, a)
    make_shards(a, SHARDS)
    a.sql("SET GLOBAL read_only=OFF")
    wait_applied(b, a)


def wait_applied(replica: MariaDBServer, source: MariaDBServer, timeout: float = 30) -> None:
    pos = source.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    r = replica.sql("SELECT MASTER_GTID_WAIT(%s, %s)", (pos, timeout))[0][0]
    assert r == 0, f"{replica.address} did not apply {pos} of {source.address}"


def roles(pair) -> tuple[MariaDBServer, MariaDBServer]:
    """(master, standby) by read_only."""
    a, b = pair
    return (a, b) if a.sql("SELECT @@GLOBAL.read_only")[0][0] == 0 else (b, a)


@pytest.fixture
def zk_store(zookeeper, pair):
    """A fresh cluster with the pair's map (master = the writable node)."""
    master, standby = roles(pair)
    store = ZooKeeperMapStore(zookeeper.address, "p" + uuid.uuid4().hex[:10])
    store.write(ShardMap.from_ranges([
        {"range": [0, 3], "master": master.address, "standby": standby.address,
         "state": "open"},
        {"range": [4, 7], "master": master.address, "standby": standby.address,
         "state": "closed"},
    ], mod_shard_count=8), NO_NODE)
    yield store
    store.close()


def opts(**kw: Any) -> Options:
    return Options(**{"user": "root", "password": MariaDBServer.root_password,
                      "connect_timeout": 2, **kw})


@pytest.fixture
def writer_store(zookeeper, zk_store, tmp_path):
    r = Router(ZooKeeperMapStore(zookeeper.address, zk_store.cluster),
               cache_file=tmp_path / "map.json", user=APP_USER, password=APP_PASSWORD,
               frozen_wait=10.0, connect_timeout=2, read_timeout=10)
    s = Store(r)
    yield s
    s.close()
    r.close()


def nodes(pair) -> list[str]:
    return [s.address for s in pair]


def channel(server: MariaDBServer) -> dict[str, Any]:
    conn = server.connect()
    try:
        rows = promote.replica_status(conn)
    finally:
        conn.close()
    return rows[0] if rows else {}


# -- planned ---------------------------------------------------------------------------

def test_planned_check_mode_changes_nothing(pair, zk_store):
    master, standby = roles(pair)
    before = zk_store.read()
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts(), check=True)
    assert res.changed and res.new_master == standby.address
    assert any("would" in s for s in res.steps), res.steps
    # its NEXT line speaks of the promotion it would do, not of one done
    assert res.next_step.startswith("check mode changed nothing"), res.next_step
    after = zk_store.read()
    assert after.version == before.version and after.map == before.map, "check mode wrote"
    assert roles(pair) == (master, standby), "check mode changed read_only"
    assert ops.Journal(zk_store, f"promote-{PAIR}").load() is None, "check mode journalled"


def test_planned_under_load_zero_loss_then_idempotent(pair, zk_store, writer_store):
    master, standby = roles(pair)
    w = Writer(writer_store, max_seconds=60).start()
    try:
        assert w.wait_acks(200), f"writer made no progress\n{w.status()}"
        t0 = time.monotonic()
        res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
        assert w.wait_acks(200), f"writer did not resume\n{w.status()}"
    finally:
        w.stop()
    assert res.changed and res.old_master == master.address
    assert res.steps[-1] == "flipped", res.steps
    m = zk_store.read().map
    assert all(r.master == standby.address and r.standby == master.address for r in m.ranges)
    assert [r.state for r in m.ranges] == ["open", "closed"], "states not restored"
    assert not any("frozen_from" in r.extra for r in m.ranges)
    assert roles(pair) == (standby, master), "read_only not swapped"
    wait_applied(master, standby)
    ch = channel(master)
    assert ch["Slave_IO_Running"] == "Yes" and ch["Slave_SQL_Running"] == "Yes", ch
    for s in (standby, master):  # every acknowledged write is on both nodes
        conn = s.connect()
        try:
            assert missing_ids(conn, w.acked) == [], f"acknowledged writes lost on {s.address}"
        finally:
            conn.close()
    stall = w.longest_stall(since=t0)
    print(f"\nplanned: {len(w.acked)} acked, longest stall {stall:.3f}s, "
          f"frozen {res.timings.get('frozen_seconds')}s, errors {len(w.errors)} {w.errors[:2]}")
    assert stall < 3.0, f"writer stalled {stall:.2f}s"
    # a rerun toward the same master changes nothing
    again = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                            master=standby.address, opts=opts())
    assert not again.changed and zk_store.read().version == zk_store.read().version
    assert again.warnings == [], again.warnings


def test_planned_refused_when_master_dead(pair, zk_store):
    master, standby = roles(pair)
    before = zk_store.read()
    dead = [master.address.replace(str(master.port), "1"), standby.address]
    m = before.map
    zk_store.write(ShardMap.from_ranges([replace(r, master=dead[0]) for r in m.ranges],
                                        m.mod_shard_count), before.version)
    v = zk_store.read()
    with pytest.raises(PromotionRefused, match="does not answer.*emergency"):
        promote.promote(zk_store, PAIR, dead, mode="planned", opts=opts())
    assert zk_store.read().version == v.version and roles(pair) == (master, standby)


def test_refusals_leave_everything_unchanged(pair, zk_store, zookeeper):
    master, standby = roles(pair)
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match="answers: use mode=planned"):
        promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    with pytest.raises(PromotionRefused, match="no range in the map"):
        promote.promote(zk_store, "pair404", ["127.0.0.1:1", "127.0.0.1:2"], opts=opts())
    with pytest.raises(PromotionRefused, match="not a server of pair"):
        promote.promote(zk_store, PAIR, nodes(pair), master="127.0.0.1:9", opts=opts())
    # another operation (a split takes its source master's lock) holds one server of the pair
    with ops.servers_lock(zk_store, [nodes(pair)[0]]):
        other = ZooKeeperMapStore(zookeeper.address, zk_store.cluster)
        try:
            with pytest.raises(PromotionRefused, match="another operation holds"):
                promote.promote(other, PAIR, nodes(pair), opts=opts(lock_timeout=0.5))
            with pytest.raises(PromotionRefused, match="another operation holds"):
                promote.promote(other, PAIR, nodes(pair), opts=opts(), check=True)
        finally:
            other.close()
    assert zk_store.read().version == v and roles(pair) == (master, standby)
    assert ops.Journal(zk_store, f"promote-{PAIR}").load() is None


def test_refused_when_a_range_has_no_copy_on_the_standby(pair, zk_store):
    master, standby = roles(pair)
    cur = zk_store.read()
    r0, r1 = cur.map.ranges
    zk_store.write(ShardMap.from_ranges([r0, replace(r1, standby=None)], 8), cur.version)
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match="not the standby of"):
        promote.promote(zk_store, PAIR, nodes(pair), opts=opts())
    assert zk_store.read().version == v and roles(pair) == (master, standby)


def test_planned_reports_errant_transaction(pair, zk_store):
    master, standby = roles(pair)
    # break standby -> master replication, write on the standby directly: errant
    master.sql("STOP SLAVE")
    conn = standby.connect()
    with conn.cursor() as c:
        c.execute("INSERT INTO db00000.pins (body) VALUES ('{\"errant\": 1}')")
    conn.close()
    try:
        res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    finally:
        master.sql("START SLAVE")
    assert res.errant, res.to_dict()
    assert any("errant" in w for w in res.warnings)
    wait_applied(master, standby)


def test_module_check_mode_and_refusal(pair, zk_store, zookeeper, tmp_path):
    """shard_promote through ansible-playbook: check mode lists the plan and writes
    nothing; a refusal fails with one line; the password never reaches the output."""
    from .test_modules import run_module

    master, standby = roles(pair)
    args = {"zookeeper_hosts": [zookeeper.address], "cluster": zk_store.cluster,
            "pair": PAIR, "nodes": nodes(pair), "login_user": "root",
            "login_password": MariaDBServer.root_password}
    v = zk_store.read().version
    res, out = run_module(tmp_path, "shard_promote", args, check=True, diff=True)
    assert res["changed"] and res["new_master"] == standby.address, res
    assert "freeze (would)" in res["steps"] and res["diff"]["before"]
    res, out2 = run_module(tmp_path, "shard_promote", {**args, "mode": "emergency"})
    assert res["failed"] and "answers: use mode=planned" in res["msg"], res
    assert MariaDBServer.root_password not in out + out2
    assert zk_store.read().version == v and roles(pair) == (master, standby)


# -- emergency -------------------------------------------------------------------------

def test_emergency_check_mode_and_force(pair, zk_store):
    master, standby = roles(pair)
    v = zk_store.read().version
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency",
                          opts=opts(force=True), check=True)
    assert res.changed and any("would" in s for s in res.steps)
    assert zk_store.read().version == v and roles(pair) == (master, standby)


def test_emergency_kill_master_under_load(pair, zk_store, writer_store):
    master, standby = roles(pair)
    w = Writer(writer_store, max_seconds=90).start()
    try:
        assert w.wait_acks(300), f"writer made no progress\n{w.status()}"
        master.kill()  # SIGKILL mid-load
        time.sleep(0.5)
        t0 = time.monotonic()
        res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
        t_done = time.monotonic()
        assert w.wait_acks(100), f"writer did not resume on {standby.address}\n{w.status()}"
    finally:
        w.stop()
    first = w.first_ack_after(t0)
    assert first is not None
    print(f"\nemergency: promote {t_done - t0:.3f}s, first ack after {first - t0:.3f}s, "
          f"{len(w.acked)} acked, warnings {res.warnings}")
    assert res.changed and res.new_master == standby.address
    assert res.errant == [], res.errant
    m = zk_store.read().map
    assert all(r.master == standby.address and r.extra.get("rebuild") == master.address
               for r in m.ranges), m.dumps()
    conn = standby.connect()
    try:
        assert missing_ids(conn, w.acked) == [], "acknowledged writes lost"
    finally:
        conn.close()
    assert channel(standby) == {}, "the channel to the dead master is left"
    # rerun: nothing to do; a planned promotion back to the dead node is refused
    again = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    assert not again.changed and "rebuild" in again.next_step
    with pytest.raises(PromotionRefused, match="marked for rebuild"):
        promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", master=master.address,
                        opts=opts())
    # the old master comes back read-only and takes no writes
    master.start()
    assert master.sql("SELECT @@GLOBAL.read_only")[0][0] == 1
    app = master.connect(user=APP_USER, password=APP_PASSWORD)
    with pytest.raises(Exception, match="read-only|1290"), app.cursor() as c:
        c.execute("INSERT INTO db00000.pins (body) VALUES ('{}')")
    app.close()
    # re-attach it as the standby (what playbooks/rebuild-standby.yml does)
    rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=opts(
        replication_user=REPL_USER, replication_password=REPL_PASSWORD))
    assert rr.changed, rr.to_dict()
    m = zk_store.read().map
    assert all("rebuild" not in r.extra and r.standby == master.address for r in m.ranges)
    conn = master.connect()
    try:
        wait_applied(master, standby)
        assert missing_ids(conn, w.acked) == [], "rebuilt standby lacks acknowledged writes"
    finally:
        conn.close()
    assert standby.sql("SELECT @@GLOBAL.rpl_semi_sync_master_enabled")[0][0] == 1, \
        "semi-sync not back on the master after the rebuild"
    assert promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=opts()).changed is False


def test_pair_is_whole_again_after_rebuild(pair, zk_store, writer_store):
    """After the emergency and the rebuild, a planned promotion back works under load."""
    master, standby = roles(pair)
    w = Writer(writer_store, max_seconds=30).start()
    try:
        assert w.wait_acks(100)
        res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
        assert w.wait_acks(100)
    finally:
        w.stop()
    assert res.changed and roles(pair) == (standby, master)
    wait_applied(master, standby)
    for s in pair:
        conn = s.connect()
        try:
            assert missing_ids(conn, w.acked) == [], s.address
        finally:
            conn.close()


def test_a_catch_up_longer_than_the_connections_read_timeout_is_waited_for(pair):
    """A standby that needs longer to catch up than its admin connection's read timeout
    (a rebuilt node applying what the master took during the copy): the wait ends when it
    applied the position, not as 'lost connection (timed out)' after the read timeout
    (the e2e physical rebuild under a writer failed so, with 30 s)."""
    master, standby = roles(pair)
    standby.sql("STOP SLAVE SQL_THREAD")
    try:
        master.sql("INSERT INTO db00001.pins (body) VALUES ('{}')")
        pos = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
        starter = threading.Timer(5.0, standby.sql, ("START SLAVE SQL_THREAD",))
        starter.start()
        conn = standby.connect(read_timeout=2)
        try:
            t0 = time.monotonic()
            replication.wait_for_gtid(conn, pos, 60)
            assert time.monotonic() - t0 >= 4.0
            # and the wait still ends at its own bound, with its own error
            standby.sql("STOP SLAVE SQL_THREAD")
            master.sql("INSERT INTO db00001.pins (body) VALUES ('{}')")
            pos = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
            with pytest.raises(replication.ReplicationTimeout, match="within 3.5s"):
                replication.wait_for_gtid(conn, pos, 3.5)
        finally:
            starter.cancel()
            conn.close()
    finally:
        standby.sql("START SLAVE SQL_THREAD")
    wait_applied(standby, master)


def test_emergency_refused_when_standby_dead(pair, zk_store):
    master, standby = roles(pair)
    bogus = [master.address, "127.0.0.1:1"]
    cur = zk_store.read()
    zk_store.write(ShardMap.from_ranges([replace(r, standby=bogus[1]) for r in cur.map.ranges],
                                        cur.map.mod_shard_count), cur.version)
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match="standby .* does not answer"):
        promote.promote(zk_store, PAIR, bogus, mode="emergency",
                        opts=opts(force=True, connect_timeout=1))
    assert zk_store.read().version == v


# -- expect_master: a rerun of a finished promotion changes nothing -----------------------

def test_expect_master_refuses_a_rerun_after_the_promotion(pair, zk_store, tmp_path, zookeeper):
    from .test_modules import run_module

    master, standby = roles(pair)
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                          expect_master=master.address, opts=opts())
    assert res.changed and roles(pair) == (standby, master)
    wait_applied(master, standby)
    v = zk_store.read().version
    for mode in ("planned", "emergency"):  # the same command again: refused, nothing changes
        with pytest.raises(PromotionRefused, match="already happened") as refused:
            promote.promote(zk_store, PAIR, nodes(pair), mode=mode,
                            expect_master=master.address, opts=opts())
        assert standby.address in str(refused.value)
    with pytest.raises(PromotionRefused, match="not a server of pair"):
        promote.promote(zk_store, PAIR, nodes(pair), expect_master="127.0.0.1:9", opts=opts())
    assert zk_store.read().version == v and roles(pair) == (standby, master)
    # through the module (what promote.yml runs)
    args = {"zookeeper_hosts": [zookeeper.address], "cluster": zk_store.cluster,
            "pair": PAIR, "nodes": nodes(pair), "login_user": "root",
            "login_password": MariaDBServer.root_password}
    out, _ = run_module(tmp_path, "shard_promote", {**args, "expect_master": master.address})
    assert out["failed"] and "already happened" in out["msg"], out
    assert zk_store.read().version == v and roles(pair) == (standby, master)
    # the current master as expect_master: the promotion runs (and the pair is back)
    out, _ = run_module(tmp_path, "shard_promote", {**args, "expect_master": standby.address})
    assert out["changed"] and out["new_master"] == master.address, out
    assert roles(pair) == (master, standby)
    wait_applied(standby, master)


# -- the modules' error boundary ------------------------------------------------------------

def test_module_failures_are_one_line_without_traceback(pair, zk_store, tmp_path, zookeeper):
    """A server that refuses a statement (an admin without replication privileges) and a
    dead ZooKeeper: failed, one line, no traceback in msg, no password anywhere."""
    from shardfleet.testing import free_port

    from .test_modules import run_module

    master, standby = roles(pair)
    weak_pw = "sf-weak-secret-1"
    for s in pair:
        local_user(s, "sf_weak", weak_pw, "SELECT")
    args = {"zookeeper_hosts": [zookeeper.address], "cluster": zk_store.cluster,
            "pair": PAIR, "nodes": nodes(pair), "login_user": "sf_weak",
            "login_password": weak_pw}
    v = zk_store.read().version
    try:
        res, out = run_module(tmp_path, "shard_promote", args)
    finally:
        for s in pair:
            conn = s.connect()
            with conn.cursor() as c:
                c.execute("SET sql_log_bin=0")
                c.execute("DROP USER IF EXISTS 'sf_weak'@'%'")
            conn.close()
    print("\nweak admin:", res.get("msg"), "| exception:", bool(res.get("exception")))
    assert res["failed"], res
    assert "\n" not in res["msg"] and "Traceback" not in res["msg"], res["msg"]
    assert "1227" in res["msg"] and standby.address in res["msg"], res["msg"]
    # the library's message (what happened, that nothing changed), not the crash of a module
    assert "nothing changed" in res["msg"] and "Module failed" not in res["msg"], res["msg"]
    assert weak_pw not in out
    assert zk_store.read().version == v and roles(pair) == (master, standby)
    res, out = run_module(tmp_path, "shard_promote", {
        **args, "zookeeper_hosts": [f"127.0.0.1:{free_port()}"], "zookeeper_timeout": 2})
    assert res["failed"] and "\n" not in res["msg"] and "Traceback" not in res["msg"], res
    assert "unreachable" in res["msg"]


def test_a_plain_rerun_after_a_finished_promotion_is_refused(pair, zk_store):
    """The same plain command run again (an SSH session dropped; the operator cannot tell
    a finished run from a half one) must not promote the pair back; naming the expected
    master promotes back deliberately."""
    master, standby = roles(pair)
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    assert res.changed and roles(pair) == (standby, master)
    wait_applied(master, standby)
    v = zk_store.read().version
    with pytest.raises(PromotionRefused, match="already happened.*looks like the same command"):
        promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    assert zk_store.read().version == v and roles(pair) == (standby, master)
    back = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                           expect_master=standby.address, opts=opts())
    assert back.changed and roles(pair) == (master, standby)
    wait_applied(standby, master)


def test_the_same_command_started_beside_a_running_one_decides_on_the_map_it_left(
        pair, zk_store, monkeypatch):
    """Two identical plain commands (two operators, or a retry of a hung SSH session): the
    second waits for the first's locks and must then decide on the map the first left (a
    finished promotion: refused as a rerun), not on the map it read before waiting."""
    master, standby = roles(pair)
    real = replication.wait_for_gtid
    first_holds = threading.Event()

    def slow_wait(conn: Any, position: str, timeout: float) -> None:
        first_holds.set()  # the first promotion holds the locks and has frozen the ranges
        time.sleep(1.0)
        real(conn, position, timeout)

    monkeypatch.setattr(replication, "wait_for_gtid", slow_wait)
    out: dict[str, Any] = {}

    def first() -> None:
        out["first"] = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                                       opts=opts())

    t = threading.Thread(target=first)
    t.start()
    try:
        assert first_holds.wait(30), "the first promotion never reached its drain"
        with pytest.raises(PromotionRefused, match="already happened"):
            promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                            opts=opts(lock_timeout=30))
    finally:
        t.join(60)
        monkeypatch.undo()
    assert out["first"].changed and roles(pair) == (standby, master)
    wait_applied(master, standby)
    back = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                           expect_master=standby.address, opts=opts())
    assert back.changed and roles(pair) == (master, standby)
    wait_applied(standby, master)


def test_an_emergency_after_a_planned_promotion_is_not_taken_for_a_rerun(pair, zk_store):
    master, standby = roles(pair)
    promote.promote(zk_store, PAIR, nodes(pair), mode="planned", opts=opts())
    wait_applied(master, standby)
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", check=True,
                          opts=opts(force=True))
    assert res.changed, res.to_dict()
    back = promote.promote(zk_store, PAIR, nodes(pair), mode="planned",
                           expect_master=standby.address, opts=opts())
    assert back.changed and roles(pair) == (master, standby)
    wait_applied(standby, master)


def test_forced_emergency_waits_for_the_fenced_masters_last_transactions(pair, zk_store):
    """force=true on a live master: the master is fenced, then the standby must receive and
    apply everything the master acknowledged before its I/O thread is stopped. Here the
    standby's I/O thread is stopped while the master acknowledges writes."""
    master, standby = roles(pair)
    standby.sql("STOP SLAVE IO_THREAD")
    master.sql("SET GLOBAL rpl_semi_sync_master_timeout = 100")  # acknowledge without it
    try:
        for i in range(5):
            master.sql("INSERT INTO db00001.pins (body) VALUES (%s)", (f'{{"forced": {i}}}',))
        res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency",
                              opts=opts(force=True))
    finally:
        master.sql("SET GLOBAL rpl_semi_sync_master_timeout = 1000")
    assert res.changed and res.new_master == standby.address
    got = standby.sql("SELECT COUNT(*) FROM db00001.pins WHERE JSON_VALUE(body, '$.forced') "
                      "IS NOT NULL")[0][0]
    assert got == 5, f"{5 - got} write(s) the fenced master acknowledged are missing"
    rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=opts(
        replication_user=REPL_USER, replication_password=REPL_PASSWORD))
    assert rr.changed, rr.to_dict()
    wait_applied(master, standby)
