"""The campaign's open-range runs: what playbooks/open-range.yml does (the range's shard
databases on a new pair's master, the master writable, the range registered open through
``mapstore.change_ranges``, the ``shard_map`` module's call), for a dormant range on the
split fleet's target pair, under the writer (whose shards include the new range: its
creates there fail until the range is in the map), one fault, the runbook's recovery
(rerun the same command), then the checker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.testing import MariaDBServer
from shardfleet.testing.history import check_history
from shardfleet.testing.kit import APP_USER, SplitFleet
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
from .op import open_range

# no session_expiry: an open-range takes no lock (its one map write is a compare-and-set
# decided by content), so an expired session is only a reconnect, as lost_reply covers
FAULTS = ("kill", "lost_reply", "second_op", "partition", "too_many", "stale_router",
          "zk_leader")
# an open-range of 16 shards takes 0.3-0.6 s under the writer on a quiet 2-core machine
WINDOW = 0.7
NEW = (48, 63)
SHARDS = list(range(0, 32)) + list(range(NEW[0], NEW[1] + 1))


@pytest.fixture
def open_fleet(split_servers, zookeeper):
    fleet = SplitFleet(*split_servers, zookeeper.address)
    fleet.reset()
    yield fleet
    fleet.close()


def open_spec(fleet: SplitFleet) -> dict[str, Any]:
    return {"op": "open_range", "cluster": fleet.cluster, "range": list(NEW),
            "master": fleet.target.address, "standby": fleet.standby.address,
            "password": MariaDBServer.root_password, "app_user": APP_USER}


def run_open_range(fleet: SplitFleet) -> str:
    """The same open-range command, in this process."""
    store = ZooKeeperMapStore(fleet.zk_address, fleet.cluster)
    try:
        return open_range(store, open_spec(fleet))
    finally:
        store.close()


def second_open(fleet: SplitFleet) -> tuple[str, bool]:
    """The same open-range started beside the first: it must finish the same change (it
    is idempotent, and the map write decides by content) or fail without harm."""
    try:
        return f"ran: {run_open_range(fleet)}", True
    except Exception as exc:  # noqa: BLE001 - judged by the checker after the rerun
        return f"failed: {oneline(exc)}", True


def recover(run: Run, fleet: SplitFleet) -> bool:
    """The runbook: rerun the same command. Bounded: four reruns."""
    last = ""
    for _ in range(4):
        try:
            run.schedule.note("rerun ok", result=run_open_range(fleet))
            return True
        except Exception as exc:  # noqa: BLE001 - the runbook: any failure, rerun
            last = oneline(exc)
            run.schedule.note("rerun failed", error=last)
    run.problems.append(f"wedged: the open-range did not complete by reruns alone; last: "
                        f"{last}")
    return False


@pytest.mark.parametrize("seed", seeds("open_range"))
def test_open_range_under_a_fault(seed, open_fleet, split_servers, zookeeper, tmp_path):
    run = Run("open_range", seed, FAULTS)
    plan = run.draw(WINDOW)
    open_range_run(run, plan, open_fleet, split_servers, zookeeper, tmp_path)


def open_range_run(run: Run, plan: dict[str, Any], fleet: SplitFleet,
                   split_servers: tuple[MariaDBServer, ...], zookeeper: Any,
                   tmp_path: Path) -> None:
    src, tgt, sb = split_servers
    servers = {s.address: s for s in split_servers} | zk_servers(zookeeper)
    run.schedule.note("plan", **plan, cluster=fleet.cluster)
    scene = Scene(run, zookeeper.address, fleet.cluster, SHARDS, tmp_path, list(split_servers),
                  pairs=[(tgt, sb)])
    op_log = tmp_path / "operation.log"
    with proxies(plan, zookeeper.members[0].port, tgt) as (zk_proxy, sql_proxy):
        try:
            scene.start()
            scene.keep_cache()
            spec = op_spec(open_spec(fleet), zookeeper.address, zk_proxy, sql_proxy, tgt)
            proc = OpProcess(OP_SCRIPT, spec, op_log)
            run.schedule.note("open-range started")
            inject(run, proc, plan, scene, Faults(
                zk_proxy=zk_proxy, sql_proxy=sql_proxy, busy=tgt, zk=zookeeper,
                second=lambda: second_open(fleet)))
            end_operation(run, proc, zk_proxy)
            if recover(run, fleet):
                scene.wait_resumed()
        finally:
            log = scene.stop()
    run.schedule.note("checking", ops=len(log.history.completions()))
    m = fleet.map()
    run.problems += checks.map_problems(m)
    new = m.range_for(NEW[0])
    if (new.bounds, new.master, new.standby, new.state) != (NEW, tgt.address, sb.address,
                                                            "open"):
        run.problems.append(f"the new range is {new.describe()}")
    if m.range_for(0).master != src.address:
        run.problems.append(f"the old range is {m.range_for(0).describe()}")
    if checks.read_only(tgt) or not checks.read_only(sb):
        run.problems.append(f"read_only: master {checks.read_only(tgt)}, standby "
                            f"{checks.read_only(sb)} (want False, True)")
    run.problems += checks.both_ways(tgt, sb)
    run.problems += check_history(m, servers, SHARDS, log.history, log.tag)
    run.problems += scene.origin_problems(log)
    run.problems += checks.writable_problems(zookeeper.address, fleet.cluster, tmp_path,
                                             [3, NEW[0] + 2])
    run.schedule.note("checked")
    run.fail_if_problems(log, servers, [op_log])

