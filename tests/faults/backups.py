"""The backup seam in the fault campaign: a backup of a pair's standby (what backup.yml runs)
and a restore of the pair's newest complete backup into a scratch server, each in its own
process (``op.py``), started beside a rebuild of that standby or a split onto that pair at
instants drawn from the run's seed; and their checker.

Per worker (one pytest process) a :class:`Shelf`: moto's S3 server on 127.0.0.1, one
bucket, a scratch server (read-only, no replication: a spare node to restore onto), and a
record of every backup the campaign started (its id is the campaign's): the run's seed,
the outcome of its process, and the row counts its copy must hold at least (the shard
tables of the pair as they were before the operation started: rows are never deleted
there, and whatever a correct rebuild or split leaves on the standby holds them).

The checker (:meth:`Beside.check`, every run; :meth:`Shelf.final_problems`, once per
pair at the end of a worker's campaign):

* a backup refused (the node marked for rebuild, not named as a standby, held by an
  operation) or failed is never listed as complete; a backup that returned is;
* the newest complete backup is from the pair's standby, healthy when taken, and its
  object is there with the manifest's size;
* a restore of the newest complete backup (beside the operation, and once per pair at
  the end) restores and verifies (the library's checksum step), and the restored copy
  holds every shard database and table of the pair with at least the rows they had
  before the operation (a backup of a half-rebuilt or half-cloned node does not);
* a backup process killed, or failed, is rerun after the operation's recovery (the
  runbook: run backup.yml again) and the rerun completes: nothing is wedged.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfleet import backup as backup_lib
from shardfleet.testing import MariaDBServer
from shardfleet.testing.nemesis import OpProcess, expire_session
from tests.integration.s3_fixtures import REGION, moto_s3

from .campaign import OP_SCRIPT, Faults, Run, Scene, inject, oneline

CLUSTER = "faults"
# SHARDFLEET_FAULT_BREAK_BACKUPS: break what the checker checks, to see it fail (each must
# fail the campaign's backup runs; docs/faults.md):
#   corrupt       the newest complete backup's object gets one byte flipped (same size)
#   checksums     the newest complete backup's manifest gets one checksum changed
#   list_refused  a refused backup gets a manifest (listed as complete)
#   rows          a backup is recorded as having to hold one row more than the pair had
#   no_rerun      a killed or failed backup is not rerun (its journal is left in flight)
#   unlocked      the backup takes no lock and reads no map (nothing refuses a standby
#                 being rebuilt)
BREAK = os.environ.get("SHARDFLEET_FAULT_BREAK_BACKUPS", "")
REFUSED = ("Refused", "LockBusy", "OperationInFlight")
# the backup runs' faults: the operation's process SIGKILLed or its ZooKeeper session
# expired (the campaign's), the backup's process SIGKILLed, or only the mix itself; then
# the backup's ZooKeeper session expired, the restore's process SIGKILLed
FAULTS_1 = ("kill", "session_expiry", "kill_backup", "beside")
FAULTS = FAULTS_1 + ("expire_backup", "kill_restore")
# a backup of the promotion pair's standby (8 shards) takes about 1-2 s here; its kill
# lands within that
KILL_AFTER = (0.1, 1.5)


def backup_plan(run: Run, window: float) -> dict[str, Any]:
    """The run's draws: the campaign's (fault, instant, ...), then from a source of the
    backup's own the backup's instant (from half a second before the operation to the
    end of its window), the restore's, and how long after its start a killed
    backup is killed."""
    plan = run.draw(window)
    r = random.Random(f"{run.seed}-backup")
    plan["backup_at"] = round(r.uniform(-0.5, window), 3)
    plan["restore_at"] = round(r.uniform(0.0, window), 3)
    plan["kill_after"] = round(r.uniform(*KILL_AFTER), 3)
    return plan


def fault_or_wait(run: Run, proc: OpProcess, plan: dict[str, Any], scene: Scene,
                  faults: Faults) -> None:
    """The campaign's fault on the operation (``kill``, ``session_expiry``); for the
    backup's own (``kill_backup``, ``beside``: :class:`Beside` acts) wait for it ready."""
    if plan["fault"] in ("kill_backup", "beside", "expire_backup", "kill_restore"):
        if not proc.wait_ready(60):
            run.problems.append(f"the operation's process never became ready: "
                                f"{proc.lines[-5:]}")
        return
    inject(run, proc, plan, scene, faults)


def shard_counts(server: MariaDBServer, shards: list[int]) -> dict[str, int]:
    """``db.table`` -> rows, for every base table of *shards*' databases on *server*."""
    want = {f"db{s:05d}" for s in shards}
    conn = server.connect()
    try:
        out = {}
        with conn.cursor() as c:
            c.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                      "WHERE TABLE_SCHEMA LIKE 'db%%' AND TABLE_TYPE = 'BASE TABLE'")
            tables = [(db, t) for db, t in c.fetchall() if db in want]
            for db, t in sorted(tables):
                c.execute(f"SELECT COUNT(*) FROM `{db}`.`{t}`")
                out[f"{db}.{t}"] = int(c.fetchone()[0])
        return out
    finally:
        conn.close()


def content_problems(scratch: MariaDBServer, bid: str, at_least: dict[str, int],
                     shards: list[int]) -> list[str]:
    """The restored copy of *bid* on *scratch* holds every table of *at_least* with at least
    its rows."""
    have = shard_counts(scratch, shards)
    missing = sorted(set(at_least) - set(have))
    short = sorted(k for k, n in at_least.items() if k in have and have[k] < n)
    out = []
    if missing:
        out.append(f"the restored backup {bid} lacks {len(missing)} shard table(s) of the "
                   f"pair: {missing[:5]}")
    if short:
        out.append(f"the restored backup {bid} holds fewer rows than the pair had before "
                   f"the operation in {len(short)} table(s): "
                   + ", ".join(f"{k} {have[k]} < {at_least[k]}" for k in short[:5]))
    return out


@dataclass
class Record:
    """A backup the campaign started: its run, the outcome of its process, what its copy
    must hold (see the module docstring)."""

    bid: str
    seed: int
    node: str
    at_least: dict[str, int]
    shards: list[int]
    outcome: str = "running"        # ok | refused | failed | killed | running
    detail: str = ""


class Shelf:
    """One worker's S3 server, bucket and scratch server, and the records of its backups."""

    def __init__(self, s3_url: str, scratch: MariaDBServer) -> None:
        self.url, self.scratch = s3_url, scratch
        self.s3 = backup_lib.s3_client(endpoint_url=s3_url, region=REGION,
                                       access_key="testing", secret_key="testing")
        self.bucket = "sf-faults-" + os.urandom(4).hex()
        self.s3.create_bucket(Bucket=self.bucket)
        self.records: dict[str, Record] = {}
        self.pairs: dict[str, list[int]] = {}    # pair name -> its shards (final check)
        self.lock = threading.Lock()             # one restore onto the scratch at a time

    def loc(self, pair: str) -> backup_lib.Location:
        self.pairs.setdefault(pair, [])
        return backup_lib.Location(self.bucket, CLUSTER, pair)

    def spec(self, pair: str) -> dict[str, Any]:
        return {"url": self.url, "bucket": self.bucket, "cluster": CLUSTER, "pair": pair}

    def listed(self, pair: str) -> list[dict[str, Any]]:
        return backup_lib.list_backups(self.s3, self.loc(pair))

    def restore_checked(self, pair: str) -> tuple[str, list[str]]:
        """The newest complete backup of *pair* restored into the scratch server (in this
        process), verified, and its content checked: (summary, problems)."""
        listed = self.listed(pair)
        if not listed:
            return "no complete backup", []
        newest = listed[-1]
        bid = newest["backup_id"]
        with self.lock:
            try:
                r = backup_lib.restore(self.s3, self.loc(pair), datadir=str(self.scratch.datadir),
                                       stop=self.scratch.stop, start=self.scratch.start,
                                       connect=self.scratch.connect, backup_id=bid)
            except Exception as exc:  # noqa: BLE001 - reported as a problem
                return bid, [f"the newest complete backup {bid} of {pair} does not restore "
                             f"and verify: {oneline(exc)}"]
            return (f"{bid} verified={r.checksums_verified} {r.note}",
                    self.restored_problems(bid, r.checksums_verified, r.note))

    def restored_problems(self, bid: str, verified: int, note: str) -> list[str]:
        out = []
        if not verified:
            out.append(f"the restore of {bid} verified no checksum: {note}")
        rec = self.records.get(bid)
        if rec is None:
            out.append(f"the restored backup {bid} is none the campaign started")
        else:
            out += content_problems(self.scratch, bid, rec.at_least, rec.shards)
        return out

    def final_problems(self) -> list[str]:
        """Once per pair, at the end of the worker's campaign: its newest complete backup
        restores and verifies (and holds the pair's rows)."""
        out = []
        for pair in sorted(self.pairs):
            summary, problems = self.restore_checked(pair)
            print(f"\nbackups of {pair}: {len(self.listed(pair))} complete; the newest: "
                  f"{summary}")
            out += [f"{pair}: {p}" for p in problems]
        return out


@contextmanager
def shelf(base: Path) -> Iterator[Shelf]:
    base.mkdir(parents=True, exist_ok=True)
    scratch = MariaDBServer(base, server_id=61,
                            extra=["--innodb-file-per-table=0", "--read-only=ON"]).start()
    try:
        with moto_s3("127.0.0.1", base) as s3:
            yield Shelf(s3.url, scratch)
    finally:
        scratch.stop(remove=True)


def outcome_of(proc: OpProcess, rc: int | None) -> tuple[str, str]:
    res = proc.result
    if res.startswith("ok"):
        return "ok", res
    if rc is None or rc < 0 or not res:
        return "killed", res or f"rc={rc} {proc.lines[-3:]}"
    if any(k in res.split(":")[0] for k in REFUSED):
        return "refused", res
    return "failed", res


@dataclass
class Beside:
    """A backup of *node* and a restore of the pair's newest complete backup, started beside
    one run's operation at the instants of *plan* (``backup_at``, ``restore_at``: seconds
    after the operation's process is ready; a negative ``backup_at`` starts the backup that
    long before the operation, :meth:`early`), ``kill_backup`` SIGKILLing the backup
    ``kill_after`` seconds after it started."""

    run: Run
    plan: dict[str, Any]
    shelf: Shelf
    pair: str
    node: MariaDBServer
    zk: str
    cluster: str
    tmp: Path
    at_least: dict[str, int]
    shards: list[int]
    backups: list[tuple[str, OpProcess]] = field(default_factory=list)
    restore: OpProcess | None = None
    before: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.before = [m["backup_id"] for m in self.shelf.listed(self.pair)]

    def _backup(self, lock_timeout: float | None = None) -> OpProcess:
        bid = backup_lib.new_backup_id()
        at_least = dict(self.at_least)
        if BREAK == "rows" and at_least:
            first = sorted(at_least)[0]
            at_least[first] += 1
        with self.shelf.lock:
            self.shelf.records[bid] = Record(bid, self.run.seed, self.node.address,
                                             at_least, list(self.shards))
        self.shelf.pairs[self.pair] = list(self.shards)
        spec = {"op": "backup", "zk": self.zk, "cluster": self.cluster,
                "s3": self.shelf.spec(self.pair), "server": self.node.handle(),
                "backup_id": bid, "unlocked": BREAK == "unlocked",
                "lock_timeout": lock_timeout or self.plan.get("lock_timeout")}
        n = len(self.backups)
        proc = OpProcess(OP_SCRIPT, spec, self.tmp / f"backup{n}.log")
        self.backups.append((bid, proc))
        self.run.schedule.note("backup started", backup_id=bid, node=self.node.address)
        return proc

    def early(self) -> None:
        """A backup started before the operation (negative ``backup_at``): started now, and
        the operation that long after."""
        if self.plan["backup_at"] < 0:
            self._backup()
            time.sleep(-self.plan["backup_at"])

    def start(self, op: OpProcess) -> None:
        self.thread = threading.Thread(target=self._beside, args=(op,), daemon=True,
                                       name="sf-backup-beside")
        self.thread.start()

    def _beside(self, op: OpProcess) -> None:
        if not op.wait_ready(60):
            return
        events = [(self.plan["restore_at"], "restore")]
        if self.plan["backup_at"] >= 0:
            events.append((self.plan["backup_at"], "backup"))
        fault = self.plan["fault"]
        if fault in ("kill_backup", "expire_backup"):
            events.append((max(0.0, self.plan["backup_at"]) + self.plan["kill_after"], fault))
        if fault == "kill_restore":
            events.append((self.plan["restore_at"] + self.plan["kill_after"], fault))
        for at, what in sorted(events):
            end = op.ready_at + at
            while time.monotonic() < end:  # bounded by the plan's instants
                time.sleep(0.005)
            if what == "backup":
                self._backup()
            elif what == "restore":
                self.restore = self._restore()
                self.run.schedule.note("restore started", at=at, op_running=op.running)
            elif what == "kill_restore" and self.restore is not None:
                self.run.schedule.note("restore SIGKILLed", at=at, killed=self.restore.kill(),
                                       op_running=op.running)
            elif what == "kill_backup" and self.backups:
                _, proc = self.backups[0]
                self.run.schedule.note("backup SIGKILLed", at=at, killed=proc.kill(),
                                       op_running=op.running)
            elif what == "expire_backup" and self.backups:
                self._expire(self.backups[0][1], at)

    def _restore(self, lock_timeout: float | None = None, n: int = 0) -> OpProcess:
        return OpProcess(OP_SCRIPT, {
            "op": "restore", "zk": self.zk, "cluster": self.cluster,
            "s3": self.shelf.spec(self.pair), "server": self.shelf.scratch.handle(),
            "lock_timeout": lock_timeout}, self.tmp / f"restore{n or ''}.log")

    def _expire(self, proc: OpProcess, at: float) -> None:
        """The backup's ZooKeeper session expired (as the campaign's session_expiry)."""
        if proc.session is None or not proc.running:
            self.run.schedule.note("backup not running at the expiry's instant", at=at)
            return
        try:
            expire_session(self.zk, proc.session)
            self.run.schedule.note("backup's ZooKeeper session expired", at=at,
                                   session=f"{proc.session[0]:#x}", running=proc.running)
        except Exception as exc:  # noqa: BLE001 - SessionGone: it was ending
            self.run.schedule.note("backup's session not expired", at=at, error=oneline(exc),
                                   running=proc.running)

    def stop(self) -> None:
        """On the way out of a run that raised: no process of this run left running."""
        if self.thread is not None:
            self.thread.join(120)
        for _, proc in self.backups:
            proc.kill()
        if self.restore is not None:
            self.restore.kill()

    def finish(self) -> None:
        """After the operation's recovery (the writer still writing): the backup and restore
        processes waited for (bounded), judged; a killed or failed backup rerun (backup.yml
        again, up to three times while refused) and its rerun must complete."""
        if self.thread is not None:
            self.thread.join(120)
        for bid, proc in list(self.backups):
            self._judge(bid, proc)
        if self.restore is not None:
            self._rerun_restore(self._judge_restore(self.restore))
        first = self.shelf.records[self.backups[0][0]] if self.backups else None
        if first is None or first.outcome not in ("killed", "failed") or BREAK == "no_rerun":
            return
        # the rerun waits for the node's lock (a killed backup's session holds it until
        # ZooKeeper expires it); refused again: wait and rerun. Bounded: five, a minute.
        bid = ""
        deadline = time.monotonic() + 60
        for _ in range(5):
            proc = self._backup(lock_timeout=20.0)
            bid = self.backups[-1][0]
            self._judge(bid, proc)
            rec = self.shelf.records[bid]
            if rec.outcome == "ok":
                return
            if rec.outcome != "refused" or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        self.run.problems.append(f"wedged: the backup rerun after a {first.outcome} backup "
                                 f"did not complete: {self.shelf.records[bid].detail}")

    def _judge(self, bid: str, proc: OpProcess) -> None:
        rc = proc.wait(180)
        rec = self.shelf.records[bid]
        rec.outcome, rec.detail = outcome_of(proc, rc)
        self.run.schedule.note("backup ended", backup_id=bid, outcome=rec.outcome,
                               result=rec.detail)
        if BREAK == "list_refused" and rec.outcome == "refused":
            self._list_anyway(bid)

    def _rerun_restore(self, killed: bool) -> None:
        """A killed restore rerun (the same command) until it finishes: it must, and what it
        restored is checked. Bounded: three reruns, each waiting up to 20 s for the lock the
        killed one's session held."""
        for n in range(1, 4):
            if not killed or BREAK == "no_rerun":
                return
            self.run.schedule.note("restore rerun", n=n)
            killed = self._judge_restore(self._restore(lock_timeout=20.0, n=n), rerun=True)
        self.run.problems.append("wedged: the killed restore's reruns did not finish it")

    def _judge_restore(self, proc: OpProcess, rerun: bool = False) -> bool:
        """The restore's outcome judged; True when it was killed (no result: rerun it)."""
        rc = proc.wait(180)
        res = proc.result
        self.run.schedule.note("restore ended", rc=rc, result=res or proc.lines[-3:])
        if not res and (rc is None or rc < 0):
            return True
        if rerun and "another operation holds" in res:
            return True  # the killed one's lock, not yet expired: rerun again
        if res.startswith("ok"):
            bid = res.split()[2]
            verified = int(res.split("verified=")[1].split()[0])
            note = res.split("note=", 1)[1] if "note=" in res else ""
            with self.shelf.lock:
                self.run.problems += self.shelf.restored_problems(bid, verified, note)
        elif "no complete backup" in res and not self.before:
            pass  # nothing complete yet when it started (this worker's first runs)
        else:
            self.run.problems.append(f"the restore of the newest complete backup beside the "
                                     f"operation failed: {res or proc.lines[-3:]}")
        return False

    def _list_anyway(self, bid: str) -> None:
        """SHARDFLEET_FAULT_BREAK_BACKUPS=list_refused: a manifest written for a refused
        backup (what a library that lists refused backups as complete would leave)."""
        import json

        loc = self.shelf.loc(self.pair)
        self.shelf.s3.put_object(Bucket=loc.bucket, Key=loc.key(bid, backup_lib.MANIFEST),
                                 Body=json.dumps({"backup_id": bid, "node": self.node.address,
                                                  "refused": True}).encode())

    def check(self) -> None:
        """The listing after the run (see the module docstring); with
        SHARDFLEET_FAULT_BREAK_BACKUPS=corrupt the newest object is corrupted first."""
        listed = self.shelf.listed(self.pair)
        ids = [m["backup_id"] for m in listed]
        mine = {bid for bid, _ in self.backups}
        for bid in mine:
            rec = self.shelf.records[bid]
            # a run that lost its lock after the manifest was written is complete (what it
            # restores is checked like any other's)
            if rec.outcome in ("refused", "failed") and bid in ids \
                    and "LockLost" not in rec.detail:
                self.run.problems.append(f"the {rec.outcome} backup {bid} is listed as "
                                         f"complete ({rec.detail})")
            if rec.outcome == "ok" and bid not in ids:
                self.run.problems.append(f"the backup {bid} returned but is not listed "
                                         f"as complete")
        unknown = [b for b in ids if b not in self.before and b not in mine]
        if unknown:
            self.run.problems.append(f"complete backups no process of this run took: {unknown}")
        if not listed:
            self.prune()
            return
        newest = listed[-1]
        self.run.schedule.note("backups listed", complete=len(ids), newest=newest["backup_id"],
                               this_run=sorted(set(ids) & mine))
        # from the standby this run backed up when this run took it (an earlier run's may be
        # of servers since replaced), and from a healthy standby whoever took it
        if (newest["backup_id"] in mine and newest.get("node") != self.node.address) \
                or not newest.get("from_healthy_standby"):
            self.run.problems.append(f"the newest complete backup {newest['backup_id']} is not "
                                     f"from the healthy standby {self.node.address}: node "
                                     f"{newest.get('node')}, source {newest.get('source')}")
        if BREAK == "corrupt" and newest["backup_id"] in mine:
            self._corrupt(newest)
        if BREAK == "checksums" and newest["backup_id"] in mine and newest.get("checksums"):
            self._change_a_checksum(newest)
        try:
            head = self.shelf.s3.head_object(Bucket=self.shelf.bucket, Key=newest["object"])
            if head["ContentLength"] != newest["bytes"]:
                self.run.problems.append(f"the newest backup's object has "
                                         f"{head['ContentLength']} bytes, its manifest says "
                                         f"{newest['bytes']}")
        except Exception as exc:  # noqa: BLE001 - reported
            self.run.problems.append(f"the newest backup's object is not there: {oneline(exc)}")
        self.prune()

    def prune(self) -> None:
        """moto keeps every object in memory: the library's retention keeps the pair's two
        newest complete backups and aborts the killed ones' pending uploads (no process of
        the run is running now: every upload is stale)."""
        if BREAK:
            return  # the broken manifests are none retention knows
        try:
            out = backup_lib.retention(self.shelf.s3, self.shelf.loc(self.pair), keep_count=2,
                                       stale_hours=0)
            self.run.schedule.note("retention", **{k: len(v) for k, v in out.items()
                                                   if isinstance(v, list)})
        except Exception as exc:  # noqa: BLE001 - reported
            self.run.problems.append(f"retention of {self.pair}'s backups failed: "
                                     f"{oneline(exc)}")

    def _corrupt(self, manifest: dict[str, Any]) -> None:
        """SHARDFLEET_FAULT_BREAK_BACKUPS=corrupt: one byte of the object flipped (same size:
        only a restore's sha256 sees it)."""
        body = bytearray(self.shelf.s3.get_object(Bucket=self.shelf.bucket,
                                                  Key=manifest["object"])["Body"].read())
        body[len(body) // 2] ^= 0xFF
        self.shelf.s3.put_object(Bucket=self.shelf.bucket, Key=manifest["object"],
                                 Body=bytes(body))
        self.run.schedule.note("corrupted (SHARDFLEET_FAULT_BREAK_BACKUPS)",
                               object=manifest["object"])


    def _change_a_checksum(self, manifest: dict[str, Any]) -> None:
        """SHARDFLEET_FAULT_BREAK_BACKUPS=checksums: one table's checksum in the manifest
        changed (the object intact: only the restore's verify step sees it)."""
        import json

        m = json.loads(json.dumps(manifest))
        db = sorted(m["checksums"])[0]
        table = sorted(m["checksums"][db])[0]
        m["checksums"][db][table] = (m["checksums"][db][table] or 0) + 1
        loc = self.shelf.loc(self.pair)
        self.shelf.s3.put_object(Bucket=loc.bucket, Key=loc.key(m["backup_id"],
                                                                backup_lib.MANIFEST),
                                 Body=json.dumps(m).encode())
        self.run.schedule.note("a checksum changed (SHARDFLEET_FAULT_BREAK_BACKUPS)",
                               table=f"{db}.{table}")


__all__ = ["FAULTS", "Beside", "Record", "Shelf", "backup_plan", "content_problems",
           "fault_or_wait", "shard_counts", "shelf"]
