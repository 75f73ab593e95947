"""The split's cleanup (explicit, after the cutover): the moved databases dropped from the
source pair, anything outside its ranges from the target pair."""

from __future__ import annotations

import time

from shardfleet import provision
from shardfleet.operations.runner import StepResult
from shardfleet.schema import shard_database

from .context import SplitContext
from .spec import PROGRESS, SplitError


class CleanupMixin(SplitContext):
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
