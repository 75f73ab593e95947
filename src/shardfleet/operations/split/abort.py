"""The split's abort (before the cutover), a step table of its own: refuse past the
cutover; cancel the physical copy's receivers on the target pair (none installs after
that); remove the split's replication; lift the fence; thaw the map; drop the target's
copies (a physical clone: the target pair made an empty pair again); check the cancelled
nodes stayed cancelled and empty; record the abort. Map and source as they were."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from shardfleet import physical, provision
from shardfleet.operations.runner import Step, StepResult

from .context import SplitContext
from .spec import PROGRESS, SplitError

# the rows whose changes the abort's result names, in its order
SAID = ("remove replication", "lift fence", "thaw", "drop copies")


class AbortMixin(SplitContext):
    def abort_steps(self) -> list[Step]:
        """The abort's step table. Every row acts (each is idempotent: a failed abort is
        run again until it is recorded). No journal: one row saying there is nothing to
        undo."""
        if (self.journal.data if self.journal else None) is None:
            return [Step("abort", lambda: False, lambda: StepResult(
                "abort", False, "no split in progress; nothing to undo"), always=True)]
        self._cancelled: list[str] = []
        rows = (("refuse", self._abort_refuse), ("cancel copies", self._abort_cancel),
                ("remove replication", self._abort_replication),
                ("lift fence", self._abort_fence), ("thaw", self._abort_thaw),
                ("drop copies", self._abort_copies), ("verify", self._abort_verify),
                ("record", self._abort_record))
        return [Step(name, lambda: False, self._timed(name, act), always=True)
                for name, act in rows]

    @staticmethod
    def _timed(name: str, act: Callable[[], tuple[Any, str]]) -> Callable[[], StepResult]:
        def action() -> StepResult:
            t0 = time.monotonic()
            value, msg = act()
            return StepResult(name, bool(value), msg, time.monotonic() - t0)
        return action

    def abort(self) -> StepResult:
        """The abort's table run in order here, as one result (:meth:`run` runs the table
        on the runner, under the split's locks)."""
        t0 = time.monotonic()
        return self.abort_result([s.action() for s in self.abort_steps()],
                                 time.monotonic() - t0)

    @staticmethod
    def abort_result(results: Sequence[StepResult], seconds: float) -> StepResult:
        """The abort's rows as one ``abort`` result: what it undid, each row in details."""
        if len(results) == 1 and results[0].step == "abort":
            return results[0]
        did = [r.msg for r in results if r.step in SAID and r.changed]
        return StepResult("abort", True, "aborted: " + (", ".join(did) or "nothing to undo"),
                          seconds, {"steps": [r.to_dict() for r in results]})

    def _abort_refuse(self) -> tuple[Any, str]:
        """SplitError when the split is past its cutover or the map was flipped already."""
        data = self.journal.data if self.journal else None
        if self.progress(data) >= PROGRESS["cutover"]:
            raise SplitError(f"split {self.name} is past its cutover: shards "
                             f"{self.moving[0]}..{self.moving[1]} live on {self.spec.target} now; "
                             "run cleanup (or split them back)")
        current = self.store.read().map
        entry = current.find(self.moving[0]) if current else None
        if entry is not None and entry.master == self.spec.target:
            raise SplitError("the map was flipped to the target already; run the cutover step "
                             "to finish it instead of aborting")
        return False, "before the cutover: the split can be undone"

    def _abort_cancel(self) -> tuple[Any, str]:
        # first of all, no receiver of this split's copy may install any more
        self._cancelled = self._fence_receivers(self._journal_data())
        return self._cancelled, f"cancelled the copies into {self._cancelled or 'no node'}"

    def _abort_replication(self) -> tuple[Any, str]:
        return self._remove_channel(), "removed the replication"

    def _abort_fence(self) -> tuple[Any, str]:
        n = self._set_fence(False)
        return n, f"lifted the fence on {n} grant(s)"

    def _abort_thaw(self) -> tuple[Any, str]:
        return self._thaw(), "restored the map"

    def _abort_copies(self) -> tuple[Any, str]:
        copies = self._drop_copies(self._journal_data())
        return copies, f"dropped {len(copies)} copies from the target"

    def _abort_verify(self) -> tuple[Any, str]:
        self._check_fenced_and_empty(self._cancelled)
        return False, "the cancelled nodes are still cancelled and hold no shard database"

    def _abort_record(self) -> tuple[Any, str]:
        self._record("aborted", state="aborted")
        return False, "recorded in the journal"

    def _journal_data(self) -> dict[str, Any]:
        return (self.journal.data if self.journal else None) or {}

    def _drop_copies(self, data: dict[str, Any]) -> list[str]:
        """The target's copies dropped (a physical clone: the target pair emptied)."""
        if data.get("copy") and self.spec.target_standby:
            return self._empty_target_pair()
        copies = sorted(self._shard_dbs(self.spec.target) & set(self.databases))
        provision.apply_drop(self.conn(self.spec.target), copies,
                             app_user=self.creds.app_user, app_host=self.creds.app_host)
        return copies

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
