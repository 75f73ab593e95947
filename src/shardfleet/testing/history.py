"""A Jepsen-style history of the kit's writer, and the checker over it.

Every writer operation is recorded twice: an ``invoke`` when it starts and one
completion when it ends, ``ok`` (acknowledged: it happened) or ``info`` (it errored:
it may or may not have happened). A create carries its operation's index in the
row it writes (``$.op`` in the body), so an errored create can be found, or proven
absent, on the servers afterwards, and a create applied twice (a retry after a lost
reply) shows up as two rows with one index::

    index  process  f       value                    type    time
    17     1        create  {"shard": 20}            invoke  12.301
    17     1        create  {"id": 5629...}          ok      12.309
    18     0        update  {"id": 5629..., "v": 3}  invoke  12.310
    18     0        update  {"id": 5629..., "v": 3}  info    17.311  ShardFrozenError(...)

:func:`check_history` reads the writer's rows from the masters the map names and
says what is wrong (a list of problems, empty when the history holds): an
acknowledged write lost or stale, an errored create present more than once or
incomplete, a row no operation wrote, an acknowledged create whose row carries
another operation's index.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pymysql

from shardfleet import ids
from shardfleet.schema import shard_database
from shardfleet.shardmap import ShardMap

PIN = 1


@dataclass(frozen=True)
class Op:
    """One event of the history: an invocation or its completion."""

    index: int       # the operation's number (an invoke and its completion share it)
    process: int     # the writer thread
    f: str           # "create" or "update"
    value: dict[str, Any]
    type: str        # "invoke", "ok" or "info"
    time: float      # time.monotonic()
    error: str = ""


@dataclass
class History:
    """Thread-safe list of :class:`Op`; see the module docstring."""

    ops: list[Op] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next: int = 0

    def invoke(self, process: int, f: str, value: dict[str, Any]) -> int:
        with self._lock:
            index, self._next = self._next, self._next + 1
            self.ops.append(Op(index, process, f, dict(value), "invoke", time.monotonic()))
        return index

    def ok(self, index: int, process: int, f: str, value: dict[str, Any]) -> None:
        with self._lock:
            self.ops.append(Op(index, process, f, dict(value), "ok", time.monotonic()))

    def info(self, index: int, process: int, f: str, value: dict[str, Any],
             error: str) -> None:
        with self._lock:
            self.ops.append(Op(index, process, f, dict(value), "info", time.monotonic(),
                               error[:300]))

    def snapshot(self) -> list[Op]:
        with self._lock:
            return list(self.ops)

    def completions(self) -> dict[int, Op]:
        """The completion of every finished operation, by index."""
        return {o.index: o for o in self.snapshot() if o.type != "invoke"}

    def invoked(self) -> dict[int, Op]:
        return {o.index: o for o in self.snapshot() if o.type == "invoke"}

    def pending(self) -> list[Op]:
        """Invocations without a completion (a thread still running when it was read)."""
        done = self.completions()
        return [o for o in self.invoked().values() if o.index not in done]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for o in self.snapshot():
            if o.type != "invoke":
                out[f"{o.f} {o.type}"] += 1
        return dict(out)

    def dump(self, path: Path, t0: float = 0.0) -> None:
        """One JSON object per line (times relative to *t0*)."""
        with path.open("w") as out:
            for o in self.snapshot():
                d = asdict(o)
                d["time"] = round(o.time - t0, 4)
                out.write(json.dumps(d, sort_keys=True) + "\n")


def tagged_rows(server: Any, shards: list[int], tag: str) -> dict[int, tuple[int, int | None]]:
    """{object id: (body version, the writing operation's index)} of every pin the writer
    tagged *tag* on *server* in *shards* (a missing database is skipped)."""
    out: dict[int, tuple[int, int | None]] = {}
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            for s in shards:
                try:
                    cur.execute(f"SELECT local_id, JSON_VALUE(body, '$.v'), "
                                f"JSON_VALUE(body, '$.op') FROM `{shard_database(s)}`.`pins` "
                                "WHERE JSON_VALUE(body, '$.tag') = %s", (tag,))
                except pymysql.err.ProgrammingError:
                    continue
                for local, v, op in cur.fetchall():
                    out[ids.compose(s, PIN, int(local))] = (
                        int(v) if v is not None else -1, int(op) if op is not None else None)
    finally:
        conn.close()
    return out


def check_history(shard_map: ShardMap, servers: dict[str, Any], shards: list[int],
                  history: History, tag: str) -> list[str]:
    """What the servers (read through *shard_map*: each shard on the master it names)
    contradict in *history*; empty when nothing does. *servers* maps an address to an
    object with ``connect()``."""
    by_master: dict[str, list[int]] = defaultdict(list)
    for s in shards:
        by_master[shard_map.range_for(s).master].append(s)
    live: dict[int, tuple[int, int | None]] = {}
    for master, on_master in by_master.items():
        if master not in servers:
            return [f"the map names {master} for shards {on_master[:3]}..., not a test server"]
        live.update(tagged_rows(servers[master], on_master, tag))
    invoked, done = history.invoked(), history.completions()
    problems: list[str] = []
    # the value of each object: acknowledged, and possible (errored updates)
    acked: dict[int, int] = {}
    possible: dict[int, set[int]] = defaultdict(set)
    created_by: dict[int, int] = {}  # oid -> the create op that was acknowledged with it
    for op in sorted(done.values(), key=lambda o: o.time):
        if op.f == "create" and op.type == "ok":
            oid = int(op.value["id"])
            created_by[oid] = op.index
            acked[oid] = max(acked.get(oid, 0), 0)
        elif op.f == "update":
            oid, v = int(op.value["id"]), int(op.value["v"])
            if op.type == "ok":
                acked[oid] = max(acked.get(oid, 0), v)
            else:
                possible[oid].add(v)
    for o in history.pending():  # unfinished: may or may not have happened
        if o.f == "update":
            possible[int(o.value["id"])].add(int(o.value["v"]))
    lost = [oid for oid in acked if oid not in live]
    if lost:
        problems.append(f"{len(lost)} acknowledged object(s) missing from the master the map "
                        f"names, e.g. {[ids.decompose(i) for i in lost[:3]]}")
    stale = [(oid, v, live[oid][0]) for oid, v in acked.items()
             if oid in live and live[oid][0] != v
             and not (live[oid][0] > v and live[oid][0] in possible[oid])]
    if stale:
        problems.append(f"{len(stale)} object(s) without their last acknowledged value "
                        f"(id, acked, found): {stale[:3]}")
    wrong_op = [(oid, i, live[oid][1]) for oid, i in created_by.items()
                if oid in live and live[oid][1] != i]
    if wrong_op:
        problems.append(f"{len(wrong_op)} acknowledged create(s) whose row another operation "
                        f"wrote (id, op, row's op): {wrong_op[:3]}")
    seen: dict[int, list[int]] = defaultdict(list)
    for oid, (_, writer_op) in live.items():
        seen[writer_op if writer_op is not None else -1].append(oid)
    twice = {op: oids for op, oids in seen.items() if op >= 0 and len(oids) > 1}
    if twice:
        problems.append(f"{len(twice)} create(s) applied more than once (op: ids): "
                        f"{dict(list(twice.items())[:3])}")
    creates = {i for i, o in invoked.items() if o.f == "create"}
    phantom = [oid for op, oids in seen.items() if op not in creates for oid in oids]
    if phantom:
        problems.append(f"{len(phantom)} row(s) no create of this history wrote: "
                        f"{[ids.decompose(i) for i in phantom[:3]]}")
    # an errored create is fully there (once, at version 0 or a later update) or absent
    for i in creates:
        c = done.get(i)
        if c is not None and c.type == "ok":
            continue
        for oid in seen.get(i, []):
            if live[oid][0] != 0:
                problems.append(f"errored create op {i} left object {oid} at version "
                                f"{live[oid][0]} (nobody updated it)")
    return problems


__all__ = ["History", "Op", "check_history", "tagged_rows"]
