"""The campaign's backup runs (:mod:`tests.faults.backups`): a backup of a pair's standby
(backup.yml) and a restore of the pair's newest complete backup into a scratch server,
started at instants drawn from the run's seed beside

* ``backup_rebuild``: a rebuild of that standby (the map marks it ``rebuild``, then
  ``promote.rebuild_standby``, what rebuild-standby.yml runs; a logical or a physical
  copy, drawn), on the promotion pair under the writer;
* ``backup_split`` (in :mod:`tests.faults.test_split`): a split onto the pair whose
  standby is backed up.

The faults (:data:`tests.faults.backups.FAULTS`): the operation's process SIGKILLed or its
ZooKeeper session expired (the campaign's ``kill`` and ``session_expiry``), the backup's
process SIGKILLed (``kill_backup``) or its session expired (``expire_backup``), the
restore's process SIGKILLed (``kill_restore``), or none but the mix itself (``beside``).
The recovery: the operation's command rerun until it finishes, a killed or failed backup
rerun, a killed restore rerun. The checker: the
promotion family's (:func:`tests.faults.test_promote.check_pair`) and the backups'
(:meth:`tests.faults.backups.Beside.check`; the restore checks).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from shardfleet.shardmap import from_obj
from shardfleet.testing.kit import wait_pair_synced
from shardfleet.testing.nemesis import OpProcess

from .backups import FAULTS, Beside, backup_plan, fault_or_wait, shard_counts
from .campaign import OP_SCRIPT, Faults, Run, Scene, end_operation, seeds, zk_servers
from .conftest import PROMOTE_SHARDS
from .test_promote import (
    PAIR,
    REBUILD_WINDOW,
    check_pair,
    opts_spec,
    promote_store,  # noqa: F401 - the fixture
    recover_rebuild,
    roles,
)

# the windows the instants are drawn from: a little longer than a rebuild of the pair's
# standby beside a backup under the writer (logical 1-2 s, physical 4-5 s)
WINDOWS = {"logical": REBUILD_WINDOW, "physical": 5.0}


def mark_for_rebuild(store: Any, node: str) -> None:
    """What an operator's map edit (or an emergency promotion) leaves: every range of the
    pair marks *node* ``rebuild``."""
    cur = store.read()
    obj = json.loads(cur.map.dumps())
    for r in obj["ranges"]:
        r["rebuild"] = node
    store.write(from_obj(obj), cur.version)


@pytest.mark.parametrize("seed", seeds("backup_rebuild"))
def test_backup_and_restore_beside_a_rebuild_of_the_standby(seed, promote_pair, promote_store,  # noqa: F811
                                                            zookeeper, backup_shelf, tmp_path):
    run = Run("backup_rebuild", seed, FAULTS)
    copy = random.Random(f"{seed}-copy").choice(("logical", "physical"))
    plan = dict(backup_plan(run, WINDOWS[copy]), copy=copy)
    pair = promote_pair
    master, standby = roles(pair)
    wait_pair_synced(master, standby)
    at_least = shard_counts(master, PROMOTE_SHARDS)
    nodes = [s.address for s in pair]
    servers = {s.address: s for s in pair} | zk_servers(zookeeper)
    run.schedule.note("plan", **plan, cluster=promote_store.cluster, master=master.address,
                      standby=standby.address)
    scene = Scene(run, zookeeper.address, promote_store.cluster, PROMOTE_SHARDS, tmp_path,
                  list(pair), frozen_wait=10.0, pairs=[(master, standby)])
    beside = Beside(run, plan, backup_shelf, PAIR, standby, zookeeper.address,
                    promote_store.cluster, tmp_path, at_least, PROMOTE_SHARDS)
    op_log = tmp_path / "rebuild.log"
    try:
        scene.start()
        beside.early()
        mark_for_rebuild(promote_store, standby.address)
        run.schedule.note("standby marked for rebuild", node=standby.address)
        proc = OpProcess(OP_SCRIPT, {"op": "rebuild", "zk": zookeeper.address,
                                     "cluster": promote_store.cluster, "pair": PAIR,
                                     "nodes": nodes, "opts": opts_spec(), "copy": copy,
                                     "servers": [s.handle() for s in pair]}, op_log)
        run.schedule.note("rebuild started", copy=copy)
        beside.start(proc)
        fault_or_wait(run, proc, plan, scene, Faults(zk=zookeeper))
        end_operation(run, proc, None)
        if recover_rebuild(run, promote_store, nodes, copy, pair):
            scene.wait_resumed()
        beside.finish()
    finally:
        beside.stop()
        log = scene.stop()
        for s in pair:
            if not s.running:
                s.start()
    run.schedule.note("checking", ops=len(log.history.completions()))
    check_pair(run, promote_store, pair, log, servers, zookeeper, tmp_path, scene)
    beside.check()
    run.fail_if_problems(log, servers, [op_log, *sorted(tmp_path.glob("backup*.log")),
                                        *sorted(tmp_path.glob("restore*.log"))])
