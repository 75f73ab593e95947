"""Restores of a pair's backups from S3, on the operation runner.

A restore downloads the object as a stream into ``mbstream -x`` in a scratch directory
next to the data directory, hashing the bytes as they pass; the target's data directory
is touched only after the sha256 equals the manifest's (:mod:`shardfleet.storage` holds
where the objects are). It then prepares the copy, installs it
(:func:`shardfleet.physical.install`, which puts the old contents back when the server
does not start on the copy), leaves the node read-only with no replication channel and
its ``gtid_slave_pos`` at the backup's position, and compares every shard table's
checksum with the manifest. A point-in-time replay after it is the archive's
(:func:`shardfleet.operations.archive.replay`): the caller chains the two.

Steps: ``download`` (and prepare: refused, nothing changed, when the object is corrupted
or does not prepare), ``install``, ``detach`` (read-only, no channel, the position),
``verify``. On the runner (*store* given) the restore holds the server lock of the node
it restores for its whole run (refused, nothing changed, when another operation holds it
or an unfinished one touches the node) and journals each step (``restore-<node>``, kind
``restore``); it is in the registry of operations in flight until ``verify`` (or a
refusal: ``refused``). A restore that failed after it touched the node (install,
checksums) stays in flight: the node holds no usable data until a restore succeeds.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfleet import physical, replication, topology
from shardfleet.operations.runner import (
    Journal,
    Runner,
    Step,
    StepResult,
)
from shardfleet.storage import (
    READ,
    Location,
    RestoreFailed,
    RestoreRefused,
    latest,
    read_manifest,
    restorable,
)

# the journal's steps after which a restore is no longer in flight
FINISHED = ("verify", "refused")


def journal_name(node: str) -> str:
    """The journal of the restores onto *node* (one per node, reused by the next)."""
    return "restore-" + node.replace("/", "_")


@dataclass
class Restored:
    backup_id: str
    position: str
    bytes: int
    seconds: float
    checksums_verified: int      # tables whose checksum matched the manifest
    note: str = ""


@dataclass
class _Restore:
    """One restore's inputs, and what its steps found (the next step reads them)."""

    s3: Any
    loc: Location
    manifest: dict[str, Any]
    datadir: str
    stop: Callable[[], Any]
    start: Callable[[], Any]
    connect: Callable[[], Any]
    owner: str | None
    use_memory: str
    verify: bool
    journal: Journal | None = None
    t0: float = 0.0
    bytes: int = 0
    position: str = ""
    verified: int = 0
    note: str = ""

    @property
    def bid(self) -> str:
        return str(self.manifest["backup_id"])

    @property
    def incoming(self) -> str:
        return self.datadir.rstrip("/") + ".restore"


def restore(s3: Any, loc: Location, *, datadir: str, stop: Callable[[], Any],
            start: Callable[[], Any], connect: Callable[[], Any],
            backup_id: str | None = None, owner: str | None = None,
            use_memory: str = "256M", verify: bool = True,
            allow_master: bool = False, store: Any = None, node: str = "",
            operations: list[dict[str, Any]] | None = None,
            lock_timeout: float = 5.0) -> Restored:
    """Restore *backup_id* (default: the latest complete one) into the node whose data
    directory is *datadir* (*stop*/*start* the server; *connect* an admin connection
    once it runs); see the module's docstring. A target that answers and is writable (a
    master) is refused unless *allow_master*; one that does not answer is restored (a
    node being rebuilt). With *store* (the map's ZooKeeper store) the restore runs on the
    runner under target *node*'s (``host:port``) lock, waiting *lock_timeout* s for it;
    without one, *operations* is the registry of operations in flight as read elsewhere
    (:func:`refuse_if_in_flight`) and no lock is taken."""
    args = dict(datadir=datadir, stop=stop, start=start, connect=connect, owner=owner,
                use_memory=use_memory, verify=verify)
    if store is None:
        if operations is not None:
            refuse_if_in_flight(None, node, operations)
        return _run(_begin(s3, loc, backup_id, allow_master, args), None)
    if not node:
        raise RestoreRefused("a restore on the runner needs the target node (host:port); "
                             "nothing was changed")
    runner = Runner(store, journal_name(node), [node], kind="restore", finished_by=FINISHED,
                    lock_timeout=lock_timeout)
    with runner.refusing(_refusal(node)):
        run = _begin(s3, loc, backup_id, allow_master, args)
        run.journal = Journal(store, runner.name)
        run.journal.load()
        run.journal.save({"step": "start", "node": node, "backup_id": run.bid,
                          "datadir": datadir, "steps": []})
        return _run(run, runner)


def _refusal(node: str) -> Callable[[str], RestoreRefused]:
    return lambda why: RestoreRefused(f"{why} (restore onto {node}: nothing was changed)")


def refuse_beside(store: Any, node: str) -> None:
    """Check mode's refusal: :class:`RestoreRefused` when another operation holds *node*'s
    lock or an unfinished one touches it (takes no lock, changes nothing)."""
    with Runner(store, journal_name(node), [node], kind="restore").refusing(
            _refusal(node), check=True):
        pass


def _begin(s3: Any, loc: Location, backup_id: str | None, allow_master: bool,
           args: dict[str, Any]) -> _Restore:
    """The manifest to restore, after the refusal of a writable target."""
    manifest = restorable(read_manifest(s3, loc, backup_id) if backup_id else latest(s3, loc))
    if not allow_master:
        _refuse_writable(args["connect"], args["datadir"])
    return _Restore(s3, loc, manifest, t0=time.monotonic(), **args)


def _run(run: _Restore, runner: Runner | None) -> Restored:
    steps = [Step(name, lambda: False, _journaled(run, name, fn), would=would)
             for name, fn, would in (
                 ("download", _download, f"download and prepare backup {run.bid}"),
                 ("install", _install, f"install it into {run.datadir}"),
                 ("detach", _detach, "leave the node read-only without a channel"),
                 ("verify", _verify_step, "compare the checksums with the manifest"))]
    if runner is None:
        for s in steps:
            s.action()
    else:
        runner.run(steps)
    return Restored(backup_id=run.bid, position=run.position, bytes=run.bytes,
                    seconds=time.monotonic() - run.t0, checksums_verified=run.verified,
                    note=run.note)


def _journaled(run: _Restore, name: str,
               fn: Callable[[_Restore], str]) -> Callable[[], StepResult]:
    """*fn* as a step's action: its step journaled when it is done; a refusal (nothing
    changed) finishes the journal, another failure is recorded where it stopped."""
    def act() -> StepResult:
        try:
            msg = fn(run)
        except RestoreRefused as exc:
            if run.journal is not None:
                run.journal.step("refused", error=str(exc)[:500])
            raise
        except RestoreFailed as exc:
            if run.journal is not None:
                run.journal.note(error=str(exc)[:500])
            raise
        if run.journal is not None:
            run.journal.step(name)
        return StepResult(name, True, msg)
    return act


def _download(run: _Restore) -> str:
    shutil.rmtree(run.incoming, ignore_errors=True)  # a restore that never completed
    run.bytes = download(run.s3, run.loc, run.manifest, run.incoming)
    try:
        physical.prepare(run.incoming, use_memory=run.use_memory)
    except physical.CopyFailed as exc:
        shutil.rmtree(run.incoming, ignore_errors=True)
        raise RestoreRefused(f"backup {run.bid} did not prepare: {exc}; nothing was changed "
                             "on the target") from None
    run.position = physical.position(run.incoming)
    want = run.manifest["position"]["gtid"]
    if run.position != want:
        shutil.rmtree(run.incoming, ignore_errors=True)
        raise RestoreRefused(f"backup {run.bid}: the copy's position {run.position!r} is not "
                             f"the manifest's {want!r}; nothing was changed on the target")
    _forget_replication(run.incoming)
    return f"downloaded and prepared backup {run.bid} ({run.bytes} bytes)"


def _install(run: _Restore) -> str:
    try:
        physical.install(run.incoming, run.datadir, stop=run.stop, start=run.start,
                         owner=run.owner)
    except physical.CopyFailed as exc:
        raise RestoreFailed(f"restoring backup {run.bid}: {exc}") from None
    return f"installed backup {run.bid} into {run.datadir}"


def _detach(run: _Restore) -> str:
    """Read-only, no replication channel, ``gtid_slave_pos`` at the backup's position."""
    conn = _connect_retrying(run.connect)
    try:
        replication.set_read_only(conn, True)
        replication.stop_all_channels(conn)
        for row in replication.replica_rows(conn):
            with conn.cursor() as c:
                c.execute(replication.channel_sql("RESET", row, "ALL"))
        replication.set_replica_pos(conn, run.position)
    finally:
        conn.close()
    return f"read-only, no channel, replication position {run.position}"


def _verify_step(run: _Restore) -> str:
    if not run.verify:
        run.note = "checksums not verified (verify=false)"
    elif not run.manifest.get("checksums_at_position"):
        run.note = ("checksums not verified: the backup recorded none ("
                    f"{run.manifest.get('checksums_note') or 'unknown'})")
    else:
        conn = _connect_retrying(run.connect)
        try:
            run.verified = _verify(conn, run.manifest)
        finally:
            conn.close()
    return run.note or f"{run.verified} checksums match the manifest"


def download(s3: Any, loc: Location, manifest: dict[str, Any], directory: str) -> int:
    """Stream the object into ``[zstd -d |] mbstream -x -C directory`` (created; must not
    exist), hashing it; :class:`RestoreRefused` (and the directory removed) when the
    sha256 or the size differs from the manifest, or the stream does not extract."""
    Path(directory).mkdir(parents=True)
    sha = hashlib.sha256()
    total = 0
    ok = False
    try:
        with tempfile.TemporaryFile() as err:
            procs: list[subprocess.Popen[bytes]] = []
            if manifest.get("compressed"):
                procs.append(subprocess.Popen([physical._tool("zstd"), "-q", "-d", "-c"],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=err))
            procs.append(subprocess.Popen(
                [physical._tool("mbstream"), "-x", "-C", directory],
                stdin=procs[0].stdout if procs else subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=err))
            if len(procs) > 1:
                procs[0].stdout.close()  # type: ignore[union-attr]
            sink = procs[0].stdin
            assert sink is not None
            broken = ""
            try:
                body = s3.get_object(Bucket=loc.bucket, Key=manifest["object"])["Body"]
                for chunk in body.iter_chunks(READ):
                    sha.update(chunk)
                    total += len(chunk)
                    sink.write(chunk)
            except BrokenPipeError:
                broken = "the extraction stopped reading"
            finally:
                try:
                    sink.close()
                except OSError:
                    pass
                codes = [p.wait() for p in procs]
            if sha.hexdigest() != manifest["sha256"] or total != manifest["bytes"]:
                raise RestoreRefused(
                    f"backup {manifest['backup_id']} is corrupted: its object "
                    f"s3://{loc.bucket}/{manifest['object']} has sha256 {sha.hexdigest()} "
                    f"and {total} bytes, the manifest says {manifest['sha256']} and "
                    f"{manifest['bytes']} bytes. Nothing was changed on the target; "
                    "restore another backup")
            if broken or any(codes):
                err.seek(0)
                raise RestoreRefused(f"backup {manifest['backup_id']} did not extract "
                                     f"({broken or 'exit ' + str(codes)}): "
                                     f"{err.read().decode(errors='replace')[-500:]}; nothing "
                                     "was changed on the target")
        ok = True
        return total
    finally:
        if not ok:
            shutil.rmtree(directory, ignore_errors=True)


def refuse_if_in_flight(store: Any, node: str,
                       operations: list[dict[str, Any]] | None = None) -> None:
    """:class:`RestoreRefused` when an operation in flight (the runner's registry of
    *store*: a split, promotion or rebuild whose journal is unfinished) touches *node*:
    a restore would replace the data under its steps. Without a store, *operations* is
    that registry as the control node read it (``shard_info``'s ``operations``: name,
    kind, step, servers)."""
    if not node:
        raise RestoreRefused("a restore checked against the operations in flight needs the "
                             "target node (host:port); nothing was changed")
    if store is not None:
        from shardfleet import ops  # ZooKeeper only where a store is given

        busy = [op.describe() for op in ops.in_flight(store) if node in op.servers]
    else:
        busy = [f"{o.get('kind')} {o.get('name')} (step {o.get('step')}, on "
                f"{', '.join(o.get('servers') or [])})" for o in operations or []
                if node in (o.get("servers") or [])]
    if busy:
        raise RestoreRefused(f"an operation is in flight on {node}: " + "; ".join(busy)
                             + ". Finish or abort it first; nothing was changed")


def _refuse_writable(connect: Callable[[], Any], datadir: str) -> None:
    try:
        conn = connect()
    except Exception:  # noqa: BLE001 - not running: nothing serves from it
        return
    try:
        ro = replication.is_read_only(conn)
    finally:
        conn.close()
    if not ro:
        raise RestoreRefused(f"the server on {datadir} is writable (read_only=OFF): it may "
                             "be a master. Restore onto a new or fenced node (read_only=ON), "
                             "or pass allow_master; nothing was changed")


def _forget_replication(directory: str) -> None:
    """The source's replication state, if the copy carries any, must not start a channel
    on the restored node at boot (it would apply changes past the backup's position)."""
    for pattern in ("master*.info", "multi-master.info", "relay-log*.info", "*relay-bin*"):
        for f in Path(directory).glob(pattern):
            f.unlink()


def _verify(conn: Any, manifest: dict[str, Any]) -> int:
    want: dict[str, dict[str, int]] = manifest["checksums"]
    have_tables = topology.shard_tables(conn)
    problems = []
    if set(have_tables) != set(want):
        problems.append(f"shard databases differ: missing {sorted(set(want) - set(have_tables))}"
                        f", extra {sorted(set(have_tables) - set(want))}")
    common = {db: [t for t in have_tables[db] if t in want[db]]
              for db in have_tables if db in want}
    have = topology.checksum_tables(conn, common)
    n = 0
    for db, tables in want.items():
        for t, v in tables.items():
            got = have.get(db, {}).get(t)
            if got != v:
                problems.append(f"{db}.{t}: {got} != {v}")
            else:
                n += 1
    if problems:
        raise RestoreFailed(f"backup {manifest['backup_id']} restored, but "
                            f"{len(problems)} checksum(s) differ from its manifest: "
                            f"{'; '.join(problems[:10])}. The node is read-only; do not "
                            "use it")
    return n


def _connect_retrying(connect: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return connect()
        except Exception:  # noqa: BLE001 - the server may still be starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


__all__ = ["Restored", "RestoreFailed", "RestoreRefused", "download", "journal_name",
           "refuse_beside", "refuse_if_in_flight", "restore"]
