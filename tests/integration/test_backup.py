"""Backups of a pair's standby to S3 (moto's server on 127.0.0.1) and restores from them
(shardfleet.backup): a backup under a writer restored onto a fresh server with the
manifest's checksums; a master refused; a backup killed mid-stream leaves nothing that
looks complete; a corrupted object refused before the target is touched; retention.

Its own pair (the fixtures of test_promote.py); every test leaves it whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from shardfleet import backup, ids, physical, replication
from shardfleet.backup import BackupFailed, BackupRefused, Location, RestoreRefused
from shardfleet.testing import MariaDBServer

from . import test_promote as tp
from .s3_fixtures import REGION, S3, s3_server  # noqa: F401 - the fixture
from .test_promote import roles, wait_applied

pair, zk_store, writer_store = tp.pair, tp.zk_store, tp.writer_store

pytestmark = pytest.mark.skipif(shutil.which("mariadb-backup") is None,
                                reason="mariadb-backup is not installed (make host-deps)")

PART = 5 << 20          # S3's smallest part: several parts even for a small server
REPO = Path(__file__).resolve().parents[2]


def argv_of(server: MariaDBServer, workdir: str) -> list[str]:
    cnf = physical.client_defaults(workdir, "root", MariaDBServer.root_password)
    return physical.backup_argv(defaults_file=cnf, datadir=str(server.datadir),
                                socket_path=str(server.socket), parallel=2)


def take(s3: Any, loc: Location, server: MariaDBServer, **kw: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return backup.backup(s3, loc, argv_of(server, tmp), connect=server.connect,
                             node=server.address, part_size=PART, **kw)


def keys(s3: Any, loc: Location) -> list[str]:
    r = s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.root)
    return sorted(o["Key"] for o in r.get("Contents", []))


def pending_uploads(s3: Any, loc: Location) -> list[dict[str, Any]]:
    return list(s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.root)
                .get("Uploads", []))


@pytest.fixture
def loc(s3_server: S3) -> Location:  # noqa: F811
    return Location(s3_server.new_bucket(), "c1", tp.PAIR, prefix="backups")


@pytest.fixture
def s3(s3_server: S3) -> Any:  # noqa: F811
    return s3_server.client()


@pytest.fixture
def fresh(tmp_path_factory) -> Iterator[MariaDBServer]:
    server = MariaDBServer(tmp_path_factory.mktemp("restore"), server_id=30,
                           extra=["--innodb-file-per-table=0", "--read-only=ON"]).start()
    yield server
    server.stop(remove=True)


def marker(server: MariaDBServer) -> None:
    server.sql("CREATE DATABASE IF NOT EXISTS sf_marker")


def test_a_backup_of_the_standby_under_a_writer_restores_with_its_checksums(
        pair, writer_store, s3, loc, fresh):
    master, standby = roles(pair)
    w = tp.Writer(writer_store, max_seconds=120).start()
    try:
        assert w.wait_acks(50), f"writer made no progress\n{w.status()}"
        wait_applied(standby, master)
        before = w.acked  # on the standby before the backup starts
        parts: list[int] = []
        m = take(s3, loc, standby, compress=True,
                 progress=lambda p: parts.append(p.object_bytes))
        assert w.wait_acks(20), f"writer stopped during the backup\n{w.status()}"
    finally:
        w.stop()
    assert m["checksums_at_position"], m["checksums_note"]
    assert set(m["checksums"]) == {f"db{s:05d}" for s in tp.SHARDS}
    assert m["node"] == standby.address and m["sha256"] and m["bytes"] > 0
    assert m["stream_bytes"] > m["bytes"], "zstd compressed nothing"
    assert replication.gtid_covers(master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0],
                                   m["position"]["gtid"])
    assert len(parts) >= 1
    head = s3.head_object(Bucket=loc.bucket, Key=m["object"])
    assert head["ServerSideEncryption"] == "AES256" and head["ContentLength"] == m["bytes"]
    assert keys(s3, loc) == sorted([m["object"], loc.key(m["backup_id"], "manifest.json")])
    assert [b["backup_id"] for b in backup.list_backups(s3, loc)] == [m["backup_id"]]
    print(f"\nbackup: {m['stream_bytes'] / 2**20:.1f} MiB stream, {m['bytes'] / 2**20:.1f} MiB "
          f"object in {m['seconds']:.2f}s "
          f"({m['stream_bytes'] / 2**20 / max(m['seconds'], 1e-3):.1f} MiB/s)")

    marker(fresh)
    r = backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect)
    print(f"restore: {r.bytes / 2**20:.1f} MiB object in {r.seconds:.2f}s, "
          f"{r.checksums_verified} tables verified")
    assert r.backup_id == m["backup_id"] and r.position == m["position"]["gtid"]
    assert r.checksums_verified == sum(len(t) for t in m["checksums"].values()) > 0, r
    assert not r.note, r.note
    assert fresh.sql("SELECT @@GLOBAL.read_only")[0][0] == 1
    assert fresh.sql("SHOW ALL SLAVES STATUS") == []
    assert fresh.sql("SELECT @@GLOBAL.gtid_slave_pos")[0][0] == m["position"]["gtid"]
    assert not fresh.sql("SHOW DATABASES LIKE 'sf_marker'"), "the old data is still there"
    assert not Path(str(fresh.datadir) + ".restore").exists()
    conn = fresh.connect()
    try:
        assert tp.missing_ids(conn, before) == [], "acknowledged writes missing from the restore"
    finally:
        conn.close()
    # the verification sees a changed row
    db = f"db{ids.shard_of(before[0]):05d}"  # a shard the writer wrote to
    fresh.sql(f"UPDATE {db}.pins SET created_at = created_at - INTERVAL 1 DAY LIMIT 1")
    conn = fresh.connect()
    try:
        with pytest.raises(backup.RestoreFailed, match=rf"1 checksum\(s\) differ.*{db}.pins"):
            backup._verify(conn, m)
    finally:
        conn.close()
    # the standby kept replicating through the backup
    wait_applied(standby, master)
    assert tp.channel(standby)["Slave_SQL_Running"] == "Yes"


def test_a_master_is_refused_and_nothing_is_uploaded(pair, s3, loc):
    master, _ = roles(pair)
    with pytest.raises(BackupRefused, match="read_only=OFF"):
        take(s3, loc, master)
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []


def test_a_backup_whose_mariadb_backup_dies_mid_stream_leaves_nothing(pair, s3, loc):
    _, standby = roles(pair)
    killed: list[int] = []

    def kill_after_first_part(p: backup.Progress) -> None:
        if not killed:
            os.kill(p.pids[0], signal.SIGKILL)  # mariadb-backup itself
            killed.append(p.pids[0])

    with pytest.raises(BackupFailed, match="mariadb-backup failed"):
        take(s3, loc, standby, progress=kill_after_first_part)
    assert killed
    assert backup.list_backups(s3, loc) == []
    assert keys(s3, loc) == [], "a failed backup left objects"
    assert pending_uploads(s3, loc) == [], "the multipart upload was not aborted"


class BrokenUploads:
    """The S3 client, but its part uploads fail (a network cut, S3 refusing)."""

    def __init__(self, s3: Any) -> None:
        self.s3, self.parts = s3, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.s3, name)

    def upload_part(self, **kw: Any) -> Any:
        self.parts += 1
        raise ConnectionResetError("the connection to S3 was cut")


def test_a_compressed_backup_whose_upload_breaks_leaves_nothing(pair, s3, loc):
    _, standby = roles(pair)
    broken = BrokenUploads(s3)
    with tempfile.TemporaryDirectory() as tmp, \
            pytest.raises(BackupFailed, match="connection to S3 was cut"):
        backup.backup(broken, loc, argv_of(standby, tmp), connect=standby.connect,
                      node=standby.address, compress=True, part_size=PART)
    assert broken.parts == 1
    assert backup.list_backups(s3, loc) == [] and keys(s3, loc) == []
    assert pending_uploads(s3, loc) == [], "the multipart upload was not aborted"


KILLED = """
import sys, time
sys.path.insert(0, {src!r})
from shardfleet import backup, physical
s3 = backup.s3_client(endpoint_url={url!r}, region={region!r}, access_key="testing",
                      secret_key="testing")
loc = backup.Location({bucket!r}, "c1", {pair!r}, prefix="backups")
argv = physical.backup_argv(defaults_file={cnf!r}, datadir={datadir!r},
                            socket_path={socket!r}, parallel=2)
import pymysql
def connect():
    return pymysql.connect(unix_socket={socket!r}, user="root", password={password!r},
                           autocommit=True)
def progress(p):
    print("PART", p.parts, flush=True)
    time.sleep(60)  # killed here, mid-stream
backup.backup(s3, loc, argv, connect=connect, node="n", part_size={part}, progress=progress)
"""


def test_a_killed_backup_process_leaves_no_manifest_and_retention_aborts_its_upload(
        pair, s3, loc, s3_server, tmp_path):  # noqa: F811
    _, standby = roles(pair)
    cnf = physical.client_defaults(str(tmp_path), "root", MariaDBServer.root_password)
    code = KILLED.format(src=str(REPO / "src"), url=s3_server.url, region=REGION,
                         bucket=loc.bucket, pair=loc.pair, cnf=cnf, datadir=str(standby.datadir),
                         socket=str(standby.socket), password=MariaDBServer.root_password,
                         part=PART)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]  # bounded by the backup
        assert line.startswith("PART"), f"no part uploaded: {line!r} {proc.stderr.read()}"  # type: ignore[union-attr]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the backup and its mariadb-backup
        proc.wait(30)
    assert backup.list_backups(s3, loc) == [], "a killed backup looks complete"
    assert not any(k.endswith("manifest.json") for k in keys(s3, loc))
    assert len(pending_uploads(s3, loc)) == 1, "the killed upload should still be pending"
    # a fresh upload is kept (it may be a running backup), a stale one aborted
    assert backup.retention(s3, loc, keep_count=1)["aborted_uploads"] == []
    later = datetime.now(UTC) + timedelta(hours=25)
    out = backup.retention(s3, loc, keep_count=1, now=later)
    assert len(out["aborted_uploads"]) == 1 and pending_uploads(s3, loc) == []


def test_a_corrupted_backup_is_refused_and_the_target_is_untouched(pair, s3, loc, fresh):
    _, standby = roles(pair)
    m = take(s3, loc, standby, compress=True)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=m["object"])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=loc.bucket, Key=m["object"], Body=bytes(body))
    marker(fresh)
    listing = sorted(p.name for p in fresh.datadir.iterdir())
    with pytest.raises(RestoreRefused, match="corrupted.*Nothing was changed"):
        backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect, backup_id=m["backup_id"])
    assert fresh.running and fresh.sql("SHOW DATABASES LIKE 'sf_marker'")
    assert sorted(p.name for p in fresh.datadir.iterdir()) == listing
    assert not Path(str(fresh.datadir) + ".restore").exists()
    fresh.sql("SET GLOBAL read_only = OFF")
    with pytest.raises(RestoreRefused, match="writable"):
        backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect, backup_id=m["backup_id"])
    assert sorted(p.name for p in fresh.datadir.iterdir()) == listing
    with pytest.raises(RestoreRefused, match="no complete backup nope"):
        backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect, backup_id="nope")


def _fake(s3: Any, loc: Location, bid: str, finished: datetime, manifest: bool = True,
          healthy: bool | None = None) -> None:
    s3.put_object(Bucket=loc.bucket, Key=loc.key(bid, "backup.mbstream"), Body=b"x")
    if manifest:
        m: dict[str, Any] = {"backup_id": bid, "finished": finished.isoformat()}
        if healthy is not None:  # None: a manifest from before the field
            m["from_healthy_standby"] = healthy
        s3.put_object(Bucket=loc.bucket, Key=loc.key(bid, "manifest.json"),
                      Body=json.dumps(m).encode())


def test_retention_by_count_and_age_keeps_the_newest_and_removes_stale_incomplete(s3, loc):
    now = datetime.now(UTC)
    times = [now - timedelta(days=10 - i) for i in range(1, 6)]
    ages = {f"{t:%Y%m%dT%H%M%SZ}-00000{i}": t for i, t in enumerate(times)}
    for bid, fin in ages.items():
        _fake(s3, loc, bid, fin)
    leftover = f"{now:%Y%m%dT%H%M%SZ}-000009"
    _fake(s3, loc, leftover, now, manifest=False)  # a failed backup's leftover
    ids = sorted(ages)
    # ages 9, 8, 7, 6, 5 days: keep 2 by count (ids[3:]) and any younger than 7.5 days
    # (ids[2])
    plan = backup.retention(s3, loc, keep_count=2, keep_days=7.5, check=True)
    assert plan["deleted"] == ids[:2] and plan["kept"] == ids[2:]
    assert len(backup.list_backups(s3, loc)) == 5, "check mode deleted something"
    out = backup.retention(s3, loc, keep_count=2, keep_days=7.5)
    assert out["deleted"] == ids[:2] and out["deleted_incomplete"] == []
    assert [b["backup_id"] for b in backup.list_backups(s3, loc)] == ids[2:]
    # by count only; the incomplete one once it is stale
    out = backup.retention(s3, loc, keep_count=1, now=now + timedelta(days=2))
    assert out["deleted"] == ids[2:4] and out["deleted_incomplete"] == [leftover]
    assert keys(s3, loc) == sorted(loc.key(ids[4], n) for n in ("backup.mbstream",
                                                                "manifest.json"))
    with pytest.raises(Exception, match="keep_count must be at least 1"):
        backup.retention(s3, loc, keep_count=0)


def test_the_module_backs_up_lists_and_prunes_with_check_mode_and_no_secrets(
        pair, s3, loc, s3_server, zookeeper, tmp_path):  # noqa: F811
    """On the runner (zookeeper_hosts): the backup and the restore lock their node and
    leave a finished journal each; nothing leaks a secret."""
    from shardfleet.mapstore import ZooKeeperMapStore

    from .test_modules import run_module

    master, standby = roles(pair)
    secret = "sf-s3-secret-" + os.urandom(4).hex()
    common = {"bucket": loc.bucket, "prefix": loc.prefix, "cluster": loc.cluster,
              "pair": loc.pair, "endpoint_url": s3_server.url, "region": REGION,
              "access_key": "AKIASHARDFLEETTEST", "secret_key": secret,
              "login_user": "root", "login_password": MariaDBServer.root_password,
              "zookeeper_hosts": [zookeeper.address]}

    def on(server: MariaDBServer, **kw: Any) -> dict[str, Any]:
        return {**common, "login_unix_socket": str(server.socket),
                "datadir": str(server.datadir), "node": server.address, "parallel": 2,
                "part_size_mb": 5, **kw}

    outputs = []
    r, out = run_module(tmp_path, "shard_backup", on(standby, mode="backup"), check=True)
    outputs.append(out)
    assert r.get("changed") and "would back up" in r["msg"], r
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    r, out = run_module(tmp_path, "shard_backup", on(master, mode="backup"))
    outputs.append(out)
    assert r.get("failed") and "read_only=OFF" in r["msg"] and "Traceback" not in r["msg"], r
    r, out = run_module(tmp_path, "shard_backup", on(standby, mode="backup"))
    outputs.append(out)
    assert r.get("changed") and r["manifest"]["checksums_at_position"], r
    assert r["manifest"]["checksummed_databases"] == len(tp.SHARDS)
    bid = r["manifest"]["backup_id"]
    r, out = run_module(tmp_path, "shard_backup", {**common, "mode": "list"})
    outputs.append(out)
    assert [b["backup_id"] for b in r["backups"]] == [bid], r
    r, out = run_module(tmp_path, "shard_backup", on(standby, mode="restore"), check=True)
    outputs.append(out)
    assert r.get("changed") and bid in r["msg"], r
    r, out = run_module(tmp_path, "shard_backup", on(master, mode="archive"))
    outputs.append(out)
    assert r.get("changed") and r["archived"], r
    r, out = run_module(tmp_path, "shard_backup", on(standby, mode="restore",
                                                     stop_gtid="0-1-1"))
    outputs.append(out)
    assert r.get("failed") and "needs binlog_node" in r["msg"], r
    r, out = run_module(tmp_path, "shard_backup", {**common, "mode": "prune", "keep_count": 1})
    outputs.append(out)
    assert not r.get("changed") and r["pruned"]["kept"] == [bid], r
    for out in outputs:
        assert secret not in out and MariaDBServer.root_password not in out
    store = ZooKeeperMapStore(zookeeper.address, loc.cluster)
    try:
        (j,) = _journals_of(store, "backup")
        assert j["done"] and j["servers"] == [standby.address] and j["backup_id"] == bid, j
    finally:
        store.close()
    wait_applied(standby, master)


def test_backup_playbook_names_the_maps_standby_never_the_master(pair, zk_store, zookeeper,
                                                                 tmp_path):
    """backup.yml's first play against the pair's map (the backups themselves need fleet
    hosts: the e2e tier): the standby is backed up, the master only archives its binary
    logs. Only the control node's play runs (--limit)."""
    master, standby = roles(pair)
    out, name = run_backup_playbook(pair, zk_store, zookeeper, tmp_path)
    added = set(re.findall(r"groups:\s+- (\w+)\s+host_name: (\S+)", out))
    assert added == {("backup_standbys", name[standby.address]),
                     ("backup_masters", name[master.address])}, out[-3000:]


def test_point_in_time_restore_replays_the_masters_archived_binlogs_to_a_gtid(
        pair, writer_store, s3, loc, fresh, tmp_path):
    master, standby = roles(pair)
    w = tp.Writer(writer_store, max_seconds=120).start()
    try:
        assert w.wait_acks(30), f"writer made no progress\n{w.status()}"
        m = take(s3, loc, standby, compress=True)
        n_backup = len(w.acked)
        assert w.wait_acks(30), f"writer stopped\n{w.status()}"
    finally:
        w.stop()
    upto = w.acked  # every acknowledged write is before the point in time...
    assert len(upto) > n_backup
    stop = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    conn = master.connect()  # ...and this one after it
    try:
        with conn.cursor() as c:
            c.execute("INSERT INTO db00000.pins (body) VALUES ('{\"after\": true}')")
            after = c.lastrowid
    finally:
        conn.close()
    sent = backup.archive_binlogs(s3, loc, connect=master.connect, node=master.address)
    assert sent and backup.archive_binlogs(s3, loc, connect=master.connect,
                                           node=master.address, flush=False) == []
    # the archive is not a backup, and retention leaves it alone
    assert [b["backup_id"] for b in backup.list_backups(s3, loc)] == [m["backup_id"]]
    backup.retention(s3, loc, keep_count=1, now=datetime.now(UTC) + timedelta(days=30))
    assert any("/binlogs/" in k for k in keys(s3, loc))

    r = backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect)
    assert r.checksums_verified > 0
    cnf = physical.client_defaults(str(tmp_path), "root", MariaDBServer.root_password)
    client = [shutil.which("mariadb") or "mariadb", f"--defaults-extra-file={cnf}",
              "--host=127.0.0.1", f"--port={fresh.port}"]
    out = backup.replay(s3, loc, node=master.address, start=r.position, client_argv=client,
                        connect=fresh.connect, stop_gtid=stop)
    assert replication.gtid_covers(out["position"], stop), (out, stop)
    conn = fresh.connect()
    try:
        assert tp.missing_ids(conn, upto) == [], "writes before the point in time are missing"
        with conn.cursor() as c:
            c.execute("SELECT COUNT(*) FROM db00000.pins WHERE local_id = %s", (after,))
            assert c.fetchone()[0] == 0, "a write after the point in time was replayed"
    finally:
        conn.close()
    assert fresh.sql("SELECT @@GLOBAL.read_only")[0][0] == 1
    assert fresh.sql("SELECT @@GLOBAL.gtid_slave_pos")[0][0] == out["position"]


@pytest.mark.parametrize("stop_by", ["gtid", "datetime"])
def test_point_in_time_restore_when_a_domain_did_not_move_after_the_backup(
        pair, s3, loc, fresh, tmp_path, stop_by):
    """The master's binary logs name a GTID domain that has no event after the backup's
    position (a former master's, after a promotion: the e2e tier's pair). mariadb-binlog
    fails a replay whose start or stop names such a domain ('Binary logs never reached
    expected GTID state of 99-99-1'), so the replay passes only the domains that move;
    a time is turned into the position the archive holds at that time."""
    master, standby = roles(pair)
    conn = master.connect()
    try:
        with conn.cursor() as c:  # a write in another domain, as a former master's
            c.execute("SET SESSION gtid_domain_id = 99")
            c.execute("SET SESSION server_id = 99")
            c.execute("INSERT INTO db00001.pins (body) VALUES ('{\"domain\": 99}')")
    finally:
        conn.close()
    wait_applied(standby, master)
    m = take(s3, loc, standby)
    assert "99-99-" in m["position"]["gtid"], m["position"]
    before = []
    conn = master.connect()
    try:
        with conn.cursor() as c:
            for _ in range(3):
                c.execute("INSERT INTO db00000.pins (body) VALUES ('{\"before\": true}')")
                before.append(c.lastrowid)
        stop = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
        time.sleep(1.2)  # the point in time: a second of its own
        point = master.sql("SELECT DATE_FORMAT(NOW(), '%Y-%m-%d %H:%i:%s')")[0][0]
        time.sleep(1.2)
        with conn.cursor() as c:
            c.execute("INSERT INTO db00000.pins (body) VALUES ('{\"after\": true}')")
            after = c.lastrowid
    finally:
        conn.close()
    # the domain that did not move since the backup
    moved = replication.parse_gtids(stop)
    assert moved[99] == replication.parse_gtids(m["position"]["gtid"])[99], (stop, m)
    backup.archive_binlogs(s3, loc, connect=master.connect, node=master.address)

    r = backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect)
    cnf = physical.client_defaults(str(tmp_path), "root", MariaDBServer.root_password)
    client = [shutil.which("mariadb") or "mariadb", f"--defaults-extra-file={cnf}",
              "--host=127.0.0.1", f"--port={fresh.port}"]
    out = backup.replay(s3, loc, node=master.address, start=r.position, client_argv=client,
                        connect=fresh.connect, **({"stop_gtid": stop} if stop_by == "gtid"
                                                  else {"stop_datetime": point}))
    assert replication.gtid_covers(out["position"], stop), (out, stop)
    assert replication.parse_gtids(out["position"])[99] == moved[99], out
    rows = {row[0] for row in fresh.sql("SELECT local_id FROM db00000.pins WHERE local_id IN "
                                        f"({','.join(str(i) for i in before + [after])})")}
    assert rows == set(before), f"replayed {sorted(rows)}; before the point {before}, " \
                                f"after it {after}"
    assert fresh.sql("SELECT @@GLOBAL.gtid_slave_pos")[0][0] == out["position"]


# -- defect 2: only a healthy standby is backed up -----------------------------------------

def flipped_map(master: MariaDBServer, standby: MariaDBServer) -> dict[str, Any]:
    """The map an emergency promotion leaves: the old master named as the standby, with
    the ``rebuild`` mark (it diverged and boots read_only)."""
    return {"mod_shard_count": 8, "ranges": [
        {"range": [0, 3], "master": master.address, "standby": standby.address,
         "state": "open", "rebuild": standby.address},
        {"range": [4, 7], "master": master.address, "standby": standby.address,
         "state": "closed", "rebuild": standby.address}]}


def healthy_map(master: MariaDBServer, standby: MariaDBServer) -> dict[str, Any]:
    out = flipped_map(master, standby)
    for r in out["ranges"]:
        del r["rebuild"]
    return out


def test_a_standby_marked_for_rebuild_in_the_map_is_refused_and_nothing_uploaded(pair, s3, loc):
    master, standby = roles(pair)
    with pytest.raises(BackupRefused, match="marked for rebuild") as e:
        take(s3, loc, standby, shard_map=flipped_map(master, standby))
    assert not e.value.health.healthy and e.value.health.rebuild  # type: ignore[attr-defined]
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    # the same node, the map healthy: backed up, and the manifest says from what
    m = take(s3, loc, standby, shard_map=healthy_map(master, standby))
    assert m["from_healthy_standby"] is True and m["source"]["role"] == "standby", m
    assert m["source"]["channels"] and not m["source"]["reasons"], m["source"]


@pytest.mark.parametrize("thread", ["SQL_THREAD", "IO_THREAD"])
def test_a_standby_whose_replication_is_stopped_is_refused_and_nothing_uploaded(
        pair, s3, loc, thread):
    master, standby = roles(pair)
    standby.sql(f"STOP SLAVE {thread}")
    try:
        with pytest.raises(BackupRefused, match=r"replication .*stopped") as e:
            take(s3, loc, standby)
        assert not e.value.health.healthy  # type: ignore[attr-defined]
        assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    finally:
        standby.sql("START SLAVE")
    wait_applied(standby, master)


def test_a_lagging_standby_is_refused_beyond_the_bound(pair, s3, loc):
    """Received but not applied (MASTER_DELAY holds the events): beyond max_lag_trx the
    backup is refused; within it, taken."""
    master, standby = roles(pair)
    standby.sql("STOP SLAVE")
    standby.sql("CHANGE MASTER TO MASTER_DELAY = 600")
    standby.sql("START SLAVE")
    try:
        for _ in range(3):
            master.sql("INSERT INTO db00000.pins (body) VALUES ('{\"lag\": true}')")
        want = master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
        deadline = time.monotonic() + 30
        while not replication.gtid_covers(tp.channel(standby).get("Gtid_IO_Pos") or "", want):
            assert time.monotonic() < deadline, "the standby did not receive the writes"
            time.sleep(0.1)
        with pytest.raises(BackupRefused, match=r"behind") as e:
            take(s3, loc, standby, max_lag_trx=2)
        assert not e.value.health.healthy  # type: ignore[attr-defined]
        assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    finally:
        standby.sql("STOP SLAVE")
        standby.sql("CHANGE MASTER TO MASTER_DELAY = 0")
        standby.sql("START SLAVE")
    wait_applied(standby, master)


def test_retention_never_deletes_the_last_backup_from_a_healthy_standby(s3, loc):
    """Newer backups that were not taken from a healthy standby (a master's with
    allow_master, or ones from before the manifests said) do not push the last healthy
    one out, whatever keep_count says."""
    now = datetime.now(UTC)
    bids = [f"{now - timedelta(days=5 - i):%Y%m%dT%H%M%SZ}-00000{i}" for i in range(4)]
    for i, bid in enumerate(bids):
        _fake(s3, loc, bid, now - timedelta(days=5 - i),
              healthy=None if i == 0 else (i == 1))
    out = backup.retention(s3, loc, keep_count=1)
    assert out["deleted"] == [bids[0], bids[2]], out
    assert out["kept"] == [bids[1], bids[3]], out
    assert out["protected"] == bids[1], out


def run_backup_playbook(pair, zk_store, zookeeper, tmp_path) -> tuple[str, dict[str, str]]:
    """backup.yml's first play (the control node's, --limit) against *zk_store*'s map:
    its output and the inventory names by address."""
    hosts = {f"sf-test-{i}": {"shardfleet_pair": tp.PAIR, "shardfleet_address": "127.0.0.1",
                              "mysql_port": s.port} for i, s in enumerate(pair)}
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps({"all": {"children": {"mysql": {"hosts": hosts}}, "hosts": {
        "localhost": {"ansible_connection": "local",
                      "ansible_python_interpreter": sys.executable}}}}))
    extra = {"backup_zookeeper_hosts": [zookeeper.address], "backup_cluster": zk_store.cluster,
             "mysql_admin_user": "root", "mysql_admin_password": MariaDBServer.root_password,
             "zookeeper_admin_password": ""}
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    p = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv),
                        "--limit", "localhost", "-e", json.dumps(extra), "-v",
                        str(REPO / "playbooks" / "backup.yml")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert MariaDBServer.root_password not in out
    return out, {s.address: h for h, s in zip(hosts, pair, strict=True)}


def test_backup_playbook_after_an_emergency_flip_backs_up_nobody_and_warns(
        pair, zk_store, zookeeper, tmp_path):
    """The map an emergency promotion leaves names the old master as the standby, marked
    for rebuild: it is not backed up, and the run warns (an Ansible warning, not a line
    of debug output) that the pair has no healthy standby."""
    from shardfleet.shardmap import from_obj

    master, standby = roles(pair)
    v = zk_store.read()
    zk_store.write(from_obj(flipped_map(master, standby)), v.version)
    out, name = run_backup_playbook(pair, zk_store, zookeeper, tmp_path)
    added = set(re.findall(r"groups:\s+- (\w+)\s+host_name: (\S+)", out))
    assert added == {("backup_masters", name[master.address])}, out[-3000:]
    assert re.search(r"\[WARNING\]: .*pair009.*marked for rebuild", out), out[-3000:]


def test_a_restore_onto_a_node_with_an_operation_in_flight_is_refused(zk_store, s3, loc, fresh):
    from shardfleet import ops

    j = ops.Journal(zk_store, "rebuild-pairX")
    j.load()
    j.save({"kind": "rebuild", "node": fresh.address, "master": "127.0.0.1:1", "step": "copied",
            "done": False})
    marker(fresh)
    listing = sorted(p.name for p in fresh.datadir.iterdir())
    try:
        with pytest.raises(RestoreRefused, match=r"in flight.*rebuild-pairX.*nothing was changed"):
            backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                           start=fresh.start, connect=fresh.connect, store=zk_store,
                           node=fresh.address)
    finally:
        j.delete()
    assert fresh.running and fresh.sql("SHOW DATABASES LIKE 'sf_marker'")
    assert sorted(p.name for p in fresh.datadir.iterdir()) == listing


def test_the_module_refuses_a_rebuild_marked_standby_with_result_fields(pair, s3, loc,
                                                                        s3_server, tmp_path):  # noqa: F811
    """The playbook branches on the module's fields (refused, from_healthy_standby),
    never on its message."""
    from .test_modules import run_module

    master, standby = roles(pair)
    args = {"bucket": loc.bucket, "prefix": loc.prefix, "cluster": loc.cluster,
            "pair": loc.pair, "endpoint_url": s3_server.url, "region": REGION,
            "access_key": "testing", "secret_key": "testing", "login_user": "root",
            "login_password": MariaDBServer.root_password,
            "login_unix_socket": str(standby.socket), "datadir": str(standby.datadir),
            "node": standby.address, "parallel": 2, "part_size_mb": 5, "mode": "backup",
            "shard_map": flipped_map(master, standby)}
    # no ZooKeeper and not unlocked: refused before anything is read
    r, _ = run_module(tmp_path, "shard_backup", args)
    assert r.get("failed") and r["refused"] is True and "needs zookeeper_hosts" in r["msg"], r
    args["unlocked"] = True
    for check in (True, False):
        r, _ = run_module(tmp_path, "shard_backup", args, check=check)
        assert r.get("failed") and r["refused"] is True, r
        assert r["from_healthy_standby"] is False and r["source"]["rebuild"] is True, r
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    r, _ = run_module(tmp_path, "shard_backup", dict(args, shard_map=healthy_map(master, standby)))
    assert r.get("changed") and r["refused"] is False and r["from_healthy_standby"] is True, r


# -- defect 3: the binary-log archive keeps each tenure apart ------------------------------

@pytest.fixture
def lone(tmp_path_factory) -> Iterator[MariaDBServer]:
    """A master of its own (RESET MASTER on the pair's would break its peer)."""
    server = MariaDBServer(tmp_path_factory.mktemp("tenure"), server_id=41).start()
    yield server
    server.stop(remove=True)


def _archived(s3: Any, loc: Location, node: str) -> dict[str, str]:
    """Every archived object of *node*: key -> sha256 of its bytes."""
    import hashlib

    root = backup.binlog_root(loc, node)
    out = {}
    for o in backup._objects(s3, loc.bucket, root):
        body = s3.get_object(Bucket=loc.bucket, Key=o["Key"])["Body"].read()
        out[o["Key"]] = hashlib.sha256(body).hexdigest()
    return out


def _closed_binlogs(server: MariaDBServer) -> dict[str, str]:
    """The server's closed binary logs: name -> sha256."""
    import hashlib

    names = [r[0] for r in server.sql("SHOW BINARY LOGS")][:-1]
    return {n: hashlib.sha256((server.datadir / n).read_bytes()).hexdigest() for n in names}


def _rows(server: MariaDBServer, ids_: list[int]) -> None:
    for i in ids_:
        server.sql("INSERT INTO tenure.t (id, v) VALUES (%s, 'x')", (i,))


def test_a_reset_master_between_two_archive_runs_keeps_both_tenures_and_replays_one(
        lone, s3, loc, fresh, tmp_path):
    """RESET MASTER (a physical rebuild, a split attach) restarts the numbering at
    000001 and, with gtid_binlog_state put back at the copy's position, reuses the GTIDs
    of the tail it lost. The archive must keep the old tenure's files as they were,
    archive the new tenure's files too (even those of the same name and size), and a
    replay from the copy's position must apply the new tenure only: never the lost tail."""
    lone.sql("CREATE DATABASE tenure")
    lone.sql("CREATE TABLE tenure.t (id INT PRIMARY KEY, v VARCHAR(8))")
    _rows(lone, [1, 2, 3])
    copy_pos = lone.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    lone.sql("FLUSH BINARY LOGS")
    _rows(lone, [101, 102, 103])            # the tail the rebuild loses
    backup.archive_binlogs(s3, loc, connect=lone.connect, node=lone.address)
    old = _archived(s3, loc, lone.address)
    assert old

    lone.sql("RESET MASTER")
    lone.sql("SET GLOBAL gtid_binlog_state = %s", (copy_pos,))
    _rows(lone, [201, 202, 203])            # the new tenure: the same GTIDs as the lost tail
    lone.sql("FLUSH BINARY LOGS")
    _rows(lone, [204])
    end_pos = lone.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    backup.archive_binlogs(s3, loc, connect=lone.connect, node=lone.address)
    now = _archived(s3, loc, lone.address)
    changed = {k for k in old if now.get(k) != old[k]}
    assert not changed, f"the old tenure's history was overwritten or lost: {sorted(changed)}"
    missing = {n for n, sha in _closed_binlogs(lone).items() if sha not in now.values()}
    assert not missing, f"the new tenure's files were never archived: {sorted(missing)}"

    # the copy at copy_pos, replayed to the new tenure's end: rows 201-204, not 101-103
    fresh.sql("SET GLOBAL read_only = OFF")
    try:
        conn = fresh.connect()
        with conn.cursor() as c:
            c.execute("SET sql_log_bin = 0")
            c.execute("CREATE DATABASE tenure")
            c.execute("CREATE TABLE tenure.t (id INT PRIMARY KEY, v VARCHAR(8))")
            c.execute("INSERT INTO tenure.t (id, v) VALUES (1, 'x'), (2, 'x'), (3, 'x')")
        conn.close()
    finally:
        fresh.sql("SET GLOBAL read_only = ON")
    cnf = physical.client_defaults(str(tmp_path), "root", MariaDBServer.root_password)
    client = [shutil.which("mariadb") or "mariadb", f"--defaults-extra-file={cnf}",
              "--host=127.0.0.1", f"--port={fresh.port}"]
    backup.replay(s3, loc, node=lone.address, start=copy_pos, client_argv=client,
                  connect=fresh.connect, stop_gtid=end_pos)
    got = sorted(r[0] for r in fresh.sql("SELECT id FROM tenure.t"))
    assert got == [1, 2, 3, 201, 202, 203, 204], f"replayed {got}"


def test_a_replay_the_archive_does_not_cover_and_a_changed_file_are_refused(lone, s3, loc,
                                                                              tmp_path):
    lone.sql("CREATE DATABASE tenure")
    lone.sql("CREATE TABLE tenure.t (id INT PRIMARY KEY, v VARCHAR(8))")
    early = lone.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    lone.sql("FLUSH BINARY LOGS")
    current = lone.sql("SHOW MASTER STATUS")[0][0]
    deadline = time.monotonic() + 30
    # MariaDB keeps (silently) a file whose binlog checkpoint InnoDB has not written yet:
    # purge until the older files are really gone
    while [r[0] for r in lone.sql("SHOW BINARY LOGS")] != [current]:
        assert time.monotonic() < deadline, lone.sql("SHOW BINARY LOGS")
        lone.sql("PURGE BINARY LOGS TO %s", (current,))
        time.sleep(0.1)
    _rows(lone, [1, 2])
    backup.archive_binlogs(s3, loc, connect=lone.connect, node=lone.address)
    with pytest.raises(backup.RestoreFailed, match="does not cover the start"):
        backup.replay(s3, loc, node=lone.address, start=early.replace("-2", "-1"),
                      client_argv=["false"], connect=lone.connect,
                      stop_gtid=lone.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0])
    # an archived object whose checksum is not the server's file's: loud, not overwritten
    (key,) = [k for k in _archived(s3, loc, lone.address)]
    body = s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
    meta = s3.head_object(Bucket=loc.bucket, Key=key)["Metadata"]
    s3.put_object(Bucket=loc.bucket, Key=key, Body=body, Metadata=dict(meta, sha256="0" * 64))
    with pytest.raises(backup.ArchiveConflict, match="differs"):
        backup.archive_binlogs(s3, loc, connect=lone.connect, node=lone.address, flush=False)


# -- the runner's contract: a backup and a restore hold their node's lock, journal ----------
# -- their steps, and appear in the registry of operations in flight while they run --------

def _journals_of(store: Any, kind: str) -> list[dict[str, Any]]:
    from shardfleet.operations.runner import journals

    return [dict(d, name=n) for n, d in journals(store).items() if d.get("kind") == kind]


def test_a_backup_beside_a_rebuild_holding_the_nodes_lock_is_refused_and_uploads_nothing(
        pair, zk_store, s3, loc):
    from shardfleet.operations.runner import Runner

    master, standby = roles(pair)
    rebuild = Runner(zk_store, "rebuild-" + tp.PAIR, [master.address, standby.address],
                     kind="rebuild")
    with rebuild.held():
        with pytest.raises(BackupRefused, match=r"holds.*nothing uploaded"):
            take(s3, loc, standby, store=zk_store, lock_timeout=0.5)
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
    assert _journals_of(zk_store, "backup") == []  # refused before it began


def test_a_backup_beside_an_unfinished_rebuild_journal_is_refused(pair, zk_store, s3, loc):
    from shardfleet.operations.runner import Journal

    master, standby = roles(pair)
    j = Journal(zk_store, "rebuild-" + tp.PAIR)
    j.load()
    j.save({"kind": "rebuild", "servers": [standby.address, master.address],
            "step": "copied", "done": False})
    try:
        with pytest.raises(BackupRefused, match=r"in flight.*rebuild-pair009"):
            take(s3, loc, standby, store=zk_store)
    finally:
        j.delete()
    assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []


def test_a_promotion_beside_a_running_backup_is_refused_and_the_backup_is_in_flight(
        pair, zk_store, s3, loc):
    from shardfleet import promote
    from shardfleet.operations.runner import LockBusy, Runner, in_flight
    from shardfleet.promote import PromotionRefused

    master, standby = roles(pair)
    seen: dict[str, Any] = {}

    def promotion() -> Runner:
        return Runner(zk_store, "promote-" + tp.PAIR, [master.address, standby.address],
                      kind="promotion (planned)", lock_timeout=0.5)

    def during(_p: Any) -> None:
        if seen:
            return
        with pytest.raises(LockBusy):
            with promotion().held():
                pass
        # the promotion itself (promote.yml's call): refused, nothing changed
        with pytest.raises(PromotionRefused, match="holds"):
            promote.promote(zk_store, tp.PAIR, [s.address for s in pair], mode="planned",
                            opts=tp.opts(lock_timeout=0.5))
        seen["ops"] = [(op.kind, op.servers) for op in in_flight(zk_store)]

    m = take(s3, loc, standby, store=zk_store, progress=during)
    assert seen["ops"] == [("backup", (standby.address,))], seen
    assert in_flight(zk_store) == []           # finished: its journal says so
    (j,) = _journals_of(zk_store, "backup")
    assert j["done"] and j["servers"] == [standby.address] and j["backup_id"] == m["backup_id"]
    assert m["locked"] is True
    with promotion().held():                   # the lock went with the backup
        pass
    assert roles(pair) == (master, standby)    # the promotion changed nothing


def test_a_restore_journals_its_steps_and_is_in_flight_while_it_runs(
        pair, zk_store, s3, loc, fresh):
    from shardfleet.operations.runner import LockBusy, Runner, in_flight

    master, standby = roles(pair)
    m = take(s3, loc, standby)
    seen: dict[str, Any] = {}

    def stop() -> None:
        seen["ops"] = [(op.kind, op.servers) for op in in_flight(zk_store)]
        with pytest.raises(LockBusy):
            with Runner(zk_store, "rebuild-x", [fresh.address], lock_timeout=0.5).held():
                pass
        fresh.stop()

    r = backup.restore(s3, loc, datadir=str(fresh.datadir), stop=stop, start=fresh.start,
                       connect=fresh.connect, store=zk_store, node=fresh.address)
    assert r.backup_id == m["backup_id"] and r.checksums_verified > 0
    assert seen["ops"] == [("restore", (fresh.address,))], seen
    assert in_flight(zk_store) == []
    (j,) = _journals_of(zk_store, "restore")
    assert j["done"] and j["servers"] == [fresh.address], j
    assert [s["step"] for s in j["steps"]] == ["download", "install", "detach", "verify"], j


def test_a_restore_beside_a_held_lock_is_refused_and_the_target_untouched(
        zk_store, s3, loc, fresh):
    from shardfleet.operations.runner import Runner

    marker(fresh)
    listing = sorted(p.name for p in fresh.datadir.iterdir())
    with Runner(zk_store, "rebuild-x", [fresh.address], kind="rebuild").held():
        with pytest.raises(RestoreRefused, match=r"holds.*nothing was changed"):
            backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                           start=fresh.start, connect=fresh.connect, store=zk_store,
                           node=fresh.address, lock_timeout=0.5)
    assert fresh.running and fresh.sql("SHOW DATABASES LIKE 'sf_marker'")
    assert sorted(p.name for p in fresh.datadir.iterdir()) == listing
    assert _journals_of(zk_store, "restore") == []


def test_a_backup_that_loses_its_lock_mid_stream_writes_no_manifest(pair, zk_store, s3, loc):
    """Another run took the node's fencing token while the stream ran (what a run that
    took the lock after this one's ZooKeeper session expired does): the backup fails
    before its manifest (BackupFailed, not complete, its object removed)."""
    from shardfleet.operations.runner import Journal, server_lock_name

    master, standby = roles(pair)
    fence = zk_store.ops_node("fence", server_lock_name(standby.address))

    def take_the_fence(_p: Any) -> None:
        raw, version = zk_store.read_raw(fence)
        if raw is not None and not getattr(take_the_fence, "done", False):
            zk_store.write_raw(fence, raw, version)
            take_the_fence.done = True  # type: ignore[attr-defined]

    try:
        with pytest.raises(BackupFailed, match="lost its lock.*no manifest"):
            take(s3, loc, standby, store=zk_store, progress=take_the_fence)
        assert keys(s3, loc) == [] and pending_uploads(s3, loc) == []
        assert backup.list_backups(s3, loc) == []
    finally:
        for d in _journals_of(zk_store, "backup"):  # left at its step: the fence moved
            j = Journal(zk_store, d["name"])
            j.load()
            j.delete()


@pytest.fixture
def killed_backup(pair, zk_store, s3, loc, monkeypatch) -> Iterator[str]:
    """What a backup process SIGKILLed mid-stream leaves: its journal at ``stream``
    (unfinished; its process never wrote ``failed``) and no lock (its session gone). The
    journal's name."""
    from shardfleet.operations import backup as op_backup

    master, standby = roles(pair)

    def killed(_p: Any) -> None:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(op_backup, "_journal_failure", lambda journal, exc: None)
    with pytest.raises(KeyboardInterrupt):
        take(s3, loc, standby, store=zk_store, progress=killed)
    monkeypatch.undo()
    (j,) = _journals_of(zk_store, "backup")
    assert not j["done"] and j["step"] == "check" and j["in_flight_while_locked"], j
    yield j["name"]


def test_a_killed_backups_rerun_takes_its_journal_over_and_finishes_it(
        pair, zk_store, s3, loc, killed_backup):
    from shardfleet.operations.runner import in_flight

    master, standby = roles(pair)
    m = take(s3, loc, standby, store=zk_store)
    (j,) = _journals_of(zk_store, "backup")
    assert j["done"] and j["backup_id"] == m["backup_id"] and in_flight(zk_store) == []


def test_a_killed_backups_journal_does_not_block_a_rebuild(pair, zk_store, s3, loc,
                                                           killed_backup):
    from shardfleet.operations.runner import Runner, in_flight, servers_lock

    master, standby = roles(pair)
    try:
        # in flight while the node's lock has a holder (a live backup), not after
        with servers_lock(zk_store, [standby.address], identifier=killed_backup):
            assert [op.name for op in in_flight(zk_store)] == [killed_backup]
        assert in_flight(zk_store) == []
        with Runner(zk_store, "rebuild-" + tp.PAIR, [master.address, standby.address],
                    kind="rebuild", lock_timeout=0.5).held():
            pass
    finally:
        take(s3, loc, standby, store=zk_store)  # finishes the journal for the next test


def test_a_restore_of_a_manifest_missing_fields_is_refused_before_it_starts(
        pair, zk_store, s3, loc, fresh):
    """A manifest without what a restore reads (hand-written, another version's, a
    mutated one) is refused before the journal starts: no KeyError half-way, nothing in
    flight, the target untouched."""
    from shardfleet.operations.runner import in_flight

    master, standby = roles(pair)
    m = take(s3, loc, standby)
    key = loc.key(m["backup_id"], "manifest.json")
    body = json.loads(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    del body["checksums"]
    s3.put_object(Bucket=loc.bucket, Key=key, Body=json.dumps(body).encode())
    marker(fresh)
    with pytest.raises(RestoreRefused, match=r"manifest.*checksums.*nothing was changed"):
        backup.restore(s3, loc, datadir=str(fresh.datadir), stop=fresh.stop,
                       start=fresh.start, connect=fresh.connect, store=zk_store,
                       node=fresh.address)
    assert fresh.running and fresh.sql("SHOW DATABASES LIKE 'sf_marker'")
    assert in_flight(zk_store) == [] and _journals_of(zk_store, "restore") == []
