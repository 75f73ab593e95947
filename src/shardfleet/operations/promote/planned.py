"""The planned promotion's step table (the master answers: zero loss)::

    catch up   wait (bounded) until the standby applied the master's position
    freeze     the pair's ranges -> frozen (frozen_from keeps their state):
               routers hold writes to them instead of sending them
    fence      master read_only=ON; wait for open write transactions (bounded)
    drain      read the master's GTID position; wait until the standby applied it
    writable   standby read_only=OFF
    flip       one map write: master and standby swapped, the ranges unfrozen

The old master keeps replicating from the new one (master-master), so the pair
is whole again. If the standby does not catch up in time the master is made
writable again and the ranges unfrozen: nothing changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from shardfleet import replication
from shardfleet.operations.promote.common import (
    PromotionRun,
    _record_failure,
    _rerun_cmd,
    _unfreeze,
    errant_against,
    semisync_state,
)
from shardfleet.operations.promote.table import Table
from shardfleet.operations.runner import ERRORS, LockLost, Step, never
from shardfleet.operations.types import (
    OperationFailed,
    Options,
    PromotionFailed,
    PromotionRefused,
    close,
    describe,
    owner,
    reach,
    try_connect,
    write_map,
)
from shardfleet.shardmap import freeze_owner

T = TypeVar("T")


class Planned(Table):
    """The planned table's rows and actions."""

    def planned_steps(self) -> list[Step]:
        o, n, row = self.old, self.new, self.run.row
        return [
            row("caught_up", never, self._catch_up, always=True),
            row("frozen", self._frozen, self._rollback(self._freeze), "freeze (would)"),
            row("old_read_only", self._rollback(self._flipped), self._rollback(self._fence_planned),
                f"{o} read_only=ON (would)"),
            row("drained", self._rollback(self._flipped), self._drain_planned,
                f"wait for {n} to apply {o}'s position (would)"),
            row("new_writable", self._after_drain(self._new_writable),
                self._after_drain(self._make_writable_planned), f"{n} read_only=OFF (would)"),
            row("flipped", self._after_drain(self._flipped), self._flip_planned,
                "write the swapped map (would)"),
        ]

    def _connect_planned(self) -> None:
        old, new, run = self.old, self.new, self.run
        self.mconn, why, refusing = reach(old, self.opts)
        if self.mconn is None and self.res.resumed and not refusing:
            raise PromotionRefused(
                f"the master {old} does not answer ({why}); the unfinished planned promotion "
                f"of {run.pair} to {new} left its ranges frozen. If {old} is dead, continue it "
                f"as an emergency promotion (same new master): "
                f"{_rerun_cmd(run.pair, 'emergency', old)} (library: mode='emergency'); if "
                f"{old} comes back, rerun this same command")
        if self.mconn is None:
            raise PromotionRefused(f"the master {old} does not answer ({why}): a planned "
                                   "promotion needs it; if it is dead use mode=emergency")
        self.sconn, why = try_connect(new, self.opts)
        if self.sconn is None:
            raise PromotionRefused(f"the standby {new} does not answer ({why}): nothing to "
                                   "promote")

    def _catch_up(self) -> None:
        """The checks (refusals: nothing changed), the errant report, then wait (bounded)
        until the standby applied the master's position, so the frozen time is the last
        few transactions only."""
        old, new, res, mconn, sconn = self.old, self.new, self.res, self.mconn, self.sconn
        ch = replication.peer_channel(sconn)
        if ch is None or ch.get("Slave_SQL_Running") != "Yes":
            raise PromotionRefused(f"the standby {new} is not applying replication from {old} "
                                   f"(SQL thread {ch and ch.get('Slave_SQL_Running')}: "
                                   f"{ch and ch.get('Last_Error')}); refusing a planned promotion")
        res.semisync = {"master": semisync_state(mconn), "standby": semisync_state(sconn)}
        if not res.semisync["master"]["master_enabled"]:
            res.warnings.append(f"semi-sync is off on {old}: replication is asynchronous")
        # errant: what the standby wrote itself that the master lacks (after a short catch-up)
        sid = replication.server_id(sconn)
        sbin = replication.gtid_position(sconn)
        try:
            replication.wait_for_gtid(mconn, sbin, 1.0)
        except replication.ReplicationTimeout:
            pass
        res.errant = errant_against(sbin, replication.gtid_applied(mconn), sid)
        if res.errant:
            res.warnings.append(f"errant transactions on {new} that {old} never applied: "
                                f"{', '.join(res.errant)} (they will replicate to {old})")
        try:
            replication.wait_for_gtid(sconn, replication.gtid_position(mconn),
                                      self.opts.catchup_timeout)
        except replication.ReplicationTimeout as exc:
            raise PromotionRefused(f"the standby {new} is too far behind: {exc}") from None
        self.run.step("caught_up")

    def _rollback(self, fn: Callable[[], T]) -> Callable[[], T]:
        """Until the drain is done a failure rolls the promotion back."""
        return self._guard(fn, lambda exc: _planned_rollback(
            self.run, self.old, self.new, self.bounds, exc, self.opts))

    def _after_drain(self, fn: Callable[[], T]) -> Callable[[], T]:
        """After the drain a failure leaves the ranges frozen (see :meth:`_failed`)."""
        return self._guard(fn, self._failed)

    def _failed(self, exc: BaseException) -> PromotionFailed:
        """The standby may be writable already: never make the old master writable again
        here; a rerun finishes the flip (or, the master dead, continues as emergency)."""
        _record_failure(self.run, exc)
        pair, old, new = self.run.pair, self.old, self.new
        return PromotionFailed(
            f"the planned promotion of {pair} failed after the drain: "
            f"{describe(exc)}. State left: ranges FROZEN (writes wait), {old} read_only, "
            f"{new} has every write of {old} and may be writable. Rerun the same command "
            f"to finish ({_rerun_cmd(pair, 'planned', old)}); if {old} is dead: "
            f"{_rerun_cmd(pair, 'emergency', old)}")

    def _fence_planned(self) -> None:
        """The master read_only=ON; wait (bounded) for its open write transactions."""
        replication.set_read_only(self.mconn, True)
        left = replication.wait_no_write_transactions(self.mconn, self.opts.trx_timeout)
        self.run.step("old_read_only", open_write_transactions=left)

    def _drain_planned(self) -> None:
        """Read the fenced master's GTID position; wait until the standby applied it."""
        try:
            pos = replication.gtid_position(self.mconn)
            self.res.gtid["master_final"] = pos
            replication.wait_for_gtid(self.sconn, pos, self.opts.drain_timeout)
        except ERRORS as exc:
            raise _planned_rollback(self.run, self.old, self.new, self.bounds, exc,
                                    self.opts) from exc
        self.run.step("drained", position=pos)

    def _make_writable_planned(self) -> None:
        replication.set_read_only(self.sconn, False)
        self.run.step("new_writable")

    def _flip_planned(self) -> None:
        """One map write: master and standby swapped, the ranges unfrozen."""
        try:
            self._flip_map(False)
        except ERRORS as exc:
            raise self._failed(exc) from exc
        self.res.timings["frozen_seconds"] = round(
            time.monotonic() - (self.t_freeze or self.run.t_begin), 3)
        self.run.step("flipped")

    def _check_old_replicates(self) -> None:
        """The old master keeps replicating from the new one (master-master)."""
        ch = replication.wait_peer_channel_running(self.mconn, 30.0) or None
        if ch is None or ch.get("Slave_IO_Running") != "Yes" \
                or ch.get("Slave_SQL_Running") != "Yes":
            self.res.warnings.append(f"{self.old} is not replicating from {self.new} "
                                     f"(IO {ch and ch.get('Slave_IO_Running')}, SQL "
                                     f"{ch and ch.get('Slave_SQL_Running')}): check it")


def _planned_rollback(run: PromotionRun, old: str, new: str, bounds: set[tuple[int, int]],
                      exc: BaseException, opts: Options) -> OperationFailed:
    """Undo a planned promotion that failed before the standby became writable.

    The master writable again and the ranges unfrozen, when the master answers (on a
    fresh connection: the promotion's own may be what broke). When it does not, the
    ranges stay frozen and the journal unfinished: it may be dead, and only an
    emergency promotion (same new master) may then finish what this one started.
    """
    what = describe(exc)
    if isinstance(exc, LockLost):
        return run.lost(exc)
    try:
        if run.runner is not None:
            run.runner.check_fence()
        m = run.store.read().map
    except LockLost as lost:
        return run.lost(lost)
    except ERRORS as again:
        return _rollback_failed(run, old, new, what, again)
    moved = [r.describe() for r in (m.ranges if m else []) if r.bounds in bounds and not (
        r.master == old and r.standby == new
        and (r.state != "frozen" or freeze_owner(r) == owner(run.pair)))]
    if m is None or moved:
        _record_failure(run, exc)
        return PromotionFailed(
            f"the planned promotion of {run.pair} stopped ({what}); not rolled back: the "
            f"map no longer names {old} master of the pair's ranges as this run left them "
            f"({'; '.join(moved) or 'no map'}), so another run moved it. {old} and {new} "
            f"are left as they are; look before acting: `shardfleet ops show {run.name}`")
    conn, why, refusing = reach(old, opts)
    if conn is None:
        _record_failure(run, exc)
        alive = ("it answers with an error (alive but refusing)" if refusing
                 else "it does not answer")
        return PromotionFailed(
            f"the planned promotion of {run.pair} stopped: {what}; then the master {old} could "
            f"not be made writable again: {alive} ({why}). State left: ranges FROZEN (writes "
            f"to them wait), {new} read_only (not promoted), {old} possibly read_only; the "
            f"journal {run.journal.path} is unfinished. If {old} is dead, continue as an "
            f"emergency promotion to {new}: {_rerun_cmd(run.pair, 'emergency', old)}; if it "
            f"is alive, rerun the same command: {_rerun_cmd(run.pair, 'planned', old)}")
    try:
        replication.set_read_only(conn, False)
        write_map(run.store, lambda m: _unfreeze(m, bounds, run.pair))
        run.step("rolled_back", error=what)
        run.journal.note(done=True, failed=what)
    except ERRORS as again:
        return _rollback_failed(run, old, new, what, again)
    finally:
        close(conn)
    return PromotionFailed(f"rolled back (master {old} writable again, ranges unfrozen; "
                           f"nothing changed): {what}")


def _rollback_failed(run: PromotionRun, old: str, new: str, what: str,
                     again: BaseException) -> PromotionFailed:
    _record_failure(run, again)
    return PromotionFailed(
        f"the planned promotion of {run.pair} stopped ({what}) and its rollback failed "
        f"({describe(again)}). State left: ranges possibly FROZEN, {old} possibly "
        f"read_only, {new} read_only; rerun the same command: "
        f"{_rerun_cmd(run.pair, 'planned', old)}")
