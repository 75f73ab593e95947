"""Promotion on the container fleet under load (runs after the site tests: the name
sorts last). A bounded writer on the host, through the routing library, writes to
pair001's shards and logs every acknowledged ID:

0. healthy: --check of every operation playbook (tests/e2e/checkmode.py) changes nothing;
1. planned: promote.yml -e pair=pair001; zero acknowledged writes lost, the old master
   read_only and replicating from the new one; the writer's longest stall is measured;
   a rerun naming the new master changes nothing; refusals change nothing;
2. emergency: podman kill the new master, promote.yml -e mode=emergency; zero
   acknowledged writes lost, the writer resumes on the new master; the killed node,
   started again, comes up read_only and refuses the application's writes.

The killed node is rebuilt last, by test_zzz_promote_faults (the split and the named
fault schedules start from the emergency's state).
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request

import pymysql
import pytest

from shardfleet import ids
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.store import Store
from tests.integration.s3_fixtures import S3
from tests.integration.test_promote import Writer, missing_ids

from .checkmode import assert_check_changes_nothing, operations
from .conftest import E2E_TLS, Fleet, assert_pairs_replicate

pytestmark = pytest.mark.e2e
PAIR = "pair001"


def _admin(fleet: Fleet, server: str, timeout: float = 5) -> pymysql.connections.Connection:
    host, _, port = server.rpartition(":")
    return pymysql.connect(host=host, port=int(port), user="shardfleet_admin",
                           password=fleet.secrets["vault_mysql_admin_password"],
                           autocommit=True, connect_timeout=timeout,
                           **E2E_TLS.pymysql_kwargs())


def _one(conn: pymysql.connections.Connection, sql: str) -> object:
    with conn.cursor() as c:
        c.execute(sql)
        row = c.fetchone()
        return row[0] if row else None


def _wait_answer(fleet: Fleet, server: str, timeout: float = 90) -> pymysql.connections.Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _admin(fleet, server, timeout=2)
        except pymysql.err.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _wait_replicating(fleet: Fleet, server: str, timeout: float = 60) -> None:
    """*server*'s replication from its peer runs (IO and SQL Yes), bounded."""
    conn = _admin(fleet, server)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with conn.cursor(pymysql.cursors.DictCursor) as c:
                c.execute("SHOW SLAVE STATUS")
                st = c.fetchone()
            if st and (st["Slave_IO_Running"], st["Slave_SQL_Running"]) == ("Yes", "Yes"):
                return
            assert time.monotonic() < deadline, f"{server} does not replicate: {st}"
            time.sleep(0.5)
    finally:
        conn.close()


def _wait_applied(fleet: Fleet, server: str, source: str, timeout: int = 120) -> None:
    """*server* applied *source*'s current binlog position (a GTID wait, bounded)."""
    src = _admin(fleet, source)
    try:
        pos = _one(src, "SELECT @@GLOBAL.gtid_binlog_pos")
    finally:
        src.close()
    conn = _admin(fleet, server, timeout=10)
    try:
        with conn.cursor() as c:
            c.execute("SELECT MASTER_GTID_WAIT(%s, %s)", (pos, timeout))
            assert c.fetchone()[0] == 0, f"{server} did not apply {source}'s {pos}"
    finally:
        conn.close()


def _node(fleet: Fleet, server: str) -> str:
    return next(h for h in fleet.group("mysql") if server.startswith(fleet.ip(h) + ":"))


def _check_acked(fleet: Fleet, server: str, acked: list[int]) -> None:
    conn = _admin(fleet, server)
    try:
        lost = missing_ids(conn, acked)
    finally:
        conn.close()
    assert lost == [], f"{len(lost)} acknowledged writes missing on {server}: {lost[:5]}"


def _shards(fleet: Fleet, server: str) -> list[str]:
    conn = _admin(fleet, server)
    try:
        with conn.cursor() as c:
            c.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA "
                      "WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$' ORDER BY 1")
            return [str(r[0]) for r in c.fetchall()]
    finally:
        conn.close()


def _checksums(fleet: Fleet, server: str, wait_for: str | None = None) -> dict[str, int]:
    """CHECKSUM TABLE of every shard's pins table on *server* (after it has
    applied *wait_for*'s binlog position)."""
    if wait_for is not None:
        _wait_applied(fleet, server, wait_for, timeout=120)
    conn = _admin(fleet, server, timeout=10)
    try:
        out: dict[str, int] = {}
        dbs = _shards(fleet, server)
        with conn.cursor() as c:
            for i in range(0, len(dbs), 256):
                c.execute("CHECKSUM TABLE " + ", ".join(f"{d}.pins" for d in dbs[i:i + 256]))
                out.update({str(t): int(v or 0) for t, v in c.fetchall()})
        return out
    finally:
        conn.close()


def _wait_exporter_shows_finished(fleet: Fleet, kind: str, since: float,
                                  timeout: float = 60) -> None:
    """The shardfleet exporter (on the monitoring host) shows an operation of *kind* that
    finished after *since* (Unix time): its latest end, from the journals."""
    url = f"http://{fleet.ip(fleet.group('monitoring')[0])}:9150/metrics"
    pattern = re.compile(r'^shardfleet_operation_last_finished_timestamp_seconds\{kind="'
                         + re.escape(kind) + r'"\} (\S+)$', re.M)
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the fleet's own
            text = resp.read().decode()
        m = pattern.search(text)
        if m and float(m.group(1)) >= since:
            return
        assert time.monotonic() < deadline, (
            f"the exporter shows no {kind} finished after {since:.0f} in {timeout:.0f} s: "
            f"{m.group(0) if m else 'no series'}")
        time.sleep(2)


def test_promote_planned_then_emergency(fleet: Fleet, s3: S3) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"
    zk = ",".join(f"{fleet.ip(h)}:2181" for h in fleet.group("zookeeper"))
    mapstore = ZooKeeperMapStore(zk, "default")
    router = Router(ZooKeeperMapStore(zk, "default"), user="shardfleet_app",
                    password=fleet.secrets["vault_mysql_app_password"], frozen_wait=15.0,
                    connect_timeout=2, read_timeout=10, tls=E2E_TLS)
    store = Store(router)
    report: list[str] = []
    try:
        nodes = [f"{fleet.ip(h)}:3306" for h in fleet.group("mysql")
                 if fleet.hosts[h]["shardfleet_pair"] == PAIR]
        r0 = next(r for r in mapstore.read().map.ranges if r.master in nodes)
        old, new = r0.master, r0.standby
        assert new in nodes, f"pair001's range has no standby: {r0.describe()}"
        near = ids.compose(r0.first, 1, 1)

        # -- --check of every operation on the healthy fleet: each exits 0 (the split,
        # with no empty pair to take a range, is refused) and changes nothing ------------
        lines, _ = assert_check_changes_nothing(fleet, mapstore, operations(
            s3=s3, pair=PAIR, split=(PAIR, "pair002"), open_pair="pair002",
            add_pair="pair009", refused={"split.yml": "is not empty"}), state="healthy", s3=s3)
        report += lines

        # -- refusals: nothing changes --------------------------------------------------
        v0 = mapstore.read().version
        bad = fleet.playbook("promote.yml", "-e", "pair=pair404")
        assert bad.rc != 0 and "pair404 has 0 servers" in bad.output, bad.output[-2000:]
        live = fleet.playbook("promote.yml", "-e", f"pair={PAIR}", "-e", "mode=emergency")
        assert live.rc != 0 and "answers: use mode=planned" in live.output, live.output[-2000:]
        assert mapstore.read().version == v0, "a refused promotion changed the map"

        # -- planned, under load --------------------------------------------------------
        w = Writer(store, max_seconds=120, near=near).start()
        try:
            assert w.wait_acks(200), f"writer made no progress\n{w.status()}"
            t0, wall0 = time.monotonic(), time.time()
            run = fleet.playbook("promote.yml", "-e", f"pair={PAIR}")
            t1 = time.monotonic()
            assert w.wait_acks(200), f"writer did not resume\n{w.status()}"
        finally:
            w.stop()
        assert run.rc == 0, run.output[-4000:]
        assert "MAP BEFORE:" in run.output and "MAP AFTER:" in run.output
        stall = w.longest_stall(since=t0 - 0.5)
        report.append(f"planned: playbook {run.seconds:.1f}s, longest write stall {stall:.3f}s, "
                      f"{len(w.acked)} acked, {len(w.errors)} errors")
        r1 = next(r for r in mapstore.read().map.ranges if r.bounds == r0.bounds)
        assert (r1.master, r1.standby, r1.state) == (new, old, r0.state), r1.describe()
        _check_acked(fleet, new, w.acked)
        oc = _admin(fleet, old)
        try:
            assert _one(oc, "SELECT @@GLOBAL.read_only") == 1, "old master still writable"
        finally:
            oc.close()
        _wait_replicating(fleet, old, timeout=30)
        # the old master (now the standby) may lag: wait for the new master's position
        # (on a busy machine a few hundred writes), never a count
        _wait_applied(fleet, old, new, timeout=120)
        _check_acked(fleet, old, w.acked)
        assert_pairs_replicate(lambda pb: (lambda r: (r.rc, r.output))(
            fleet.playbook(pb.name)))
        assert t1 - t0 < 60
        _wait_exporter_shows_finished(fleet, "promotion (planned)", wall0)
        again = fleet.playbook("promote.yml", "-e", f"pair={PAIR}", "-e", f"promote_master={new}")
        assert again.rc == 0 and "changed=0" in again.output, again.output[-2000:]

        # -- emergency: kill the new master mid-load ------------------------------------
        w2 = Writer(store, max_seconds=120, near=near).start()
        try:
            assert w2.wait_acks(200), f"writer made no progress: {w2.errors[-3:]}"
            dead = _node(fleet, new)
            subprocess.run(["podman", "kill", dead], check=True, capture_output=True)
            t_kill = time.monotonic()
            em = fleet.playbook("promote.yml", "-e", f"pair={PAIR}", "-e", "mode=emergency")
            t_start = t_kill  # the playbook started right after the kill
            assert em.rc == 0, em.output[-4000:]
            assert w2.wait_acks(200, timeout=30), f"writer did not resume: {w2.errors[-3:]}"
        finally:
            w2.stop()
        first = w2.first_ack_after(t_start)
        assert first is not None
        report += [ln.strip() for ln in em.output.splitlines() if "SECONDS FROM START" in ln]
        report.append(f"emergency: playbook {em.seconds:.1f}s, kill -> first acknowledged "
                      f"write on {old} {first - t_start:.2f}s, {len(w2.acked)} acked, "
                      f"{len(w2.errors)} errors")
        _check_acked(fleet, old, w.acked + w2.acked)
        r2 = next(r for r in mapstore.read().map.ranges if r.bounds == r0.bounds)
        assert r2.master == old and r2.extra.get("rebuild") == new, r2.to_dict()
        assert "rebuild-standby.yml" in em.output
        # every other pair still replicates both ways (pair001 waits for its rebuild)
        assert_pairs_replicate(lambda pb: (lambda r: (r.rc, r.output))(
            fleet.playbook(pb.name)), except_pairs=(PAIR,))

        # -- the killed master comes back read-only and takes no writes -----------------
        subprocess.run(["podman", "start", dead], check=True, capture_output=True)
        back = _wait_answer(fleet, new)
        try:
            deadline = time.monotonic() + 60
            while _one(back, "SELECT COUNT(*) FROM information_schema.PROCESSLIST") is None:
                assert time.monotonic() < deadline
                time.sleep(1)
            assert _one(back, "SELECT @@GLOBAL.read_only") == 1, "returning master is writable"
        finally:
            back.close()
        host, _, port = new.rpartition(":")
        app = pymysql.connect(host=host, port=int(port), user="shardfleet_app",
                              password=fleet.secrets["vault_mysql_app_password"],
                              autocommit=True,
                              **E2E_TLS.pymysql_kwargs())
        try:
            with pytest.raises(pymysql.err.MySQLError, match="read-only|1290"), \
                    app.cursor() as c:
                c.execute(f"INSERT INTO db{r0.first:05d}.pins (body) VALUES ('{{}}')")
        finally:
            app.close()

    finally:
        print("\n" + "\n".join(report))
        store.close()
        router.close()
        mapstore.close()
