"""Journals, fencing tokens and the registry of operations in flight (the runner's
record keeping; :mod:`shardfleet.operations.runner` re-exports every name here).

Journals live in ZooKeeper, beside the map (the paths:
:meth:`~shardfleet.mapstore.ZooKeeperMapStore.ops_node`). A journal is written with
compare-and-set like the map, so two operators cannot interleave steps; it is what
makes a rerun continue where it stopped. Every journal carries one header, whatever
the operation: ``kind``, ``servers``, ``step``, ``done`` and ``epoch`` (the fencing
token of the run that wrote it); the registry reads nothing else.

A lock is only as good as the ZooKeeper session that holds it: the locks are
ephemeral znodes, gone when the session expires, and then another run may take
them. So a run is fenced (:class:`Fence`): taking the locks bumps each server's
fence znode and remembers its version; before every action the runner checks that
its session is the one that took the locks and that no fence moved, and every
journal write checks the fences in the same ZooKeeper transaction. A run that lost
its locks raises :class:`LockLost` before its next action and must not act again,
not even to roll back.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardfleet.errors import FenceMoved, MapConflictError, ShardfleetError
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore

if TYPE_CHECKING:
    from shardfleet.operations.runner import Runner


class LockLost(ShardfleetError):
    """Raised when a run no longer holds its locks: its ZooKeeper session expired (the
    lock znodes went with it) or another run took the servers' fencing tokens. The run
    stops before its next action and must not act again, not even to roll back."""


class Fence:
    """The fencing tokens of one run: each server's ``ops/fence/<lock name>`` version
    after this run bumped it, and the session that took the locks."""

    def __init__(self, store: ZooKeeperMapStore, names: Sequence[str], holder: str) -> None:
        self.store, self.holder = store, holder
        self.names = sorted(set(names))
        self.tokens: dict[str, int] = {}
        self.session: int | None = None

    def take(self) -> None:
        """Bump every fence (under the locks): a run that held them before is fenced out."""
        self.session = self.store.session()
        for name in self.names:
            path = self.store.ops_node("fence", name)
            for _ in range(5):  # only another taker moves a fence: under the locks, none
                _, version = self.store.read_raw(path)
                body = json.dumps({"holder": self.holder, "at": time.time()}).encode()
                try:
                    self.tokens[path] = self.store.write_raw(path, body, version)
                    break
                except MapConflictError:
                    continue
            else:
                raise LockLost(f"{self.holder}: {path} kept moving while this run took it: "
                               "another run is taking these servers' locks")

    @property
    def epoch(self) -> int:
        """The header's ``epoch``: the newest token this run holds."""
        return max(self.tokens.values(), default=0)

    def checks(self) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(self.tokens.items()))

    def check_session(self) -> None:
        """LockLost unless the store's session is still the one that took the locks."""
        now = self.store.session()
        if self.session is None or now != self.session:
            raise LockLost(f"{self.holder} lost its locks: its ZooKeeper session "
                           f"{self.session and hex(self.session)} expired (now "
                           f"{now and hex(now)}); another run may hold them now")

    def check(self) -> None:
        """LockLost unless this run still holds its locks: the same session, no fence moved."""
        self.check_session()
        for path, version in self.tokens.items():
            _, cur = self.store.read_raw(path)
            if cur != version:
                raise LockLost(f"{self.holder} lost its locks: {path} is at {cur}, this run "
                               f"holds {version}: another run took them")


# journals written while a Runner of the same name holds its locks are fenced by it
_FENCED: dict[tuple[int, str], Runner] = {}


def stepped(data: dict[str, Any], name: str, **fields: Any) -> dict[str, Any]:
    """*data* with step *name* done (its *fields* set, appended to ``steps``)."""
    steps = [*data.get("steps", []), {"step": name, "at": time.time(), **fields}]
    return {**data, **fields, "step": name, "steps": steps}


class Journal:
    """A versioned JSON document at ``ops/journal/<name>``.

    While a :class:`Runner` named *name* holds its locks (in this process) every write
    carries the run's header and checks its fence in the same transaction (LockLost
    when another run took the servers since)."""

    def __init__(self, store: ZooKeeperMapStore, name: str) -> None:
        if not name or "/" in name:
            raise ShardfleetError(f"journal name {name!r} must be non-empty without '/'")
        self.store, self.name = store, name
        self.path = store.ops_node("journal", name)
        self.version = NO_NODE
        self.data: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        raw, self.version = self.store.read_raw(self.path)
        self.data = json.loads(raw) if raw else None
        return self.data

    def save(self, data: dict[str, Any]) -> None:
        """Write *data* if nobody else wrote since :meth:`load` (MapConflictError otherwise;
        LockLost when this process's run of the same name lost its locks)."""
        data = dict(data, updated_at=time.time())
        runner = _FENCED.get((id(self.store), self.name))
        checks: tuple[tuple[str, int], ...] = ()
        if runner is not None and runner.fence is not None:
            # the fences themselves are checked by the write's own transaction
            runner.fence.check_session()
            data.update(runner.header(data))
            checks = runner.fence.checks()
        try:
            self.version = self.store.write_raw(
                self.path, json.dumps(data, sort_keys=True).encode(), self.version,
                checks=checks)
        except FenceMoved as exc:
            raise LockLost(f"{self.name} lost its locks: {exc}") from None
        self.data = data

    def write(self, change: Callable[[dict[str, Any]], dict[str, Any]],
              attempts: int = 5) -> dict[str, Any]:
        """The one compare-and-set write with retry: save ``change(data)``; when another
        writer wrote since :meth:`load` (MapConflictError), load again and apply *change*
        to what it wrote. Under a run's locks the one other writer is a physical copy's
        watch (it takes no lock, and a killed run's watch outlives its playbook)."""
        for attempt in range(attempts):
            try:
                data = change(dict(self.data or {}))
                self.save(data)
                return self.data or data
            except MapConflictError:
                if attempt == attempts - 1:
                    raise
                self.load()
                time.sleep(0.05)
        raise AssertionError("unreachable")

    def note(self, **fields: Any) -> dict[str, Any]:
        """Set *fields* without recording a step."""
        return self.write(lambda data: {**data, **fields})

    def step(self, name: str, **fields: Any) -> dict[str, Any]:
        """Record that step *name* is done (with *fields*), appending to ``steps``."""
        return self.write(lambda data: stepped(data, name, **fields))

    def delete(self) -> None:
        if self.version != NO_NODE:
            self.store.delete_raw(self.path, self.version)
        self.version, self.data = NO_NODE, None


class OperationInFlight(ShardfleetError):
    """Raised before anything changed when another unfinished operation (its journal says
    so) touches a server this one would change: finish or abort that one first."""


@dataclass(frozen=True)
class InFlight:
    """An unfinished operation, from its journal."""

    name: str
    kind: str
    step: str
    servers: tuple[str, ...]
    updated_at: float
    data: dict[str, Any]

    def describe(self) -> str:
        age = max(0.0, time.time() - self.updated_at) if self.updated_at else 0.0
        return (f"{self.kind} {self.name} (step {self.step}, on {', '.join(self.servers)}, "
                f"journal updated {age:.0f} s ago)")


def journal_base(store: ZooKeeperMapStore) -> str:
    return store.ops_node("journal")


def journals(store: ZooKeeperMapStore) -> dict[str, dict[str, Any]]:
    """Every journal under ``ops/journal`` by name (finished ones included)."""
    base = journal_base(store)
    names = store.children(base)
    out = {}
    for n in sorted(names):
        raw, _ = store.read_raw(f"{base}/{n}")
        if raw:
            try:
                out[n] = json.loads(raw)
            except ValueError:
                out[n] = {"step": "unreadable journal"}
    return out


HOST_PORT = re.compile(r"[^\s:/]+:\d+")
# A journal written before the header (0.1): a split finished at these steps.
_LEGACY_FINISHED = ("cutover", "cleanup", "aborted")


def _kind(name: str, d: dict[str, Any]) -> str:
    """What operation a journal records: its header's ``kind`` (before the header: the
    name's first word, ``promote`` read as ``promotion (<mode>)``)."""
    if "servers" in d and d.get("kind"):
        return str(d["kind"])
    word = name.split("-", 1)[0]
    if word == "promote":
        return f"promotion ({d.get('mode') or 'planned'})"
    return word


def _finished(d: dict[str, Any]) -> bool:
    """The header's ``done``, or its ``step`` is one of its ``finished_by`` (a journal
    written outside its runner keeps the header it had; before the header: ``done``, or a
    split past its cutover)."""
    step = str(d.get("step") or "")
    if "servers" in d:
        return bool(d.get("done")) or step in (d.get("finished_by") or ())
    return bool(d.get("done")) or step in _LEGACY_FINISHED


def _servers(d: dict[str, Any]) -> list[str]:
    """The header's ``servers`` (before the header: every ``host:port`` value it holds)."""
    if "servers" in d:
        return [str(s) for s in d["servers"] if s]
    return [v for v in d.values() if isinstance(v, str) and HOST_PORT.fullmatch(v)]


def _unfinished(name: str, d: dict[str, Any]) -> InFlight | None:
    """The operation a journal describes, when it is not finished: read from the header
    only (the registry knows no operation's own fields)."""
    if _finished(d):
        return None
    return InFlight(name, _kind(name, d), str(d.get("step") or "start"),
                    tuple(sorted(set(_servers(d)))),
                    float(d.get("updated_at") or d.get("started_at") or 0), d)


def server_lock_name(server: str) -> str:
    """The lock every operation takes for a server it changes (``server-host:port``), so a
    split and a promotion touching the same server exclude each other."""
    return "server-" + server.replace("/", "_")


def _holderless(store: ZooKeeperMapStore, name: str, d: dict[str, Any]) -> bool:
    """A journal whose header says ``in_flight_while_locked`` (an operation that changes
    nothing on its servers, a backup) when its run holds none of its servers' locks (no
    contender names the journal, as a runner names its locks): its process is gone, and it
    blocks no one (its next run takes the journal over)."""
    if not d.get("in_flight_while_locked"):
        return False
    return not any(name in store.client.Lock(
        store.ops_node("locks", server_lock_name(s))).contenders() for s in _servers(d))


def operations(store: ZooKeeperMapStore) -> tuple[list[InFlight], list[dict[str, Any]]]:
    """Every journal, read once: the operations in flight, and the finished ones the
    journals still hold, a dead backup's among them (name, kind, and when the journal last
    moved: a pair's promotion journal is reused by its next promotion, so that is the
    latest one's end)."""
    running: list[InFlight] = []
    done: list[dict[str, Any]] = []
    for n, d in journals(store).items():
        if (op := _unfinished(n, d)) is not None and not _holderless(store, n, d):
            running.append(op)
        else:
            done.append({"name": n, "kind": _kind(n, d),
                         "updated_at": float(d.get("updated_at") or d.get("started_at") or 0)})
    return running, done


def in_flight(store: ZooKeeperMapStore) -> list[InFlight]:
    """The registry of operations in flight: every journal not finished."""
    return operations(store)[0]


def refuse_if_busy(store: ZooKeeperMapStore, servers: list[str], me: str) -> None:
    """OperationInFlight when an unfinished operation other than *me* (a journal name)
    touches any of *servers*; one operation at a time per server, across steps and runs
    (the locks only cover one run)."""
    mine = set(servers)
    others = [op for op in in_flight(store) if op.name != me and mine & set(op.servers)]
    if others:
        raise OperationInFlight(
            "another operation is in flight on these servers: "
            + "; ".join(op.describe() for op in others)
            + ". Finish it (rerun its playbook) or abort it first; see "
              "`shardfleet ops list` and `shardfleet ops show NAME`. Nothing changed")
