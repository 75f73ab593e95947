"""The campaign's promotion runs, on one pair (semi-sync, read-only at boot, no replica
started at boot: as the ``mysql`` role configures one) under the writer:

* planned: ``promote.promote(mode="planned", expect_master=<master>)``, what
  ``promote.yml -e pair=... -e expect_master=...`` runs, one fault, the runbook's
  recovery (the RERUN command; a refusal that says wait: wait and rerun);
* emergency: the master SIGKILLed, then ``promote.promote(mode="emergency",
  expect_master=<dead master>)`` and, the old master back, ``promote.rebuild_standby``
  (what ``rebuild-standby.yml`` runs), one fault in one of the two (drawn), each
  recovered by rerunning its own command.

Then the checker: the writer's history against the master the map names, one writable
node (the map's master), both ways replication, equal rows, no mark, frozen range or
journal left, the pair writable through a fresh router.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from shardfleet import promote
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.physical import CopyBusy, CopyFailed
from shardfleet.promote import PromotionFailed, PromotionRefused
from shardfleet.shardmap import ShardMap
from shardfleet.testing import MariaDBServer
from shardfleet.testing.history import check_history, tagged_rows
from shardfleet.testing.kit import REPL_PASSWORD, REPL_USER, WriterLog, wait_pair_synced
from shardfleet.testing.nemesis import OpProcess

from . import checks
from .campaign import (
    OP_SCRIPT,
    Faults,
    Run,
    Scene,
    end_operation,
    inject,
    oneline,
    op_spec,
    proxies,
    seeds,
    zk_servers,
)
from .conftest import PROMOTE_SHARDS
from .op import rebuild_physical

PAIR = "pair041"
PLANNED_FAULTS = ("kill", "lost_reply", "second_op", "partition", "too_many", "stale_router",
                  "zk_leader", "session_expiry")
# the emergency's faults before session_expiry: the seeds found then replay with them
EMERGENCY_FAULTS_1 = ("kill", "lost_reply", "second_op", "restart_new", "stale_router",
                      "partition")
EMERGENCY_FAULTS = EMERGENCY_FAULTS_1 + ("session_expiry",)
# Windows the fault's instant is drawn from (seconds after the operation is ready): a
# little longer than the operation under the writer on a quiet 2-core machine (planned
# 0.15-0.25 s; emergency 1.1-1.4 s, most of it deciding the master is dead; a logical
# rebuild of 8 shards 1-2 s).
PLANNED_WINDOW = float(os.environ.get("SHARDFLEET_FAULT_PROMOTE_WINDOW", "0.3"))
EMERGENCY_WINDOW = 1.8
REBUILD_WINDOW = 2.0
# a physical rebuild: mariadb-backup of the master, prepare, the node stopped and started
# on the copy, re-attached (4-7 s quiet)
PHYSICAL_REBUILD_WINDOW = 8.0


def promote_opts(**kw: Any) -> promote.Options:
    return promote.Options(**{"user": "root", "password": MariaDBServer.root_password,
                              "connect_timeout": 2.0, "replication_user": REPL_USER,
                              "replication_password": REPL_PASSWORD, **kw})


def opts_spec(**kw: Any) -> dict[str, Any]:
    """:func:`promote_opts` as the operation's process takes them (JSON: the campaign's
    connections use no TLS, so Options' default stands in for it there)."""
    return {k: v for k, v in vars(promote_opts(**kw)).items() if k != "tls"}


def roles(pair: tuple[MariaDBServer, ...]) -> tuple[MariaDBServer, MariaDBServer]:
    """(master, standby) by read_only; a pair with two or no writable node is broken."""
    a, b = pair
    ro = (checks.read_only(a), checks.read_only(b))
    assert ro in ((False, True), (True, False)), \
        f"the promotion pair is broken (read_only {ro}): an earlier run left it so"
    return (a, b) if not ro[0] else (b, a)


@pytest.fixture
def promote_store(promote_pair, zookeeper):
    """A fresh cluster with the pair's map (master = the writable node)."""
    master, standby = roles(promote_pair)
    store = ZooKeeperMapStore(zookeeper.address, "f" + os.urandom(5).hex())
    store.write(ShardMap.from_ranges([
        {"range": [0, 3], "master": master.address, "standby": standby.address,
         "state": "open"},
        {"range": [4, 7], "master": master.address, "standby": standby.address,
         "state": "open"},
    ], mod_shard_count=8), NO_NODE)
    yield store
    store.close()


def second_promotion(store: ZooKeeperMapStore, nodes: list[str], mode: str, old: str,
                     lock_timeout: float) -> tuple[str, bool]:
    """The same promotion command started again: refused, or finishing the same one."""
    try:
        r = promote.promote(store, PAIR, nodes, mode=mode, expect_master=old,
                            opts=promote_opts(lock_timeout=lock_timeout))
        return f"ran: changed={r.changed} resumed={r.resumed} {r.steps}", True
    except PromotionRefused as exc:
        return f"refused: {oneline(exc)}", True
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return oneline(exc), False


def rebuild_once(store: ZooKeeperMapStore, nodes: list[str], copy: str,
                 pair: tuple[MariaDBServer, ...], **kw: Any) -> str:
    """rebuild-standby.yml once: the library's call (logical), or the playbook's three
    parts (physical: fence and name the copy, the copy node to node, re-attach)."""
    if copy == "physical":
        return rebuild_physical(store, PAIR, nodes, opts_spec(**kw),
                                [s.handle() for s in pair])
    r = promote.rebuild_standby(store, PAIR, nodes, opts=promote_opts(**kw))
    return f"changed={r.changed} {r.steps} warnings={r.warnings}"


def second_rebuild(store: ZooKeeperMapStore, nodes: list[str], lock_timeout: float,
                   copy: str = "logical", pair: tuple[MariaDBServer, ...] = ()
                   ) -> tuple[str, bool]:
    try:
        return f"ran: {rebuild_once(store, nodes, copy, pair, lock_timeout=lock_timeout)}", True
    except CopyBusy as exc:  # the first run's copy holds the node's copy lock
        return f"refused: {oneline(exc)}", True
    except PromotionRefused as exc:
        return f"refused: {oneline(exc)}", True
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return oneline(exc), False


def recover_promotion(run: Run, store: ZooKeeperMapStore, nodes: list[str], mode: str,
                      old: str) -> bool:
    """The runbook's recovery: rerun the same command (RERUN: with expect_master); a refusal
    for a lock the killed run's session still holds says wait: wait and rerun; "already
    happened" means it finished. Bounded: eight reruns, a minute."""
    last = ""
    named_used = False
    deadline = time.monotonic() + 60
    for _ in range(8):
        try:
            r = promote.promote(store, PAIR, nodes, mode=mode, expect_master=old,
                                opts=promote_opts())
            run.schedule.note("rerun ok", changed=r.changed, resumed=r.resumed,
                              warnings=r.warnings, next_step=r.next_step)
            return True
        except (PromotionRefused, PromotionFailed) as exc:
            last = oneline(exc)
            run.schedule.note("rerun refused/failed", error=last)
            if "already happened" in last:
                return True
            named = re.search(r"promote_master=(\S+?)[.;,]?(?:\s|$)", last)
            if named and not named_used:
                # the master answers again, read_only: the command the message names, once
                named_used = True
                try:
                    r = promote.promote(store, PAIR, nodes, master=named.group(1),
                                        opts=promote_opts())
                    run.schedule.note("ran the command the message names", changed=r.changed,
                                      steps=r.steps, warnings=r.warnings)
                    return True
                except Exception as exc:  # noqa: BLE001 - the runbook ends here
                    last = f"the command the message names failed: {oneline(exc)}"
                    run.schedule.note(last)
                    break
            if "another operation holds" in last or "rerun" in last.lower():
                if time.monotonic() > deadline:
                    break
                time.sleep(1.0)
                continue
            break
        except Exception as exc:  # noqa: BLE001 - a driver error escaped: a finding
            last = oneline(exc)
            run.schedule.note("rerun raised", error=last)
            run.problems.append(f"the promotion raised {last} (not a refusal or failure)")
    run.problems.append(f"wedged: the {mode} promotion did not complete by reruns alone; "
                        f"last: {last}")
    return False


def recover_rebuild(run: Run, store: ZooKeeperMapStore, nodes: list[str],
                    copy: str = "logical", pair: tuple[MariaDBServer, ...] = ()) -> bool:
    """rebuild-standby.yml again until it succeeds (a refusal for a held lock: wait).
    Bounded: eight reruns, a minute (two for a physical copy)."""
    last = ""
    deadline = time.monotonic() + (120 if copy == "physical" else 60)
    for _ in range(8):
        try:
            summary = rebuild_once(store, nodes, copy, pair)
            run.schedule.note("rebuild rerun ok", copy=copy, summary=summary)
            return True
        except (PromotionRefused, PromotionFailed, CopyFailed) as exc:
            last = oneline(exc)
            run.schedule.note("rebuild rerun refused/failed", error=last)
            if time.monotonic() > deadline:
                break
            if "does not answer" in last and "start it" in last:
                # the message's own instruction (the runbook's step 1): start the node
                for s in pair:
                    if not s.running:
                        try:
                            s.start()
                            run.schedule.note("started the node, as the message says",
                                              node=s.address)
                        except Exception as start_exc:  # noqa: BLE001 - noted, then rerun
                            run.schedule.note("the node does not start",
                                              node=s.address, error=oneline(start_exc))
            time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - a driver error escaped: a finding
            last = oneline(exc)
            run.schedule.note("rebuild rerun raised", error=last)
            run.problems.append(f"the rebuild raised {last} (not a refusal or failure)")
            break
    run.problems.append(f"wedged: the rebuild did not complete by reruns alone; last: {last}")
    return False


def check_pair(run: Run, store: ZooKeeperMapStore, pair: tuple[MariaDBServer, ...],
               log: WriterLog, servers: dict[str, Any], zookeeper: Any, tmp_path: Path,
               scene: Scene) -> None:
    """The checker of a promotion run (see the module docstring)."""
    nodes = [s.address for s in pair]
    m = store.read().map
    run.problems += checks.map_problems(m)
    assert m is not None
    masters = {(r.master, r.standby) for r in m.ranges}
    if len(masters) != 1 or set(next(iter(masters))) != set(nodes):
        run.problems.append(f"the pair's ranges name {masters}")
    if any("rebuild" in r.extra for r in m.ranges):
        run.problems.append(f"a rebuild mark is left: {m.dumps()}")
    new_master = m.ranges[0].master
    for s in pair:
        want = s.address != new_master
        if checks.read_only(s) != want:
            run.problems.append(f"{s.address} read_only={not want} but the map names "
                                f"{new_master} master")
    run.problems += checks.in_flight_problems(store)
    run.problems += checks.both_ways(*pair)
    run.problems += check_history(m, servers, PROMOTE_SHARDS, log.history, log.tag)
    run.problems += scene.origin_problems(log)
    try:
        a, b = pair
        wait_pair_synced(a, b)
        wait_pair_synced(b, a)
        if tagged_rows(a, PROMOTE_SHARDS, log.tag) != tagged_rows(b, PROMOTE_SHARDS, log.tag):
            run.problems.append("the pair's nodes hold different rows after syncing")
    except AssertionError as exc:
        run.problems.append(str(exc))
    run.problems += checks.writable_problems(zookeeper.address, store.cluster, tmp_path,
                                             [1, 6])
    run.schedule.note("checked")


@pytest.mark.parametrize("seed", seeds("planned"))
def test_planned_promotion_under_a_fault(seed, promote_pair, promote_store, zookeeper,
                                         tmp_path):
    run = Run("planned", seed, PLANNED_FAULTS)
    master, standby = roles(promote_pair)
    nodes = [s.address for s in promote_pair]
    servers = {s.address: s for s in promote_pair} | zk_servers(zookeeper)
    plan = run.draw(PLANNED_WINDOW)
    run.schedule.note("plan", **plan, cluster=promote_store.cluster, master=master.address)
    scene = Scene(run, zookeeper.address, promote_store.cluster, PROMOTE_SHARDS, tmp_path,
                  list(promote_pair), frozen_wait=10.0, pairs=[(master, standby)])
    op_log = tmp_path / "operation.log"
    with proxies(plan, zookeeper.members[0].port, master) as (zk_proxy, sql_proxy):
        try:
            scene.start()
            scene.keep_cache()
            spec = op_spec({"op": "promote", "cluster": promote_store.cluster, "pair": PAIR,
                            "nodes": nodes, "mode": "planned", "expect_master": master.address,
                            "opts": opts_spec()},
                           zookeeper.address, zk_proxy, sql_proxy, master)
            proc = OpProcess(OP_SCRIPT, spec, op_log)
            run.schedule.note("promotion started")
            inject(run, proc, plan, scene, Faults(
                zk_proxy=zk_proxy, sql_proxy=sql_proxy, busy=master, zk=zookeeper,
                second=lambda: second_promotion(promote_store, nodes, "planned",
                                                master.address, plan["lock_timeout"])))
            end_operation(run, proc, zk_proxy)
            if recover_promotion(run, promote_store, nodes, "planned", master.address):
                scene.wait_resumed()
        finally:
            log = scene.stop()
    run.schedule.note("checking", ops=len(log.history.completions()))
    check_pair(run, promote_store, promote_pair, log, servers, zookeeper, tmp_path, scene)
    run.fail_if_problems(log, servers, [op_log])


def emergency_run(run: Run, plan: dict[str, Any], pair: tuple[MariaDBServer, ...],
                  store: ZooKeeperMapStore, zookeeper: Any, tmp_path: Path) -> None:
    """The master SIGKILLed under the writer; the emergency promotion; the old master back;
    the rebuild; the fault in the phase *plan* names; each phase's recovery; the checker."""
    master, standby = roles(pair)
    nodes = [s.address for s in pair]
    servers = {s.address: s for s in pair} | zk_servers(zookeeper)
    run.schedule.note("plan", **plan, cluster=store.cluster, master=master.address)
    scene = Scene(run, zookeeper.address, store.cluster, PROMOTE_SHARDS, tmp_path,
                  list(pair), frozen_wait=10.0, pairs=[(master, standby)])
    logs = [tmp_path / "emergency.log", tmp_path / "rebuild.log"]

    def restart_new() -> None:
        standby.kill()
        if not master.running:
            master.start()
        standby.start()

    def phase(name: str, base: dict[str, Any], proxy_to: MariaDBServer,
              second: Any, op_log: Path) -> None:
        p = plan if plan["phase"] == name else dict(plan, fault="none")
        with proxies(p, zookeeper.members[0].port, proxy_to) as (zk_proxy, sql_proxy):
            spec = op_spec(base, zookeeper.address, zk_proxy, sql_proxy, proxy_to)
            proc = OpProcess(OP_SCRIPT, spec, op_log)
            run.schedule.note(f"{name} started")
            if p["fault"] == "none":
                proc.wait_ready(60)
            else:
                inject(run, proc, p, scene, Faults(
                    zk_proxy=zk_proxy, sql_proxy=sql_proxy, busy=standby, second=second,
                    restart=restart_new))
            end_operation(run, proc, zk_proxy)

    try:
        scene.start()
        scene.keep_cache()
        master.kill()
        run.schedule.note("master SIGKILLed", master=master.address)
        phase("emergency", {"op": "promote", "cluster": store.cluster, "pair": PAIR,
                            "nodes": nodes, "mode": "emergency",
                            "expect_master": master.address,
                            "opts": opts_spec()}, standby,
              lambda: second_promotion(store, nodes, "emergency", master.address,
                                       plan["lock_timeout"]), logs[0])
        if recover_promotion(run, store, nodes, "emergency", master.address):
            if not master.running:
                master.start()
                run.schedule.note("old master started again")
            copy = plan.get("copy", "logical")
            phase("rebuild", {"op": "rebuild", "cluster": store.cluster, "pair": PAIR,
                              "nodes": nodes, "opts": opts_spec(),
                              "copy": copy, "servers": [s.handle() for s in pair],
                              "die_in_install": plan.get("die_in_install")}, standby,
                  lambda: second_rebuild(store, nodes, plan["lock_timeout"], copy, pair),
                  logs[1])
            if recover_rebuild(run, store, nodes, copy, pair):
                scene.wait_resumed()
    finally:
        log = scene.stop()
        for s in pair:
            if not s.running:
                s.start()
    run.schedule.note("checking", ops=len(log.history.completions()))
    check_pair(run, store, pair, log, servers, zookeeper, tmp_path, scene)
    run.fail_if_problems(log, servers, logs)


@pytest.mark.parametrize("seed", seeds("emergency"))
def test_emergency_promotion_and_rebuild_under_a_fault(seed, promote_pair, promote_store,
                                                       zookeeper, tmp_path):
    emergency_seed(seed, promote_pair, promote_store, zookeeper, tmp_path)


# Named schedules: seeds that found a defect, replayed as drawn (the instant is a time,
# which under another load may fall on another statement; the integration test named
# pins the exact one).
# Seed 999320 (fixed in promote.py: the rebuild decides under the locks): a second
# rebuild started beside the first read the map before waiting for the locks and rebuilt
# the finished standby again (fenced, its journal left in flight, the pair not
# replicating). Integration: test_promote_faults::test_a_second_rebuild_that_waited_...
# Seed 910004 (fixed by copy_id and physical.copy_lock): the same physical rebuild
# started beside a running one; both copies extracted into one directory, and the older
# copy's re-attach could run on the newer copy's data. Integration: test_physical.
@pytest.mark.parametrize("seed", [999320, 910004])
def test_a_second_rebuild_started_beside_a_running_one(seed, promote_pair, promote_store,
                                                      zookeeper, tmp_path):
    emergency_seed(seed, promote_pair, promote_store, zookeeper, tmp_path, EMERGENCY_FAULTS_1)


def emergency_seed(seed: int, promote_pair: Any, promote_store: Any, zookeeper: Any,
                   tmp_path: Path, faults: tuple[str, ...] = EMERGENCY_FAULTS) -> None:
    """One emergency run as the campaign draws it from *seed* (and *faults*: the list of
    the seed's time for a named one)."""
    run = Run("emergency", seed, faults)
    plan = run.draw(EMERGENCY_WINDOW)
    plan["phase"] = "emergency" if plan["fault"] == "restart_new" \
        else run.rng.choice(("emergency", "rebuild"))
    # the copy is drawn from a source of its own, so a seed's fault, instant and the rest
    # are drawn as before physical copies existed; SHARDFLEET_FAULT_COPY=logical|physical
    # forces the copy (a seed documented before replays with logical)
    plan["copy"] = os.environ.get("SHARDFLEET_FAULT_COPY") or random.Random(
        f"{seed}-copy").choice(("logical", "physical"))
    if plan["phase"] == "rebuild":
        window = PHYSICAL_REBUILD_WINDOW if plan["copy"] == "physical" else REBUILD_WINDOW
        plan["at"] = round(plan["at"] * window / EMERGENCY_WINDOW, 3)
    emergency_run(run, plan, promote_pair, promote_store, zookeeper, tmp_path)


# Named schedule, found by seeds 3003 and 3009 (fixed in promote.py, the rebuild's step
# master_writable): the new master restarted right after the emergency, the old master
# back; the new master booted read_only as every node does, the map named it master, and
# the rebuild finished "nothing required" with every write to the pair failing (1290).
def test_emergency_then_the_new_master_restarts_with_the_old_one_back(
        promote_pair, promote_store, zookeeper, tmp_path):
    run = Run("emergency-new-master-restarted", 3003, EMERGENCY_FAULTS_1)
    plan = dict(run.draw(EMERGENCY_WINDOW), fault="restart_new", phase="emergency",
                at=60.0)  # restart_new waits for the emergency to end, then restarts
    emergency_run(run, plan, promote_pair, promote_store, zookeeper, tmp_path)


# Named schedule, found by seed 25011 (fixed in promote.py: the emergency's refusal names
# promote_master=<master>, which makes it writable and starts the pair's stopped
# replication): the master died, and before the emergency changed anything the standby
# restarted and the master came back. Both read_only, neither replicating: the emergency
# refused (the master answers), the planned promotion refused (the standby does not
# replicate), and the pair took no writes.
def test_the_master_back_and_the_standby_restarted_before_the_emergency_acts(
        promote_pair, promote_store, zookeeper, tmp_path):
    run = Run("emergency-both-restarted-first", 25011, EMERGENCY_FAULTS_1)
    plan = dict(run.draw(EMERGENCY_WINDOW), fault="restart_new", phase="emergency", at=0.0)
    emergency_run(run, plan, promote_pair, promote_store, zookeeper, tmp_path)


# Named schedule: the physical rebuild's process SIGKILLed while it moved the copy into
# the node's data directory (the node stopped, its directory half old, half copy). The
# rerun must make a new copy and finish: the node's data is the fenced, marked node's,
# replaced whole by the copy anyway.
def test_a_physical_rebuild_killed_while_installing_the_copy_is_finished_by_its_rerun(
        promote_pair, promote_store, zookeeper, tmp_path):
    run = Run("emergency-physical-killed-installing", 7001, EMERGENCY_FAULTS_1)
    plan = dict(run.draw(EMERGENCY_WINDOW), fault="none", phase="rebuild", copy="physical",
                die_in_install=3)
    emergency_run(run, plan, promote_pair, promote_store, zookeeper, tmp_path)


# Named schedule: the physical rebuild's process SIGKILLed once every entry of the node's
# data directory was moved aside and before any of the copy's was moved in (the node
# stopped, its data directory empty).
def test_a_physical_rebuild_killed_with_the_data_directory_empty_is_finished_by_its_rerun(
        promote_pair, promote_store, zookeeper, tmp_path):
    run = Run("emergency-physical-killed-empty", 7002, EMERGENCY_FAULTS_1)
    master, _ = roles(promote_pair)
    entries = len(list(Path(master.datadir).iterdir()))
    plan = dict(run.draw(EMERGENCY_WINDOW), fault="none", phase="rebuild", copy="physical",
                die_in_install=entries)
    emergency_run(run, plan, promote_pair, promote_store, zookeeper, tmp_path)
