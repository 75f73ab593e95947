"""Backups and a point-in-time restore on the container fleet (the name sorts after the
split tests, whose end state it backs up, on the fleet `make e2e` gives them).

S3 is moto's server, on this machine, listening on the e2e fleet network's gateway
address only (the containers reach it there; the data goes node to S3 and back, never
through the control node). On a pair the map gives a standby:

1. ``backup.yml -e pair=...`` under a writer: the map's standby is backed up (never the
   master), the master's binary logs archived; the manifest is in S3;
2. the writer stops; every shard's checksum on the master is the point in time, its
   GTID position the stop; one more write after it; ``backup.yml -e
   backup_binlogs_only=true`` archives the logs past the point;
3. ``fleet-add.yml`` makes two fresh containers (the mysql role, in no range), and
   ``restore.yml`` restores the backup onto them and replays the archived logs to the
   stop: every shard's checksum equals the master's at the point on both, every write
   acknowledged before it is there, the one after it is not, both read-only.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from shardfleet import ids
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardRange
from shardfleet.store import Store
from shardfleet.testing.kit import Writer
from tests.integration.s3_fixtures import KEYS, S3

from .conftest import E2E_TLS, PREFIX_TO, REPO, Fleet
from .test_zz_promote import _admin, _check_acked, _one
from .test_zz_split import _play as _play_on
from .test_zzz_promote_faults import _read_only, _zk

pytestmark = pytest.mark.e2e
FRESH_PAIR = "pair006"  # after the split test's pair003-pair005


def _checksums(fleet: Fleet, server: str, shards: list[int]) -> dict[str, int]:
    """CHECKSUM TABLE of every shard table of *shards* on *server*."""
    conn = _admin(fleet, server, timeout=10)
    try:
        with conn.cursor() as c:
            c.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                      "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")
            mine = {f"db{s:05d}" for s in shards}
            tables = sorted(f"{d}.{t}" for d, t in c.fetchall() if d in mine)
            assert tables, f"{server} holds no table of its shards"
            out: dict[str, int] = {}
            for i in range(0, len(tables), 256):
                c.execute("CHECKSUM TABLE " + ", ".join(tables[i:i + 256]))
                out.update({str(t): int(v or 0) for t, v in c.fetchall()})
            return out
    finally:
        conn.close()


def flat(out: str) -> str:
    """The output with its line breaks gone (the yaml result format folds long lines)."""
    return " ".join(out.split())


def _play(fleet: Fleet, inventory: Path, playbook: str, *args: str) -> tuple[int, str]:
    """test_zz_split's run of a playbook on *inventory*; no password in its output."""
    rc, out, _ = _play_on(fleet, inventory, REPO / "playbooks" / playbook, *args)
    for secret in fleet.secrets.values():
        assert secret not in out, f"a password reached {playbook}'s output"
    return rc, out


def test_a_standby_backup_restores_to_a_point_in_time_onto_fresh_containers(
        fleet: Fleet, s3: S3, tmp_path: Path) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"
    zk = _zk(fleet)
    mapstore = ZooKeeperMapStore(zk, "default")
    try:
        m = mapstore.read().map
    finally:
        mapstore.close()
    assert m is not None
    by_ip = {f"{fleet.ip(h)}:3306": fleet.hosts[h]["shardfleet_pair"]
             for h in fleet.group("mysql")}
    ranges: dict[str, list[ShardRange]] = {}
    for r in m.ranges:
        if r.standby and by_ip.get(r.master) and by_ip.get(r.master) == by_ip.get(r.standby):
            ranges.setdefault(by_ip[r.master], []).append(r)
    pair = next((p for p in ("pair002", "pair001") if p in ranges), None)
    assert pair, "no pair of the inventory has a standby in the map: " + "; ".join(
        r.describe() for r in m.ranges)
    master, standby = ranges[pair][0].master, ranges[pair][0].standby
    assert standby is not None
    shards = sorted(s for r in ranges[pair] for s in range(r.first, r.last + 1))

    bucket = "sf-e2e-backups"
    s3.client().create_bucket(Bucket=bucket)
    s3_args = ["-e", f"backup_s3_bucket={bucket}", "-e", f"backup_s3_endpoint_url={s3.url}",
               "-e", f"backup_s3_access_key={KEYS['AWS_ACCESS_KEY_ID']}",
               "-e", f"backup_s3_secret_key={KEYS['AWS_SECRET_ACCESS_KEY']}", "-e", f"pair={pair}"]
    report: list[str] = []

    # -- 1. the standby's backup, under a writer ------------------------------------------
    router = Router(ZooKeeperMapStore(zk, "default"), user="shardfleet_app",
                    password=fleet.secrets["vault_mysql_app_password"], frozen_wait=15.0,
                    connect_timeout=2, read_timeout=10, tls=E2E_TLS)
    store = Store(router)
    writes = random.Random(6).sample(shards, 16)
    w = Writer(store, writes, threads=2, seconds=600, max_ops=50_000, pause=0.01).start()
    try:
        assert w.wait_acks(100, timeout=120), f"writer made no progress\n{w.status()}"
        t0 = time.monotonic()
        rc, out = _play(fleet, fleet.inventory, "backup.yml", *s3_args)
        seconds = time.monotonic() - t0
        assert rc == 0, out[-4000:]
        assert w.wait_acks(100, timeout=120), f"writer did not go on\n{w.status()}"
    finally:
        w.stop()
        store.close()
        router.close()
    assert w.errors == [], f"the backup disturbed the writer: {w.errors[:3]}"
    made = re.search(rf"{pair}: backup (\S+) of (\S+) at (\S+), (\d+) bytes in ([\d.]+)s",
                     flat(out))
    assert made, out[-4000:]
    backup_id, node = made.group(1), made.group(2)
    assert node == standby, f"backed up {node}, the map's standby is {standby}"
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.endswith(f"/{backup_id}/manifest.json") for k in keys), keys
    assert any("/binlogs/" in k for k in keys), f"the master's binlogs not archived: {keys}"
    report.append(f"backup.yml {seconds:.1f}s ({made.group(4)} bytes, mariadb-backup "
                  f"{made.group(5)}s), {len(w.acked)} writes acknowledged beside it, 0 errors")

    # -- 2. the point in time, one write after it, the logs archived ----------------------
    acked = w.acked
    at_point = _checksums(fleet, master, shards)
    conn = _admin(fleet, master)
    try:
        stop = str(_one(conn, "SELECT @@GLOBAL.gtid_binlog_pos"))
        with conn.cursor() as c:
            c.execute(f"INSERT INTO db{shards[0]:05d}.pins (body) VALUES "
                      "('{\"after the point\": true}')")
            after = c.lastrowid
    finally:
        conn.close()
    rc, out = _play(fleet, fleet.inventory, "backup.yml", *s3_args,
                    "-e", "backup_binlogs_only=true")
    assert rc == 0, out[-4000:]

    # -- 3. two fresh containers, the restore to the point --------------------------------
    inv = tmp_path / "inventory"
    shutil.copytree(fleet.inventory, inv)
    rc, out = _play(fleet, inv, "fleet-add.yml", "-e", f"pair={FRESH_PAIR}")
    assert rc == 0, f"fleet-add.yml failed:\n{out[-3000:]}"
    added = yaml.safe_load((inv / "added-pairs.yml").read_text())
    fresh = {h: v for h, v in added["all"]["children"]["fleet"]["children"]["mysql"]["hosts"]
             .items() if v["shardfleet_pair"] == FRESH_PAIR}
    assert sorted(fresh) == [f"{PREFIX_TO}mysql006a", f"{PREFIX_TO}mysql006b"], fresh
    t0 = time.monotonic()
    rc, out = _play(fleet, inv, "restore.yml", *s3_args, "-e", f"restore_hosts={','.join(fresh)}",
                    "-e", f"restore_stop_gtid={stop}", "-e", f"restore_binlog_node={master}")
    seconds = time.monotonic() - t0
    assert rc == 0, out[-4000:]
    assert flat(out).count(f"backup {backup_id} restored") == 2, out[-4000:]
    report.append(f"restore.yml onto 2 fresh containers, replayed to {stop}: {seconds:.1f}s")
    for host, hv in fresh.items():
        server = f"{hv['shardfleet_container_ip']}:3306"
        assert _read_only(fleet, server) == 1, f"{host} is writable"
        got = _checksums(fleet, server, shards)
        differ = sorted(t for t in at_point if got.get(t) != at_point[t])
        assert not differ and set(got) == set(at_point), \
            f"{host}: {len(differ)} of {len(at_point)} tables differ from the point: {differ[:5]}"
        _check_acked(fleet, server, acked)
        conn = _admin(fleet, server)
        try:
            with conn.cursor() as c:
                c.execute(f"SELECT COUNT(*) FROM db{shards[0]:05d}.pins WHERE local_id = %s",
                          (after,))
                assert c.fetchone()[0] == 0, f"{host}: the write after the point was replayed"
        finally:
            conn.close()
    # the master was never backed up, and still serves
    assert _read_only(fleet, master) == 0
    assert ids.shard_of(acked[0]) in shards
    print("\n" + "\n".join(report))
