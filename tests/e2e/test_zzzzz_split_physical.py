"""split.yml with the physical clone on the container fleet (runs last: the name sorts after
every other e2e test, whose end state it splits).

``fleet-add.yml`` makes pair007. The top shards of a pair the map gives a standby move
onto it with ``split_clone=physical`` under a writer: one ``mariadb-backup`` of the
source's standby streamed node to node to both new containers at once, the copy attached
(the shards pair007 does not take dropped), then replicate and cutover as ever.

split.yml is killed (the playbook alone, SIGKILL: its copy tasks in the containers run
on, as they do when an operator's laptop dies) once the journal's progress shows the
copy streaming; the rerun names a new copy (its receivers wait for the killed run's copy
to land, or preempt receivers still waiting for a sender), attaches it and finishes.

Checks: the copy came from the map's standby, never the master; no acknowledged write
lost, no row nobody acknowledged, no error on a moving shard; both new nodes hold the
moving shards and nothing else, table by table equal; every pair replicates; a rerun
changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.shardmap import ShardRange

from .conftest import PREFIX_TO, REPO, Fleet, assert_pairs_replicate, awaiting_rebuild
from .test_zz_promote import _admin
from .test_zz_split import (
    _check,
    _map,
    _play,
    _recap_changed,
    _sample,
    _start_split,
    _top,
    _until,
    _wait_ops,
    _writer,
)
from .test_zzz_promote_faults import _zk
from .test_zzzz_backup import _checksums

pytestmark = pytest.mark.e2e
NEW_PAIR = "pair007"  # after the split test's pair003-pair005 and the backup test's pair006


def _source_pair(fleet: Fleet, store: ZooKeeperMapStore) -> tuple[str, ShardRange]:
    """A pair of the inventory that the map gives a standby of its own, and its range."""
    by_ip = {f"{fleet.ip(h)}:3306": fleet.hosts[h]["shardfleet_pair"]
             for h in fleet.group("mysql")}
    m = _map(store)
    for pair in ("pair001", "pair002"):
        mine = [r for r in m.ranges if by_ip.get(r.master) == pair and r.standby
                and by_ip.get(r.standby) == pair and not r.extra.get("rebuild")]
        if len(mine) == 1 and mine[0].size >= 512:
            return pair, mine[0]
    raise AssertionError("no pair of the inventory has one range with a standby in the map: "
                         + "; ".join(r.describe() for r in m.ranges))


def _shard_dbs(fleet: Fleet, server: str) -> set[str]:
    conn = _admin(fleet, server, timeout=10)
    try:
        with conn.cursor() as c:
            c.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA "
                      "WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$'")
            return {str(row[0]) for row in c.fetchall()}
    finally:
        conn.close()


def _wait_scraped(fleet: Fleet, want: set[tuple[str, str]], timeout: float = 120) -> None:
    """Prometheus (the monitoring host) scrapes these (job, inventory name) targets and
    each answers: fleet-add.yml gave the new pair its exporters and Prometheus its
    targets."""
    url = f"http://{fleet.ip(fleet.group('monitoring')[0])}:9090/api/v1/targets?state=active"
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the fleet's own
            active = json.loads(resp.read().decode())["data"]["activeTargets"]
        up = {(t["scrapePool"], t["labels"]["instance"]) for t in active if t["health"] == "up"}
        if want <= up:
            return
        assert time.monotonic() < deadline, f"Prometheus does not scrape {sorted(want - up)}"
        time.sleep(3)


def test_a_physical_split_killed_during_its_copy_finishes_on_rerun(
        fleet: Fleet, tmp_path: Path) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; nothing to split"
    zk = _zk(fleet)
    store = ZooKeeperMapStore(zk, "default")
    split_pb = REPO / "playbooks" / "split.yml"
    report: list[str] = []
    try:
        pair, r = _source_pair(fleet, store)
        inv = tmp_path / "inventory"
        shutil.copytree(fleet.inventory, inv)
        rc, out, t_add = _play(fleet, inv, REPO / "playbooks" / "fleet-add.yml",
                               "-e", f"pair={NEW_PAIR}")
        assert rc == 0, f"fleet-add.yml failed:\n{out[-3000:]}"
        added = yaml.safe_load((inv / "added-pairs.yml").read_text())
        hosts = {h: v for h, v in added["all"]["children"]["fleet"]["children"]["mysql"]
                 ["hosts"].items() if v["shardfleet_pair"] == NEW_PAIR}
        assert sorted(hosts) == [f"{PREFIX_TO}mysql007a", f"{PREFIX_TO}mysql007b"], hosts
        tgt = [f"{hosts[h]['shardfleet_container_ip']}:3306" for h in sorted(hosts)]
        report.append(f"fleet-add.yml {NEW_PAIR} {t_add:.0f}s")
        _wait_scraped(fleet, {(job, h) for job in ("node", "mysqld") for h in hosts})

        moving = _top(r)
        shards = _sample(r, moving)
        journal = f"{store.root}/default/ops/journal/split-{moving[0]}-{moving[1]}"
        args = ["-e", f"split_source_pair={pair}", "-e", f"split_target_pair={NEW_PAIR}",
                "-e", json.dumps({"split_range": list(moving)}), "-e", "split_clone=physical"]

        def streaming() -> bool:  # the watch saw bytes arrive on the receivers
            raw, _ = store.read_raw(journal)
            p = (json.loads(raw) if raw else {}).get("clone_progress") or {}
            return "receiving" in str(p.get("phase")) and int(p.get("bytes_done") or 0) > 0

        with _writer(fleet, zk, shards, frozen_wait=15, seconds=1200) as (_, w):
            w.start()
            _wait_ops(w, 200)
            t0 = time.monotonic()
            log = tmp_path / "split-killed-copying.log"
            with log.open("w") as sink:
                p = _start_split(fleet, inv, args, sink)
                try:
                    _until("the copy streaming (the journal's clone_progress)", p, log,
                           streaming)
                finally:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(60)
            first = json.loads(store.read_raw(journal)[0] or b"{}")
            assert first.get("step") == "started", first
            report.append(f"split.yml killed {time.monotonic() - t0:.0f}s after its start, "
                          f"copy {first['copy']['copy_id']} streaming: "
                          f"{first.get('clone_progress')}")
            rc, out, t_split = _play(fleet, inv, split_pb, *args)
            assert rc == 0, f"the rerun of split.yml failed:\n{out[-5000:]}"
            _wait_ops(w, 200)
        j = json.loads(store.read_raw(journal)[0] or b"{}")
        assert j.get("step") == "cutover" and j.get("clone_method") == "physical", j
        assert j["copy"]["copy_id"] != first["copy"]["copy_id"], "the rerun reused the copy"
        assert j["copy_source"] == r.standby, \
            f"copied {j['copy_source']}, the map's standby is {r.standby}"
        m = _map(store)
        moved = m.range_for(moving[0])
        assert (moved.bounds, moved.master, moved.standby) == (moving, tgt[0], tgt[1]), \
            moved.describe()
        assert m.range_for(r.first).master == r.master
        summary = _check(fleet, store, w.log, shards, moving, r.master, tgt[0], t0)
        report.append(f"rerun {t_split:.0f}s (copy {j['copy_bytes']} bytes in "
                      f"{j['copy_seconds']}s, attach dropped {j['dropped_on_target']} "
                      f"databases), stall {j['frozen_seconds'] * 1000:.0f} ms; {summary}")
        moving_shards = list(range(moving[0], moving[1] + 1))
        sums = [_checksums(fleet, node, moving_shards) for node in tgt]
        assert sums[0] == sums[1], "the new pair's nodes differ"
        assert {t.split(".")[0] for t in sums[0]} == {f"db{s:05d}" for s in moving_shards}
        for node in tgt:
            assert _shard_dbs(fleet, node) == {f"db{s:05d}" for s in moving_shards}, \
                f"{node} holds shards it does not serve"
        assert_pairs_replicate(lambda pb: _play(fleet, inv, pb)[:2],
                               except_pairs=awaiting_rebuild(fleet, m))
        rc, again, _ = _play(fleet, inv, split_pb, *args)
        assert rc == 0 and _recap_changed(again) == 0, again[-3000:]
    finally:
        store.close()
        print("\n" + "\n".join(report))
