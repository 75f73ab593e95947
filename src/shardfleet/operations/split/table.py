"""The split's step table on the operation runner: which rows run, what "is it done?"
reads, the locks, check mode, and the status read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shardfleet.operations.runner import Runner, Step, StepResult

from .context import SplitContext
from .spec import FINISHED_BY, PROGRESS, STEPS, SplitError


class TableMixin(SplitContext):
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

    def run(self, step: str, *, cleanup: bool = False, check: bool = False
            ) -> list[StepResult]:
        """Run *step* (or ``all``: check, clone, replicate, cutover, and cleanup when asked)
        on the operation runner: the servers' locks for the whole run, no other
        operation in flight on them, done steps skipped. *check*: change nothing, say
        what would run (the check step itself runs: it only reads)."""
        if step not in STEPS + ("all", "abort"):
            raise SplitError(f"step {step!r} is not one of {', '.join(STEPS + ('all', 'abort'))}")
        if step == "abort":
            return self._run_abort(check)
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

    def _run_abort(self, check: bool) -> list[StepResult]:
        """The abort's own step table on the runner, under the split's locks, as one
        ``abort`` result (its rows in details)."""
        with self.locked(check=check) as runner:
            if check:
                data = self.journal.data if self.journal else None
                todo = 0 <= self.progress(data) < PROGRESS["cutover"]
                return [StepResult("abort", todo, "would undo the split" if todo
                                   else "nothing to undo")]
            t0 = time.monotonic()
            results = runner.run(self.abort_steps())
            return [self.abort_result(results, time.monotonic() - t0)]

    def runner(self) -> Runner:
        return Runner(self.store, self.spec.name or "split", [
            self.spec.source, self.spec.target, self.spec.target_standby or ""],
            lock_timeout=self.lock_timeout,
            identifier=f"split {self.spec.source} -> {self.spec.target}",
            kind="split", finished_by=FINISHED_BY)

    def steps(self, names: Sequence[str]) -> list[Step]:
        """The split's step table (see the package docstring), the rows *names*."""
        a, b = self.moving
        table = {
            "check": Step("check", lambda: False, self.check, always=True),
            "clone": Step("clone", self._cloned, self.clone,
                          f"copy shards {a}..{b} from {self.spec.source} to {self.spec.target} "
                          "at one consistent snapshot"),
            "replicate": Step("replicate", self._replicating, self.replicate,
                              f"replicate the moving shards from {self.spec.source} to "
                              f"{self.spec.target} until caught up"),
            "cutover": Step("cutover", self._done("cutover"), self.cutover,
                            f"freeze shards {a}..{b}, fence them on {self.spec.source}, drain, "
                            f"flip them to {self.spec.target}"),
            "cleanup": Step("cleanup", self._done("cleanup"), self.cleanup,
                            f"drop shards {a}..{b} from {self.spec.source}"),
        }
        return [table[n] for n in names]

    def _done(self, step: str) -> Callable[[], bool]:
        """"Is it done?" of *step* by the journal."""
        return lambda: self.progress(self.journal.data if self.journal else None) \
            >= PROGRESS[step]

    def _replicating(self) -> bool:
        if self._done("cutover")():
            return True
        if not self._done("replicate")():
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

    def _cloned(self) -> bool:  # the journal says so and the copies are there
        return self._done("replicate")() or (self._done("clone")() and set(self.databases) <= (
            self._shard_dbs(self.spec.target)))

    def status(self) -> dict[str, Any]:
        """The journal (resolving the moving range) and the map's entry for it; changes nothing."""
        data = self.resolve()
        m = self.store.read().map
        entry = m.find(self.moving[0]) if m else None
        return {"journal": data, "moving": list(self.moving), "name": self.name,
                "entry": entry.to_dict() if entry else None}
