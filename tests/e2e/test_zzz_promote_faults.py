"""Named fault schedules of the promotion on the container fleet, after test_zz_promote
(the name sorts after it; `make e2e` runs the split tests on a fleet of their own, so
these start from test_zz_promote's state). pair001's map master is the node the
emergency promoted (writable); the killed old master was started again, read-only, and
the map marks it ``rebuild`` (rebuilt by the last test here); pair002 is whole (its two
nodes healthy, replicating both ways). Each test leaves one writable node per pair.

1. The new master restarted after the emergency, the old master back (the fault
   campaign's restart_new, seeds 3003 and 3009): under a writer on pair001 the new
   master's container is restarted; it boots read_only like every node, so every write
   to the pair fails with 1290. The documented command, promote.yml naming the map's
   master (``-e promote_master=<it>``), makes it writable again: changed, the writer
   resumes, zero acknowledged writes lost, the old master still read-only and still
   marked ``rebuild``; the same command again changes nothing; and the master is as the
   emergency left it, semi-sync off (nothing can acknowledge until the rebuild; the
   restart brought back the configured ON), checked last. The test leaves semi-sync off
   there either way.
2. A second operation on the same pair: two planned promotions of pair002 (pair001
   awaits its rebuild) started at the same time, both with ``-e expect_master=<the
   master>``, under a writer. Exactly one promotes; the other is refused (the lock is
   held, or the promotion already happened) and changes nothing; zero acknowledged
   writes lost; the old master replicates from the new one.
3. The rebuild, last: first --check of every operation playbook, rebuild-standby.yml's
   among them (what on-call runs first; tests/e2e/checkmode.py), exits 0 or refuses as
   documented and changes nothing (the map's and the journals' znodes, every server's
   gtid_binlog_pos and read_only). Then
   rebuild-standby.yml under a writer re-attaches pair001's old
   master as the standby by a physical copy of the master's data directory (every
   shard it holds, over 10,000 tablespaces with the 2,048 shards of CI (28,000 with
   4,096): more than the container's 8,192 open files,
   so mariadb-backup closes each file once copied), node to node; then every pair
   replicates both ways, the master holds every acknowledged write, the mark is gone,
   and the two nodes' checksums agree for every shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pymysql
import pytest

from shardfleet import ids
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardRange
from shardfleet.store import Store
from tests.integration.s3_fixtures import S3
from tests.integration.test_promote import Writer

from .checkmode import assert_check_changes_nothing, operations
from .conftest import BIN, E2E_TLS, PLAYBOOK_TIMEOUT, REPO, Fleet, Run, assert_pairs_replicate
from .test_zz_promote import (
    _admin,
    _check_acked,
    _checksums,
    _node,
    _one,
    _shards,
    _wait_answer,
    _wait_applied,
    _wait_replicating,
)
from .test_zz_split import _app_insert

pytestmark = pytest.mark.e2e
PAIR = "pair001"  # promoted in an emergency by test_zz_promote; awaits its rebuild
WHOLE = "pair002"  # never promoted: both nodes replicate


def _zk(fleet: Fleet) -> str:
    return ",".join(f"{fleet.ip(h)}:2181" for h in fleet.group("zookeeper"))


def _pair_nodes(fleet: Fleet, pair: str) -> list[str]:
    return sorted(f"{fleet.ip(h)}:3306" for h in fleet.group("mysql")
                  if fleet.hosts[h]["shardfleet_pair"] == pair)


def _ranges(mapstore: ZooKeeperMapStore, nodes: list[str]) -> list[ShardRange]:
    m = mapstore.read().map
    assert m is not None, "no map in ZooKeeper"
    return [r for r in m.ranges if r.master in nodes]


def _global(fleet: Fleet, server: str, variable: str) -> int:
    """A numeric global variable of *server* (its own admin connection)."""
    conn = _admin(fleet, server)
    try:
        return int(_one(conn, f"SELECT @@GLOBAL.{variable}"))  # type: ignore[arg-type]
    finally:
        conn.close()


def _read_only(fleet: Fleet, server: str) -> int:
    return _global(fleet, server, "read_only")


def _semisync_master(fleet: Fleet, server: str) -> int:
    return _global(fleet, server, "rpl_semi_sync_master_enabled")


def _changed(run: Run) -> int:
    return sum(c.get("changed", 0) for c in run.recap().values())


def _one_writable_per_pair(fleet: Fleet) -> None:
    """Every pair of the fleet has exactly one writable node (the one the map names)."""
    m = ZooKeeperMapStore(_zk(fleet), "default")
    try:
        masters = {r.master for r in m.read().map.ranges}  # type: ignore[union-attr]
    finally:
        m.close()
    for pair in sorted({fleet.hosts[h]["shardfleet_pair"] for h in fleet.group("mysql")}):
        writable = [n for n in _pair_nodes(fleet, pair) if _read_only(fleet, n) == 0]
        assert len(writable) == 1 and writable[0] in masters, \
            f"{pair}: writable nodes {writable}, map masters {sorted(masters)}"


def _routed(fleet: Fleet) -> tuple[Router, Store]:
    router = Router(ZooKeeperMapStore(_zk(fleet), "default"), user="shardfleet_app",
                    password=fleet.secrets["vault_mysql_app_password"], frozen_wait=15.0,
                    connect_timeout=2, read_timeout=10, tls=E2E_TLS)
    return router, Store(router)


def test_new_master_restarted_after_the_emergency(fleet: Fleet) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"
    mapstore = ZooKeeperMapStore(_zk(fleet), "default")
    router, store = _routed(fleet)
    report: list[str] = []
    master = old = ""
    try:
        ranges = _ranges(mapstore, _pair_nodes(fleet, PAIR))
        assert ranges and all(r.extra.get("rebuild") for r in ranges), \
            f"test_zz_promote left no emergency state: {[r.to_dict() for r in ranges]}"
        master, old = ranges[0].master, str(ranges[0].extra["rebuild"])
        shard = ranges[0].first
        _wait_answer(fleet, old, timeout=300).close()  # test_zz_promote started it again
        assert (_read_only(fleet, master), _read_only(fleet, old)) == (0, 1), \
            "after the emergency: the new master writable, the old one read-only"
        # the emergency turned semi-sync off on the new master (nothing can acknowledge
        # until the rebuild), at runtime: a restart brings back the configured ON
        semi_before = _semisync_master(fleet, master)

        w = Writer(store, max_seconds=600, near=ids.compose(shard, 1, 1),
                   max_writes=200_000).start()
        try:
            assert w.wait_acks(200, timeout=60), f"writer made no progress\n{w.status()}"
            errors_before = len(w.errors)
            t_restart = time.monotonic()
            subprocess.run(["podman", "restart", "--time", "120", _node(fleet, master)],
                           check=True, capture_output=True, timeout=300)
            t_up = time.monotonic()  # the server that acknowledged before is gone
            _wait_answer(fleet, master, timeout=300).close()
            t_answers = time.monotonic()
            assert _read_only(fleet, master) == 1, "the restarted master booted writable"
            # the fault is real: the map names it master, and every write fails (1290)
            deadline = time.monotonic() + 120
            while not any("1290" in e for e in w.errors[errors_before:]):
                assert time.monotonic() < deadline, \
                    f"no write refused with 1290 after the restart: {w.errors[-3:]}"
                time.sleep(0.2)
            assert w.first_ack_after(t_up) is None, "a write was acknowledged by a read-only pair"
            err = _app_insert(master, fleet.secrets["vault_mysql_app_password"], shard)[1]
            assert "1290" in err or "read-only" in err, err
            assert _ranges(mapstore, _pair_nodes(fleet, PAIR))[0].master == master

            # the documented command: a promotion to the map's master
            t0 = time.monotonic()
            run = fleet.playbook("promote.yml", "-e", f"pair={PAIR}",
                                 "-e", f"promote_master={master}")
            assert run.rc == 0, run.output[-4000:]
            assert _changed(run) >= 1, run.output[-3000:]
            assert f"made the master {master} writable again" in " ".join(run.output.split()), \
                run.output[-3000:]
            assert w.wait_acks(200, timeout=60), f"writer did not resume\n{w.status()}"
            first = w.first_ack_after(t0)
            assert first is not None
        finally:
            w.stop()
        refused = sum("1290" in e for e in w.errors[errors_before:])
        report.append(f"restart_new: podman restart {t_up - t_restart:.0f}s, answering after "
                      f"{t_answers - t_restart:.0f}s, {refused} writes refused (1290); "
                      f"promote.yml promote_master={master} {run.seconds:.1f}s, first "
                      f"acknowledged write {first - t0:.1f}s after its start; "
                      f"{len(w.acked)} acked")
        _check_acked(fleet, master, w.acked)
        assert _read_only(fleet, master) == 0
        assert _read_only(fleet, old) == 1, "the old master (awaiting its rebuild) is writable"
        after = _ranges(mapstore, _pair_nodes(fleet, PAIR))
        assert [(r.master, r.extra.get("rebuild")) for r in after] == \
            [(master, old)] * len(ranges), [r.to_dict() for r in after]
        _one_writable_per_pair(fleet)
        again = fleet.playbook("promote.yml", "-e", f"pair={PAIR}",
                               "-e", f"promote_master={master}")
        assert again.rc == 0 and _changed(again) == 0, again.output[-3000:]
        # last, so that everything above is checked first: made writable again, the
        # master must also be as the emergency left it, semi-sync off while its standby
        # awaits the rebuild; with it on, a commit waits rpl_semi_sync_master_timeout (1 s)
        # for an acknowledgement nothing sends, each time a semi-sync replica comes and
        # goes (a split's channel)
        semi_after = _semisync_master(fleet, master)
        report.append(f"rpl_semi_sync_master_enabled on {master}: {semi_before} after the "
                      f"emergency, {semi_after} after the restart and promote_master")
        assert semi_after == 0, (
            f"promote.yml promote_master={master} made the restarted master writable but left "
            f"semi-sync on (rpl_semi_sync_master_enabled={semi_after}; the emergency had "
            f"turned it off: {semi_before}) although its peer {old} awaits a rebuild: commits "
            "wait rpl_semi_sync_master_timeout for an acknowledgement nothing sends "
            f"(the first write after the command came {first - t0:.1f}s after its start, "
            f"the playbook took {run.seconds:.1f}s)")
    finally:
        print("\n" + "\n".join(report))
        store.close()
        router.close()
        mapstore.close()
        # leave pair001 as the emergency left it (for a test after this one): semi-sync
        # off on the master while a rebuild is due
        try:
            if master and old and _semisync_master(fleet, master):
                conn = _admin(fleet, master)
                try:
                    with conn.cursor() as c:
                        c.execute("SET GLOBAL rpl_semi_sync_master_enabled = OFF")
                finally:
                    conn.close()
        except pymysql.err.MySQLError as exc:
            print(f"could not turn semi-sync off on {master}: {exc!r}")


def _start_playbook(fleet: Fleet, name: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(BIN / "ansible-playbook"), "-i", str(fleet.inventory), "-e",
             f"@{fleet.extra_vars}", str(REPO / "playbooks" / name), *args],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_two_planned_promotions_of_one_pair_at_once(fleet: Fleet, tmp_path: Path) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"
    mapstore = ZooKeeperMapStore(_zk(fleet), "default")
    router, store = _routed(fleet)
    report: list[str] = []
    try:
        nodes = _pair_nodes(fleet, WHOLE)
        ranges = _ranges(mapstore, nodes)
        assert ranges and not any(r.extra.get("rebuild") for r in ranges), \
            [r.to_dict() for r in ranges]
        a, b = ranges[0].master, next(n for n in nodes if n != ranges[0].master)
        assert all((r.master, r.standby) == (a, b) for r in ranges)
        # whole: one writable node, both replicating, the standby caught up
        assert (_read_only(fleet, a), _read_only(fleet, b)) == (0, 1)
        for n in nodes:
            _wait_replicating(fleet, n)
        _wait_applied(fleet, b, a)

        w = Writer(store, max_seconds=300, near=ids.compose(ranges[0].first, 1, 1)).start()
        try:
            assert w.wait_acks(200, timeout=60), f"writer made no progress\n{w.status()}"
            logs = [tmp_path / f"promote-{i}.log" for i in (1, 2)]
            t0 = time.monotonic()
            procs = [_start_playbook(fleet, "promote.yml", log, "-e", f"pair={WHOLE}",
                                     "-e", f"expect_master={a}") for log in logs]
            try:
                rcs = [p.wait(PLAYBOOK_TIMEOUT) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait(30)
            seconds = time.monotonic() - t0
            assert w.wait_acks(200, timeout=60), f"writer did not resume\n{w.status()}"
        finally:
            w.stop()
        runs = [Run(rc, log.read_text(), seconds) for rc, log in zip(rcs, logs, strict=True)]
        won = [r for r in runs if r.rc == 0 and _changed(r) >= 1]
        lost = [r for r in runs if r not in won]
        assert len(won) == 1 and len(lost) == 1, \
            "\n=====\n".join(f"rc {r.rc}:\n{r.output[-2500:]}" for r in runs)
        refusal = lost[0]
        reasons = ("another operation holds", "the promotion already happened")
        assert refusal.rc != 0 and _changed(refusal) == 0, refusal.output[-3000:]
        why = next((x for x in reasons if x in refusal.output), None)
        assert why is not None, refusal.output[-3000:]
        assert "MAP AFTER:" in won[0].output and "MAP AFTER:" not in refusal.output

        after = _ranges(mapstore, nodes)
        assert [(r.master, r.standby, r.state) for r in after] == \
            [(b, a, r.state) for r in ranges], [r.to_dict() for r in after]
        raw, _ = mapstore.read_raw(f"{mapstore.root}/default/ops/journal/promote-{WHOLE}")
        journal = json.loads(raw or b"{}")
        assert (journal.get("done"), journal.get("old_master"), journal.get("new_master"),
                journal.get("mode")) == (True, a, b, "planned"), journal
        assert (_read_only(fleet, a), _read_only(fleet, b)) == (1, 0)
        _check_acked(fleet, b, w.acked)
        _wait_replicating(fleet, a)
        _wait_applied(fleet, a, b)
        _check_acked(fleet, a, w.acked)
        _wait_replicating(fleet, b)
        _one_writable_per_pair(fleet)
        report.append(f"two promotions of {WHOLE} at once: both ended within {seconds:.1f}s; "
                      f"one promoted {a} -> {b}, the other refused ('{why}'); "
                      f"{len(w.acked)} acked, {len(w.errors)} errors, longest write stall "
                      f"{w.longest_stall(since=t0):.2f}s")
    finally:
        print("\n" + "\n".join(report))
        store.close()
        router.close()
        mapstore.close()


def test_the_old_master_rebuilt_by_a_physical_copy_under_a_writer(fleet: Fleet, s3: S3) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"
    mapstore = ZooKeeperMapStore(_zk(fleet), "default")
    router, store = _routed(fleet)
    report: list[str] = []
    try:
        ranges = _ranges(mapstore, _pair_nodes(fleet, PAIR))
        assert ranges and all(r.extra.get("rebuild") for r in ranges), \
            f"no old master of {PAIR} awaits a rebuild: {[r.to_dict() for r in ranges]}"
        master, old = ranges[0].master, str(ranges[0].extra["rebuild"])
        _wait_answer(fleet, old, timeout=300).close()
        # on-call looks first, as the runbook says: --check of every operation after the
        # emergency, before the rebuild, exits 0 (the split, with no empty pair, is
        # refused) and changes nothing (rebuild-standby.yml's failed once:
        # 'rebuild_target_host' is undefined)
        lines, outputs = assert_check_changes_nothing(fleet, mapstore, operations(
            s3=s3, pair=PAIR, split=(PAIR, WHOLE), open_pair=WHOLE, add_pair="pair009",
            refused={"split.yml": "is not empty"}), state="after the emergency", s3=s3)
        report += lines
        assert _read_only(fleet, old) == 1 and _read_only(fleet, master) == 0
        assert "check mode: no copy is made" in outputs["rebuild-standby.yml"], \
            outputs["rebuild-standby.yml"][-4000:]
        # bounded past the rebuild under load in time and in writes (at load 10 the
        # playbook took over 200 s, and a bound of 20,000 writes ended the writer first)
        w = Writer(store, max_seconds=900, near=ids.compose(ranges[0].first, 1, 1),
                   max_writes=400_000).start()
        try:
            assert w.wait_acks(100), f"writer made no progress\n{w.status()}"
            rb = fleet.playbook("rebuild-standby.yml", "-e", f"pair={PAIR}")
            report.append(f"rebuild-standby (physical, {len(_shards(fleet, master))} shards, "
                          f"under a writer): rc {rb.rc}, playbook {rb.seconds:.0f}s, "
                          f"{len(w.acked)} acked; "
                          + "; ".join(ln.strip().strip('",') for ln in rb.output.splitlines()
                                      if "COPY:" in ln))
            assert rb.rc == 0, rb.output[-4000:]
            assert w.wait_acks(100), f"writer stopped\n{w.status()} ({w.ops} ops)"
        finally:
            w.stop()
        assert w.errors == [], f"writes failed during the rebuild: {w.errors[:3]}"
        after = _ranges(mapstore, _pair_nodes(fleet, PAIR))
        assert all("rebuild" not in r.extra and r.standby == old for r in after), \
            [r.to_dict() for r in after]
        _check_acked(fleet, master, w.acked)
        assert_pairs_replicate(lambda pb: (lambda r: (r.rc, r.output))(fleet.playbook(pb.name)))
        a, b = _checksums(fleet, master), _checksums(fleet, old, wait_for=master)
        assert len(a) >= 1024 and a == b, \
            f"{sum(a.get(k) != b.get(k) for k in a | b)} shard tables differ"
        _one_writable_per_pair(fleet)
    finally:
        print("\n" + "\n".join(report))
        store.close()
        router.close()
        mapstore.close()
