"""Who accepted each write: the fault campaign's fencing check, from the servers' binary logs.

What it proves
--------------
Every server logs every row change it applies (``--log-bin``, ``--binlog-format=ROW``,
``--log-slave-updates``) with the *originating* server's id in each event's header: a
row its own client wrote carries its own id, a row it replicated carries the id of the
server that accepted it. :func:`binlog_writes` reads those row events for the writer's
pins (the rows whose body carries the writer's ``tag``) from each server's own log, so
the evidence does not depend on what any router or operation believed.

:class:`MapTimeline` watches the shard map and records each version with the
``time.monotonic()`` at which it was observed. :func:`check_origins` ties every writer
row event to the :mod:`history <shardfleet.testing.history>` operation that wrote it
(a create by the ``op`` index in its body; an update by (object id, ``v``)), and calls it
a violation when its origin server X had been the named master of the row's shard, had
*already* stopped being it in a map version observed before the operation was invoked,
and was not named again by any version observed before the operation completed (plus
``slack``). Such a write was accepted by a server the map no longer named: a broken
fence. A tagged row event no operation can account for is reported too.

Limits
------
* Timeline lag: the watch observes a change some time after it happened, so only a
  change observed *before* an operation's invoke counts against it, and a re-naming
  observed up to ``slack`` seconds after its completion clears it. A write that
  slipped through in the lag window (fence raised after the map changed but before
  the watch saw it) is not caught: this check can only miss violations, not invent them.
* Map versions the watch never delivered (two changes in quick succession, a session
  loss) might have named X: such a write is counted as not judged, not as a violation.
* A server never named master of the shard in the timeline is not judged: a split's
  clone copies rows onto its target (with the target's server id) before the map
  names it. Those writes are counted (``never_named``) so a reader can see them.
* Rebuilt servers (binary logs reset) have lost their earlier events; replicas may hold
  copies of them. The check works on what the logs hold, and one origin's event seen
  in several logs counts once (by GTID).
* Binary log timestamps (1 s resolution, wall clock) are not used: the time of a
  write is bounded by its operation's invoke and completion, in the same monotonic
  clock as the timeline.
* If several update operations carry the same (object id, ``v``) (an errored update's
  version retried), a row event is a violation only if it is one under every one of
  them.
"""

from __future__ import annotations

import bisect
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from shardfleet import ids
from shardfleet.mapstore import MapStore, ZooKeeperMapStore
from shardfleet.schema import OBJECT_COLUMNS
from shardfleet.shardmap import ShardMap
from shardfleet.testing.history import History, Op

PIN = 1
PINS_TABLE = "pins"
# the columns' positions in a row image (@1, @2, ...): the object table's column order
_LOCAL_COL = 1 + [c for c, _ in OBJECT_COLUMNS].index("local_id")
_BODY_COL = 1 + [c for c, _ in OBJECT_COLUMNS].index("body")


class BinlogReadError(RuntimeError):
    """A binary log could not be read (not a finding about the writes)."""


class RowWrite(NamedTuple):
    """One row change of a writer's pin, as a server's binary log holds it.

    ``origin`` is the server id in the event header (the server that accepted the
    write); ``kind`` is ``insert``, ``update`` (the SET image) or ``delete`` (the WHERE
    image); ``v`` and ``op`` come from that image's body (None when absent); ``where``
    is the log and event end position it was read at, for messages.
    """

    origin: int
    shard: int
    local_id: int
    kind: str
    v: int | None
    op: int | None
    gtid: str | None
    body: dict[str, Any] | None
    where: str

    @property
    def oid(self) -> int:
        return ids.compose(self.shard, PIN, self.local_id)

    def key(self) -> tuple[Any, ...]:
        """The same event in several servers' logs (the origin's and its replicas')
        has one key: its GTID and the row; without a GTID, the row and its place."""
        if self.gtid:
            return (self.gtid, self.shard, self.local_id, self.kind, self.v, self.op)
        return (self.origin, self.shard, self.local_id, self.kind, self.v, self.op, self.where)

    def describe(self) -> str:
        return (f"{self.kind} of shard {self.shard} local_id {self.local_id} v={self.v} "
                f"op={self.op} by server id {self.origin} (GTID {self.gtid}, {self.where})")


# -- reading the binary log ----------------------------------------------------------
_HEADER = re.compile(r"^#\d{6} +\d{1,2}:\d\d:\d\d server id (\d+) +end_log_pos (\d+) .*?\t(.*)$")
_GTID = re.compile(r"^GTID (\d+-\d+-\d+)")
_ROWS = re.compile(r"^### (INSERT INTO|UPDATE|DELETE FROM) `([^`]+)`\.`([^`]+)`$")
_COLUMN = re.compile(r"^###   @(\d+)=(.*)$")
_SHARD_DB = re.compile(r"^db(\d{5})$")
_INT = re.compile(r"^-?\d+(?: \((\d+)\))?$")  # -v prints a huge unsigned as "-1 (1844...)"
_KINDS = {"INSERT INTO": "insert", "UPDATE": "update", "DELETE FROM": "delete"}
_HEX = frozenset("0123456789abcdefABCDEF")


def decode_string(value: str) -> str:
    """The text of a string column as ``mariadb-binlog -v`` prints it (without the quotes).

    mariadb-binlog writes a string's bytes as they are, single quotes and backslashes
    included (its escaping branches for them are unreachable), except bytes below 0x20,
    which become ``\\xNN``. For JSON text that is unambiguous: a valid JSON text has no
    backslash outside a string and no ``\\x`` escape inside one, so a backslash that
    starts a JSON escape (``\\\\``, ``\\"``, ``\\n``...) is kept with the character after
    it, and ``\\x`` plus two hex digits is a printed control byte.
    """
    if "\\" not in value:
        return value
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
        elif value[i + 1] == "x" and i + 3 < n and value[i + 2] in _HEX \
                and value[i + 3] in _HEX:
            out.append(chr(int(value[i + 2:i + 4], 16)))
            i += 4
        else:
            out.append(value[i:i + 2])
            i += 2
    return "".join(out)


def _int(value: str) -> int | None:
    m = _INT.match(value.strip())
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else int(value.split()[0])


def _body(value: str) -> tuple[dict[str, Any] | None, str]:
    """(the parsed JSON object or None, its text)."""
    if len(value) < 2 or value[0] != "'" or value[-1] != "'":
        return None, value
    text = decode_string(value[1:-1])
    try:
        body = json.loads(text, strict=False)
    except ValueError:
        return None, text
    return (body if isinstance(body, dict) else None), text


def _as_int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and re.fullmatch(r"-?\d+", x):
        return int(x)
    return None


def binlog_files(server: Any) -> list[Path]:
    """The server's binary logs in order (``binlog.index`` in ``server.datadir``); a file
    the index names but that is gone (purged meanwhile) is left out."""
    datadir = Path(server.datadir)
    index = datadir / "binlog.index"
    if not index.exists():
        raise BinlogReadError(f"{index} does not exist: is the binary log on?")
    out = []
    for line in index.read_text().splitlines():
        name = line.strip()
        if name:
            p = Path(name) if Path(name).is_absolute() else datadir / name
            if p.exists():
                out.append(p)
    return out


def _parse(lines: Iterable[str], where: str, tag: str | None) -> Iterator[RowWrite]:
    """Row events on ``db?????.pins`` (with *tag* in the body when given) of one
    ``mariadb-binlog -v`` output, each once its transaction's commit is in the log."""
    origin, pos, gtid = 0, "", None
    pending: list[RowWrite] = []
    in_rows = False  # inside a row event's "###" lines
    cur: dict[str, Any] | None = None  # the row image being read

    def finish() -> RowWrite | None:
        nonlocal cur
        row, cur = cur, None
        if row is None:
            return None
        cols: dict[int, str] = row["cols"]
        local = _int(cols.get(_LOCAL_COL, ""))
        raw = cols.get(_BODY_COL, "")
        body, text = _body(raw)
        if tag is not None:
            if body is not None:
                if body.get("tag") != tag:
                    return None
            elif tag not in text:
                return None
        if local is None:
            return None
        return RowWrite(origin, row["shard"], local, row["kind"],
                        _as_int(body.get("v")) if body else None,
                        _as_int(body.get("op")) if body else None,
                        gtid, body, f"{where}:{pos}")

    def keep(row: RowWrite | None) -> None:
        if row is not None:
            pending.append(row)

    for line in lines:
        if line.startswith("### "):
            if not in_rows:
                continue  # a statement's text, not a row image
            m = _ROWS.match(line)
            if m:
                keep(finish())
                db = _SHARD_DB.match(m.group(2))
                if db and m.group(3) == PINS_TABLE:
                    cur = {"kind": _KINDS[m.group(1)], "shard": int(db.group(1)), "cols": {}}
                continue
            if cur is None:
                continue
            if line.rstrip() in ("### SET", "### WHERE"):
                if line.rstrip() == "### SET":
                    cur["cols"] = {}  # an update's after image replaces its before image
                continue
            c = _COLUMN.match(line)
            if c:
                cur["cols"][int(c.group(1))] = c.group(2)
            continue
        if in_rows:
            keep(finish())
            in_rows = False
        if not line.startswith("#"):
            if line.startswith("COMMIT"):  # a Query COMMIT (non-XA, non-InnoDB)
                yield from pending
                pending.clear()
            continue
        h = _HEADER.match(line)
        if not h:
            continue
        origin, pos, what = int(h.group(1)), h.group(2), h.group(3)
        g = _GTID.match(what)
        if g:
            # a new transaction: anything pending was committed (the log holds only
            # committed transactions; only its very end may be cut short)
            yield from pending
            pending.clear()
            gtid = g.group(1)
        elif what.startswith("Xid"):
            yield from pending
            pending.clear()
        elif what.startswith(("Write_rows", "Update_rows", "Delete_rows")):
            in_rows = True
    # pending now: a transaction without its commit at the end of the log (a file cut
    # short while being written): not committed in this log (yet), left out


def read_binlog(path: Path, tag: str | None = None, *,
                binary: str | None = None) -> tuple[list[RowWrite], str]:
    """The writer's row events in one binary log file, and what ``mariadb-binlog`` said on
    stderr (an ``ERROR`` there with a zero exit: the file's end was cut short, as the
    file a running server is writing may be)."""
    exe = binary or shutil.which("mariadb-binlog") or shutil.which("mysqlbinlog")
    if not exe:
        raise BinlogReadError("mariadb-binlog is not installed")
    argv = [exe, "--no-defaults", "--base64-output=decode-rows", "-v",
            "--skip-gtid-strict-mode", str(path)]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        try:
            lines = (raw.decode("utf-8", "replace").rstrip("\n") for raw in proc.stdout)
            rows = list(_parse(lines, path.name, tag))
        finally:
            proc.stdout.close()
            rc = proc.wait(120)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace").strip()
    if rc != 0:
        raise BinlogReadError(f"mariadb-binlog {path} exited {rc}: {stderr[-500:]}")
    return rows, stderr


def file_id(path: Path) -> tuple[str, int, int]:
    """A closed binary log's identity: name, inode and size (a rebuild's RESET MASTER
    starts ``binlog.000001`` again under the same name: the inode and size tell it apart)."""
    st = path.stat()
    return (path.name, st.st_ino, st.st_size)


def rotate(server: Any) -> set[tuple[str, int, int]]:
    """``FLUSH BINARY LOGS`` on *server*, then the identities of its closed logs: what an
    audit of later writes may skip (:func:`binlog_writes` *skip*), so a campaign that
    reuses servers reads only the logs of its current run."""
    server.sql("FLUSH BINARY LOGS")
    files = binlog_files(server)
    return {file_id(p) for p in files[:-1]}


def binlog_writes(server: Any, tag: str | None,
                  skip: set[tuple[str, int, int]] | frozenset[Any] = frozenset()
                  ) -> list[RowWrite]:
    """Every committed row event on a ``db?????.pins`` table whose body carries
    ``"tag": tag`` (any tag when None) in *server*'s own binary logs, in log order.

    Reads the files in ``server.datadir`` (listed by ``binlog.index``): that works for a
    running server (the file it writes is read up to its last complete transaction)
    and a stopped or killed one alike. Raises :class:`BinlogReadError` when a log
    cannot be read, or when a log other than the last one is cut short. *skip*: logs
    (:func:`file_id`) to leave out, e.g. those :func:`rotate` closed before a run.
    """
    files = binlog_files(server)
    out: list[RowWrite] = []
    for i, path in enumerate(files):
        if skip and file_id(path) in skip:
            continue
        rows, stderr = read_binlog(path, tag)
        if "ERROR" in stderr and i != len(files) - 1:
            raise BinlogReadError(f"{path} is cut short or unreadable: {stderr[-500:]}")
        out.extend(rows)
    return out


# -- the map's timeline --------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """One version of the map as the timeline's watch delivered it, at ``time``
    (``time.monotonic()``); ``map`` None: the map was absent."""

    time: float
    version: int
    map: ShardMap | None

    def master(self, shard: int) -> str | None:
        if self.map is None:
            return None
        r = self.map.find(shard)
        return r.master if r is not None else None


class MapTimeline:
    """Every version of the shard map as it was observed, with the time of each
    observation: start it before the writer, stop it after.

    It watches through its own store (:meth:`for_cluster` opens one, its own ZooKeeper
    session, and closes it on :meth:`stop`), so a router's view plays no part. A
    repeated delivery of one version (kazoo re-arming a watch) is recorded once.
    """

    def __init__(self, store: MapStore, *, owns_store: bool = False) -> None:
        self.store = store
        self.owns_store = owns_store
        self._obs: list[Observation] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    @classmethod
    def for_cluster(cls, hosts: str, cluster: str, **kw: Any) -> MapTimeline:
        """A timeline over its own ZooKeeper store of *cluster* (closed on stop)."""
        return cls(ZooKeeperMapStore(hosts, cluster, **kw), owns_store=True)

    def _on_map(self, m: ShardMap | None, version: int) -> None:
        now = time.monotonic()
        with self._changed:
            if self.stopped_at is not None:
                return
            if self._obs and self._obs[-1].version == version and (
                    (self._obs[-1].map is None) == (m is None)):
                return
            self._obs.append(Observation(now, version, m))
            self._changed.notify_all()

    def start(self, timeout: float = 30.0) -> MapTimeline:
        """Set the watch and wait (bounded) for its first delivery, the baseline."""
        self.started_at = time.monotonic()
        self.store.watch(self._on_map)
        with self._changed:
            if not self._changed.wait_for(lambda: bool(self._obs), timeout):
                raise TimeoutError(f"the map watch delivered nothing within {timeout}s")
        return self

    def stop(self) -> None:
        """Stop recording (later deliveries are ignored); close an owned store."""
        with self._changed:
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
        if self.owns_store:
            self.store.close()

    def __enter__(self) -> MapTimeline:
        return self.start() if self.started_at is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def observations(self) -> list[Observation]:
        with self._lock:
            return list(self._obs)

    def wait_version(self, version: int, timeout: float = 30.0) -> Observation:
        """The first observation of *version* or later, waiting (bounded) for it."""
        def seen() -> Observation | None:
            return next((o for o in self._obs if o.version >= version), None)

        with self._changed:
            if not self._changed.wait_for(lambda: seen() is not None, timeout):
                raise TimeoutError(f"map version {version} not observed within {timeout}s")
            found = seen()
        assert found is not None
        return found

    def at(self, t: float) -> Observation | None:
        """The last observation at or before *t* (None before the first)."""
        obs = self.observations
        i = bisect.bisect_right([o.time for o in obs], t) - 1
        return obs[i] if i >= 0 else None

    def named_master(self, shard: int, t: float) -> str | None:
        """The master the map named for *shard* as last observed at or before *t*."""
        o = self.at(t)
        return o.master(shard) if o is not None else None

    def master_intervals(self, shard: int, address: str) -> list[tuple[float, float | None]]:
        """The observed intervals [start, end) in which *address* was the named master
        of *shard* (end None: still named at the last observation)."""
        out: list[tuple[float, float | None]] = []
        start: float | None = None
        for o in self.observations:
            named = o.master(shard) == address
            if named and start is None:
                start = o.time
            elif not named and start is not None:
                out.append((start, o.time))
                start = None
        if start is not None:
            out.append((start, None))
        return out


# -- the check -----------------------------------------------------------------------
@dataclass(frozen=True)
class Violation:
    """A write accepted by *server* for a shard the map no longer named it master of:
    ``observed`` is the last observation before the operation's invoke (naming
    another master), ``window`` the operation's [invoke, completion]."""

    write: RowWrite
    server: str
    op: int
    window: tuple[float, float]
    observed: Observation

    def describe(self, t0: float = 0.0) -> str:
        return (f"{self.write.describe()} = {self.server}, op {self.op} "
                f"[{self.window[0] - t0:.3f}, {self.window[1] - t0:.3f}]; map version "
                f"{self.observed.version} observed at {self.observed.time - t0:.3f} names "
                f"{self.observed.master(self.write.shard)}")


@dataclass
class Origins:
    """What :func:`audit_origins` found: ``problems`` (empty when the check holds), the
    distinct writer row events (``writes``), how many were judged against the timeline,
    and why the others were not (``unjudged``: reason -> count)."""

    problems: list[str] = field(default_factory=list)
    writes: list[RowWrite] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    untied: list[tuple[RowWrite, str]] = field(default_factory=list)
    judged: int = 0
    unjudged: Counter[str] = field(default_factory=Counter)
    by_origin: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        return (f"{len(self.writes)} writer row event(s) by {dict(self.by_origin)}; "
                f"{self.judged} judged, not judged {dict(self.unjudged)}; "
                f"{len(self.violations)} violation(s), {len(self.untied)} untied")


def _servers(servers: Mapping[str, Any] | Iterable[Any]) -> list[Any]:
    return list(servers.values()) if isinstance(servers, Mapping) else list(servers)


def _verdict(obs: list[Observation], times: list[float], shard: int, address: str,
             window: tuple[float, float], slack: float) -> tuple[str, Observation | None]:
    """("ok" | "violation" | a reason it cannot be judged, the observation it rests on)."""
    invoke, end = window
    i = bisect.bisect_left(times, invoke) - 1  # the last observation strictly before invoke
    if i < 0:
        return "no map observed before the operation", None
    last = obs[i]
    if last.master(shard) == address:
        return "ok", last
    if not any(o.master(shard) == address for o in obs[:i]):
        return "never named master of the shard", last
    prev = last.version
    for o in obs[i + 1:]:
        if o.time > end + slack:
            break
        if o.master(shard) == address:
            return "ok", o
        if o.version > prev + 1:
            return "map versions unseen", last
        prev = max(prev, o.version)
    return "violation", last


def audit_origins(timeline: MapTimeline, history: History,
                  servers: Mapping[str, Any] | Iterable[Any], tag: str, *,
                  slack: float = 1.0,
                  skip: Mapping[str, set[tuple[str, int, int]]] | None = None) -> Origins:
    """:func:`check_origins` with its counts; see the module docstring."""
    res = Origins()
    by_id: dict[int, str] = {}
    for s in _servers(servers):
        by_id[int(s.server_id)] = s.address
    seen: set[tuple[Any, ...]] = set()
    for s in _servers(servers):
        try:
            rows = binlog_writes(s, tag, (skip or {}).get(s.address, frozenset()))
        except (BinlogReadError, OSError, subprocess.SubprocessError) as exc:
            res.problems.append(f"cannot read the binary log of {s.address}: {exc}")
            continue
        for w in rows:
            if w.key() not in seen:
                seen.add(w.key())
                res.writes.append(w)

    ops = history.snapshot()
    invoked: dict[int, Op] = {o.index: o for o in ops if o.type == "invoke"}
    done: dict[int, Op] = {o.index: o for o in ops if o.type != "invoke"}
    end = max([o.time for o in ops] + [timeline.stopped_at or time.monotonic()])
    updates: dict[tuple[int, int], list[int]] = defaultdict(list)
    for o in invoked.values():
        if o.f == "update":
            updates[(int(o.value["id"]), int(o.value["v"]))].append(o.index)

    def window(index: int) -> tuple[float, float]:
        c = done.get(index)
        return invoked[index].time, (c.time if c is not None and c.type == "ok" else end)

    obs = timeline.observations
    times = [o.time for o in obs]
    never_invoked: list[RowWrite] = []
    unknown_origin: list[RowWrite] = []
    for w in res.writes:
        address = by_id.get(w.origin)
        res.by_origin[address or f"server id {w.origin}"] += 1
        if address is None:
            unknown_origin.append(w)
            continue
        if w.kind == "insert":
            if w.op is None:
                res.untied.append((w, "no op index in the body"))
                continue
            if w.op not in invoked:
                never_invoked.append(w)
                continue
            if invoked[w.op].f != "create":
                res.untied.append((w, f"op {w.op} is a {invoked[w.op].f}, not a create"))
                continue
            candidates = [w.op]
        elif w.kind == "update":
            if w.v is None:
                res.untied.append((w, "no version in the body"))
                continue
            candidates = updates.get((w.oid, w.v), [])
            if not candidates:
                never_invoked.append(w)
                continue
        else:
            res.untied.append((w, "the writer never deletes"))
            continue
        verdicts = [(k, *_verdict(obs, times, w.shard, address, window(k), slack))
                    for k in candidates]
        bad = [(k, ob) for k, v, ob in verdicts if v == "violation" and ob is not None]
        if len(bad) == len(verdicts):
            k, ob = bad[0]
            res.judged += 1
            res.violations.append(Violation(w, address, k, window(k), ob))
        elif any(v == "ok" for _, v, _ in verdicts):
            res.judged += 1
        else:
            res.unjudged[next(v for _, v, _ in verdicts if v != "violation")] += 1

    t0 = timeline.started_at or 0.0
    if res.violations:
        res.problems.append(
            f"{len(res.violations)} write(s) accepted by a server the map no longer named "
            "master of the shard (times from the timeline's start): "
            + "; ".join(v.describe(t0) for v in res.violations[:5]))
    if never_invoked:
        res.problems.append(
            f"{len(never_invoked)} tagged row event(s) no operation of the history invoked: "
            + "; ".join(w.describe() for w in never_invoked[:5]))
    if res.untied:
        res.problems.append(
            f"{len(res.untied)} tagged row event(s) that cannot be tied to a history "
            "operation: " + "; ".join(f"{w.describe()}: {why}" for w, why in res.untied[:5]))
    if unknown_origin:
        res.problems.append(
            f"{len(unknown_origin)} tagged row event(s) from a server id none of the given "
            "servers has: " + "; ".join(w.describe() for w in unknown_origin[:5]))
    return res


def check_origins(timeline: MapTimeline, history: History,
                  servers: Mapping[str, Any] | Iterable[Any], tag: str, *,
                  slack: float = 1.0,
                  skip: Mapping[str, set[tuple[str, int, int]]] | None = None) -> list[str]:
    """The problems with who accepted the writer's writes, from every server's binary log
    (empty when none): writes accepted by a server the map had stopped naming master of
    the shard before the operation started (and did not name again before it ended,
    plus *slack* seconds of watch lag), and tagged row events no history operation
    accounts for. *servers*: MariaDBServer-like objects (``server_id``, ``address``,
    ``datadir``), a list or an {address: server} dict: every server whose id may be
    in a log. Never raises for a finding; an unreadable log is a problem too."""
    return audit_origins(timeline, history, servers, tag, slack=slack, skip=skip).problems


__all__ = ["BinlogReadError", "MapTimeline", "Observation", "Origins", "RowWrite",
           "Violation", "audit_origins", "binlog_files", "binlog_writes", "check_origins",
           "decode_string", "file_id", "read_binlog", "rotate"]
