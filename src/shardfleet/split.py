"""Split a hot pair's range onto a new pair, live: check, clone, replicate, cutover, cleanup.

The operation the design exists for ("replicate MySQL001A to a new pair, then
flip the config so each carries half the shards"), one idempotent step at a
time, with its progress in a journal beside the map
(``/shardfleet/<cluster>/ops/journal/split-<first>-<last>``) so that a rerun
after any failure continues where it stopped::

    check      the source master owns the moving range; the target is new and
               empty (or holds this split's own earlier attempt); GTID binlogs on
    clone      the moving shard databases copied from one consistent snapshot of
               the source (START TRANSACTION WITH CONSISTENT SNAPSHOT; no lock,
               no blocked writes) onto the target's master, with the GTID
               position the snapshot corresponds to; the target's standby gets
               it through its own pair's replication
    replicate  the target's master replicates from the source's master over a
               named multi-source connection (``split_<first>_<last>``) that
               applies only the moving databases, from the clone's GTID, until
               caught up (compared by GTID, never Seconds_Behind_Master)
    cutover    freeze the moving range in the map (routers hold writes); fence
               the moving shards on the source (the application user loses
               INSERT, UPDATE, DELETE on them: a router with a stale map gets
               error 1142, refreshes and waits); let writes that passed the
               fence's check finish; read the source's GTID position *after*
               that; wait until the target applied it; flip the map (range ->
               target, its previous state); remove the split's replication.
               A timeout undoes the fence and the freeze and leaves the map as
               it was.
    cleanup    (explicit) drop the moved databases from the source pair and
               anything outside its ranges from the target pair
    abort      (before cutover) under the locks of every server the split changes
               (source, target, target standby) and refused beside another
               operation in flight on them: first cancel the physical copy's
               receivers on the target pair (none installs after that), then
               remove the split's replication, freeze and fence, and the
               target's copies; map and source as they were

The write stall is the time between the freeze and the flip: the fence is one
UPDATE of ``mysql.db`` plus ``FLUSH PRIVILEGES`` (constant time; REVOKE costs
about 0.6 ms per database, 0.6 s for 1,024 shards), the target is granted and
made writable *before* the freeze, and the wait is for a caught-up replica.

MariaDB only for now (tested 10.11): the snapshot's GTID comes from
``binlog_snapshot_file/position`` and the replication is multi-source by name.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shardfleet import physical, provision, replication, topology
from shardfleet.errors import (
    DatabaseError,
    MapConflictError,
    MapError,
    MapWriteUnknown,
    ShardfleetError,
)
from shardfleet.mapstore import NO_NODE, Updated, ZooKeeperMapStore, update
from shardfleet.operations.types import Credentials
from shardfleet.ops import Journal, Runner, Step, StepResult
from shardfleet.schema import Schema, default_schema, shard_database
from shardfleet.shardmap import ShardMap, ShardRange, diff, freeze_owner
from shardfleet.tls import TLS, StreamTLS

log = logging.getLogger(__name__)

STEPS = ("check", "clone", "replicate", "cutover", "cleanup")
CLONE_METHODS = ("logical", "physical")
# clone="auto": physical when the moving shards hold more InnoDB data than this (bytes);
# docs/runbooks/split.md says how it was chosen
PHYSICAL_ABOVE = 1 << 30
# Journal ``step`` values in the order a split reaches them ("aborted" restarts).
PROGRESS = {"started": 0, "clone": 1, "replicate": 2, "cutover": 3, "cleanup": 4}
WRITE_PRIVILEGES = ("Insert_priv", "Update_priv", "Delete_priv")
# the same, as information_schema.SCHEMA_PRIVILEGES names the privileges the server enforces
LIVE_WRITE_PRIVILEGES = ", ".join(f"'{p.removesuffix('_priv').upper()}'"
                                  for p in WRITE_PRIVILEGES)


class SplitError(ShardfleetError):
    """Raised when a split step is refused or fails; the message says what changed (if anything)."""


class CutoverAborted(SplitError):
    """Raised when the cutover timed out and was undone (fence and freeze lifted, map as before)."""


@dataclass(frozen=True)
class SplitSpec:
    """What to move where. ``moving`` defaults to the upper half of the source's range."""

    source: str
    target: str
    target_standby: str | None = None
    moving: tuple[int, int] | None = None
    name: str | None = None


def upper_half(r: ShardRange) -> tuple[int, int]:
    """The default moving range: the upper half of *r* (0..2047 -> 1024..2047)."""
    if r.size < 2:
        raise SplitError(f"range [{r.first}, {r.last}] has one shard; nothing to split")
    return (r.first + r.size // 2, r.last)


class Split:
    """One split, driven step by step (every step idempotent; see the module docstring).

    Keyword arguments (documented defaults):

    * ``schema`` — the shard schema (the library's ``schema.yml``).
    * ``catchup_timeout`` (600 s) — how long ``replicate`` waits for the target to catch up.
    * ``cutover_timeout`` (5 s) — how long the cutover waits for the target to apply the
      source's position after the fence; on timeout the cutover is undone.
    * ``drain_timeout`` (2 s) — how long the cutover waits for writes that passed the
      fence's privilege check to finish; on timeout the cutover is undone.
    * ``lock_timeout`` (5 s) — waiting for the pairs' operation locks (LockBusy after).
    * ``tls`` (None: off) — client TLS options of the admin connections
      (:mod:`shardfleet.tls`).
    * ``clone_parallel`` (1) — connections the clone copies over, all in one snapshot
      (``docs/runbooks/split.md`` says how the default was chosen: more gained nothing
      where the control node's CPU is the limit).
    * ``clone`` ("logical") — ``physical``: the clone is a ``mariadb-backup`` copy of a
      source node onto both target nodes (:mod:`shardfleet.physical`, made between the
      nodes by the caller; see :meth:`clone`), ``copy_position`` / ``copy_id`` /
      ``copy_stats`` saying what it installed.
    """

    def __init__(self, store: ZooKeeperMapStore, spec: SplitSpec, creds: Credentials, *,
                 schema: Schema | None = None, catchup_timeout: float = 600.0,
                 cutover_timeout: float = 5.0, drain_timeout: float = 2.0,
                 lock_timeout: float = 5.0, connect_timeout: float = 10.0,
                 tls: TLS | None = None, clone_parallel: int = 1, clone: str = "logical",
                 copy_position: str = "", copy_id: str = "",
                 copy_stats: dict[str, Any] | None = None,
                 physical_above: int = PHYSICAL_ABOVE) -> None:
        if spec.source == spec.target:
            raise SplitError(f"source and target are the same server {spec.source}")
        self.store = store
        self.spec = spec
        self.creds = creds
        self.schema = schema or default_schema()
        self.catchup_timeout = catchup_timeout
        self.cutover_timeout = cutover_timeout
        self.drain_timeout = drain_timeout
        self.lock_timeout = lock_timeout
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.clone_parallel = max(1, int(clone_parallel))
        if clone not in CLONE_METHODS + ("auto",):
            raise SplitError(f"clone must be one of {', '.join(CLONE_METHODS + ('auto',))}, "
                             f"not {clone!r}")
        if copy_position and clone == "auto":
            clone = "physical"
        if clone == "physical" and not spec.target_standby:
            raise SplitError("a physical clone copies onto both nodes of the target pair: "
                             "give the target's standby (target_standby)")
        self.clone_method = clone
        # seconds a target node of a physical copy is waited for when it refuses
        # connections (restarting on a copy)
        self.start_wait = 300.0
        self.physical_above = int(physical_above)
        # the mysql role's mysql_replication_connect_retry (a target pair's channels that a
        # physical copy replaced are made again with what they had, else this)
        self.pair_connect_retry = 10
        self.copy_position = copy_position
        self.copy_id = copy_id
        self.copy_stats = dict(copy_stats or {})
        self._conns: dict[str, Any] = {}
        self.moving: tuple[int, int] = (0, 0)
        self.original: ShardRange | None = None
        self.journal: Journal | None = None
        # hooks for tests: called with the step name after a step finished, and (on the
        # clone's worker threads) with each database the clone finished
        self.after_step: Callable[[str], None] | None = None
        self.after_clone_db: Callable[[str], None] | None = None

    # -- plumbing ----------------------------------------------------------
    def conn(self, server: str) -> Any:
        c = self._conns.get(server)
        if c is None or not c.open:
            c = self._conns[server] = self._connect(server)
        return c

    def _connect(self, server: str) -> Any:
        """An admin connection to *server*. A target node of the physical copy the journal
        names may be restarting on it (the install of a killed run's copy, or of this
        split's, goes on without the playbook): one that refuses connections is waited
        for, up to ``start_wait`` seconds."""
        copy = ((self.journal.data if self.journal else None) or {}).get("copy") or {}
        wait = self.start_wait if server in (copy.get("targets") or ()) else 0.0
        deadline = time.monotonic() + wait
        while True:
            try:
                return topology.connect(
                    server, self.creds.admin_user, self.creds.admin_password,
                    timeout=self.connect_timeout,
                    client_flag=provision.multi_statement_flags(), tls=self.tls)
            except DatabaseError as exc:
                if "cannot connect" not in str(exc) or time.monotonic() >= deadline:
                    if wait:
                        raise DatabaseError(f"{exc} (waited {wait:.0f}s: a target node of "
                                            "the physical copy; is it starting on a "
                                            "copy? see its error log)") from None
                    raise
                log.info("split: %s does not answer yet (%s); waiting for it", server, exc)
                time.sleep(1.0)

    def close(self) -> None:
        for c in self._conns.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._conns.clear()

    def __enter__(self) -> Split:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exec(self, server: str, sql: str, params: Any = None) -> list[Any]:
        with self.conn(server).cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    @property
    def shards(self) -> list[int]:
        return list(range(self.moving[0], self.moving[1] + 1))

    @property
    def databases(self) -> list[str]:
        return [shard_database(s) for s in self.shards]

    @property
    def target_nodes(self) -> list[str]:
        """The target pair: its master and standby (a physical clone copies onto both)."""
        return [self.spec.target, str(self.spec.target_standby)]

    @property
    def connection_name(self) -> str:
        return f"split_{self.moving[0]}_{self.moving[1]}"

    @contextmanager
    def locked(self, *, check: bool = False) -> Iterator[Runner]:
        """The split's runner holding the locks of every server the split changes (source,
        target, target standby), the journal resolved under them, and refusing (before
        anything changed) beside another operation in flight on any of them (this split's
        own journal aside). *check*: no lock taken, but refused when one is held."""
        runner = self.runner()

        def prepare() -> str:
            self.resolve()
            return self.name

        with runner.held(prepare, check=check):
            yield runner

    # -- resolving what moves ------------------------------------------------
    def resolve(self) -> dict[str, Any] | None:
        """Work out the moving range and load the journal; returns the journal (or None)."""
        current = self.store.read().map
        if current is None:
            raise SplitError("there is no shard map in ZooKeeper; register the ranges first")
        moving = self.spec.moving
        if moving is None and self.spec.name:
            j = Journal(self.store, self.spec.name)
            data = j.load()
            if data and data.get("moving"):
                moving = (int(data["moving"][0]), int(data["moving"][1]))
        if moving is None:
            moving = self._journaled_moving()
        if moving is None:
            mine = [r for r in current.ranges if r.master == self.spec.source
                    and freeze_owner(r) is None]
            if len(mine) != 1:
                owned = ", ".join(f"[{r.first}, {r.last}]" for r in mine) or "no range"
                raise SplitError(f"source {self.spec.source} owns {owned}; give the moving "
                                 "range explicitly")
            moving = upper_half(mine[0])
        first, last = int(moving[0]), int(moving[1])
        if first > last:
            raise SplitError(f"moving range [{first}, {last}] is not first <= last")
        self.moving = (first, last)
        name = self.spec.name or f"split-{first}-{last}"
        self.journal = Journal(self.store, name)
        data = self.journal.load()
        if data and data.get("step") == "aborted":
            data = self.journal.data = None  # an aborted attempt restarts from the beginning
        if data:
            if (data.get("source"), data.get("target"), tuple(data.get("moving", ()))) != (
                    self.spec.source, self.spec.target, self.moving):
                raise SplitError(
                    f"journal {self.journal.path} records another split "
                    f"({data.get('source')} -> {data.get('target')}, shards "
                    f"{data.get('moving')}; step {data.get('step')}); finish or abort it, "
                    "or give another split name")
            self.original = ShardRange.from_dict(data["original"])
        return data

    def _journaled_moving(self) -> tuple[int, int] | None:
        """The moving range of the newest split journal between this source and target that
        was not aborted (so a rerun without a range continues, or reports, that split)."""
        import json

        base = f"{self.store.root}/{self.store.cluster}/ops/journal"
        names = self.store.children(base)
        if not names:
            return None
        found: list[tuple[float, tuple[int, int]]] = []
        for n in names:
            if not n.startswith("split"):
                continue
            raw, _ = self.store.read_raw(f"{base}/{n}")
            d = json.loads(raw) if raw else {}
            if (d.get("source"), d.get("target")) == (self.spec.source, self.spec.target) \
                    and d.get("step") != "aborted" and d.get("moving"):
                found.append((float(d.get("updated_at", 0)),
                              (int(d["moving"][0]), int(d["moving"][1]))))
        return max(found)[1] if found else None

    @property
    def name(self) -> str:
        assert self.journal is not None
        return self.journal.path.rsplit("/", 1)[1]

    def progress(self, data: dict[str, Any] | None) -> int:
        if not data:
            return -1
        return PROGRESS.get(str(data.get("step")), -1)

    # -- check ---------------------------------------------------------------
    def check(self) -> StepResult:
        """Refuse (SplitError, nothing changed) unless the split can run or continue."""
        t0 = time.monotonic()
        data = self.resolve()
        done = self.progress(data)
        m = self.store.read().map
        assert m is not None
        first, last = self.moving
        problems: list[str] = []
        if done >= PROGRESS["cutover"]:
            entry = m.find(first)
            if entry is None or entry.master != self.spec.target:
                problems.append(f"the journal says the cutover is done but the map puts shard "
                                f"{first} on {entry.master if entry else 'no server'}")
            if problems:
                raise SplitError("; ".join(problems))
            return StepResult("check", False, f"split {self.name} is past its cutover "
                              f"(step {data and data.get('step')})", time.monotonic() - t0,
                              {"moving": list(self.moving)})
        # the source owns the moving range
        flipped = m.find(first)
        if (done >= PROGRESS["replicate"] and flipped is not None
                and flipped.bounds == self.moving and flipped.master == self.spec.target):
            return StepResult("check", False, f"the map puts shards {first}..{last} on the "
                              "target already; the cutover step will finish", time.monotonic() - t0,
                              {"moving": list(self.moving)})
        holder = [r for r in m.ranges if r.first <= last and first <= r.last]
        owner = holder[0] if len(holder) == 1 else None
        if owner is None or not (owner.first <= first and last <= owner.last) \
                or owner.master != self.spec.source:
            mine = ", ".join(f"[{r.first}, {r.last}]" for r in m.ranges
                             if r.master == self.spec.source) or "nothing"
            raise SplitError(f"source {self.spec.source} does not own shards {first}..{last} "
                             f"(it owns {mine}); nothing changed")
        if owner.state == "frozen" and freeze_owner(owner) != self.name:
            raise SplitError(f"range [{owner.first}, {owner.last}] is frozen by another "
                             f"operation ({dict(owner.extra)}); nothing changed")
        if self.original is None:
            self.original = owner
        # the target is new: in no range of the map
        for server in filter(None, (self.spec.target, self.spec.target_standby)):
            used = m.ranges_of(server)
            if used:
                problems.append(f"target server {server} already serves "
                                + ", ".join(f"[{r.first}, {r.last}]" for r in used))
        # ... and empty, or holding this split's own earlier copies
        have = self._shard_dbs(self.spec.target)
        mine_ok = set(self.databases) if done >= PROGRESS["started"] else set()
        if done >= PROGRESS["started"] and (data or {}).get("copy"):
            # a physical copy of the source named by this split may be installed and not
            # yet attached: every shard database the source node held is there
            mine_ok |= have
        foreign = sorted(have - mine_ok)
        if foreign:
            problems.append(f"target {self.spec.target} is not empty: it holds "
                            f"{len(foreign)} shard database(s) ({_few(foreign)})"
                            + ("" if done >= 0 else " and no journal says they are this "
                               "split's"))
        # the source has every moving database
        missing = sorted(set(self.databases) - self._shard_dbs(self.spec.source))
        if missing:
            problems.append(f"source {self.spec.source} lacks {len(missing)} moving shard "
                            f"database(s) ({_few(missing)})")
        problems += self._check_replication()
        if not missing:
            problems += self._fence_problems()
        if problems:
            raise SplitError("; ".join(problems) + "; nothing changed")
        if self.clone_method == "auto":
            self.clone_method = self._choose_clone(data)
        return StepResult("check", False,
                          f"ok: move shards {first}..{last} from {self.spec.source} to "
                          f"{self.spec.target}" + (f" (resuming after {data['step']})"
                                                   if data else ""),
                          time.monotonic() - t0,
                          {"moving": list(self.moving), "original": owner.to_dict()})

    def _choose_clone(self, data: dict[str, Any] | None) -> str:
        """``clone="auto"``: the method an earlier run of this split began with, else
        physical when the moving shards hold more than ``physical_above`` bytes of InnoDB
        data (and the target has a standby to copy onto), else logical."""
        if (data or {}).get("clone_method") in CLONE_METHODS:
            return str((data or {})["clone_method"])
        if not self.spec.target_standby:
            return "logical"
        size = self._estimate(self.conn(self.spec.source), self.databases)["bytes"]
        return "physical" if size > self.physical_above else "logical"

    def _shard_dbs(self, server: str) -> set[str]:
        with self.conn(server).cursor() as cur:
            return provision.existing_databases(cur)

    def _check_replication(self) -> list[str]:
        out: list[str] = []
        servers = {"source": self.spec.source, "target": self.spec.target}
        info: dict[str, dict[str, Any]] = {}
        for role, server in servers.items():
            c = self.conn(server)
            d = topology.server_dialect(c)
            if not d.is_mariadb:
                out.append(f"{role} {server} runs {d.version}: splits support MariaDB only")
                continue
            info[role] = topology.dict_rows(
                c, "SELECT @@GLOBAL.log_bin AS log_bin, @@GLOBAL.binlog_format AS fmt, "
                   "@@GLOBAL.server_id AS sid, @@GLOBAL.gtid_domain_id AS dom, "
                   "@@GLOBAL.log_slave_updates AS lsu")[0]
            if not int(info[role]["log_bin"]):
                out.append(f"{role} {server} has no binary log (GTID replication is off)")
            if str(info[role]["fmt"]).upper() != "ROW":
                out.append(f"{role} {server} logs {info[role]['fmt']}, not ROW (the split's "
                           "per-database replication filter needs ROW)")
        if len(info) == 2:
            if info["source"]["sid"] == info["target"]["sid"]:
                out.append(f"source and target share server_id {info['source']['sid']}")
            src_domains = set(replication.parse_gtids(replication.gtid_position(
                self.conn(self.spec.source))))
            if int(info["target"]["dom"]) in src_domains:
                out.append(f"target's gtid_domain_id {info['target']['dom']} is already used "
                           "in the source's binlog")
            if self.spec.target_standby and not int(info["target"]["lsu"]):
                out.append(f"target {self.spec.target} has log_slave_updates off: its standby "
                           "would not get the replicated changes")
        return out

    # -- journal -------------------------------------------------------------
    def _record(self, step: str, **fields: Any) -> dict[str, Any]:
        assert self.journal is not None and self.original is not None

        def write() -> dict[str, Any]:
            assert self.journal is not None and self.original is not None
            if self.journal.data is None or self.journal.data.get("step") == "aborted":
                base = {"kind": "split", "name": self.name, "source": self.spec.source,
                        "target": self.spec.target, "target_standby": self.spec.target_standby,
                        "moving": list(self.moving), "original": self.original.to_dict(),
                        "connection": self.connection_name, "started_at": time.time(),
                        "state": "running", "steps": []}
                self.journal.data = base
            return self.journal.step(step, **fields)

        return self._journal_write(write)

    def _note(self, **fields: Any) -> None:
        """Update journal fields without recording a step."""
        assert self.journal is not None and self.journal.data is not None
        self._journal_write(lambda: self.journal.save(  # type: ignore[union-attr]
            {**(self.journal.data or {}), **fields}))  # type: ignore[union-attr]

    def _journal_write(self, write: Callable[[], Any], attempts: int = 5) -> Any:
        """*write()* the journal (a version-checked save); on a conflict, load it again and
        write again. Under the split's locks the one other writer is a physical copy's
        watch (:meth:`watch_copy`), which takes no lock and writes ``clone_progress``
        only: the module of a killed run's watch outlives its playbook (e2e: the rerun's
        first write failed "is at version 23, expected 22")."""
        assert self.journal is not None
        for attempt in range(attempts):
            try:
                return write()
            except MapConflictError:
                if attempt == attempts - 1:
                    raise
                self.journal.load()
                time.sleep(0.05)
        return None

    # -- clone ---------------------------------------------------------------
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
        tgt, src = self.spec.target, self.spec.source
        self._unfence_receivers([tgt], binlog=True)  # an aborted physical attempt's cancel
        there = self._shard_dbs(tgt)
        kept = [d for d in (data or {}).get("clone_done", [])
                if d in set(self.databases) and d in there]
        base = str((data or {}).get("clone_base") or "")
        if not base:
            kept = []
        partial = sorted((there & set(self.databases)) - set(kept))
        if partial:  # copies this split's earlier attempt did not finish: start them over
            provision.apply_drop(self.conn(tgt), partial)
        todo_dbs = [d for d in self.databases if d not in set(kept)]
        provision.ensure_shards(self.conn(tgt), [s for s in self.shards
                                                 if shard_database(s) in set(todo_dbs)],
                                self.schema, app_user=None)
        snaps, gtid = self._snapshots(src, self.clone_parallel)
        try:
            if kept:
                self._advance(kept, base, gtid)
            self._note(clone_base=gtid, clone_done=kept)
            tables, rows = self._copy(snaps, tgt, todo_dbs, kept, gtid)
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

    # -- clone, physical ------------------------------------------------------
    def _clone_physical(self, t0: float) -> StepResult:
        """The Jetpants way: a physical copy of a source node onto both target nodes, then
        the shards the target does not take dropped there.

        Without ``copy_position`` (the first call): names the copy to make (a new
        ``copy_id`` each time, in the journal's ``copy``) and stops there
        (``StepResult.waits``): the caller streams one ``mariadb-backup`` of
        ``copy["source"]`` to both ``copy["targets"]`` at once (one backup, so one GTID
        position), each node preparing it and installing it in place of its data
        directory (``shard_copy``; ``split.yml`` does it), then runs the split again with
        the copy's position and id.

        With them, the copy is attached (:meth:`_attach_copy`)."""
        data = self.journal.data if self.journal else None
        if self.progress(data) < 0:
            self._record("started")
        if not self.copy_position:
            return self._name_copy(t0)
        return self._attach_copy(t0)

    def _copy_source(self) -> str:
        """The node a physical clone copies: the source range's standby per the map (the
        master's disks and buffer pool stay the application's), else the master (no
        standby, or the map marks it for rebuild)."""
        r = self.original
        assert r is not None
        if r.standby and r.extra.get("rebuild") != r.standby:
            return r.standby
        return r.master

    def _name_copy(self, t0: float) -> StepResult:
        src = self._copy_source()
        targets = self.target_nodes
        copy = {"source": src, "targets": targets, "copy_id": secrets.token_hex(6),
                "bytes_estimated": self._estimate(self.conn(src),
                                                  sorted(self._shard_dbs(src)))["bytes"]}
        retry = [int(r.get("Connect_Retry") or 0) for r in topology.dict_rows(
            self.conn(targets[0]), "SHOW ALL SLAVES STATUS") if not r.get("Connection_name")]
        self._note(clone_method="physical", copy=copy, copy_attaching=None,
                   target_connect_retry=(retry or [self.pair_connect_retry])[0],
                   clone_progress={"phase": "copying", "copy_id": copy["copy_id"],
                                   "bytes_estimated": copy["bytes_estimated"],
                                   "started_at": round(time.time(), 3)})
        self._unfence_receivers(targets)  # an abort's cancel of older copies lifted
        return StepResult("clone", True, f"copy {src}'s data directory to {targets[0]} and "
                          f"{targets[1]} (physical, ~{copy['bytes_estimated']} bytes of "
                          "InnoDB data), then run the split again with the copy's GTID "
                          "position", time.monotonic() - t0, {"copy": copy}, waits=True)

    def watch_copy(self, receivers: Sequence[str], secret: str, *, timeout: float = 7200.0,
                   interval: float = 2.0, silence: float = 300.0) -> dict[str, Any]:
        """The copy's progress while it runs, for on-call: polls the receivers
        (:func:`shardfleet.physical.status`, the copy's secret) every *interval* seconds
        and writes ``clone_progress`` into the journal (phase, bytes received of the
        estimate, rate, ETA) until every receiver is done (installed, failed, or gone
        after it received), or *timeout*, or when no receiver answered for *silence*
        seconds (one that failed before it listened; the caller's wait for the copy's
        tasks says why: the watch only reports). Only while the journal still names the copy
        this run made: a newer run's copy is never touched, and the journal is written
        by version (a concurrent write wins; this round is skipped). Returns the last
        progress written. Takes no lock: it changes nothing but the progress. With a
        ``ca_cert`` in the split's TLS, the receivers are asked over TLS, verified by it."""
        data = self.resolve() or {}
        copy = dict(data.get("copy") or {})
        copy_id = str(copy.get("copy_id") or "")
        if not copy_id:
            raise SplitError("no physical copy is named in the journal: nothing to watch")
        estimate = int(copy.get("bytes_estimated") or 0)
        seen: dict[str, dict[str, Any]] = {}
        gone: set[str] = set()
        deadline = time.monotonic() + timeout
        progress: dict[str, Any] = {}
        heard = time.monotonic()
        # the fleet's copies run over TLS when its MySQL connections do (shard_copy's
        # tls_dir): the receivers are verified against the same CA
        stream = StreamTLS(self.tls.ca_cert) if self.tls and self.tls.ca_cert else None
        while True:
            for r in receivers:
                st = physical.status(r, secret, timeout=min(5.0, interval * 2), tls=stream)
                if st is not None:
                    seen[r] = st
                    heard = time.monotonic()
                elif r in seen:
                    gone.add(r)
            states = [seen.get(r, {}) for r in receivers]
            done_bytes = min(int(st.get("bytes") or 0) for st in states)
            secs = max(float(st.get("seconds") or 0) for st in states)
            rate = done_bytes / secs if secs > 0 else 0.0
            phases = sorted({str(st.get("phase") or "starting") for st in states})
            progress = {"phase": "/".join(phases), "copy_id": copy_id,
                        "bytes_done": done_bytes, "bytes_estimated": estimate,
                        "bytes_per_second": round(rate), "seconds": round(secs, 1),
                        "eta_seconds": (round(max(0, estimate - done_bytes) / rate)
                                        if rate > 0 and estimate else None),
                        "receivers": {r: seen.get(r, {}).get("phase", "starting")
                                      for r in receivers}}
            self._note_copy_progress(copy_id, progress)
            finished = all(r in gone or seen.get(r, {}).get("phase") in ("installed", "failed")
                           for r in receivers)
            now = time.monotonic()
            if finished or now > deadline or now - heard > silence:
                return progress
            time.sleep(interval)

    def _note_copy_progress(self, copy_id: str, progress: dict[str, Any]) -> None:
        assert self.journal is not None
        data = self.journal.load() or {}
        if (data.get("copy") or {}).get("copy_id") != copy_id or data.get("step") != "started":
            return  # another run's copy, or past the clone
        try:
            self.journal.save({**data, "clone_progress": progress})
        except MapConflictError:
            pass  # written meanwhile: the next round writes again
        log.info("copy %s: %s, %d of ~%d bytes", copy_id, progress["phase"],
                 progress["bytes_done"], progress["bytes_estimated"])

    def _attach_copy(self, t0: float) -> StepResult:
        """Both target nodes run on the copy named *copy_id*, installed at
        ``copy_position``: make them this split's target pair.

        Refused, nothing changed, when no copy was named, when another run named a newer
        copy since, when this copy's attach was begun by an earlier run (the target pair
        may have moved past its position: attaching again would rewind it; a rerun of
        the split makes a new copy), or when a node does not hold the moving databases
        or is writable. Then, on both nodes: replication stopped and its channels removed
        (the source node's, carried by the copy), the shard databases outside the moving
        range dropped (not binlogged), the binlog history reset to the copy's position;
        the pair replicates both ways from it, the split's channel from the source's
        master starts at it, and the pair is checked to replicate both ways."""
        assert self.journal is not None and self.journal.data is not None
        data = self.journal.data
        copy = dict(data.get("copy") or {})
        named = str(copy.get("copy_id") or "")
        pos = self.copy_position
        if not named:
            raise SplitError("no physical copy was named for this split: run it without "
                             "copy_position first (that names the copy to make); nothing "
                             "changed")
        if self.copy_id and self.copy_id != named:
            raise SplitError(f"another run of this split named a newer copy ({named}) after "
                             f"this run's ({self.copy_id}): the target may run on that one, "
                             "at another position; nothing changed. Run the split again "
                             "alone (it makes a new copy)")
        if data.get("copy_attaching") == named:
            raise SplitError(f"the attach of copy {named} was begun by an earlier run and cut "
                             "short: the target pair may have moved past the copy's position; "
                             "nothing changed. Run the split again (it makes a new copy)")
        nodes = self.target_nodes
        for n in nodes:
            missing = sorted(set(self.databases) - self._shard_dbs(n))
            if missing:
                raise SplitError(f"{n} lacks {len(missing)} moving shard database(s) "
                                 f"({_few(missing)}): it does not run on the copy of "
                                 f"{copy.get('source')}; nothing changed. Run the split again "
                                 "(it makes the copy first)")
            if not replication.is_read_only(self.conn(n)):
                raise SplitError(f"{n} is writable: a node that runs on a fresh copy boots "
                                 "read_only, so this is not the copy; nothing changed")
        self._note(copy_attaching=named)
        dropped = sum(len(d) for d in self._on_both(nodes, lambda n: self._reset_node(
            n, sorted(self._shard_dbs(n) - set(self.databases)), pos)))
        self._unfence_receivers(nodes)  # carried by a copy of a node once fenced
        self._pair_up(nodes)
        self._create_channel(pos)
        problems = self._pair_health()
        if problems:
            raise SplitError(f"the target pair does not replicate both ways after the copy "
                             f"was attached: {'; '.join(problems)}")
        took = time.monotonic() - t0
        stats = {k: self.copy_stats[k] for k in ("bytes", "seconds") if k in self.copy_stats}
        self._note(clone_progress={"phase": "attached", "copy_id": named, **stats})
        res = self._record("clone", clone_gtid=pos, clone_method="physical",
                           copy_source=copy.get("source"), copy_bytes=stats.get("bytes"),
                           copy_seconds=stats.get("seconds"), dropped_on_target=dropped,
                           clone_seconds=round(took, 3))
        return StepResult("clone", True, f"attached the physical copy of {copy.get('source')} "
                          f"at GTID {pos} on {nodes[0]} and {nodes[1]} (dropped {dropped} "
                          "shard database(s) the target does not take)", took,
                          {"clone_gtid": res["clone_gtid"], "copy": copy})

    def _snapshots(self, src: str, n: int) -> tuple[list[Any], str]:
        """*n* connections to *src* in one consistent snapshot, and its GTID position.
        More than one are started while commits are blocked (``BACKUP STAGE
        BLOCK_COMMIT``, held for the moments the snapshots take to start; writes wait,
        none fails), and checked to be at one binlog position."""
        conns = [topology.connect(src, self.creds.admin_user, self.creds.admin_password,
                                  timeout=self.connect_timeout, tls=self.tls)
                 for _ in range(max(1, n))]
        try:
            gate = self.conn(src) if len(conns) > 1 else None
            if gate is not None:
                with gate.cursor() as c:
                    c.execute("SET SESSION lock_wait_timeout = %s", (int(self.lock_timeout) + 5,))
                    c.execute("BACKUP STAGE START")
                    c.execute("BACKUP STAGE BLOCK_COMMIT")
            seen: set[tuple[str, int]] = set()
            try:
                for conn in conns:
                    with conn.cursor() as cur:
                        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
                        cur.execute("SHOW STATUS LIKE 'binlog_snapshot_%'")
                        st = {k.lower(): v for k, v in cur.fetchall()}
                    seen.add((str(st["binlog_snapshot_file"]),
                              int(st["binlog_snapshot_position"])))
            finally:
                if gate is not None:
                    with gate.cursor() as c:
                        c.execute("BACKUP STAGE END")
            if len(seen) != 1:
                raise SplitError(f"the clone's {len(conns)} snapshots of {src} are at "
                                 f"different binlog positions ({sorted(seen)}); nothing was "
                                 "copied, run the split again")
            (file, pos), = seen
            with conns[0].cursor() as cur:
                cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (file, pos))
                gtid = str(cur.fetchone()[0] or "")
            return conns, gtid
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
            self._exec(tgt, replication.slave_sql("STOP", name))
            self._exec(tgt, f"SET GLOBAL `{name}`.replicate_do_db = %s", (",".join(kept),))
        self._start_channel(name, until=until)
        self._wait_applied(until, self.catchup_timeout, "bring the databases copied earlier "
                           "to the new snapshot")
        # UNTIL keeps it from applying more, but its threads stop only once an event past
        # the position arrives (a quiet source: never): stop it here, at the position
        self._exec(tgt, replication.slave_sql("STOP", name))

    def _copy(self, snaps: list[Any], tgt: str, dbs: list[str], kept: list[str],
              gtid: str, batch: int = 1000) -> tuple[int, int]:
        """Copy every row of *dbs* from the snapshot connections *snaps* (one worker each,
        a database at a time), recording each finished database and the progress in the
        journal (every couple of seconds)."""
        import queue
        import threading

        import pymysql.cursors

        estimate = self._estimate(snaps[0], dbs)
        work: queue.SimpleQueue[str] = queue.SimpleQueue()
        for db in dbs:
            work.put(db)
        done = list(kept)
        lock = threading.Lock()
        stop = threading.Event()
        failures: list[BaseException] = []
        totals = {"tables": 0, "rows": 0}
        tables = self.schema.tables

        def worker(snap: Any) -> None:
            out = topology.connect(tgt, self.creds.admin_user, self.creds.admin_password,
                                   timeout=self.connect_timeout, tls=self.tls)
            try:
                while not stop.is_set():
                    try:
                        db = work.get_nowait()
                    except queue.Empty:
                        return
                    ntab = 0
                    for t in tables:
                        nrows = 0
                        with snap.cursor(pymysql.cursors.SSCursor) as rd:
                            rd.execute(f"SELECT * FROM `{db}`.`{t}`")
                            cols = ", ".join(f"`{d[0]}`" for d in rd.description)
                            marks = ", ".join(["%s"] * len(rd.description))
                            sql = f"INSERT INTO `{db}`.`{t}` ({cols}) VALUES ({marks})"
                            while not stop.is_set():
                                chunk = rd.fetchmany(batch)
                                if not chunk:
                                    break
                                ntab += nrows == 0
                                with out.cursor() as wr:
                                    wr.executemany(sql, chunk)
                                nrows += len(chunk)
                                with lock:
                                    totals["rows"] += len(chunk)
                        if stop.is_set():
                            return
                    with lock:
                        done.append(db)
                        totals["tables"] += ntab
                    if self.after_clone_db is not None:
                        self.after_clone_db(db)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failures.append(exc)
                stop.set()
            finally:
                out.close()

        threads = [threading.Thread(target=worker, args=(c,), daemon=True,
                                    name=f"split-clone-{i}") for i, c in enumerate(snaps)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        try:
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(timeout=2.0)
                with lock:
                    snapshot = (list(done), totals["rows"])
                self._note_progress(snapshot[0], len(kept), dbs, snapshot[1], estimate,
                                    time.monotonic() - t0)
        finally:
            stop.set()
            for t in threads:
                t.join()
            # what finished is kept by a rerun, whatever ended this one
            self._note_progress(done, len(kept), dbs, totals["rows"], estimate,
                                time.monotonic() - t0)
        if failures:
            raise failures[0]
        for c in snaps:
            c.commit()
        return totals["tables"], totals["rows"]

    @staticmethod
    def _estimate(snap: Any, dbs: list[str]) -> dict[str, int]:
        """InnoDB's persistent statistics of *dbs*: rows and bytes (for progress; never
        exact). ``mysql.innodb_table_stats`` is a plain table: information_schema.TABLES
        would open every table of a 2,048-shard server to answer."""
        rows = size = 0
        with snap.cursor() as cur:
            for i in range(0, len(dbs), 500):
                part = dbs[i:i + 500]
                cur.execute("SELECT COALESCE(SUM(n_rows), 0), COALESCE(SUM("
                            "clustered_index_size + sum_of_other_index_sizes), 0) * "
                            "@@innodb_page_size FROM mysql.innodb_table_stats WHERE "
                            f"database_name IN ({', '.join(['%s'] * len(part))})", part)
                r, b = cur.fetchone()
                rows, size = rows + int(r), size + int(b)
        return {"rows": rows, "bytes": size}

    def _note_progress(self, done: list[str], kept: int, dbs: list[str], rows: int,
                       estimate: dict[str, int], seconds: float) -> None:
        """The clone's progress in the journal: what is finished (kept by a rerun) and
        rows done of the estimate, rate, ETA."""
        rate = rows / seconds if seconds > 0 else 0.0
        left = max(0, estimate["rows"] - rows)
        progress = {"databases_done": len(done), "databases": kept + len(dbs),
                    "rows_done": rows, "rows_estimated": estimate["rows"],
                    "bytes_estimated": estimate["bytes"], "rows_per_second": round(rate),
                    "eta_seconds": round(left / rate) if rate > 0 else None,
                    "seconds": round(seconds, 1)}
        self._note(clone_done=done, clone_progress=progress)
        log.info("clone %s: %d/%d databases, %d of ~%d rows, %.0f rows/s", self.name,
                 len(done), kept + len(dbs), rows, estimate["rows"], rate)

    # -- replicate -----------------------------------------------------------
    def _channel(self, server: str, name: str | None = None) -> dict[str, Any] | None:
        """*server*'s replication connection *name* (default: the split's), as ``SHOW ALL
        SLAVES STATUS`` shows it, or None."""
        want = self.connection_name if name is None else name
        for r in topology.dict_rows(self.conn(server), "SHOW ALL SLAVES STATUS"):
            if str(r.get("Connection_name") or "") == want:
                return r
        return None

    def replicate(self) -> StepResult:
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        done = self.progress(data)
        if done < PROGRESS["clone"]:
            raise SplitError(f"split {self.name} has not been cloned yet; run the clone step")
        if done >= PROGRESS["cutover"]:
            return StepResult("replicate", False, "past the cutover: the split's replication "
                              "is gone")
        assert data is not None
        tgt = self.spec.target
        changed = False
        ch = self._channel(tgt)
        if ch is None:
            self._create_channel(str(data["clone_gtid"]))
            changed = True
        elif (ch.get("Slave_SQL_Running") != "Yes" or ch.get("Slave_IO_Running") != "Yes"
              or set(str(ch.get("Replicate_Do_DB") or "").split(",")) != set(self.databases)
              or str(ch.get("Until_Condition") or "None") != "None"):
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error")
            if ch.get("Last_SQL_Errno"):
                raise SplitError(f"the split's replication on {tgt} stopped with an error: "
                                 f"{err}; abort the split (step abort) and run it again")
            # stopped without an error, or left by the clone applying only the databases
            # an earlier attempt copied (UNTIL the new snapshot): every moving database now
            self._exec(tgt, replication.slave_sql("STOP", self.connection_name))
            self._exec(tgt, f"SET GLOBAL `{self.connection_name}`.replicate_do_db = %s",
                       (",".join(self.databases),))
            self._start_channel(self.connection_name)
            changed = True
        pos = replication.gtid_position(self.conn(self.spec.source))
        self._wait_applied(pos, self.catchup_timeout, "catch up")
        lag = time.monotonic() - t0
        if done < PROGRESS["replicate"]:
            self._record("replicate", replicate_gtid=pos, catchup_seconds=round(lag, 3))
            changed = True
        return StepResult("replicate", changed, f"{tgt} replicates the moving shards from "
                          f"{self.spec.source} and has applied {pos}", lag,
                          {"replicate_gtid": pos})

    def _create_channel(self, clone_gtid: str, *, databases: Sequence[str] | None = None,
                        start: bool = True) -> None:
        """The split's channel on the target from *clone_gtid*, applying *databases* (all
        the moving ones by default); started unless *start* is false (the target's other
        channels are started again either way)."""
        tgt, name = self.spec.target, self.connection_name
        c = self.conn(tgt)
        running = [r["Connection_name"] for r in topology.dict_rows(c, "SHOW ALL SLAVES STATUS")
                   if r.get("Slave_IO_Running") == "Yes" or r.get("Slave_SQL_Running") == "Yes"]
        host, _, port = self.spec.source.rpartition(":")
        slave_pos = merge_gtids(str(topology.scalar(c, "SELECT @@GLOBAL.gtid_slave_pos") or ""),
                                clone_gtid)
        self._exec(tgt, "STOP ALL SLAVES")
        try:
            # The target's standby echoes the source's GTIDs back to the target's
            # master (server_id differs from the master's own): ignore the duplicates.
            self._exec(tgt, "SET GLOBAL gtid_ignore_duplicates = ON")
            self._exec(tgt, "SET GLOBAL gtid_slave_pos = %s", (slave_pos,))
            replication.change_master(c, host.strip("[]"), int(port), self.creds.repl_user,
                                      self.creds.repl_password, name=name)
            self._exec(tgt, f"SET GLOBAL `{name}`.replicate_do_db = %s",
                       (",".join(self.databases if databases is None else databases),))
        finally:
            for other in running + [name]:
                if other == name and (not start or self._channel(tgt) is None):
                    continue
                self._start_channel(other)

    def _start_channel(self, name: str, *, until: str | None = None) -> None:
        """START SLAVE of the target's channel *name* (``UNTIL master_gtid_pos`` *until*),
        first clearing a skip counter an earlier stop left on it.

        With ``gtid_ignore_duplicates`` on (set by :meth:`_create_channel`), MariaDB skips an
        event group whose GTID it applied already by setting the channel's
        ``sql_slave_skip_counter`` to 1 until the group's end (``exec_relay_log_event`` in
        sql/slave.cc). The target's channel from its standby gets such groups all through
        the split: the standby's echo of the source transactions the split's channel
        applied. A STOP SLAVE while one is still arriving leaves the counter at 1, and the
        next START skips the next group the channel reads, a new transaction: its GTID
        counts as applied, its changes are lost, both threads say Yes (fault campaign,
        seed 500073: a row written on the target's standby after the cutover never reached
        the target). Nothing here sets the counter on purpose, and a started channel
        begins at a group's start (GTID mode: from ``gtid_slave_pos``), so a leftover
        counter only ever skips a transaction that was not applied."""
        tgt = self.spec.target
        ch = self._channel(tgt, name)
        if (ch is not None and int(ch.get("Skip_Counter") or 0)
                and ch.get("Slave_SQL_Running") != "Yes"):
            log.warning("split %s: %s's replication connection %r was stopped with "
                        "sql_slave_skip_counter %s (a skipped duplicate left unfinished); "
                        "cleared before starting it", self.name if self.journal else "",
                        tgt, name, ch.get("Skip_Counter"))
            replication.clear_skip_counter(self.conn(tgt), name)
        if until is None:
            self._exec(tgt, replication.slave_sql("START", name))
        else:
            self._exec(tgt, replication.slave_sql("START", name) + " UNTIL master_gtid_pos = %s",
                       (until,))

    def _wait_applied(self, pos: str, timeout: float, what: str) -> None:
        """Wait (bounded) until the target applied *pos*: a split channel that stopped
        with an error fails the wait at once, naming the error."""
        def stopped() -> None:
            ch = self._channel(self.spec.target) or {}
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error") or ""
            if ch and err and "No" in (ch.get("Slave_SQL_Running"), ch.get("Slave_IO_Running")):
                raise SplitError(f"target did not {what}: the split's replication from "
                                 f"{self.spec.source} stopped: {err}")

        try:
            replication.wait_for_gtid(self.conn(self.spec.target), pos, timeout, stopped)
        except replication.ReplicationTimeout as exc:
            ch = self._channel(self.spec.target) or {}
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error") or ""
            raise SplitError(f"target did not {what}: {exc}"
                             f"{'; replication error: ' + err if err else ''}") from None

    def _remove_channel(self) -> bool:
        if self._channel(self.spec.target) is None:
            return False
        self._exec(self.spec.target, replication.slave_sql("STOP", self.connection_name))
        self._exec(self.spec.target, replication.slave_sql("RESET", self.connection_name, "ALL"))
        return True

    # -- the map -------------------------------------------------------------
    # Every map change is one edit of the map-change vocabulary (shardmap: freeze, thaw,
    # flip, owned by this split's name) through mapstore.update, which survives a lost
    # reply by reading the map again and deciding by content.

    def _freeze(self) -> bool:
        def edit(m: ShardMap) -> ShardMap:
            cur = m.find(self.moving[0])
            if cur is None or cur.master != self.spec.source:
                raise SplitError(f"shard {self.moving[0]} is on "
                                 f"{cur.master if cur else 'no server'}, not the source")
            return m.freeze([self.moving], self.name)
        return self._update(edit).changed

    def _thaw(self) -> bool:
        """The moving piece's freeze lifted and the source's range whole again (only this
        split's piece: another operation's freeze inside the same range stays)."""
        assert self.original is not None
        bounds = self.original.bounds
        return self._update(lambda m: m.thaw(self.name, rejoin=bounds)).changed

    def _flip(self) -> bool:
        # "rebuild" names a node of the source pair: it says nothing of the target pair
        return self._update(lambda m: m.flip(
            self.name, [self.moving], master=self.spec.target,
            standby=self.spec.target_standby, drop=("rebuild",))).changed

    def _update(self, edit: Callable[[ShardMap], ShardMap]) -> Updated:
        try:
            return update(self.store, edit)
        except MapError as exc:
            raise SplitError(f"the map does not allow this step: {exc}") from None

    def _flipped(self, m: ShardMap) -> bool:
        """The map puts the moving range on the target (the cutover's flip landed)."""
        entry = m.find(self.moving[0])
        return (entry is not None and entry.bounds == self.moving
                and entry.master == self.spec.target and entry.state != "frozen")

    def _settled_map(self) -> ShardMap:
        """The map, read after a sync (retrying within the store's timeout)."""
        sync = getattr(self.store, "sync", None)
        if sync is not None:
            sync()
        m = self.store.read().map
        if m is None:
            raise SplitError("the shard map disappeared from ZooKeeper")
        return m

    # -- fence ---------------------------------------------------------------
    def _set_fence(self, on: bool, *, reads: bool = False) -> int:
        """Take (on) or give back (off) the application user's write privileges on the moving
        databases on the source master; returns how many grants changed.

        One UPDATE of ``mysql.db`` and ``FLUSH PRIVILEGES``: constant time, where a REVOKE per
        database costs ~0.6 ms each. Both are binlogged (row events, FLUSH is logged), so the
        source's standby holds the same fence; the split's replication filter skips them.
        The FLUSH runs whether or not the UPDATE changed a row: a run killed between the two
        left the table fenced and the live privileges open, and only a FLUSH closes them.
        """
        flag = "N" if on else "Y"
        dbs = self.databases
        privs = WRITE_PRIVILEGES + (("Select_priv",) if reads or not on else ())
        marks = ",".join(["%s"] * len(dbs))
        sets = ", ".join(f"{p} = %s" for p in privs)
        not_yet = " OR ".join(f"{p} <> %s" for p in privs)
        sql = (f"UPDATE mysql.db SET {sets} WHERE User = %s AND Host = %s "
               f"AND Db IN ({marks}) AND ({not_yet})")
        with self.conn(self.spec.source).cursor() as cur:
            n = cur.execute(sql, [flag] * len(privs) + [self.creds.app_user,
                                                        self.creds.app_host] + dbs
                            + [flag] * len(privs))
            cur.execute("FLUSH PRIVILEGES")
        return int(n)

    def _fence_problems(self, *, fenced: bool = False) -> list[str]:
        """Why the fence would not (or, *fenced*, does not) stop the application's writes to
        the moving databases on the source: a database without a grant row for
        ``app_user@app_host`` (the fence takes privileges from those rows, so an
        ``app_host`` that matches none fences nothing), another host pattern of the same
        user that may write them, global write privileges, and once fenced any row still
        writable. Empty: the fence holds."""
        user, host, dbs = self.creds.app_user, self.creds.app_host, self.databases
        marks = ",".join(["%s"] * len(dbs))
        writable = " OR ".join(f"{p} = 'Y'" for p in WRITE_PRIVILEGES)
        rows = self._exec(self.spec.source, f"SELECT Db, ({writable}) FROM mysql.db WHERE "
                          f"User = %s AND Host = %s AND Db IN ({marks})", [user, host] + dbs)
        have = {str(r[0]): bool(r[1]) for r in rows}
        out = []
        missing = [d for d in dbs if d not in have]
        if missing:
            out.append(f"the application user '{user}'@'{host}' has no grant on {len(missing)} "
                       f"moving database(s) on the source ({_few(missing)}): the fence takes "
                       "write privileges from those grants, so it would stop nothing (give "
                       "the app_host its grants use)")
        if fenced:
            # the table and what the server enforces: the privileges it holds in memory
            live = self._exec(self.spec.source, "SELECT DISTINCT TABLE_SCHEMA FROM "
                              "information_schema.SCHEMA_PRIVILEGES WHERE GRANTEE = %s AND "
                              f"PRIVILEGE_TYPE IN ({LIVE_WRITE_PRIVILEGES}) AND TABLE_SCHEMA "
                              f"IN ({marks})", [f"'{user}'@'{host}'"] + dbs)
            still = sorted({d for d, w in have.items() if w} | {str(r[0]) for r in live})
            if still:
                out.append(f"'{user}'@'{host}' can still write {len(still)} moving "
                           f"database(s) ({_few(still)})")
        others = self._exec(self.spec.source, f"SELECT DISTINCT Host FROM mysql.db WHERE "
                            f"User = %s AND Host <> %s AND Db IN ({marks}) AND ({writable})",
                            [user, host] + dbs)
        if others:
            out.append(f"'{user}' may also write the moving databases from host(s) "
                       f"{', '.join(str(r[0]) for r in others)}, which the fence (on "
                       f"'{host}') does not cover")
        glob = self._exec(self.spec.source, f"SELECT Host FROM mysql.user WHERE User = %s "
                          f"AND ({writable})", [user])
        if glob:
            out.append(f"'{user}' has global write privileges (host "
                       f"{', '.join(str(r[0]) for r in glob)}): a fence on databases cannot "
                       "hold it")
        return out

    def _drain(self, fenced_at: float) -> list[str]:
        """Wait (bounded) for the application's writes that may have passed the privilege check
        before the fence (the rule is :func:`pending_writes`). New statements on the moving
        shards are refused (1142), so once these end nothing else can land there. Returns a
        description of each one still open when the wait ends (empty: drained).

        InnoDB's transaction view is read every ``replication.TRX_VIEW_PERIOD`` and a
        reading counts only when it was refreshed after the fence
        (:func:`replication.innodb_trx_view`)."""
        c = self.conn(self.spec.source)
        deadline = fenced_at + self.drain_timeout
        q: int | None = None
        cutoff: Any = None
        pending = ["InnoDB's transaction view (information_schema.INNODB_TRX) was not "
                   "refreshed: another client reads it more often than every 0.1 s"]
        while True:
            snapshot = replication.innodb_trx_view(c, DRAIN_SQL, (self.creds.app_user,))
            if snapshot is not None:
                if not snapshot:
                    return []
                if q is None:
                    q, cutoff = int(snapshot[0][6]), snapshot[0][12]
                pending = pending_writes(snapshot, q, cutoff)
                if not pending:
                    return []
            if time.monotonic() + replication.TRX_VIEW_PERIOD > deadline:
                return pending
            time.sleep(replication.TRX_VIEW_PERIOD)

    # -- cutover -------------------------------------------------------------
    def cutover(self) -> StepResult:
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        done = self.progress(data)
        if done >= PROGRESS["cutover"]:
            return StepResult("cutover", False, f"cut over already (map version flipped; stall "
                              f"{data and data.get('frozen_seconds')} s)")
        if done < PROGRESS["replicate"]:
            raise SplitError(f"split {self.name} does not replicate yet; run the replicate step")
        assert data is not None
        if self._flipped(self._settled_map()):
            # flipped before a crash or a lost reply: fence again (a run that undid its
            # fence after an ambiguous flip left the source writable), then finish
            self._fence_after_flip()
            self._finish_cutover()
            self._record("cutover", cutover_gtid=data.get("cutover_gtid"), state="cut over",
                         cutover_phase=None)
            return StepResult("cutover", True, "the map had been flipped; fenced the source "
                              "and finished the cutover", time.monotonic() - t0)
        ch = self._channel(self.spec.target)
        if ch is None or ch.get("Slave_SQL_Running") != "Yes":
            raise SplitError(f"the split's replication on {self.spec.target} is not running; "
                             "run the replicate step first")
        fence = self._fence_problems()
        if fence:
            raise SplitError("; ".join(fence) + "; nothing changed")
        # Before the freeze (outside the stall): catch up, grant the application user on
        # the target and make its master writable. Nothing routes there before the flip.
        self._wait_applied(replication.gtid_position(self.conn(self.spec.source)),
                           self.catchup_timeout, "catch up before the cutover")
        tconn = self.conn(self.spec.target)
        plan = provision.plan_shards(tconn, self.shards, self.schema,
                                     app_user=self.creds.app_user, app_host=self.creds.app_host,
                                     check_definitions=False)
        provision.apply_plan(tconn, plan, self.schema, app_user=self.creds.app_user,
                             app_host=self.creds.app_host)
        replication.set_read_only(tconn, False)
        self._note(cutover_phase="freezing", cutover_attempt_at=time.time())
        # -- the stall starts
        frozen_at = time.monotonic()
        self._freeze()
        fenced_at, pos, waited = frozen_at, "", 0.0
        try:
            self._set_fence(True)
            fenced_at = time.monotonic()
            open_grants = self._fence_problems(fenced=True)
            if open_grants:
                raise SplitError("the fence does not hold: " + "; ".join(open_grants))
            left = self._drain(fenced_at)
            if left:
                raise CutoverAborted(f"{len(left)} write(s) on {self.spec.source} did not "
                                     f"finish within {self.drain_timeout}s of the fence: "
                                     + "; ".join(left))
            pos = replication.gtid_position(self.conn(self.spec.source))  # after the fence
            waited = time.monotonic()
            try:
                replication.wait_for_gtid(tconn, pos, self.cutover_timeout)
            except replication.ReplicationTimeout:
                raise CutoverAborted(f"target {self.spec.target} did not apply the source's "
                                     f"position {pos} within {self.cutover_timeout}s") from None
            waited = time.monotonic() - waited
            self._exec(self.spec.target, replication.slave_sql("STOP", self.connection_name))
            self._flip()
        except MapWriteUnknown as exc:
            raise SplitError(
                f"the cutover's map write may or may not have landed ({exc}). The fence and "
                f"the freeze STAY on shards {self.moving[0]}..{self.moving[1]} (writes to them "
                "are held or refused, nothing is lost); when ZooKeeper answers, rerun the "
                "cutover step: it finishes the cutover if the map was flipped") from None
        except BaseException as exc:
            if self._undo_cutover(exc):
                raise
            # the flip had landed although the call failed: finish below
        flipped_at = time.monotonic()
        # -- the stall ends
        stall = flipped_at - frozen_at
        self._fence_after_flip()
        self._finish_cutover()
        self._record("cutover", cutover_gtid=pos, frozen_seconds=round(stall, 4),
                     fence_to_flip_seconds=round(flipped_at - fenced_at, 4),
                     gtid_wait_seconds=round(waited, 4), cutover_phase=None,
                     last_cutover_error=None, state="cut over")
        return StepResult("cutover", True, f"shards {self.moving[0]}..{self.moving[1]} now on "
                          f"{self.spec.target}; writes to them were held {stall * 1000:.0f} ms",
                          time.monotonic() - t0, {"frozen_seconds": round(stall, 4),
                                                  "cutover_gtid": pos})

    def _undo_cutover(self, exc: BaseException) -> bool:
        """After a failed cutover: read the map first. Flipped (the write landed though the
        call failed): keep the fence and return False, the caller finishes the cutover. Not
        flipped: lift the fence, then the freeze (in that order: an unfrozen router must
        find the source writable), restart the split's replication, record why; True.
        Unreadable: keep everything and raise (a rerun decides)."""
        log.warning("cutover of %s failed (%s); reading the map before undoing it",
                    self.name, exc)
        try:
            m = self._settled_map()
        except ShardfleetError as read_exc:
            raise SplitError(
                f"cutover failed ({exc}) and the map cannot be read to tell whether the flip "
                f"landed ({read_exc}). The fence and the freeze STAY on shards "
                f"{self.moving[0]}..{self.moving[1]}; when ZooKeeper answers, rerun the "
                "cutover step: it finishes the cutover if the map was flipped, or undoes "
                "it") from exc
        if self._flipped(m):
            log.warning("the flip of %s had landed; finishing the cutover", self.name)
            return False
        try:
            self._set_fence(False)
            self._thaw()
            if self._channel(self.spec.target) is not None:
                self._start_channel(self.connection_name)
            self._note(cutover_phase=None, last_cutover_error=str(exc) or type(exc).__name__)
        except Exception as undo_exc:  # noqa: BLE001 - report both
            raise SplitError(f"cutover failed ({exc}) and undoing it failed too ({undo_exc}); "
                             "rerun the cutover step (it finishes or undoes it by what the map "
                             "says), or run the abort step") from undo_exc
        if isinstance(exc, CutoverAborted):
            exc.args = (f"cutover undone: {exc}; the freeze and the fence are lifted and the "
                        "map is as it was",)
        return True

    def _fence_after_flip(self) -> None:
        """The source refuses the moved shards to the application for good: writes (a
        router still on the old map must not write where nothing replicates any more) and
        reads (it must not read, and fill caches with, the source's stale copy)."""
        self._set_fence(True, reads=True)
        problems = self._fence_problems(fenced=True)
        if problems:
            raise SplitError("the map is flipped but the fence on the source does not hold: "
                             + "; ".join(problems) + "; fix the grants, rerun the cutover step")

    def _finish_cutover(self) -> None:
        """Remove the split's replication and prove the target pair replicates both ways."""
        self._remove_channel()
        self._restart_pair_channels()
        problems = self._pair_health()
        if problems:
            raise SplitError("the cutover is done but the target pair is not healthy: "
                             + "; ".join(problems))

    def _restart_pair_channels(self) -> None:
        """Restart the target master's own channels after the split's is gone. MariaDB's
        semi-sync replica state is global: stopping the split's connection turns it off
        for the pair's connection too, whose I/O thread then misreads the master's
        semi-sync packets (error 1595 "could not queue event"). A restart renegotiates."""
        tconn = self.conn(self.spec.target)
        names = [str(r.get("Connection_name") or "")
                 for r in topology.dict_rows(tconn, "SHOW ALL SLAVES STATUS")]
        for name in names:
            self._exec(self.spec.target, replication.slave_sql("STOP", name))
        if self.spec.target_standby:
            self._align_source_domains()
        for name in names:
            self._start_channel(name)

    def _align_source_domains(self) -> None:
        """The target's position in the source's domains as its standby's binlog has them.

        ``gtid_slave_pos`` is one for every channel: the split's channel left the source's
        domain at the last source transaction the target *applied*, but the target logs
        only the moving databases' (the others are filtered) and its standby may not have
        received them yet. Its channel from the standby then asks for a GTID the standby
        does not have and stops for good (1236 "... which is not in the master's binlog";
        found by the fault campaign, seed 999304). So: wait (bounded) until the standby
        has everything the target logged, then set the target's position in each domain
        the standby's binlog is behind in to the standby's (nothing after it will come:
        the split's replication is gone). Called with the target's channels stopped."""
        tconn, sconn = self.conn(self.spec.target), self.conn(str(self.spec.target_standby))
        replication.wait_for_gtid(sconn, replication.gtid_position(tconn), 30.0)
        have = replication.parse_gtids(replication.gtid_position(sconn))
        slave = replication.parse_gtids(str(topology.scalar(
            tconn, "SELECT @@GLOBAL.gtid_slave_pos") or ""))
        behind = {d: have[d] for d, (_, seq) in slave.items() if d in have and have[d][1] < seq}
        if behind:
            slave.update(behind)
            pos = replication.format_gtids(slave)
            log.info("split %s: the target's gtid_slave_pos in domains %s set to its "
                     "standby's: %s", self.name, sorted(behind), pos)
            self._exec(self.spec.target, "SET GLOBAL gtid_slave_pos = %s", (pos,))

    def _pair_health(self, timeout: float = 30.0) -> list[str]:
        """Wait (bounded) until the target master and its standby replicate from each other
        (both threads running, no error); what is still wrong after *timeout*."""
        servers = [self.spec.target] + ([self.spec.target_standby]
                                        if self.spec.target_standby else [])
        deadline = time.monotonic() + timeout
        while True:
            problems = []
            for server in servers:
                rows = [r for r in topology.dict_rows(self.conn(server), "SHOW ALL SLAVES STATUS")
                        if not r.get("Connection_name")]
                if self.spec.target_standby and not rows:
                    problems.append(f"{server} has no replication from its peer")
                for r in rows:
                    if (r.get("Slave_IO_Running"), r.get("Slave_SQL_Running")) != ("Yes", "Yes"):
                        problems.append(
                            f"{server}: replication from {r.get('Master_Host')}:"
                            f"{r.get('Master_Port')} IO {r.get('Slave_IO_Running')} SQL "
                            f"{r.get('Slave_SQL_Running')} ({r.get('Last_IO_Error') or ''}"
                            f"{r.get('Last_SQL_Error') or ''})")
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.2)

    # -- cleanup -------------------------------------------------------------
    def cleanup(self) -> StepResult:
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        done = self.progress(data)
        if done >= PROGRESS["cleanup"]:
            return StepResult("cleanup", False, "cleaned up already")
        if done < PROGRESS["cutover"]:
            raise SplitError(f"split {self.name} has not cut over; cleanup drops the source's "
                             "copies only after the cutover")
        m = self.store.read().map
        assert m is not None
        for s in (self.moving[0], self.moving[1]):
            r = m.find(s)
            if r is None or r.master != self.spec.target:
                raise SplitError(f"the map puts shard {s} on {r.master if r else 'nothing'}, "
                                 f"not {self.spec.target}; refusing to drop the source's copy")
        src_dbs = sorted(self._shard_dbs(self.spec.source) & set(self.databases))
        provision.apply_drop(self.conn(self.spec.source), src_dbs, app_user=self.creds.app_user,
                             app_host=self.creds.app_host)
        keep = {shard_database(s) for r in m.ranges_of(self.spec.target)
                for s in range(r.first, r.last + 1)}
        stray = sorted(self._shard_dbs(self.spec.target) - keep)
        provision.apply_drop(self.conn(self.spec.target), stray, app_user=self.creds.app_user,
                             app_host=self.creds.app_host)
        self._record("cleanup", state="done", dropped_source=len(src_dbs),
                     dropped_target=len(stray))
        return StepResult("cleanup", bool(src_dbs or stray),
                          f"dropped {len(src_dbs)} moved database(s) from {self.spec.source} and "
                          f"{len(stray)} stray one(s) from {self.spec.target}",
                          time.monotonic() - t0)

    # -- abort ---------------------------------------------------------------
    def abort(self) -> StepResult:
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        done = self.progress(data)
        if data is None:
            return StepResult("abort", False, "no split in progress; nothing to undo")
        if done >= PROGRESS["cutover"]:
            raise SplitError(f"split {self.name} is past its cutover: shards "
                             f"{self.moving[0]}..{self.moving[1]} live on {self.spec.target} now; "
                             "run cleanup (or split them back)")
        current = self.store.read().map
        entry = current.find(self.moving[0]) if current else None
        if entry is not None and entry.master == self.spec.target:
            raise SplitError("the map was flipped to the target already; run the cutover step "
                             "to finish it instead of aborting")
        # first of all, no receiver of this split's copy may install any more
        receivers = self._fence_receivers(data)
        removed = self._remove_channel()
        unfenced = self._set_fence(False)
        restored = self._thaw()
        if data.get("copy") and self.spec.target_standby:
            copies = self._empty_target_pair()
        else:
            copies = sorted(self._shard_dbs(self.spec.target) & set(self.databases))
            provision.apply_drop(self.conn(self.spec.target), copies,
                                 app_user=self.creds.app_user, app_host=self.creds.app_host)
        self._check_fenced_and_empty(receivers)
        self._record("aborted", state="aborted")
        did = [w for w, yes in (("removed the replication", removed),
                                (f"lifted the fence on {unfenced} grant(s)", unfenced),
                                ("restored the map", restored),
                                (f"dropped {len(copies)} copies from the target", copies)) if yes]
        return StepResult("abort", True, "aborted: " + (", ".join(did) or "nothing to undo"),
                          time.monotonic() - t0)

    def _fence_receivers(self, data: dict[str, Any]) -> list[str]:
        """Cancel the copies into the nodes the journal's physical copy names (none: no
        receiver of this split can exist): :data:`shardfleet.physical.FENCE_DB` created
        on each, not binlogged (each node its own). A receiver installs only when it
        does not find it, looked at once its server is stopped for the swap
        (:func:`shardfleet.physical.install`): so once this returned, no receiver that
        had not stopped the server yet installs; one that had is installing and the node
        does not answer (the connection waits for it, ``start_wait``, and then this runs on
        the copy, which the abort then empties). Returns the nodes fenced."""
        nodes = [str(n) for n in ((data.get("copy") or {}).get("targets") or ()) if n]
        for n in nodes:
            with self._unlogged(n):
                self._exec(n, f"CREATE DATABASE IF NOT EXISTS `{physical.FENCE_DB}` "
                              "COMMENT 'copies cancelled by a split abort'")
        return nodes

    def _unfence_receivers(self, nodes: Sequence[str], *, binlog: bool = False) -> None:
        """A new copy (or clone) onto *nodes*: an abort's cancel of the copies into them
        lifted. *binlog*: dropped on the first node and replicated to its peer (a logical
        clone, which talks to the target's master only); else on each node, not binlogged."""
        for n in nodes[:1] if binlog else nodes:
            with self._unlogged(n, on=not binlog):
                self._exec(n, f"DROP DATABASE IF EXISTS `{physical.FENCE_DB}`")

    @contextmanager
    def _unlogged(self, node: str, *, on: bool = True) -> Iterator[None]:
        """Statements on *node* not binlogged (each node of a pair its own) while held
        (*on*; else binlogged as ever)."""
        if not on:
            yield
            return
        self._exec(node, replication.SKIP_BINLOG_SQL)
        try:
            yield
        finally:
            self._exec(node, "SET SESSION sql_log_bin = 1")

    def _check_fenced_and_empty(self, nodes: Sequence[str]) -> None:
        """The abort's end on the fenced *nodes*: each still fenced and holding no shard
        database (the server the abort emptied is the one it fenced); else SplitError and
        the abort is not recorded (run it again)."""
        for n in nodes:
            fenced = self._exec(n, "SHOW DATABASES LIKE %s", (physical.FENCE_DB,))
            left = sorted(self._shard_dbs(n))
            if not fenced or left:
                raise SplitError(f"{n} changed while the abort ran (fenced: {bool(fenced)}, "
                                 f"{len(left)} shard database(s) there): a copy was installed "
                                 "meanwhile; run the abort again")

    def _empty_target_pair(self) -> list[str]:
        """The abort of a physical clone: a copy of the source may be installed on either
        target node, with or without the pair's replication (an attach resets it). Both
        nodes are made an empty pair again: every shard database dropped on each (not
        binlogged), binlog history and positions reset, replicating both ways (checked).
        Returns the databases dropped on the target's master."""
        nodes = self.target_nodes
        dropped = self._on_both(nodes, lambda n: self._reset_node(
            n, sorted(self._shard_dbs(n)), ""))[0]
        self._pair_up(nodes)
        problems = self._pair_health()
        if problems:
            raise SplitError("the target pair does not replicate both ways after the abort "
                             f"emptied it: {'; '.join(problems)}")
        return dropped

    def _reset_node(self, node: str, drop: list[str], pos: str) -> list[str]:
        """A target node made fresh at GTID *pos* ('' for none): its replication channels
        stopped and removed, the shard databases *drop* dropped (not binlogged: each node
        drops its own), binlog history reset to *pos*, ``gtid_slave_pos`` set to it.
        Returns *drop*."""
        c = self.conn(node)
        for ch in topology.dict_rows(c, "SHOW ALL SLAVES STATUS"):
            name = str(ch.get("Connection_name") or "")
            self._exec(node, replication.slave_sql("STOP", name))
            self._exec(node, replication.slave_sql("RESET", name, "ALL"))
        with self._unlogged(node):
            provision.apply_drop(c, drop, app_user=self.creds.app_user,
                                 app_host=self.creds.app_host)
        self._exec(node, "RESET MASTER")
        if pos:
            self._exec(node, "SET GLOBAL gtid_binlog_state = %s", (pos,))
        self._exec(node, "SET GLOBAL gtid_slave_pos = %s", (pos,))
        return drop

    def _on_both(self, nodes: Sequence[str], work: Callable[[str], list[str]]
                 ) -> list[list[str]]:
        """*work* on each node at once (a thread and a connection each: dropping a
        thousand shard databases takes a while on every node); the first failure raised."""
        for n in nodes:
            self.conn(n)  # connected here, one thread: each worker then uses its own
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            return list(pool.map(work, nodes))

    def _pair_up(self, nodes: Sequence[str]) -> None:
        """The target pair's own replication, both ways, from each node's current
        position (the default channel, as the ``mysql`` role makes it, with the connect
        retry its channel had before the copy)."""
        data = (self.journal.data if self.journal else None) or {}
        retry = int(data.get("target_connect_retry") or self.pair_connect_retry)
        for me, peer in ((nodes[0], nodes[1]), (nodes[1], nodes[0])):
            host, _, port = peer.rpartition(":")
            replication.change_master(self.conn(me), host.strip("[]"), int(port),
                                      self.creds.repl_user, self.creds.repl_password,
                                      connect_retry=retry)
            self._exec(me, replication.slave_sql("START"))

    # -- driving -------------------------------------------------------------
    def run(self, step: str, *, cleanup: bool = False, check: bool = False
            ) -> list[StepResult]:
        """Run *step* (or ``all``: check, clone, replicate, cutover, and cleanup when asked)
        on the operation runner: the servers' locks for the whole run, no other
        operation in flight on them, done steps skipped. *check*: change nothing, say
        what would run (the check step itself runs: it only reads)."""
        if step not in STEPS + ("all", "abort"):
            raise SplitError(f"step {step!r} is not one of {', '.join(STEPS + ('all', 'abort'))}")
        if step == "abort":
            with self.locked(check=check) as runner:
                if check:
                    data = self.journal.data if self.journal else None
                    todo = 0 <= self.progress(data) < PROGRESS["cutover"]
                    return [StepResult("abort", todo, "would undo the split" if todo
                                       else "nothing to undo")]
                return runner.run([Step("abort", lambda: False, self.abort, always=True)])
        names = (["check", "clone", "replicate", "cutover"] + (["cleanup"] if cleanup else [])
                 if step == "all" else (["check", step] if step != "check" else ["check"]))
        runner = self.runner()
        runner.after_step = self.after_step
        if check:
            self.resolve()
            runner.name = self.name
            return runner.run(self.steps(names), check=True)

        def prepare() -> str:
            self.resolve()
            return self.name

        with runner.held(prepare):
            return runner.run(self.steps(names))

    def runner(self) -> Runner:
        return Runner(self.store, self.spec.name or "split", [
            self.spec.source, self.spec.target, self.spec.target_standby or ""],
            lock_timeout=self.lock_timeout,
            identifier=f"split {self.spec.source} -> {self.spec.target}",
            kind="split", finished_by=("cutover", "cleanup", "aborted"))

    def steps(self, names: Sequence[str]) -> list[Step]:
        """The split's step table (see the module docstring), the rows *names*."""
        a, b = self.moving

        def done(step: str) -> Callable[[], bool]:
            return lambda: self.progress(self.journal.data if self.journal else None) \
                >= PROGRESS[step]

        def replicating() -> bool:
            if done("cutover")():
                return True
            if not done("replicate")():
                return False
            if self._flipped(self._settled_map()):
                # the cutover flipped the map (and may have removed the split's channel)
                # before a crash: the cutover step finishes it; re-creating the channel
                # would rewind gtid_slave_pos to the clone's GTID and re-apply the source's
                # events on the target
                return True
            ch = self._channel(self.spec.target)
            return ch is not None and (ch.get("Slave_IO_Running"),
                                       ch.get("Slave_SQL_Running")) == ("Yes", "Yes")

        def cloned() -> bool:  # the journal says so and the copies are there
            return done("replicate")() or (done("clone")() and set(self.databases) <= (
                self._shard_dbs(self.spec.target)))

        table = {
            "check": Step("check", lambda: False, self.check, always=True),
            "clone": Step("clone", cloned, self.clone,
                          f"copy shards {a}..{b} from {self.spec.source} to {self.spec.target} "
                          "at one consistent snapshot"),
            "replicate": Step("replicate", replicating, self.replicate,
                              f"replicate the moving shards from {self.spec.source} to "
                              f"{self.spec.target} until caught up"),
            "cutover": Step("cutover", done("cutover"), self.cutover,
                            f"freeze shards {a}..{b}, fence them on {self.spec.source}, drain, "
                            f"flip them to {self.spec.target}"),
            "cleanup": Step("cleanup", done("cleanup"), self.cleanup,
                            f"drop shards {a}..{b} from {self.spec.source}"),
        }
        return [table[n] for n in names]

    def status(self) -> dict[str, Any]:
        """The journal (resolving the moving range) and the map's entry for it; changes nothing."""
        data = self.resolve()
        m = self.store.read().map
        entry = m.find(self.moving[0]) if m else None
        return {"journal": data, "moving": list(self.moving), "name": self.name,
                "entry": entry.to_dict() if entry else None}


#: The application's connections on the source with their statement and InnoDB
#: transaction, our own query id (column 6) and the server's clock (column 12).
DRAIN_SQL = ("SELECT p.ID, p.COMMAND, p.QUERY_ID, t.trx_id, t.trx_rows_modified, "
             "t.trx_rows_locked, (SELECT QUERY_ID FROM information_schema.PROCESSLIST "
             "WHERE ID = CONNECTION_ID()), p.STATE, p.TIME_MS, LEFT(p.INFO, 120), "
             "t.trx_state, t.trx_started, NOW() FROM information_schema.PROCESSLIST p "
             "LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID "
             "WHERE p.USER = %s")


def pending_writes(snapshot: Sequence[Sequence[Any]], q: int, cutoff: Any) -> list[str]:
    """The application's writes in *snapshot* (rows of :data:`DRAIN_SQL`, read after the
    fence) that may have passed the privilege check before it, described for people.

    Statements get a server-wide increasing query id when they start (before their
    privilege check); *q* is our own query id right after the fence and *cutoff* the
    server's clock at the first reading after it. A connection is pending when

    * it runs a statement with a query id <= *q* (started before the fence), or
    * its transaction started at or before *cutoff* and modified or locked rows: it may
      hold a pre-fence write that is not committed (and binlogged) yet. This is decided
      per reading, not from the first one: InnoDB gives a read-only transaction a
      temporary id that changes when it first writes, and its COMMIT is a new statement
      with a new query id, so neither the id nor the statement tells it apart later.

    A transaction begun after *cutoff* can only touch the moving shards with statements
    begun after the fence, which are refused; ``trx_started`` has one-second resolution,
    so transactions of the fence's own second count as pending (conservative)."""
    out = []
    for (cid, command, qid, trx, modified, locked, _, state, ms, info, trx_state,
         trx_started, *_rest) in snapshot:
        old_stmt = command == "Query" and int(qid or 0) <= q
        old_trx = (trx is not None and (int(modified or 0) > 0 or int(locked or 0) > 0)
                   and (trx_started is None or cutoff is None or trx_started <= cutoff))
        if old_stmt or old_trx:
            out.append(f"connection {cid} ({command}, {state or 'no state'}, "
                       f"{float(ms or 0) / 1000:.1f} s, query id {qid} vs fence {q}; "
                       f"transaction {trx} {trx_state or ''} since {trx_started}, "
                       f"{modified} row(s) modified, {locked} locked; {info or 'idle'})")
    return out


def merge_gtids(base: str, overlay: str) -> str:
    """*base* with every domain of *overlay* set to overlay's GTID (MariaDB lists)."""
    b = replication.parse_gtids(base) if base else {}
    b.update(replication.parse_gtids(overlay) if overlay else {})
    return replication.format_gtids(b)


def map_changes(before: ShardMap | None, after: ShardMap | None) -> list[str]:
    return diff(before, after)


def _few(names: Sequence[str], n: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f", ... {len(names) - n} more" if len(names) > n else "")


__all__ = ["CutoverAborted", "Credentials", "NO_NODE", "Split", "SplitError", "SplitSpec",
           "StepResult", "MapError", "DatabaseError", "merge_gtids", "upper_half"]
