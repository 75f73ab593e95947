"""The operation runner: step tables, locks, check mode, resume, and one run's journal.

An operation (split, promotion, rebuild) is a table of :class:`Step`: a name, "is it
done?" (read from the servers and the map, not only the journal), the action, and
what check mode says it would do. :class:`Runner` owns everything around the table:
the locks of every server the operation changes, held for the whole run; the refusal
to start beside another unfinished operation on those servers (the journals are the
registry, so this holds across runs and across processes); check mode; resume (a
done step is skipped, so a rerun continues where a failed run stopped).

:class:`Run` is what an operation needs around its table: its journal (started by its
first change, so a refusal leaves none), its report (:class:`~.types.Result`), the
rows of its table (:meth:`Run.row`), the locks (:meth:`Run.held`) and the error
boundary (:meth:`Run.boundary`: a refusal before the first change, a failure naming
the journal's step after it). A new operation is one step table on it.

Journals, fencing tokens and the registry of operations in flight live in
:mod:`shardfleet.operations.journal` (every name of it importable from here too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pymysql
from kazoo.exceptions import KazooException

from shardfleet.errors import MapConflictError, ShardfleetError
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.journal import (
    _FENCED,
    Fence,
    InFlight,
    Journal,
    LockLost,
    OperationInFlight,
    in_flight,
    journal_base,
    journals,
    operations,
    refuse_if_busy,
    server_lock_name,
    stepped,
)
from shardfleet.operations.types import OperationFailed, OperationRefused, Result, describe

log = logging.getLogger(__name__)


class LockBusy(ShardfleetError):
    """Raised when another operation holds the pair's lock."""


@contextmanager
def pair_lock(store: ZooKeeperMapStore, name: str, *, timeout: float = 5.0,
              identifier: str = "") -> Iterator[None]:
    """Hold ``ops/locks/<name>`` for the duration; LockBusy if another holder keeps it."""
    from kazoo.exceptions import LockTimeout

    path = store.ops_node("locks", name)
    lock = store.client.Lock(path, identifier or "shardfleet")
    try:
        got = lock.acquire(timeout=timeout)
    except LockTimeout:
        got = False
    if not got:
        holders = lock.contenders()
        raise LockBusy(f"another operation holds {path} ({', '.join(holders) or 'unknown'}); "
                       "wait for it, or check the journal")
    try:
        yield
    finally:
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - the session may already be gone
            log.warning("could not release %s", path, exc_info=True)


@contextmanager
def servers_lock(store: ZooKeeperMapStore, servers: list[str], *, timeout: float = 5.0,
                 identifier: str = "") -> Iterator[None]:
    """Hold the locks of every server in *servers* (taken in sorted order)."""
    names = sorted({server_lock_name(s) for s in servers})
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(pair_lock(store, name, timeout=timeout, identifier=identifier))
        yield


def refuse_if_locked(store: ZooKeeperMapStore, servers: list[str]) -> None:
    """LockBusy when another holder keeps the lock of any of *servers* (check mode takes
    no lock, but says when one is held)."""
    for name in sorted({server_lock_name(s) for s in servers}):
        path = store.ops_node("locks", name)
        if store.children(path):
            raise LockBusy(f"another operation holds {path}; wait for it, or check the journal")



@dataclass
class StepResult:
    """What one step did (or, in check mode, would do)."""

    step: str
    changed: bool
    msg: str
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    # the operation stops after this step, waiting for work done outside the library
    # (a physical copy between nodes: details say which); its next run continues it
    waits: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "changed": self.changed, "msg": self.msg,
                "seconds": round(self.seconds, 3), **self.details}


@dataclass(frozen=True)
class Step:
    """One row of an operation's step table.

    * ``done()`` — is the step's effect already there (read from the servers, the map,
      the journal)? A done step is skipped: that is what makes a rerun a resume.
    * ``action()`` — do it (idempotent: a crash inside it is resumed by running it again).
    * ``would`` — what check mode reports for a step that is not done.
    * ``always`` — run even when ``done()`` (validation steps such as a split's check).
    """

    name: str
    done: Callable[[], bool]
    action: Callable[[], StepResult]
    would: str = ""
    always: bool = False


class Runner:
    """Run an operation's step table under its servers' locks (see the module docstring).

    *name* is the operation's journal name (so the registry does not refuse the
    operation its own journal), *servers* every server it changes, *kind* what the
    journal's header calls it, *finished_by* the steps after which the operation is
    finished (the header's ``done``; else the operation records ``done`` itself).
    """

    def __init__(self, store: ZooKeeperMapStore, name: str, servers: Sequence[str], *,
                 lock_timeout: float = 5.0, identifier: str = "", kind: str = "",
                 finished_by: Sequence[str] = ()) -> None:
        self.store, self.name = store, name
        self.servers = sorted({s for s in servers if s})
        self.lock_timeout = lock_timeout
        self.identifier = identifier or name
        self.kind = kind or name.split("-", 1)[0]
        self.finished_by = tuple(finished_by)
        self.fence: Fence | None = None
        self.after_step: Callable[[str], None] | None = None  # a hook for tests

    def header(self, data: dict[str, Any]) -> dict[str, Any]:
        """The header every journal this run writes carries (see the module docstring)."""
        step = str(data.get("step") or "start")
        return {"kind": self.kind, "servers": self.servers, "step": step,
                "done": bool(data.get("done")) or step in self.finished_by,
                "finished_by": list(self.finished_by),
                "epoch": self.fence.epoch if self.fence else 0}

    def check_fence(self) -> None:
        """LockLost when this run lost its locks (nothing to check in check mode)."""
        if self.fence is not None:
            self.fence.check()

    @contextmanager
    def _fenced(self) -> Iterator[None]:
        """Take the fencing tokens (the locks are held) and fence this run's journal."""
        self.fence = Fence(self.store, [server_lock_name(s) for s in self.servers],
                           self.identifier)
        self.fence.take()
        key = (id(self.store), self.name)
        _FENCED[key] = self
        try:
            yield
        finally:
            if _FENCED.get(key) is self:
                del _FENCED[key]

    @contextmanager
    def held(self, prepare: Callable[[], str] | None = None, *,
             check: bool = False) -> Iterator[None]:
        """The locks of every server; then *prepare()* (it may read the journal and
        return the operation's name, known only then); then the registry's refusal. All
        under the locks, so no other operation can start between the look and the
        first change. *check*: take no lock (check mode changes nothing), but refuse
        (LockBusy) when another holder keeps one."""
        if check:
            refuse_if_locked(self.store, self.servers)
            if prepare is not None:
                self.name = prepare()
            refuse_if_busy(self.store, self.servers, self.name)
            yield
            return
        with servers_lock(self.store, self.servers, timeout=self.lock_timeout,
                          identifier=self.identifier):
            if prepare is not None:
                self.name = prepare()
            refuse_if_busy(self.store, self.servers, self.name)
            with self._fenced():
                yield

    @contextmanager
    def refusing(self, refusal: Callable[[str], Exception], *,
                 check: bool = False) -> Iterator[None]:
        """:meth:`held`, with LockBusy and OperationInFlight (nothing changed) raised as
        the operation's own *refusal* of their message."""
        try:
            with self.held(check=check):
                yield
        except (LockBusy, OperationInFlight) as exc:
            raise refusal(str(exc)) from None

    def run(self, steps: Sequence[Step], *, check: bool = False) -> list[StepResult]:
        """Each step in order: skipped when done, described in *check* mode, else run.
        Call it inside :meth:`held` (check mode takes no lock: it changes nothing)."""
        if check:
            refuse_if_busy(self.store, self.servers, self.name)
        out: list[StepResult] = []
        for s in steps:
            if not s.always and s.done():
                out.append(StepResult(s.name, False, f"{s.name}: done already"))
                continue
            if check and not s.always:
                out.append(StepResult(s.name, True, f"would {s.would or s.name}"))
                continue
            if not check:
                self.check_fence()  # a run that lost its locks acts no more
            res = s.action()
            out.append(res)
            log.info("%s: %s %s", self.name, s.name, res.msg)
            if self.after_step is not None and not check:
                self.after_step(s.name)
            if res.waits:
                break
        return out


# -- one run of an operation ---------------------------------------------------------

# what an operation's error boundary turns into a refusal or a failure
ERRORS = (ShardfleetError, pymysql.err.MySQLError, OSError, KazooException)


class Run:
    """One operation in progress on the runner: its journal ``ops/journal/<name>``, its
    report *res* (the steps and their timings), and the rows of its step table.

    The journal starts with the first change (:meth:`begin`, the header *start*): steps
    recorded before it (checks) are kept pending and written with it, and a refusal
    before it leaves no journal. An operation says what it is through :meth:`kind`
    (the header's kind), :meth:`refused` and :meth:`failed` (its error messages), and
    :attr:`refusal` and :attr:`failure` (the classes of its errors)."""

    refusal: type[OperationRefused] = OperationRefused
    failure: type[OperationFailed] = OperationFailed

    def __init__(self, store: ZooKeeperMapStore, name: str, res: Result, check: bool,
                 pair: str = "") -> None:
        self.store, self.name, self.res, self.check = store, name, res, check
        self.pair = pair or name
        self.journal = Journal(store, name)
        self.t0 = self.t_begin = time.monotonic()
        self.start: dict[str, Any] = {}
        self.begun = False     # a change may have happened (the journal was started)
        self.nodes: list[str] = []
        self.pending: list[dict[str, Any]] = []  # steps done before the first change
        self.runner: Runner | None = None  # while the locks are held (its fence)

    # -- what the operation says about itself -------------------------------------
    def kind(self) -> str:
        """The journal header's kind (default: the name's first word)."""
        return self.name.split("-", 1)[0]

    def refused(self, what: str) -> ShardfleetError:
        """The refusal for an unexpected error before the first change."""
        return self.refusal(f"{self.kind()} {self.name} stopped before any change: "
                                f"{what}; nothing changed")

    def failed(self, step: str, what: str) -> ShardfleetError:
        """The failure for an unexpected error after step *step* (the journal's)."""
        return self.failure(
            f"{self.kind()} {self.name} failed after step {step!r}: {what}. The journal "
            f"{self.journal.path} records the steps: fix the cause and rerun the same "
            "command to continue")

    def lost(self, exc: BaseException) -> OperationFailed:
        """This run lost its locks: it acts no more, rolls nothing back, and writes
        nothing in a journal another run may own now."""
        return self.failure(
            f"the {self.kind()} of {self.pair} stopped: {describe(exc)}. This run changed "
            "nothing more and rolled nothing back: another run may hold the pair now. Look "
            f"before acting: `shardfleet ops show {self.name}` and the map; rerun the same "
            "command once no other run is in flight")

    # -- the journal ----------------------------------------------------------------
    def begin(self) -> None:
        """Record the operation in the journal: the first change is about to happen (the
        journal starts when the first change does; a refusal before leaves none)."""
        if self.check or self.begun:
            return
        self.begun, self.t_begin = True, time.monotonic()
        start = dict(self.start)
        if self.pending:
            start.update(steps=[*start.get("steps", []), *self.pending],
                         step=self.pending[-1]["step"])
        self.journal.save(start)

    def step(self, name: str, **fields: Any) -> None:
        """Step *name* is done: in the report, and in the journal (pending until begun)."""
        self.res.steps.append(name)
        self.res.timings[name] = round(time.monotonic() - self.t0, 3)
        if self.begun:
            self.journal.step(name, **fields)
        elif not self.check:
            self.pending.append({"step": name, "at": time.time(), **fields})
        log.info("%s: %s", self.name, name)

    def row(self, name: str, done: Callable[[], bool], action: Callable[[], Any],
            would: str = "", always: bool = False) -> Step:
        """A step of the table. *action* records its journal step itself (:meth:`step`);
        a step that changes something starts the journal first. *would*: the lines
        check mode lists for it (``res.steps``), one per line."""
        def is_done() -> bool:
            if done():
                self.res.steps.append(f"{name}: done already")
                return True
            if self.check and would:
                self.res.steps.extend(would.split("\n"))
            return False

        def act() -> StepResult:
            t = time.monotonic()
            if not always:
                self.begin()
            action()
            return StepResult(name, True, name, time.monotonic() - t)

        return Step(name, is_done, act, would.replace("\n", "; "), always)

    def unfinished(self) -> dict[str, Any] | None:
        """The journal, when a run of this operation stopped before finishing."""
        j = self.journal.load()
        return j if j and not j.get("done") else None

    # -- the locks and the error boundary ---------------------------------------------
    @contextmanager
    def held(self, lock_timeout: float) -> Iterator[Runner]:
        """The runner's locks (every server of :attr:`nodes`) and its registry of
        operations in flight; check mode takes no lock but refuses when one is held.
        LockBusy and OperationInFlight are refusals: nothing changed."""
        runner = Runner(self.store, self.name, self.nodes, lock_timeout=lock_timeout,
                        identifier=self.name, kind=self.kind())
        with runner.refusing(self.refusal, check=self.check):
            self.runner = runner
            try:
                yield runner
            finally:
                self.runner = None

    @contextmanager
    def boundary(self) -> Iterator[None]:
        """No driver error (PyMySQL, kazoo, socket) escapes: before the first change it
        is a refusal, after it a failure that says what state the operation left."""
        try:
            yield
        except (OperationRefused, OperationFailed):
            raise
        except ERRORS as exc:
            raise unexpected(self, exc) from exc


def unexpected(run: Run, exc: BaseException) -> ShardfleetError:
    """A refusal (nothing changed yet) or a failure naming the step reached, for an error
    no step expected (a server or ZooKeeper gone mid-statement, a missing privilege); a
    run that lost its locks says so and that it acted no more."""
    what = describe(exc)
    log.warning("%s: %s", run.name, what)
    if isinstance(exc, LockLost) and run.begun:
        return run.lost(exc)
    if not run.begun:
        return run.refused(what)
    return run.failed(str((run.journal.data or {}).get("step", "start")), what)


def never() -> bool:
    """The "is it done?" of a step that always runs."""
    return False


__all__ = ["ERRORS", "Fence", "InFlight", "Journal", "LockBusy", "LockLost", "MapConflictError",
           "OperationInFlight", "Run", "Runner", "Step", "StepResult", "in_flight",
           "journal_base", "journals", "never", "operations", "pair_lock", "refuse_if_busy",
           "refuse_if_locked", "server_lock_name", "servers_lock", "stepped", "unexpected"]
