"""The split's cutover: freeze, fence, drain, wait for the target, flip; undone on a
timeout while the map still names the source; the split's replication removed after."""

from __future__ import annotations

import time

from shardfleet import provision, replication
from shardfleet.errors import MapWriteUnknown, ShardfleetError
from shardfleet.operations.runner import StepResult

from .context import SplitContext, log
from .spec import PROGRESS, CutoverAborted, SplitError


class CutoverMixin(SplitContext):
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
        self._cutover_ready()
        self._note(cutover_phase="freezing", cutover_attempt_at=time.time())
        # -- the stall starts
        frozen_at = time.monotonic()
        pos, fenced_at, waited = self._cutover_stall(frozen_at)
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

    def _cutover_ready(self) -> None:
        """Before the freeze (outside the stall): the split's replication runs, the fence
        would hold, the target caught up, the application user granted on the target and
        its master writable. Nothing routes there before the flip."""
        ch = self._channel(self.spec.target)
        if ch is None or ch.get("Slave_SQL_Running") != "Yes":
            raise SplitError(f"the split's replication on {self.spec.target} is not running; "
                             "run the replicate step first")
        fence = self._fence_problems()
        if fence:
            raise SplitError("; ".join(fence) + "; nothing changed")
        self._wait_applied(replication.gtid_position(self.conn(self.spec.source)),
                           self.catchup_timeout, "catch up before the cutover")
        tconn = self.conn(self.spec.target)
        plan = provision.plan_shards(tconn, self.shards, self.schema,
                                     app_user=self.creds.app_user, app_host=self.creds.app_host,
                                     check_definitions=False)
        provision.apply_plan(tconn, plan, self.schema, app_user=self.creds.app_user,
                             app_host=self.creds.app_host)
        replication.set_read_only(tconn, False)

    def _cutover_stall(self, frozen_at: float) -> tuple[str, float, float]:
        """Freeze, fence, drain, wait for the target to apply the source's position after
        the fence, stop the split's channel, flip. Undone (and raised) on a failure while
        the map still names the source. Returns the position, when the fence was set and
        the seconds the target took to apply it."""
        tconn = self.conn(self.spec.target)
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
            replication.stop_channel(self.conn(self.spec.target), self.connection_name)
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
        return pos, fenced_at, waited

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
                 for r in replication.replica_rows(tconn)]
        for name in names:
            replication.stop_channel(self.conn(self.spec.target), name)
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
        slave = replication.parse_gtids(replication.gtid_replica_pos(tconn))
        behind = {d: have[d] for d, (_, seq) in slave.items() if d in have and have[d][1] < seq}
        if behind:
            slave.update(behind)
            pos = replication.format_gtids(slave)
            log.info("split %s: the target's gtid_slave_pos in domains %s set to its "
                     "standby's: %s", self.name, sorted(behind), pos)
            replication.set_replica_pos(self.conn(self.spec.target), pos)
