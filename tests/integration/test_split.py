"""The split on real MariaDB host processes (a source, a target GTID master-master pair) and
ZooKeeper: a live split under a bounded writer through the routing library (zero lost or
duplicated writes, a stall under a second), resumption after a failure at every step
boundary, refusals that change nothing, abort, and a cutover timeout that undoes itself."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shardfleet import ids
from shardfleet.errors import MapStoreUnavailable
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.split import (
    Credentials,
    CutoverAborted,
    Split,
    SplitError,
    SplitSpec,
)
from shardfleet.router import Router
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer
from shardfleet.testing.kit import (
    APP_PASSWORD,
    APP_USER,
    REPL_PASSWORD,
    REPL_USER,
    SplitFleet,
    Writer,
    make_server,
    pair_up,
    rows,
    verify,
    wait_pair_synced,
)

MOVING = (16, 31)
ALL_SHARDS = list(range(0, 32))


@pytest.fixture(scope="module")
def split_servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("split")
    src = make_server(base, 11)
    ta, tb = make_server(base, 31, "a"), make_server(base, 32, "b")
    pair_up(ta, tb)
    yield src, ta, tb
    for s in (src, ta, tb):
        s.stop(remove=True)


@pytest.fixture
def fleet(split_servers, zookeeper):
    f = SplitFleet(*split_servers, zookeeper.address)
    f.reset()
    yield f
    f.close()


def run_split_under_writer(fleet: SplitFleet, tmp_path, steps, *, seconds: float = 20.0):
    """Run *steps* (each a callable) while a writer writes all 32 shards; return its log."""
    router = fleet.router(tmp_path)
    store = Store(router)
    writer = Writer(store, ALL_SHARDS, threads=3, seconds=seconds).start()
    try:
        time.sleep(0.5)
        for step in steps:
            step()
        time.sleep(0.5)
    finally:
        log = writer.stop()
        store.close()
        router.close()
    assert writer.ops > 100, f"the writer made only {writer.ops} writes"
    return log


def fence_writes(fleet: SplitFleet) -> int:
    """Moving databases on the source where the app user lacks a write privilege."""
    return int(fleet.source.sql(
        "SELECT COUNT(*) FROM mysql.db WHERE User=%s AND Db BETWEEN 'db00016' AND 'db00031' "
        "AND (Insert_priv='N' OR Update_priv='N' OR Delete_priv='N')", (APP_USER,))[0][0])


def test_split_under_live_writes_loses_nothing(fleet, tmp_path):
    results = []

    def go():
        with fleet.split() as sp:
            results.extend(sp.run("all"))

    log = run_split_under_writer(fleet, tmp_path, [go])
    by = {r.step: r for r in results}
    assert [r.step for r in results] == ["check", "clone", "replicate", "cutover"]
    stall = by["cutover"].details["frozen_seconds"]
    assert stall < 1.0, f"writes to the moving shards were held {stall:.3f} s (goal < 1 s)"
    moving_errors = [e for e in log.errors if MOVING[0] <= e[0] <= MOVING[1]]
    assert not moving_errors, f"the writer got errors for moving shards: {moving_errors[:3]}"
    longest = log.longest(set(range(MOVING[0], MOVING[1] + 1)))
    assert longest < 2.0, f"a write to a moving shard waited {longest:.2f} s"
    m = fleet.map()
    moved = m.range_for(20)
    assert (moved.bounds, moved.master, moved.standby, moved.state) == (
        MOVING, fleet.target.address, fleet.standby.address, "open")
    assert "frozen_from" not in moved.extra and m.range_for(3).bounds == (0, 15)
    wait_pair_synced(fleet.target, fleet.standby)
    verify(fleet, log, MOVING)
    shards = list(range(MOVING[0], MOVING[1] + 1))
    assert rows(fleet.standby, shards) == rows(fleet.target, shards), "the target's standby differs"
    assert all(r[0] == "" for r in fleet.target.sql("SHOW ALL SLAVES STATUS")), \
        "the split's replication connection is still there"
    print(f"\nsplit: stall {stall * 1000:.0f} ms, longest moving write {longest * 1000:.0f} ms, "
          f"{len(log.acked)} objects, steps "
          + ", ".join(f"{r.step} {r.seconds:.2f}s" for r in results))
    # every step again: nothing to do; then cleanup drops the source's copies
    with fleet.split() as sp:
        again = sp.run("all")
    assert not any(r.changed for r in again), [r.to_dict() for r in again]
    with fleet.split() as sp:
        done = sp.run("cleanup")
    assert done[-1].changed and rows(fleet.source, shards) == {}
    assert fleet.source.sql("SHOW DATABASES LIKE 'db00016'") == []
    assert fleet.source.sql("SHOW DATABASES LIKE 'db00015'") != []
    with fleet.split() as sp:
        assert not sp.run("cleanup")[-1].changed


@pytest.mark.parametrize("fail_after", ["check", "clone", "replicate", "cutover"])
def test_resume_after_failure_at_a_step_boundary(fleet, tmp_path, fail_after):
    class Boom(Exception):
        pass

    def first_run():
        with fleet.split() as sp:
            def hook(step):
                if step == fail_after:
                    raise Boom(step)
            sp.after_step = hook
            with pytest.raises(Boom):
                sp.run("all")

    def second_run():
        with fleet.split() as sp:
            res = sp.run("all", cleanup=fail_after == "cutover")
        # the rerun does what was left: up to the cutover, or the cleanup after it
        want = "cleanup" if fail_after == "cutover" else "cutover"
        assert [r.step for r in res if r.changed][-1] == want, [r.to_dict() for r in res]

    log = run_split_under_writer(fleet, tmp_path, [first_run, second_run])
    assert fleet.map().range_for(MOVING[0]).master == fleet.target.address
    assert not [e for e in log.errors if MOVING[0] <= e[0] <= MOVING[1]]
    verify(fleet, log, MOVING, source_copy=fail_after != "cutover")  # cleanup dropped it


def test_a_clone_killed_halfway_keeps_the_finished_databases_and_its_rerun_loses_nothing(
        fleet, tmp_path, capsys):
    """The clone dies after some databases are copied, under a writer: the rerun keeps them
    (brought to its new snapshot through the split's channel, START SLAVE UNTIL), copies
    the rest, and the split ends with every acknowledged write on the target and its
    standby; the journal showed the progress."""
    from shardfleet import cli

    class Boom(Exception):
        pass

    seen: dict[str, Any] = {}

    def first_run():
        with fleet.split(clone_parallel=2) as sp:
            finished: list[str] = []

            def hook(db: str) -> None:
                finished.append(db)
                if len(finished) == 6:
                    raise Boom(db)
            sp.after_clone_db = hook
            with pytest.raises(Boom):
                sp.run("all")
            seen["journal"] = dict(sp.journal.data)
        assert cli.main(["ops", "list", "--zk", fleet.zk_address, "--cluster",
                         fleet.cluster]) == 0
        seen["ops list"] = capsys.readouterr().out

    def second_run():
        time.sleep(1.0)  # writes to the kept databases the rerun's channel must bring
        with fleet.split() as sp:
            seen["results"] = sp.run("all")

    log = run_split_under_writer(fleet, tmp_path, [first_run, second_run])
    journal = seen["journal"]
    assert journal["step"] == "started" and len(journal["clone_done"]) >= 6, journal
    progress = journal["clone_progress"]
    assert progress["databases"] == 16 and progress["databases_done"] >= 6, progress
    assert {"rows_done", "rows_estimated", "rows_per_second", "eta_seconds"} <= set(progress)
    assert f"started (clone: {progress['databases_done']}/16 databases" in seen["ops list"], \
        seen["ops list"]
    clone = {r.step: r for r in seen["results"]}["clone"]
    assert clone.changed and "kept from an earlier attempt" in clone.msg, clone.to_dict()
    assert fleet.map().range_for(MOVING[0]).master == fleet.target.address
    assert not [e for e in log.errors if MOVING[0] <= e[0] <= MOVING[1]]
    wait_pair_synced(fleet.target, fleet.standby)
    verify(fleet, log, MOVING)
    shards = list(range(MOVING[0], MOVING[1] + 1))
    assert rows(fleet.standby, shards) == rows(fleet.target, shards), "the target's standby differs"
    assert all(r[0] == "" for r in fleet.target.sql("SHOW ALL SLAVES STATUS")), \
        "the split's replication connection is still there"


def test_resume_after_a_crash_between_the_flip_and_the_journal(fleet):
    """A run dies right after it wrote the flipped map, before it removed the split's
    replication and journaled the cutover; the rerun sees the flip and finishes."""
    class Killed(Exception):
        pass

    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")

        def killed() -> bool:
            raise Killed("after the flip")

        sp._remove_channel = killed  # type: ignore[method-assign]
        with pytest.raises(Killed):
            sp.run("cutover")
    assert fleet.map().range_for(MOVING[0]).master == fleet.target.address
    with fleet.split() as sp:
        assert sp.resolve()["step"] == "replicate"
        res = sp.run("all")
        assert sp.journal is not None and sp.journal.data is not None
        assert sp.journal.data["step"] == "cutover"
    assert res[-1].step == "cutover" and res[-1].changed and "had been flipped" in res[-1].msg
    slaves = fleet.target.sql("SHOW ALL SLAVES STATUS")
    assert not [r for r in slaves if r[0]], "the split's replication connection is left"


def freeze_as_a_cutover_that_died(fleet: SplitFleet, *, fence: bool) -> None:
    """What a cutover run killed after its freeze leaves: clone and replicate done, the
    journal in the freezing phase, the range frozen in the map; *fence*: its fence taken."""
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
        sp.resolve()
        sp._note(cutover_phase="freezing")
        sp._freeze()
        if fence:
            sp._set_fence(True)


def test_resume_after_a_crash_inside_the_cutover(fleet, tmp_path):
    """A run dies after the freeze and the fence (routers hold writes); the rerun finishes."""
    freeze_as_a_cutover_that_died(fleet, fence=True)
    assert fleet.map().range_for(20).state == "frozen" and fence_writes(fleet) == 16
    with fleet.split() as sp:
        res = sp.run("all")
    assert res[-1].step == "cutover" and res[-1].changed
    assert fleet.map().range_for(20).master == fleet.target.address


def app_write(fleet: SplitFleet, shard: int) -> str:
    """One INSERT into *shard* on the source as the application user, on a new connection
    (privileges are checked live): "ok" or the server's error."""
    import pymysql

    c = pymysql.connect(host="127.0.0.1", port=fleet.source.port, user=APP_USER,
                        password=APP_PASSWORD, autocommit=True, connect_timeout=10)
    try:
        with c.cursor() as cur:
            cur.execute(f"INSERT INTO db{shard:05d}.pins (body) VALUES ('{{\"probe\": 1}}')")
        return "ok"
    except pymysql.MySQLError as exc:
        return str(exc)
    finally:
        c.close()


def test_a_kill_between_the_fence_and_its_flush_leaves_a_fence_that_holds(fleet):
    """The fence is an UPDATE of mysql.db then FLUSH PRIVILEGES. A run killed between the
    two leaves the table fenced and the live privileges open; the rerun must not trust the
    table: while it drains, the application's writes to the moving shards are refused."""
    freeze_as_a_cutover_that_died(fleet, fence=False)
    # what the killed run had done too: the fence's UPDATE, not its FLUSH
    fleet.source.sql("UPDATE mysql.db SET Insert_priv='N', Update_priv='N', Delete_priv='N' "
                     "WHERE User=%s AND Db BETWEEN 'db00016' AND 'db00031'", (APP_USER,))
    assert fence_writes(fleet) == 16 and app_write(fleet, 20) == "ok"
    seen: list[str] = []
    with fleet.split() as sp:
        drain = sp._drain
        sp._drain = lambda fenced_at: (seen.append(app_write(fleet, 20)), drain(fenced_at))[1]
        res = sp.run("all")
    assert res[-1].step == "cutover" and res[-1].changed
    assert seen and "1142" in seen[0], f"a write on the fenced source was answered {seen}"
    assert "1142" in app_write(fleet, 20), "the source accepts writes to a moved shard"


def test_refuses_a_range_the_source_does_not_own(fleet):
    before = fleet.map()
    with fleet.split(moving=(40, 47)) as sp, pytest.raises(SplitError, match="does not own"):
        sp.run("all")
    assert fleet.map() == before
    assert fleet.target.sql("SHOW DATABASES LIKE 'db%'") == []


def test_refuses_a_non_empty_target(fleet):
    fleet.target.sql("CREATE DATABASE db00900")
    try:
        before = fleet.map()
        with fleet.split() as sp, pytest.raises(SplitError, match="not empty"):
            sp.run("all")
        assert fleet.map() == before
        assert sp.journal is not None and sp.journal.load() is None, "a refusal wrote a journal"
    finally:
        fleet.target.sql("DROP DATABASE db00900")


def test_abort_before_cutover_restores_everything(fleet):
    before = fleet.map()
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    with fleet.split() as sp:
        res = sp.run("abort")
    assert res[0].changed
    assert fleet.map() == before
    assert fleet.target.sql("SHOW DATABASES LIKE 'db%'") == []
    assert all(r[0] == "" for r in fleet.target.sql("SHOW ALL SLAVES STATUS"))
    assert fence_writes(fleet) == 0
    # the split can start over afterwards
    with fleet.split() as sp:
        assert sp.run("all")[-1].changed


def test_replication_that_stops_with_an_error_fails_the_split_at_once_naming_it(fleet):
    """The split's channel stops on an error (a row the target already has): the wait for
    the catch-up ends at once with the error, not after the admin connection's read
    timeout as a bare 'lost connection' (found by the fault campaign)."""
    db = f"db{MOVING[0]:05d}"
    with fleet.split() as sp:
        sp.run("clone")
        conn = fleet.target.connect()
        with conn.cursor() as c:
            c.execute("SET SESSION sql_log_bin=0")
            c.execute(f"INSERT INTO {db}.pins (local_id, body) VALUES (424242, '{{}}')")
        conn.close()
        fleet.source.sql(f"INSERT INTO {db}.pins (local_id, body) VALUES (424242, '{{}}')")
        with pytest.raises(SplitError, match=r"stopped: .*Duplicate entry"):
            sp.run("replicate")
    with fleet.split() as sp:  # the documented way out: abort, then start over
        assert sp.run("abort")[0].changed
    assert fleet.target.sql("SHOW DATABASES LIKE 'db%'") == []
    assert fence_writes(fleet) == 0


def test_cutover_timeout_undoes_freeze_and_fence(fleet, tmp_path):
    before = fleet.map()
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    # the target stops applying: the cutover cannot see the fenced position in time
    fleet.target.sql("STOP SLAVE 'split_16_31'")
    fleet.source.sql("INSERT INTO db00020.pins (body) VALUES ('{\"v\": 0}')")
    with fleet.split(cutover_timeout=0.5) as sp:
        # a target that lags right at the cutover: skip the catch-up before the freeze
        sp._channel = lambda server, name=None: {"Slave_SQL_Running": "Yes"}  # type: ignore[method-assign]
        sp._wait_applied = lambda *a: None  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(CutoverAborted, match="cutover undone"):
            sp.resolve()
            sp.cutover()
        held = time.monotonic() - t0
    assert fleet.map() == before, "the map was not restored"
    assert fence_writes(fleet) == 0, "the fence was not lifted"
    assert held < 5.0
    # the writes go on at the source, and a later cutover succeeds
    router = fleet.router(tmp_path)
    store = Store(router)
    try:
        store.create(1, {"v": 0}, near=(20 << 46) | (1 << 36) | 1)
    finally:
        store.close()
        router.close()
    with fleet.split() as sp:
        res = sp.run("all")
    assert res[-1].step == "cutover" and res[-1].changed


# -- failure paths of the cutover ------------------------------------------------------


class LostFlipStore(ZooKeeperMapStore):
    """The split's own store: ZooKeeper applies the flipped map, the reply is lost; then,
    optionally, ZooKeeper stays unreadable for *away* more reads."""

    def __init__(self, *a, target: str, away: int = 0, **kw):
        super().__init__(*a, **kw)
        self.target, self.away, self.lost = target, away, False

    def write(self, new, expected_version):
        v = super().write(new, expected_version)
        if not self.lost and new.range_for(MOVING[0]).master == self.target:
            self.lost = True
            raise MapStoreUnavailable("ZooKeeper connection lost writing the map (injected)")
        return v

    def sync(self):
        if self.lost and self.away:
            self.away -= 1
            raise MapStoreUnavailable("ZooKeeper is away (injected)")
        return super().sync()


def lossy_split(fleet: SplitFleet, away: int = 0, **kw) -> Split:
    store = LostFlipStore(fleet.zk_address, fleet.cluster, target=fleet.target.address,
                          away=away, timeout=2.0)
    spec = SplitSpec(fleet.source.address, fleet.target.address, fleet.standby.address, None)
    sp = Split(store, spec, fleet.creds, **kw)
    sp._test_store = store  # closed by the caller
    return sp


def old_map_store(fleet: SplitFleet, old_map) -> Store:
    """A store whose router never hears of the flip (started from its cache file, cut off
    from ZooKeeper): it routes by *old_map* for good."""
    return Store(Router(shard_map=old_map, user=APP_USER, password=APP_PASSWORD,
                        frozen_wait=0.5))


def test_a_lost_reply_to_the_flip_finishes_the_cutover(fleet, tmp_path):
    """ZooKeeper applied the flip but the reply was lost: the cutover finds the flip by
    reading the map again and finishes it; the fence stays, so a router still on the old
    map cannot write to (or read) the moved shards on the source."""
    old = fleet.map()
    fleet.source.sql("INSERT INTO db00020.pins (local_id, body) VALUES (7, '{\"v\": 1}')")
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    sp = lossy_split(fleet)
    try:
        res = sp.run("cutover")
    finally:
        sp.close()
        sp._test_store.close()
    assert sp._test_store.lost, "the injected loss never happened"
    assert res[-1].step == "cutover" and res[-1].changed, [r.to_dict() for r in res]
    assert fleet.map().range_for(20).master == fleet.target.address
    assert fence_writes(fleet) == 16, "the fence was lifted after the flip"
    stale = old_map_store(fleet, old)
    try:
        with pytest.raises(Exception, match="1142|denied|frozen"):
            stale.create(1, {"v": 1}, near=ids.compose(20, 1, 1))
        # nor read the source's copy, which stops changing now (and would fill caches)
        with pytest.raises(Exception, match="1142|denied"):
            stale.get(ids.compose(20, 1, 7))
    finally:
        stale.close()
    fresh = Store(fleet.router(tmp_path))
    try:
        assert fresh.get(ids.compose(20, 1, 7)) == {"v": 1}
    finally:
        fresh.close()


def test_a_lost_flip_reply_with_zookeeper_away_keeps_the_fence_and_the_rerun_finishes(fleet):
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    sp = lossy_split(fleet, away=10 ** 6)
    try:
        with pytest.raises(SplitError, match="(?i)fence .*stay"):
            sp.run("cutover")
    finally:
        sp.close()
        sp._test_store.close()
    assert fence_writes(fleet) == 16, "the fence was lifted while the flip's outcome was unknown"
    assert fleet.map().range_for(20).master == fleet.target.address  # it had landed
    with fleet.split() as sp:
        res = sp.run("all")
    assert res[-1].step == "cutover" and res[-1].changed
    assert fence_writes(fleet) == 16
    assert sp.journal is not None and sp.journal.load()["step"] == "cutover"


def test_the_resumed_cutover_fences_again(fleet):
    """A cutover whose map was flipped but whose fence was lifted (the old undo did that):
    the rerun takes the fence again before it calls the cutover done."""
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    sp = lossy_split(fleet, away=10 ** 6)
    try:
        with pytest.raises(SplitError):
            sp.run("cutover")
    finally:
        sp.close()
        sp._test_store.close()
    with fleet.split() as sp:
        sp.resolve()
        sp._set_fence(False)
    assert fence_writes(fleet) == 0
    with fleet.split() as sp:
        sp.run("all")
    assert fence_writes(fleet) == 16


def test_refuses_a_fence_that_covers_nothing(fleet):
    """An application host pattern with no grant rows would fence nothing: refused at the
    check, nothing changed."""
    before = fleet.map()
    spec = SplitSpec(fleet.source.address, fleet.target.address, fleet.standby.address, None)
    creds = Credentials("root", MariaDBServer.root_password, REPL_USER, REPL_PASSWORD,
                        APP_USER, "10.%")
    with Split(fleet.store, spec, creds) as sp, pytest.raises(SplitError, match="fence"):
        sp.run("all")
    assert fleet.map() == before
    assert fleet.target.sql("SHOW DATABASES LIKE 'db%'") == []


@pytest.mark.parametrize("clone_killed", [False, True])
def test_the_target_pair_replicates_both_ways_after_a_split_with_semi_sync(fleet, clone_killed):
    """With semi-synchronous replication on (as the mysql role configures it), removing
    the split's connection on the target master must not break the target's replication
    from its own standby; the cutover checks the target pair itself. Also when a killed
    clone's rerun ran the split's connection UNTIL the new snapshot (it stops by itself)."""
    servers = (fleet.source, fleet.target, fleet.standby)
    for s in servers:
        s.sql("SET GLOBAL rpl_semi_sync_master_enabled = ON")
        s.sql("SET GLOBAL rpl_semi_sync_slave_enabled = ON")
        s.sql("SET GLOBAL rpl_semi_sync_master_timeout = 2000")
    try:
        for s in (fleet.target, fleet.standby):
            s.sql("STOP ALL SLAVES")
            s.sql("START ALL SLAVES")
        if clone_killed:
            with fleet.split() as sp:
                def hook(db: str) -> None:
                    if db == "db00020":
                        raise RuntimeError("killed")
                sp.after_clone_db = hook
                with pytest.raises(RuntimeError, match="killed"):
                    sp.run("all")
            fleet.source.sql("INSERT INTO db00017.pins (body) VALUES ('{}')")
        with fleet.split() as sp:
            res = {r.step: r for r in sp.run("all")}
        assert ("kept from an earlier attempt" in res["clone"].msg) == clone_killed
        # a write on the target's standby (as after a promotion) must reach the target
        fleet.standby.sql("SET GLOBAL read_only = OFF")
        fleet.standby.sql("CREATE DATABASE sf_probe")
        fleet.standby.sql("SET GLOBAL read_only = ON")
        wait_pair_synced(fleet.standby, fleet.target)
        for s, peer in ((fleet.target, fleet.standby), (fleet.standby, fleet.target)):
            ch = [r for r in s.sql("SHOW ALL SLAVES STATUS") if r[0] == ""]
            assert ch, f"{s.address} has no replication from {peer.address}"
        st = {k: v for k, v in zip(
            [d[0] for d in _cols(fleet.target)], fleet.target.sql("SHOW SLAVE STATUS")[0],
            strict=True)}
        assert (st["Slave_IO_Running"], st["Slave_SQL_Running"]) == ("Yes", "Yes"), \
            f"target master stopped replicating from its standby: {st['Last_IO_Error']}"
    finally:
        for s in servers:
            s.sql("SET GLOBAL rpl_semi_sync_master_enabled = OFF")
            s.sql("SET GLOBAL rpl_semi_sync_slave_enabled = OFF")
        for s in (fleet.target, fleet.standby):
            s.sql("STOP ALL SLAVES")
            s.sql("START ALL SLAVES")
        fleet.target.sql("DROP DATABASE IF EXISTS sf_probe")


def _cols(server):
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW SLAVE STATUS")
            return cur.description
    finally:
        conn.close()


def test_a_second_operation_on_a_server_with_a_split_in_flight_is_refused(fleet, capsys):
    """One operation at a time per server across runs: the registry of operations in flight
    (their journals) refuses a second split of the same source before anything changes,
    and `shardfleet ops list` / `ops show` print the one in flight."""
    from shardfleet import cli
    from shardfleet.ops import OperationInFlight

    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    before = fleet.map()
    spec = SplitSpec(fleet.source.address, fleet.standby.address, None, (0, 7))
    with Split(fleet.store, spec, fleet.creds) as other, \
            pytest.raises(OperationInFlight, match="split-16-31 .*step replicate"):
        other.run("all")
    assert fleet.map() == before
    assert fleet.standby.sql("SHOW DATABASES LIKE 'db00000'") == []
    zk = ["--zk", fleet.zk_address, "--cluster", fleet.cluster]
    assert cli.main(["ops", "list", *zk]) == 0
    out = capsys.readouterr().out
    assert "split-16-31" in out and "replicate" in out and "yes" in out, out
    assert cli.main(["ops", "show", "split-16-31", *zk]) == 0
    assert '"step": "replicate"' in capsys.readouterr().out
    with fleet.split() as sp:  # the split in flight itself continues
        assert sp.run("all")[-1].step == "cutover"
    assert cli.main(["ops", "list", *zk]) == 0
    assert "no operation in flight" in capsys.readouterr().out


def test_a_promotion_of_the_source_with_a_split_in_flight_is_refused(fleet):
    """A promotion between a split's steps would leave the split unable to cut over or
    abort: the registry refuses it, naming the split, before anything changes."""
    from shardfleet import promote

    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    before = fleet.map()
    nodes = [fleet.source.address, fleet.standby.address]
    opts = promote.Options(user="root", password=MariaDBServer.root_password)
    for mode in ("planned", "emergency"):
        with pytest.raises(promote.PromotionRefused, match="in flight.*split-16-31"):
            promote.promote(fleet.store, "pair001", nodes, mode=mode, opts=opts)
    assert fleet.map() == before
    assert fleet.source.sql("SELECT @@GLOBAL.read_only")[0][0] == 0
    with fleet.split() as sp:
        assert sp.run("all")[-1].step == "cutover"


def test_the_module_in_check_mode_says_what_the_runner_would_do(fleet, tmp_path):
    """shard_split --check: the runner's check mode (the check step runs, nothing else);
    a fresh split would clone, replicate and cut over; after replicate only the cutover."""
    from .test_modules import run_module

    args = {"zookeeper_hosts": [fleet.zk_address], "cluster": fleet.cluster,
            "source": fleet.source.address, "target": fleet.target.address,
            "target_standby": fleet.standby.address, "login_user": "root",
            "login_password": MariaDBServer.root_password, "replication_user": REPL_USER,
            "replication_password": REPL_PASSWORD, "app_user": APP_USER}
    before = fleet.map()
    res, _ = run_module(tmp_path, "shard_split", args, check=True)
    assert res["changed"] and res["would_run"] == ["clone", "replicate", "cutover"], res
    assert fleet.map() == before and fleet.target.sql("SHOW DATABASES LIKE 'db%'") == []
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
    res, _ = run_module(tmp_path, "shard_split", args, check=True)
    assert res["would_run"] == ["cutover"], res
    assert fleet.map() == before


def test_a_skip_counter_a_stop_left_on_the_target_does_not_swallow_a_transaction(fleet):
    """Fault campaign seed 500073: a row written on the target's standby after the split
    never reached the target, whose channel from the standby said Yes/Yes; the target's
    log: "'SQL_SLAVE_SKIP_COUNTER=1' executed at ..." at the cutover's restart of that
    channel. With gtid_ignore_duplicates on (the split sets it on the target), MariaDB skips
    the standby's echo of a source transaction the split's channel applied by setting the
    channel's sql_slave_skip_counter to 1 until the end of that event group; a STOP SLAVE
    while the group is still arriving leaves the counter at 1 (checked by hand: a STOP
    during the echo of a 200,000-row source transaction left Skip_Counter 1, and the
    standby's next transaction was skipped). That STOP is a race, so the test leaves the
    state it leaves: the counter at 1 on the stopped channel, at the instant the cutover
    restarts the target's channels (between its STOP and its START)."""
    with fleet.split() as sp:
        real = sp._align_source_domains

        def align_then_leave_a_counter() -> None:
            real()
            with fleet.target.connect() as c, c.cursor() as cur:  # the channel is stopped here
                cur.execute("SET @@SESSION.default_master_connection = ''")
                cur.execute("SET GLOBAL sql_slave_skip_counter = 1")

        sp._align_source_domains = align_then_leave_a_counter  # type: ignore[method-assign]
        res = {r.step: r for r in sp.run("all")}
    assert res["cutover"].changed
    # the first transaction on the target's standby (as after a promotion) reaches the target
    probe = f"sf_probe_{time.monotonic_ns()}"
    fleet.standby.sql(f"CREATE DATABASE {probe}")
    try:
        deadline = time.monotonic() + 20
        while not fleet.target.sql("SELECT COUNT(*) FROM information_schema.SCHEMATA "
                                   "WHERE SCHEMA_NAME = %s", (probe,))[0][0]:
            if time.monotonic() > deadline:
                st = dict(zip([d[0] for d in _cols(fleet.target)],
                              fleet.target.sql("SHOW SLAVE STATUS")[0], strict=True))
                pytest.fail(f"a database created on the standby did not reach the target; "
                            f"its channel: IO {st['Slave_IO_Running']} SQL "
                            f"{st['Slave_SQL_Running']} at {st['Gtid_IO_Pos']}")
            time.sleep(0.1)
    finally:
        fleet.standby.sql(f"DROP DATABASE IF EXISTS {probe}")
        wait_pair_synced(fleet.standby, fleet.target)
        fleet.target.sql(f"DROP DATABASE IF EXISTS {probe}")
