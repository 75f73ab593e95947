"""Backups of a pair's standby to S3, on the operation runner.

A backup is ``mariadb-backup --backup --stream=mbstream`` (backup locks: the node keeps
serving and replicating) read by this process, optionally compressed with zstd, and
uploaded as one object with S3 multipart upload (server-side encryption ``AES256``);
nothing of it is written to the node's disk. Where it goes and what makes it exist (the
manifest, written last) is :mod:`shardfleet.storage`'s.

The manifest records the backup's GTID position (read from the stream's own
``xtrabackup_binlog_info`` by a small mbstream parser the bytes pass through, no second
copy), the object's byte count and sha256, and per-shard checksums.

Checksums at the backup's position: ``mariadb-backup`` holds ``BACKUP STAGE
BLOCK_COMMIT`` while it copies the non-InnoDB files and writes the binlog info, so the
node commits nothing in that window. When the parser sees the first non-InnoDB file in
the stream, a side connection opens a consistent snapshot
(:func:`shardfleet.topology.open_consistent_snapshot`) and reads its binlog coordinates.
When they equal the backup's own (the snapshot was taken inside the window), ``CHECKSUM
TABLE`` of every shard table runs in that snapshot after the stream ended, while
replication goes on; replication is never stopped by the backup. When they differ the
manifest says so (``checksums_at_position: false``, the reason in ``checksums_note``).

On the runner (*store* given): the backup holds the server lock of the node it copies
for its whole run, so a rebuild, split or promotion of that pair (which lock the same
servers) cannot run beside it, and a backup beside a held lock or an unfinished
operation on the node is refused (:class:`BackupRefused`) with nothing uploaded. Its
journal (``backup-<node>``, kind ``backup``) is in the registry of operations in flight
from the moment the node passed its check until the manifest is written
(``manifest``) or the backup failed (``failed``: nothing complete was left in S3; a
backup that lost its lock before the manifest, as a run whose session expired, fails
so and removes its object: the node may have changed under another run). A
backup process killed outright leaves its journal in flight: the next backup of the
node takes it over (or ``shardfleet ops`` shows it). Without a store the backup takes
no lock (a library caller's choice; the module needs ``zookeeper_hosts`` or an explicit
``unlocked``), and its manifest says ``locked: false``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardfleet import physical, replication, topology
from shardfleet.errors import ShardfleetError
from shardfleet.operations.runner import (
    Journal,
    LockLost,
    Runner,
    Step,
    StepResult,
)
from shardfleet.shardmap import ShardMap, from_obj
from shardfleet.storage import (
    DEFAULT_PART_SIZE,
    FORMAT,
    MIN_PART_SIZE,
    SSE,
    BackupFailed,
    BackupRefused,
    Location,
    Progress,
    StreamWatcher,
    Upload,
    binlog_info,
    discard,
    new_backup_id,
    now_iso,
    stream_upload,
    write_manifest,
)

log = logging.getLogger(__name__)

# A standby further behind than this is not backed up (what it received but did not apply,
# by GTID; and its own Seconds_Behind_Master): a backup is only as fresh as its source.
MAX_LAG_TRX = 10_000
MAX_LAG_SECONDS = 300
# the journal's steps after which a backup is no longer in flight
FINISHED = ("manifest", "failed")


def journal_name(node: str) -> str:
    """The journal of the backups of *node* (one per node, reused by its next backup)."""
    return "backup-" + node.replace("/", "_")



@dataclass
class SourceHealth:
    """What :func:`check_source` found about a node to back up. ``healthy``: it may be
    backed up; ``reasons`` why not (empty when healthy)."""

    node: str
    healthy: bool
    role: str                    # "standby" (read-only) or "master" (writable)
    rebuild: bool = False        # the map marks it for rebuild
    reasons: list[str] = field(default_factory=list)
    channels: list[dict[str, Any]] = field(default_factory=list)
    checked: str = ""

    @property
    def healthy_standby(self) -> bool:
        return self.healthy and self.role == "standby"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "healthy": self.healthy, "role": self.role,
                "rebuild": self.rebuild, "reasons": list(self.reasons),
                "channels": list(self.channels), "checked": self.checked}


class _Snapshot:
    """A side connection that opens a consistent snapshot when told to (from the
    stream's thread) and remembers the snapshot's binlog coordinates and the shard
    databases then (DDL is blocked by the backup)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.coords: tuple[str, int] | None = None
        self.dbs: list[str] = []
        self.error = ""
        self.at_file = ""

    def open(self, path: str) -> None:
        self.at_file = path
        try:
            self.coords, self.dbs = topology.open_consistent_snapshot(self.conn)
        except Exception as exc:  # noqa: BLE001 - recorded, the backup goes on
            self.error = f"snapshot failed: {exc}"


# -- the source's health ---------------------------------------------------------------------

def _as_map(shard_map: ShardMap | dict[str, Any] | None) -> ShardMap | None:
    if shard_map is None or isinstance(shard_map, ShardMap):
        return shard_map
    return from_obj(shard_map)


def map_problems(shard_map: ShardMap | dict[str, Any] | None, node: str, *,
                 allow_master: bool = False) -> tuple[bool, list[str]]:
    """(marked for rebuild, reasons) for backing up *node* by the map: the map marks it
    ``rebuild`` (an emergency promotion left it as the standby; its data diverged), or the
    map does not name it as a standby (as a master only with *allow_master*)."""
    m = _as_map(shard_map)
    if m is None:
        return False, []
    marked = any(r.extra.get("rebuild") == node for r in m.ranges)
    reasons = []
    if marked:
        reasons.append(f"{node} is marked for rebuild in the map (an emergency promotion "
                       "left it behind; its data diverged): rebuild it first "
                       "(playbooks/rebuild-standby.yml), then back it up")
    standby_of = [r for r in m.ranges if r.standby == node]
    master_of = [r for r in m.ranges if r.master == node]
    if not standby_of and not (allow_master and master_of):
        reasons.append(f"the map does not name {node} as the standby of any range")
    return marked, reasons


def channel_problems(channels: list[dict[str, Any]], *, max_lag_seconds: float,
                     max_lag_trx: int) -> list[str]:
    """Why a standby with these replication channels (:class:`topology.ReplicaChannel` as
    dicts, ``trx_behind`` when known) is not healthy: none; a channel whose IO or SQL
    thread is not running; one further behind than the bounds."""
    if not channels:
        return ["it has no replication channel (it replicates from nobody)"]
    out = []
    for ch in channels:
        name = f"channel {ch.get('connection')!r}" if ch.get("connection") else "its channel"
        io, sql = ch.get("io_running") or "?", ch.get("sql_running") or "?"
        if io != "Yes" or sql != "Yes":
            err = f": {ch['last_error']}" if ch.get("last_error") else ""
            out.append(f"replication is stopped on {name} from {ch.get('source')} "
                       f"(IO thread {io}, SQL thread {sql}){err}")
            continue
        behind = ch.get("seconds_behind")
        if behind is not None and float(behind) > max_lag_seconds:
            out.append(f"{name} is {behind} s behind its master (bound {max_lag_seconds:g} s)")
        trx = ch.get("trx_behind")
        if trx is not None and int(trx) > max_lag_trx:
            out.append(f"{name} is {trx} transactions behind its master (bound {max_lag_trx})")
    return out


def _received_not_applied(channel: topology.ReplicaChannel, applied: str) -> int | None:
    """Transactions *channel* received (``Gtid_IO_Pos``) that the server has not applied
    (*applied*: ``gtid_current_pos``), summed over the channel's domains."""
    try:
        got = replication.parse_gtids(channel.gtid_io_pos)
        have = replication.parse_gtids(applied)
    except ShardfleetError:
        return None
    return sum(max(0, seq - have.get(d, (0, 0))[1]) for d, (_, seq) in got.items())


def check_source(conn: Any, node: str, *, shard_map: ShardMap | dict[str, Any] | None = None,
                 allow_master: bool = False, max_lag_seconds: float = MAX_LAG_SECONDS,
                 max_lag_trx: int = MAX_LAG_TRX) -> SourceHealth:
    """Whether *node* (*conn* an admin connection to it) may be backed up: a read-only
    node the map (when given) names as a standby and does not mark for rebuild, every
    replication channel's IO and SQL threads running, no further behind than the bounds
    (transactions received but not applied, by GTID; ``Seconds_Behind_Master``). A
    writable node is a master: healthy only with *allow_master* (and then not checked
    as a replica). Replication state is read through :mod:`shardfleet.topology`."""
    ro = replication.is_read_only(conn)
    role = "standby" if ro else "master"
    marked, reasons = map_problems(shard_map, node, allow_master=allow_master)
    channels: list[dict[str, Any]] = []
    if not ro and not allow_master:
        reasons.insert(0, f"{node} is writable (read_only=OFF): it is a master. Back up the "
                          "pair's standby, or pass allow_master")
    elif ro:
        applied = replication.gtid_applied(conn)
        for ch in topology.replica_channels(conn, topology.server_dialect(conn)):
            d = {k: getattr(ch, k) for k in ("connection", "source", "io_running",
                                             "sql_running", "seconds_behind", "last_error")}
            d["trx_behind"] = _received_not_applied(ch, applied)
            channels.append(d)
        reasons += channel_problems(channels, max_lag_seconds=max_lag_seconds,
                                    max_lag_trx=max_lag_trx)
    return SourceHealth(node=node, healthy=not reasons, role=role, rebuild=marked,
                        reasons=reasons, channels=channels, checked=now_iso())


def plan(report: dict[str, Any], *, pair: str = "", max_lag_seconds: float = MAX_LAG_SECONDS,
         max_lag_trx: int = MAX_LAG_TRX) -> dict[str, Any]:
    """Which node of each pair to back up, from a fleet report (``shard_info`` /
    :func:`shardfleet.status.collect`: the map's pairs and every server's state, read from
    the control node): ``{"backup": [standby, ...], "skipped": [{pair, master, standby,
    reasons}]}``. A pair is skipped when its map entry has no standby or the standby is
    not healthy by :func:`map_problems` and :func:`channel_problems` (the backup itself
    checks the node again, on the node, before it starts). *pair*: only the pair of that
    name (the report's labels)."""
    m = report.get("map")
    out: dict[str, Any] = {"backup": [], "skipped": []}
    for p in report.get("pairs") or []:
        if pair and p.get("name") != pair:
            continue
        standby = p.get("standby")
        entry = {"pair": p.get("name"), "master": p.get("master"), "standby": standby}
        if not standby:
            reasons = ["the map names no standby (rebuild one first: "
                       "playbooks/rebuild-standby.yml)"]
        else:
            reasons = map_problems(m, standby)[1]
            st = p.get("standby_state") or {}
            if not st.get("reachable"):
                reasons.append(f"{standby} does not answer: {st.get('error') or 'no state'}")
            elif not st.get("read_only"):
                reasons.append(f"{standby} is writable (read_only=OFF)")
            else:
                chans = [dict(c, trx_behind=c.get("trx_behind")) for c in st.get("replicas") or []]
                reasons += channel_problems(chans, max_lag_seconds=max_lag_seconds,
                                            max_lag_trx=max_lag_trx)
        if reasons:
            out["skipped"].append(dict(entry, reasons=reasons))
        elif standby not in out["backup"]:
            out["backup"].append(standby)
    return out



# -- the backup: a step table on the runner --------------------------------------------------

@dataclass
class _Backup:
    """One backup's inputs, and what its steps found (the next step reads them)."""

    s3: Any
    loc: Location
    argv: list[str]
    node: str
    bid: str
    compress: bool
    part_size: int
    checksums: bool
    progress: Callable[[Progress], None] | None
    limits: dict[str, Any]
    locked: bool
    journal: Journal | None = None
    conn: Any = None
    begun: bool = False
    health: SourceHealth | None = None
    version: str = ""
    key: str = ""
    started: str = ""
    seconds: float = 0.0
    snap: _Snapshot | None = None
    prog: Progress = field(default_factory=Progress)
    digest: str = ""
    binlog: tuple[str, int, str] = ("", 0, "")
    manifest: dict[str, Any] = field(default_factory=dict)


def backup(s3: Any, loc: Location, argv: list[str], *, connect: Callable[[], Any],
           node: str, compress: bool = False, part_size: int = DEFAULT_PART_SIZE,
           allow_master: bool = False, checksums: bool = True,
           backup_id: str | None = None,
           progress: Callable[[Progress], None] | None = None,
           shard_map: ShardMap | dict[str, Any] | None = None,
           max_lag_seconds: float = MAX_LAG_SECONDS,
           max_lag_trx: int = MAX_LAG_TRX, store: Any = None,
           lock_timeout: float = 5.0) -> dict[str, Any]:
    """Back up the node *argv* (:func:`shardfleet.physical.backup_argv`) reads into S3 at
    *loc*; returns the manifest. *connect* gives an admin connection to the same node
    (the health check, the snapshot, the checksums). Refuses (:class:`BackupRefused`,
    nothing uploaded) a node that is not a healthy standby (:func:`check_source`, with
    *shard_map*, the map as the control node read it, for its rebuild marks), a writable
    one unless *allow_master*; with *store* (the map's ZooKeeper store) also a node whose
    server lock another operation holds (waiting *lock_timeout* s for it) or that an
    unfinished operation touches. The manifest records the check (``source``,
    ``from_healthy_standby``: what :func:`shardfleet.storage.retention` protects) and
    ``locked``. Raises :class:`BackupFailed` with nothing complete left in S3."""
    if part_size < MIN_PART_SIZE:
        raise BackupFailed(f"part_size {part_size} is below S3's minimum of {MIN_PART_SIZE}")
    run = _Backup(s3, loc, argv, node, backup_id or new_backup_id(), compress, part_size,
                  checksums, progress,
                  dict(shard_map=shard_map, allow_master=allow_master,
                       max_lag_seconds=max_lag_seconds, max_lag_trx=max_lag_trx),
                  locked=store is not None)
    if store is None:
        return _run(run, connect, None)
    runner = Runner(store, journal_name(node), [node], kind="backup", finished_by=FINISHED,
                    lock_timeout=lock_timeout)
    with runner.refusing(_refusal(node)):
        run.journal = Journal(store, runner.name)
        run.journal.load()
        return _run(run, connect, runner)


def _refusal(node: str) -> Callable[[str], BackupRefused]:
    return lambda why: BackupRefused(f"backup of {node} refused: {why} (nothing uploaded)")


def refuse_beside(store: Any, node: str) -> None:
    """Check mode's refusal: :class:`BackupRefused` when another operation holds *node*'s
    lock or an unfinished one touches it (takes no lock, changes nothing)."""
    with Runner(store, journal_name(node), [node], kind="backup").refusing(
            _refusal(node), check=True):
        pass


def _run(run: _Backup, connect: Callable[[], Any], runner: Runner | None) -> dict[str, Any]:
    """The steps (check, stream, manifest), on *runner* or (no store) one after the other;
    a failure after the check finishes the journal as ``failed``."""
    steps = [Step("check", lambda: False, lambda: _check(run), always=True),
             Step("stream", lambda: False, lambda: _stream_object(run),
                  would=f"stream a backup of {run.node} to s3://{run.loc.bucket}/{run.loc.root}"),
             Step("manifest", lambda: False, lambda: _write(run), would="write the manifest")]
    run.conn = connect()
    try:
        if runner is None:
            for s in steps:
                s.action()
        else:
            runner.run(steps)
        return run.manifest
    except BaseException as exc:
        if run.journal is not None and run.begun:
            _journal_failure(run.journal, exc)
        if isinstance(exc, LockLost):  # another run may have changed the node meanwhile
            why = discard(run.s3, run.loc.bucket, run.key, str(exc)) if run.key else exc
            raise BackupFailed(f"backup of {run.node} lost its lock: {why}; no manifest "
                               "written, nothing complete left in S3") from None
        raise
    finally:
        run.conn.close()


def _journal_failure(journal: Journal, exc: BaseException) -> None:
    try:
        journal.step("failed", error=f"{type(exc).__name__}: {exc}"[:500])
    except Exception as err:  # noqa: BLE001 - the lock lost: the journal cannot be written
        log.warning("could not record the failed backup in %s: %s", journal.name, err)


def _journaled(run: _Backup, step: str, **fields: Any) -> None:
    if run.journal is not None:
        run.journal.step(step, **fields)


def _check(run: _Backup) -> StepResult:
    """The node is a healthy standby with a binary log (BackupRefused otherwise); then
    the journal begins: from here the backup is in flight."""
    health = check_source(run.conn, run.node, **run.limits)
    if not health.healthy:
        raise BackupRefused(f"backup of {run.node} refused, nothing uploaded: "
                            + "; ".join(health.reasons), health)
    log_bin, run.version = topology.binlog_enabled(run.conn)
    if not log_bin:
        raise BackupRefused(f"{run.node} has no binary log: a backup would carry no position")
    run.health = health
    if run.journal is not None:
        # in_flight_while_locked: a backup changes nothing on its node, so a journal its
        # killed process left is in flight only while its run holds the node's lock (the
        # registry reads it); the next backup of the node takes it over
        run.journal.save({"step": "check", "node": run.node, "backup_id": run.bid,
                          "pair": run.loc.pair, "bucket": run.loc.bucket, "steps": [],
                          "in_flight_while_locked": True})
        run.begun = True
    return StepResult("check", False, f"{run.node} is a healthy {health.role}")


def _stream_object(run: _Backup) -> StepResult:
    """The stream uploaded as one object (aborted, nothing complete, on any failure)."""
    s3, bucket = run.s3, run.loc.bucket
    run.key = run.loc.key(run.bid, "backup.mbstream" + (".zst" if run.compress else ""))
    run.started = now_iso()
    t0 = time.monotonic()
    run.snap = _Snapshot(run.conn) if run.checksums else None
    watcher = StreamWatcher(on_locked=run.snap.open if run.snap else None)
    upload = Upload(s3, bucket, run.key)
    try:
        run.prog, run.digest = stream_upload(run.argv, watcher, upload, run.compress,
                                             run.part_size, run.progress)
        upload.finish()
    except BaseException:
        upload.abort()
        raise
    run.seconds = time.monotonic() - t0
    if watcher.broken:
        raise discard(s3, bucket, run.key, f"the stream did not parse: {watcher.broken}")
    try:
        run.binlog = binlog_info(watcher.text(physical.BINLOG_INFO))
    except BackupFailed as exc:
        raise discard(s3, bucket, run.key, str(exc)) from None
    _journaled(run, "stream", object=run.key, bytes=run.prog.object_bytes)
    return StepResult("stream", True, f"uploaded {run.prog.object_bytes} bytes to "
                                      f"s3://{bucket}/{run.key}")


def _write(run: _Backup) -> StepResult:
    """The manifest, with the checksums at the backup's position when the snapshot was
    taken there; written last."""
    bfile, bpos, gtid = run.binlog
    assert run.health is not None
    m: dict[str, Any] = {
        "format": FORMAT, "backup_id": run.bid, "cluster": run.loc.cluster,
        "pair": run.loc.pair, "node": run.node, "server_version": run.version,
        "started": run.started, "finished": None, "seconds": round(run.seconds, 3),
        "object": run.key, "compressed": bool(run.compress), "bytes": run.prog.object_bytes,
        "stream_bytes": run.prog.stream_bytes, "sha256": run.digest, "parts": run.prog.parts,
        "part_size": run.part_size, "sse": SSE,
        "position": {"gtid": gtid, "binlog_file": bfile, "binlog_pos": bpos},
        "checksums": None, "checksums_at_position": False, "checksums_note": "",
        "source": run.health.to_dict(), "from_healthy_standby": run.health.healthy_standby,
        "locked": run.locked,
    }
    _checksums(run, m)
    m["finished"] = now_iso()
    write_manifest(run.s3, run.loc, m)
    run.manifest = m
    _journaled(run, "manifest", done=True)
    return StepResult("manifest", True, f"backup {run.bid} at {gtid}")


def _checksums(run: _Backup, m: dict[str, Any]) -> None:
    snap, (bfile, bpos, _) = run.snap, run.binlog
    if snap is None:
        m["checksums_note"] = "not asked for (checksums=false)"
    elif snap.coords == (bfile, bpos):
        try:
            now_tables = topology.shard_tables(run.conn)
            tables = {db: now_tables.get(db, []) for db in snap.dbs}
            m["checksums"] = topology.checksum_tables(run.conn, tables)
            m["checksums_at_position"] = True
        except Exception as exc:  # noqa: BLE001 - the backup itself is good
            m["checksums_note"] = f"the checksums failed: {exc}"
            log.warning("backup %s: no checksums: %s", run.bid, exc)
        finally:
            run.conn.rollback()
    else:
        m["checksums_note"] = (
            snap.error or f"the snapshot (taken at {snap.at_file or 'no file'}: "
            f"{snap.coords}) is not at the backup's binlog position ({bfile}, {bpos})")
        log.warning("backup %s: no checksums: %s", run.bid, m["checksums_note"])


__all__ = ["BackupFailed", "BackupRefused", "SourceHealth", "backup", "channel_problems",
           "check_source", "journal_name", "map_problems", "plan", "refuse_beside"]
