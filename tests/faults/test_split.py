"""The campaign's split runs: ``Split.run("all")`` (what playbooks/split.yml runs) of the
source's upper half onto the target pair, under the writer, one fault (see
:mod:`tests.faults.campaign`), then the runbook's recovery (rerun the same command; a
message that names the abort step may run it once) and the checker."""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest

from shardfleet.ops import LockBusy, OperationInFlight
from shardfleet.split import SplitError
from shardfleet.testing import MariaDBServer
from shardfleet.testing.history import check_history, tagged_rows
from shardfleet.testing.kit import SplitFleet, WriterLog, verify, wait_pair_synced
from shardfleet.testing.nemesis import OpProcess

from . import checks
from .backups import FAULTS as BACKUP_FAULTS
from .backups import Beside, Shelf, backup_plan, fault_or_wait, shard_counts
from .campaign import (
    OP_SCRIPT,
    Faults,
    Run,
    Scene,
    end_operation,
    oneline,
    op_spec,
    proxies,
    seeds,
    zk_servers,
)

# the faults before session_expiry: the seeds found then replay with them
FAULTS_1 = ("kill", "lost_reply", "second_op", "partition", "too_many", "stale_router",
            "zk_leader")
FAULTS = FAULTS_1 + ("session_expiry",)
# The window the fault's instant is drawn from (seconds after the operation's process is
# ready): a little longer than a split of 16 shards under the writer on a quiet 2-core
# machine (1.1-1.4 s), so most draws land inside it and a few after it.
WINDOW = 1.5
MOVING = (16, 31)
TARGET_PAIR = "split-target"  # the backups' name for the target pair
ALL_SHARDS = list(range(0, 32))


@pytest.fixture
def split_fleet(split_servers, zookeeper):
    fleet = SplitFleet(*split_servers, zookeeper.address)
    fleet.reset()
    yield fleet
    fleet.close()


def second_split(fleet: SplitFleet, lock_timeout: float) -> tuple[str, bool]:
    """The same split started again: refused or continuing the first."""
    try:
        with fleet.split(lock_timeout=lock_timeout) as sp:
            res = sp.run("all")
        return "ran: " + ", ".join(f"{r.step}{'*' if r.changed else ''}" for r in res), True
    except (LockBusy, OperationInFlight) as exc:
        return f"refused: {oneline(exc)}", True
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return oneline(exc), False


def recover_split(run: Run, fleet: SplitFleet) -> bool:
    """The runbook's recovery: rerun the same command; a message that names one command
    (the abort step) may run it once. Bounded: four reruns."""
    named_used = False
    last = ""
    for _ in range(4):
        try:
            with fleet.split(lock_timeout=20.0) as sp:
                res = sp.run("all")
            run.schedule.note("rerun ok", steps=[f"{r.step}{'*' if r.changed else ''}"
                                                 for r in res])
            return True
        except Exception as exc:  # noqa: BLE001 - the runbook: any failure, rerun
            last = oneline(exc)
            run.schedule.note("rerun failed", error=last)
            if isinstance(exc, SplitError) and "step abort" in last and not named_used:
                named_used = True
                try:
                    with fleet.split(lock_timeout=20.0) as sp:
                        res = sp.run("abort")
                    run.schedule.note("ran the command the message names: abort",
                                      result=res[-1].msg)
                except Exception as abort_exc:  # noqa: BLE001 - the runbook ends here
                    last = f"the message named the abort step, which failed: {oneline(abort_exc)}"
                    run.schedule.note("the command the message names failed", error=last)
                    break
    run.problems.append(f"wedged: the split did not complete by reruns alone; last: {last}")
    return False


def check_split(run: Run, fleet: SplitFleet, split_servers: tuple[MariaDBServer, ...],
                log: WriterLog, servers: dict[str, Any], zookeeper: Any, tmp_path: Path,
                scene: Scene) -> None:
    """The checker of a split run: the map, the journals, the target pair both ways, the
    history against the servers, no write on the old master, the pair's rows equal, the
    fleet writable through a fresh router."""
    src, tgt, sb = split_servers
    run.schedule.note("checking", ops=len(log.history.completions()))
    m = fleet.map()
    run.problems += checks.map_problems(m)
    moved, kept = m.range_for(MOVING[0]), m.range_for(0)
    if (moved.bounds, moved.master, moved.standby) != (MOVING, tgt.address, sb.address):
        run.problems.append(f"the moved range is {moved.describe()}")
    if kept.master != src.address:
        run.problems.append(f"the kept range is {kept.describe()}")
    run.problems += checks.in_flight_problems(fleet.store)
    run.problems += checks.both_ways(tgt, sb)
    run.schedule.note("checked: map, journals, both ways")
    run.problems += check_history(m, servers, ALL_SHARDS, log.history, log.tag)
    run.problems += scene.origin_problems(log)
    try:
        verify(fleet, log, MOVING)  # the kit's checker: also no write on the old master
    except AssertionError as exc:
        run.problems.append(f"check_writes: {exc}")
    try:
        wait_pair_synced(tgt, sb, timeout=20)
        moving = list(range(MOVING[0], MOVING[1] + 1))
        if tagged_rows(tgt, moving, log.tag) != tagged_rows(sb, moving, log.tag):
            run.problems.append("the target's standby differs from the target")
    except AssertionError as exc:
        run.problems.append(str(exc))
    run.schedule.note("checked: history")
    run.problems += checks.writable_problems(zookeeper.address, fleet.cluster, tmp_path,
                                             [3, 20])
    run.schedule.note("checked: writable")


def split_run(run: Run, plan: dict[str, Any], fleet: SplitFleet,
              split_servers: tuple[MariaDBServer, ...], zookeeper: Any, tmp_path: Path,
              shelf: Shelf | None = None) -> None:
    """One split under the writer, the fault of *plan*, the recovery, the checker. With
    *shelf* (``backup_split``): a backup of the target's standby and a restore of the
    target pair's newest complete backup beside it (:class:`tests.faults.backups.Beside`),
    the moving shards' rows on the source as the split starts what a backup must hold."""
    src, tgt, sb = split_servers
    servers = {s.address: s for s in split_servers} | zk_servers(zookeeper)
    run.schedule.note("plan", **plan, cluster=fleet.cluster)
    scene = Scene(run, zookeeper.address, fleet.cluster, ALL_SHARDS, tmp_path,
                  list(split_servers), pairs=[(tgt, sb)])
    op_log = tmp_path / "operation.log"
    beside: Beside | None = None
    moving = list(range(MOVING[0], MOVING[1] + 1))
    with proxies(plan, zookeeper.members[0].port, src) as (zk_proxy, sql_proxy):
        try:
            scene.start()
            scene.keep_cache()
            if shelf is not None:
                beside = Beside(run, plan, shelf, TARGET_PAIR, sb, zookeeper.address,
                                fleet.cluster, tmp_path, shard_counts(src, moving), moving)
                beside.early()
            spec = op_spec({"op": "split", "cluster": fleet.cluster, "source": src.address,
                            "target": tgt.address, "standby": sb.address,
                            "creds": list(astuple(fleet.creds)), "lock_timeout": 20.0,
                            "die_after": plan.get("call")},
                           zookeeper.address, zk_proxy, sql_proxy, src)
            proc = OpProcess(OP_SCRIPT, spec, op_log)
            run.schedule.note("split started")
            if beside is not None:
                beside.start(proc)
            fault_or_wait(run, proc, plan, scene, Faults(
                zk_proxy=zk_proxy, sql_proxy=sql_proxy, busy=src, zk=zookeeper,
                second=lambda: second_split(fleet, plan.get("lock_timeout", 5.0))))
            end_operation(run, proc, zk_proxy)
            if recover_split(run, fleet):
                scene.wait_resumed()
            if beside is not None:
                beside.finish()
        finally:
            if beside is not None:
                beside.stop()
            log = scene.stop()
    check_split(run, fleet, split_servers, log, servers, zookeeper, tmp_path, scene)
    if beside is not None:
        beside.check()
        run.schedule.note("checked: backups")
    run.fail_if_problems(log, servers, [op_log, *sorted(tmp_path.glob("backup*.log")),
                                        *sorted(tmp_path.glob("restore*.log"))])


@pytest.mark.parametrize("seed", seeds("split"))
def test_split_under_a_fault(seed, split_fleet, split_servers, zookeeper, tmp_path):
    run = Run("split", seed, FAULTS)
    split_run(run, run.draw(WINDOW), split_fleet, split_servers, zookeeper, tmp_path)


@pytest.mark.parametrize("seed", seeds("backup_split"))
def test_backup_and_restore_beside_a_split_onto_the_pair(seed, split_fleet, split_servers,
                                                         zookeeper, backup_shelf, tmp_path):
    """backup_split (see :mod:`tests.faults.test_backup_beside`): the split of the source's
    upper half onto the target pair, a backup of the target's standby and a restore of the
    target pair's newest complete backup beside it, one of the backup runs' faults."""
    run = Run("backup_split", seed, BACKUP_FAULTS)
    split_run(run, backup_plan(run, WINDOW), split_fleet, split_servers, zookeeper, tmp_path,
              backup_shelf)


# Seed 999304 (fixed in split.py: the cutover waits for the target's standby and aligns
# the target's gtid_slave_pos in the source's domains): after the cutover the target's
# channel from its standby asked for a source-domain GTID the standby's binlog lacked
# (1236, for good). It depends on the standby's lag: replayed as drawn.
def test_split_seed_999304_the_target_pair_replicates_after_the_cutover(
        split_fleet, split_servers, zookeeper, tmp_path):
    run = Run("split", 999304, FAULTS_1)
    split_run(run, run.draw(WINDOW), split_fleet, split_servers, zookeeper, tmp_path)


# Seed 500073 (fixed in split.py: Split._start_channel clears a skip counter a STOP left):
# killed inside the clone and rerun, the target's channel from its standby was stopped
# while skipping a duplicate (gtid_ignore_duplicates), kept sql_slave_skip_counter 1, and
# the next START skipped the standby's next transaction: a row the checker wrote on the
# standby never reached the target, both threads Yes. The STOP must land inside one
# duplicate group: replayed as drawn (the integration test
# test_a_skip_counter_a_stop_left_on_the_target_does_not_swallow_a_transaction pins it).
def test_split_seed_500073_the_target_applies_its_standbys_next_transaction(
        split_fleet, split_servers, zookeeper, tmp_path):
    run = Run("split", 500073, FAULTS_1)
    split_run(run, run.draw(WINDOW), split_fleet, split_servers, zookeeper, tmp_path)


# Named schedules: a defect the campaign found, replayed at the exact instant (a seed
# replays the instant in time, which under another load may fall on another statement).

# Found by seeds 207, 219 and 68574 (fixed in split.py's replicate "is it done?"): a split
# killed after its cutover removed the split's replication (map flipped, journal not yet
# at cutover) was resumed by a rerun whose replicate step re-created the channel and set
# gtid_slave_pos back to the clone's GTID: the target re-applied the source's events (1062
# duplicate key), its pair's replication broke, and the abort the message named refused.
def test_split_killed_after_its_channel_was_removed(split_fleet, split_servers, zookeeper,
                                                     tmp_path):
    run = Run("split-killed-after-remove-channel", 207, FAULTS_1)
    split_run(run, {"fault": "die_after", "call": "_remove_channel"}, split_fleet,
              split_servers, zookeeper, tmp_path)
