"""The split on real MariaDB host processes (a source, a target GTID master-master pair) and
ZooKeeper: a live split under a bounded writer through the routing library (zero lost or
duplicated writes, a stall under a second), resumption after a failure at every step
boundary, refusals that change nothing, abort, and a cutover timeout that undoes itself."""

from __future__ import annotations

import time

import pytest

from shardfleet.split import CutoverAborted, SplitError
from shardfleet.store import Store

from .test_split_support import (
    APP_USER,
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


def test_resume_after_a_crash_inside_the_cutover(fleet, tmp_path):
    """A run dies after the freeze and the fence (routers hold writes); the rerun finishes."""
    with fleet.split() as sp:
        sp.run("clone")
        sp.run("replicate")
        sp.resolve()
        sp._note(cutover_phase="freezing")
        sp._edit_map(sp._frozen_map)
        sp._set_fence(True)
    assert fleet.map().range_for(20).state == "frozen" and fence_writes(fleet) == 16
    with fleet.split() as sp:
        res = sp.run("all")
    assert res[-1].step == "cutover" and res[-1].changed
    assert fleet.map().range_for(20).master == fleet.target.address


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
        sp._channel = lambda server: {"Slave_SQL_Running": "Yes"}  # type: ignore[method-assign]
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
