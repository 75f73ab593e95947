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

The modules: ``spec`` (what moves where, errors, constants), ``context`` (connections,
journal, map edits: what every step shares), ``table`` (the step table on the runner,
run, status), ``check``, ``clone`` (logical), ``physical`` (the physical clone: the copy
named, watched, attached), ``replicate`` (the split's channel), ``fence``, ``cutover``,
``cleanup`` and ``abort`` (a step table of its own). Each step module is a mixin over the
context; :class:`Split` joins them. The replication SQL they run lives in
:mod:`shardfleet.replication`.
"""

from __future__ import annotations

from shardfleet.errors import DatabaseError, MapError
from shardfleet.mapstore import NO_NODE
from shardfleet.operations.runner import StepResult
from shardfleet.operations.types import Credentials

from .abort import AbortMixin
from .check import CheckMixin, estimate
from .cleanup import CleanupMixin
from .clone import CloneMixin
from .context import SplitContext
from .cutover import CutoverMixin
from .fence import (
    DRAIN_SQL,
    LIVE_WRITE_PRIVILEGES,
    WRITE_PRIVILEGES,
    FenceMixin,
    pending_writes,
)
from .physical import PhysicalMixin, copy_progress
from .replicate import ReplicateMixin
from .spec import (
    CLONE_METHODS,
    FINISHED_BY,
    PHYSICAL_ABOVE,
    PROGRESS,
    STEPS,
    CutoverAborted,
    SplitError,
    SplitSpec,
    few,
    map_changes,
    merge_gtids,
    upper_half,
)
from .table import TableMixin


class Split(TableMixin, CheckMixin, CloneMixin, PhysicalMixin, ReplicateMixin, FenceMixin,
            CutoverMixin, CleanupMixin, AbortMixin, SplitContext):
    """One split, driven step by step (every step idempotent; see the package docstring).

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


__all__ = ["CLONE_METHODS", "DRAIN_SQL", "FINISHED_BY", "LIVE_WRITE_PRIVILEGES", "NO_NODE",
           "PHYSICAL_ABOVE", "PROGRESS", "STEPS", "WRITE_PRIVILEGES", "Credentials",
           "CutoverAborted", "DatabaseError", "MapError", "Split", "SplitContext", "SplitError",
           "SplitSpec", "StepResult", "copy_progress", "estimate", "few", "map_changes",
           "merge_gtids", "pending_writes", "upper_half"]
