"""The split's logical clone: the moving databases copied from one consistent snapshot of
the source onto the target's master, resumable database by database."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pymysql.cursors

from shardfleet import provision, replication, topology
from shardfleet.operations.runner import StepResult
from shardfleet.schema import shard_database

from .check import estimate
from .context import SplitContext, log
from .spec import PROGRESS, SplitError


@dataclass
class _Copying:
    """What the clone's workers share."""

    work: queue.SimpleQueue[str]
    done: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[BaseException] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=lambda: {"tables": 0, "rows": 0})


class CloneMixin(SplitContext):
    def clone(self) -> StepResult:
        """Copy the moving databases, resumable database by database.

        Every database copied is recorded in the journal (``clone_done``) with the GTID
        position its copy is consistent with (``clone_base``), progress as it goes
        (``clone_progress``: databases and rows done of the estimate, rate, ETA). A rerun
        after a kill keeps the finished databases: it drops only the partial ones, takes
        a new snapshot, brings the finished ones to that snapshot's position through the
        split's channel (``START SLAVE ... UNTIL``; the channel's own position is the
        truth once it exists) and copies the rest from the snapshot."""
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        if self.progress(data) >= PROGRESS["clone"]:
            return StepResult("clone", False,
                              f"already cloned at GTID {data and data.get('clone_gtid')}")
        if self.clone_method == "auto":
            self.clone_method = self._choose_clone(data)
        if self.clone_method == "physical":
            return self._clone_physical(t0)
        if self.progress(data) < 0:
            self._record("started")
        data = self.journal.data if self.journal else None
        if (data or {}).get("clone_method") != "logical":
            self._note(clone_method="logical")
            data = self.journal.data if self.journal else None
        kept, todo_dbs = self._clone_prepare(data or {})
        base = str((data or {}).get("clone_base") or "")
        snaps, gtid = self._snapshots(self.spec.source, self.clone_parallel)
        try:
            if kept:
                self._advance(kept, base, gtid)
            self._note(clone_base=gtid, clone_done=kept)
            tables, rows = self._copy(snaps, self.spec.target, todo_dbs, kept, gtid)
        finally:
            for c in snaps:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
        res = self._record("clone", clone_gtid=gtid, clone_tables=tables, clone_rows=rows,
                           clone_kept=len(kept), clone_seconds=round(time.monotonic() - t0, 3))
        kept_note = f"; {len(kept)} kept from an earlier attempt" if kept else ""
        return StepResult("clone", True, f"copied {rows} row(s) in {tables} non-empty table(s) "
                          f"of {len(todo_dbs)} shard(s) at GTID {gtid}{kept_note}",
                          time.monotonic() - t0, {"clone_gtid": res["clone_gtid"],
                                                  "rows": rows})

    def _clone_prepare(self, data: dict[str, Any]) -> tuple[list[str], list[str]]:
        """The databases an earlier attempt finished (kept) and those to copy, created
        empty on the target (partial copies dropped first)."""
        tgt = self.spec.target
        self._unfence_receivers([tgt], binlog=True)  # an aborted physical attempt's cancel
        there = self._shard_dbs(tgt)
        kept = [d for d in data.get("clone_done", [])
                if d in set(self.databases) and d in there]
        if not str(data.get("clone_base") or ""):
            kept = []
        partial = sorted((there & set(self.databases)) - set(kept))
        if partial:  # copies this split's earlier attempt did not finish: start them over
            provision.apply_drop(self.conn(tgt), partial)
        todo_dbs = [d for d in self.databases if d not in set(kept)]
        provision.ensure_shards(self.conn(tgt), [s for s in self.shards
                                                 if shard_database(s) in set(todo_dbs)],
                                self.schema, app_user=None)
        return kept, todo_dbs

    def _snapshots(self, src: str, n: int) -> tuple[list[Any], str]:
        """*n* connections to *src* in one consistent snapshot, and its GTID position.
        More than one are started while commits are blocked (``BACKUP STAGE
        BLOCK_COMMIT``, held for the moments the snapshots take to start; writes wait,
        none fails), and checked to be at one binlog position."""
        conns = [topology.connect(src, self.creds.admin_user, self.creds.admin_password,
                                  timeout=self.connect_timeout, tls=self.tls)
                 for _ in range(max(1, n))]
        try:
            seen: set[tuple[str, int]] = set()
            if len(conns) > 1:
                with replication.commits_blocked(self.conn(src), int(self.lock_timeout) + 5):
                    seen = {replication.start_snapshot(conn) for conn in conns}
            else:
                seen = {replication.start_snapshot(conns[0])}
            if len(seen) != 1:
                raise SplitError(f"the clone's {len(conns)} snapshots of {src} are at "
                                 f"different binlog positions ({sorted(seen)}); nothing was "
                                 "copied, run the split again")
            (file, pos), = seen
            return conns, replication.binlog_gtid_pos(conns[0], file, pos)
        except BaseException:
            for c in conns:
                c.close()
            raise

    def _advance(self, kept: list[str], base: str, until: str) -> None:
        """Bring the databases an earlier attempt copied (consistent at *base*) to the new
        snapshot's position *until*: the split's channel applies them alone up to it and
        stops there. The channel, once created, keeps its own position (a rerun killed in
        here continues from it, never from *base* again)."""
        tgt, name = self.spec.target, self.connection_name
        if self._channel(tgt) is None:
            self._create_channel(base, databases=kept, start=False)
        else:
            replication.stop_channel(self.conn(tgt), name)
            replication.set_channel_databases(self.conn(tgt), name, kept)
        self._start_channel(name, until=until)
        self._wait_applied(until, self.catchup_timeout, "bring the databases copied earlier "
                           "to the new snapshot")
        # UNTIL keeps it from applying more, but its threads stop only once an event past
        # the position arrives (a quiet source: never): stop it here, at the position
        replication.stop_channel(self.conn(tgt), name)

    def _copy(self, snaps: list[Any], tgt: str, dbs: list[str], kept: list[str],
              gtid: str, batch: int = 1000) -> tuple[int, int]:
        """Copy every row of *dbs* from the snapshot connections *snaps* (one worker each,
        a database at a time), recording each finished database and the progress in the
        journal (every couple of seconds)."""
        est = estimate(snaps[0], dbs)
        st = _Copying(queue.SimpleQueue(), list(kept))
        for db in dbs:
            st.work.put(db)
        threads = [threading.Thread(target=self._copy_worker, args=(c, tgt, st, batch),
                                    daemon=True, name=f"split-clone-{i}")
                   for i, c in enumerate(snaps)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        try:
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(timeout=2.0)
                with st.lock:
                    snapshot = (list(st.done), st.totals["rows"])
                self._note_progress(snapshot[0], len(kept), dbs, snapshot[1], est,
                                    time.monotonic() - t0)
        finally:
            st.stop.set()
            for t in threads:
                t.join()
            # what finished is kept by a rerun, whatever ended this one
            self._note_progress(st.done, len(kept), dbs, st.totals["rows"], est,
                                time.monotonic() - t0)
        if st.failures:
            raise st.failures[0]
        for c in snaps:
            c.commit()
        return st.totals["tables"], st.totals["rows"]

    def _copy_worker(self, snap: Any, tgt: str, st: _Copying, batch: int) -> None:
        """One clone worker: databases from the queue copied from *snap* until none is
        left or the copy stops (a failure handed to the caller in ``st.failures``)."""
        out = topology.connect(tgt, self.creds.admin_user, self.creds.admin_password,
                               timeout=self.connect_timeout, tls=self.tls)
        try:
            while not st.stop.is_set():
                try:
                    db = st.work.get_nowait()
                except queue.Empty:
                    return
                ntab = 0
                for t in self.schema.tables:
                    ntab += self._copy_table(snap, out, db, t, st, batch)
                    if st.stop.is_set():
                        return
                with st.lock:
                    st.done.append(db)
                    st.totals["tables"] += ntab
                if self.after_clone_db is not None:
                    self.after_clone_db(db)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            st.failures.append(exc)
            st.stop.set()
        finally:
            out.close()

    @staticmethod
    def _copy_table(snap: Any, out: Any, db: str, t: str, st: _Copying, batch: int) -> int:
        """Every row of ``db.t`` from *snap* inserted through *out*; 1 when it had rows."""
        nrows = 0
        with snap.cursor(pymysql.cursors.SSCursor) as rd:
            rd.execute(f"SELECT * FROM `{db}`.`{t}`")
            cols = ", ".join(f"`{d[0]}`" for d in rd.description)
            marks = ", ".join(["%s"] * len(rd.description))
            sql = f"INSERT INTO `{db}`.`{t}` ({cols}) VALUES ({marks})"
            while not st.stop.is_set():
                chunk = rd.fetchmany(batch)
                if not chunk:
                    break
                with out.cursor() as wr:
                    wr.executemany(sql, chunk)
                nrows += len(chunk)
                with st.lock:
                    st.totals["rows"] += len(chunk)
        return int(nrows > 0)

    def _note_progress(self, done: list[str], kept: int, dbs: list[str], rows: int,
                       est: dict[str, int], seconds: float) -> None:
        """The clone's progress in the journal: what is finished (kept by a rerun) and
        rows done of the estimate, rate, ETA."""
        rate = rows / seconds if seconds > 0 else 0.0
        left = max(0, est["rows"] - rows)
        progress = {"databases_done": len(done), "databases": kept + len(dbs),
                    "rows_done": rows, "rows_estimated": est["rows"],
                    "bytes_estimated": est["bytes"], "rows_per_second": round(rate),
                    "eta_seconds": round(left / rate) if rate > 0 else None,
                    "seconds": round(seconds, 1)}
        self._note(clone_done=done, clone_progress=progress)
        log.info("clone %s: %d/%d databases, %d of ~%d rows, %.0f rows/s", self.name,
                 len(done), kept + len(dbs), rows, est["rows"], rate)
