"""Promotion: make a pair's standby its master, planned or in an emergency.

Human-triggered, never automatic. Planned, emergency and rebuild are step tables
on the operation runner (:class:`shardfleet.ops.Runner`, named ``promote-<pair>``
or ``rebuild-<pair>``): it holds both servers' locks for the whole run, refuses
beside another operation in flight on them, and skips a step whose "is it done?"
(read from the map and the servers) holds. Each step is recorded in the journal
``ops/journal/promote-<pair>`` (started with the first change: a refusal leaves
none) so a rerun continues where a failed run stopped, and a rerun of a finished
promotion changes nothing.

Step tables (journal step names; "done?" in brackets)::

    planned    caught_up (always: checks, catch-up), frozen [the ranges frozen by
               promote-<pair>, or flipped], old_read_only [flipped], drained
               [flipped], new_writable [the new master read_only=OFF], flipped
               [the map names the new master, unfrozen, no rebuild mark]
    emergency  frozen [as above], old_fenced [flipped], received_final [flipped,
               or no live old master to receive from], drained [flipped],
               errant_checked [flipped], new_writable [read_only=OFF and semi-sync
               master off], flipped [the map names the new master with
               rebuild=<old>], replication_stopped, channel_removed [the new
               master has no channel from the old]
    rebuild    fenced_and_cleared [copied], copied [an unfinished journal of the
               same rebuild says so and the shards are on the node], replicating
               [the journal says so and both channels run], mark_cleared [no
               range of the pair marks the node]

Planned (the master answers)::

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

Emergency (the master does not answer; or ``force``)::

    freeze     as above (routers wait rather than hammer a dead server)
    fence      best effort: the old master read_only=ON if it answers
    drain      stop the standby's I/O thread, wait until it applied every
               relay log event it received, then stop its replication from
               the old master (a returning old master cannot push its
               unacknowledged tail into the new master)
    errant     GTIDs written on the standby the master never had: reported
    writable   standby read_only=OFF
    flip       master and standby swapped, ``rebuild: <old master>`` on the
               ranges (playbooks/rebuild-standby.yml re-attaches it)

With semi-synchronous replication every acknowledged commit reached the
standby's relay log, so draining the relay log loses none; when semi-sync is
off (or its state cannot be shown) the result says so in ``warnings``.

MariaDB is what runs and is tested here (the dialect is picked in
:mod:`shardfleet.topology`); the relay-log and GTID details are MariaDB's.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import pymysql
from kazoo.exceptions import KazooException

from shardfleet import replication, schema, shardmap, topology
from shardfleet.errors import DatabaseError, MapError, ShardfleetError, mysql_code
from shardfleet.mapstore import ZooKeeperMapStore, update
from shardfleet.operations.runner import (
    Journal,
    LockBusy,
    LockLost,
    OperationInFlight,
    Runner,
    Step,
    StepResult,
)
from shardfleet.operations.types import Options, Result
from shardfleet.shardmap import ShardMap, ShardRange, freeze_owner

log = logging.getLogger(__name__)
T = TypeVar("T")

MODES = ("planned", "emergency")


class PromotionRefused(ShardfleetError):
    """Raised before anything changed: the request is unsafe or makes no sense
    (emergency on a live master, planned on a dead one, unknown pair, lock held)."""


class PromotionFailed(ShardfleetError):
    """Raised when a step failed after changes began; the message says what state
    the pair was left in and the journal records every step done."""


# -- small helpers ----------------------------------------------------------

def _connect(server: str, opts: Options) -> pymysql.connections.Connection:
    return topology.connect(server, opts.user, opts.password, timeout=opts.connect_timeout,
                            read_timeout=opts.read_timeout, tls=opts.tls)


def reach(server: str, opts: Options) -> tuple[Any | None, str, bool]:
    """(connection, "", False) when *server* answers a query; else (None, why, refusing).

    *refusing* is True when the server answered with a MySQL error of its own (too many
    connections 1040, host blocked 1129, access denied 1045/1044, ...): it is alive, and
    a promotion must not treat it as dead. Only the client's own errors (2003 no route or
    refused, 2013 no answer within the timeout, ...) and OS errors mean unreachable.
    """
    try:
        conn = _connect(server, opts)
    except (DatabaseError, pymysql.err.MySQLError, OSError) as exc:
        code = mysql_code(exc)
        return None, f"MySQL error {code}: {exc}" if code else str(exc), 1000 <= code < 2000
    try:
        topology.scalar(conn, "SELECT 1")
        return conn, "", False
    except (pymysql.err.MySQLError, OSError) as exc:
        _close(conn)
        return None, f"{server}: {_describe(exc)}", 1000 <= mysql_code(exc) < 2000


def try_connect(server: str, opts: Options) -> tuple[Any | None, str]:
    """(connection, "") when *server* answers a query, else (None, why)."""
    conn, why, _ = reach(server, opts)
    return conn, why


def _alive_refusing(server: str, why: str) -> PromotionRefused:
    return PromotionRefused(
        f"the master {server} is alive but refuses the admin connection ({why}): it is NOT "
        "dead, so an emergency promotion would leave two masters. Fix the access (free "
        "connections, FLUSH HOSTS for a blocked host, the admin password or grants), then "
        "use mode=planned (zero loss); nothing changed")


class Listening:
    """Whether a standby still hears its master: the evidence an emergency promotion
    weighs when the master does not answer the control node.

    Silence is measured over a window, never read from one sample. The standby's channel
    is read while the master is probed, every 50 ms, until a deadline. The master is
    heard when what the channel received (:func:`replication.heard`: connected or not,
    position, heartbeats, GTIDs) changed at least twice: one change can be the last bytes
    of a master that just died, still in flight. A channel ``Connecting`` (a blip cut it,
    and it waits out its retry period) that has applied everything it received is first
    told to retry at once (:func:`replication.reconnect_now`), so a live master it can
    reach is heard within the window; one with events left to apply is never restarted
    (MariaDB may discard its relay logs: acknowledged writes), and its window grows by
    its retry period. It is not heard when the I/O thread is stopped, when the master's host refuses
    the standby's connection (no server listens there), or when nothing changed twice
    within three heartbeat periods (``Slave_heartbeat_period``;
    ``replication.HEARTBEAT_PERIOD`` on the channels the fleet creates) plus half a second,
    at most ``Options.silence_timeout``.
    """

    def __init__(self, conn: Any, opts: Options) -> None:
        self.conn, self.opts = conn, opts
        ch = replication.peer_channel(conn)
        retry = 0.0
        if ch is not None and ch.get("Slave_IO_Running") in ("Connecting", "Preparing"):
            if ch.get("Slave_SQL_Running") == "Yes" and _applied_all_received(ch):
                # nothing received is left to apply, so a restart of the I/O thread
                # (MariaDB may discard relay logs then) loses nothing
                replication.reconnect_now(conn, str(ch.get("Connection_name") or ""))
                ch = replication.peer_channel(conn)
            else:  # never restart it over unapplied events: wait for its own retry
                retry = float(ch.get("Connect_Retry") or 0)
        self.t0 = time.monotonic()
        self.seen = [replication.heard(ch)]
        period = float((ch or {}).get("Slave_heartbeat_period") or 0.0)
        self.window = min(3 * period + 0.5 + retry, opts.silence_timeout) if period > 0 \
            else opts.silence_timeout

    def watch(self, stop: Callable[[], bool]) -> str:
        """"" when the standby does not hear the master, else what it heard; gives up
        early (with "") when *stop* says the answer is no longer needed."""
        deadline = self.t0 + self.window
        while self.seen[-1] is not None:
            if len(self.seen) >= 3:
                return (f"{len(self.seen) - 1} changes of its connection, I/O position or "
                        f"heartbeat count in {time.monotonic() - self.t0:.1f}s")
            if stop() or time.monotonic() >= deadline:
                return ""
            time.sleep(0.05)
            ch = replication.peer_channel(self.conn)
            if replication.refused(ch):
                return ""
            now = replication.heard(ch)
            if now is None or now != self.seen[-1]:
                self.seen.append(now)
        return ""

    def probe(self, server: str, opts: Options) -> tuple[tuple[Any | None, str, bool], str]:
        """:func:`reach` *server* while watching the standby: (reach's answer, what the
        standby heard). The watch stops as soon as the probe has an answer from the
        server itself (a connection, or an error of the server's own)."""
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(reach, server, opts)
            heard = self.watch(lambda: fut.done() and (fut.result()[0] is not None
                                                       or fut.result()[2]))
            return fut.result(), heard


def _close(conn: Any) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


# The server primitives live in :mod:`shardfleet.replication`; the names the promotion's
# callers and tests have used.
replica_status = replication.replica_rows
semisync_state = replication.semisync_state
errant_against = replication.errant_gtids


# -- the map ----------------------------------------------------------------

def pair_ranges(m: ShardMap, nodes: list[str]) -> list[ShardRange]:
    """Ranges whose master (and standby, if any) are both nodes of the pair."""
    ns = set(nodes)
    return [r for r in m.ranges if r.master in ns and (r.standby is None or r.standby in ns)]


def _write_map(store: ZooKeeperMapStore, edit: Callable[[ShardMap], ShardMap]) -> ShardMap:
    """One edit through the map-change loop (:func:`shardfleet.mapstore.update`: CAS
    retries, a lost reply decided by content); PromotionFailed when the edit is refused."""
    try:
        return update(store, edit).map
    except MapError as exc:
        raise PromotionFailed(f"the map does not allow this promotion step: {exc}") from None


def owner(pair: str) -> str:
    """The name a promotion freezes its pair's ranges under (its journal's name)."""
    return f"promote-{pair}"


def _freeze(m: ShardMap, bounds: set[tuple[int, int]], pair: str) -> ShardMap:
    return m.freeze(bounds, owner(pair))


def _unfreeze(m: ShardMap, bounds: set[tuple[int, int]], pair: str) -> ShardMap:
    return m.thaw(owner(pair), bounds)


def _flip(m: ShardMap, bounds: set[tuple[int, int]], new_master: str, old_master: str,
          rebuild: bool, pair: str) -> ShardMap:
    return m.flip(owner(pair), bounds, master=new_master, standby=old_master,
                  drop=() if rebuild else ("rebuild",),
                  set_extra={"rebuild": old_master} if rebuild else None)


# -- the operation ------------------------------------------------------------

ERRORS = (ShardfleetError, pymysql.err.MySQLError, OSError, KazooException)


class _Run:
    """One promotion or rebuild in progress on the runner: the journal, the result,
    timings, and the rows of its step table."""

    def __init__(self, store: ZooKeeperMapStore, pair: str, res: Result, check: bool,
                 name: str = "") -> None:
        self.store, self.pair, self.res, self.check = store, pair, res, check
        self.name = name or owner(pair)
        self.journal = Journal(store, self.name)
        self.t0 = self.t_begin = time.monotonic()
        self.start: dict[str, Any] = {}
        self.begun = False     # a change may have happened (the journal was started)
        self.switched = False  # an unfinished planned promotion continued as an emergency
        self.nodes: list[str] = []
        self.pending: list[dict[str, Any]] = []  # steps done before the first change
        self.runner: Runner | None = None  # while the locks are held (its fence)

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
        self.res.steps.append(name)
        self.res.timings[name] = round(time.monotonic() - self.t0, 3)
        if self.begun:
            self.journal.step(name, **fields)
        elif not self.check:
            self.pending.append({"step": name, "at": time.time(), **fields})
        log.info("promote %s: %s", self.pair, name)

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

    def new_runner(self, opts: Options) -> Runner:
        return Runner(self.store, self.name, self.nodes, lock_timeout=opts.lock_timeout,
                      identifier=self.name, kind=self.kind())

    def kind(self) -> str:
        """The journal header's kind: ``rebuild`` or ``promotion (<mode>)``."""
        return "rebuild" if self.res.mode == "rebuild" else f"promotion ({self.res.mode})"

    def lost(self, exc: BaseException) -> PromotionFailed:
        """This run lost its locks: it acts no more, rolls nothing back, and writes
        nothing in a journal another run may own now."""
        return PromotionFailed(
            f"the {self.kind()} of {self.pair} stopped: {_describe(exc)}. This run changed "
            "nothing more and rolled nothing back: another run may hold the pair now. Look "
            f"before acting: `shardfleet ops show {self.name}` and the map; rerun the same "
            "command once no other run is in flight")


def _never() -> bool:
    return False


@contextmanager
def _held(run: _Run, opts: Options) -> Iterator[Runner]:
    """The runner's locks (both servers of the pair: a split of the pair takes one of them
    too) and its registry of operations in flight (a split between its steps, a rebuild
    refuses this one); check mode takes no lock but refuses when one is held. LockBusy
    and OperationInFlight are refusals: nothing changed."""
    runner = run.new_runner(opts)
    try:
        with runner.held(check=run.check):
            run.runner = runner
            try:
                yield runner
            finally:
                run.runner = None
    except (LockBusy, OperationInFlight) as exc:
        raise PromotionRefused(str(exc)) from None


def promote(store: ZooKeeperMapStore, pair: str, nodes: list[str], *, mode: str = "planned",
            master: str | None = None, expect_master: str | None = None,
            opts: Options | None = None, check: bool = False) -> Result:
    """Promote the standby of *pair* (its two servers *nodes*, ``host:port``).

    *master*: the server that should be the master afterwards (default: the
    map's standby; a finished promotion to it is no change). *expect_master*: the
    server the caller believes is the master now; when the map names another one
    the call is refused (the promotion already happened, or someone else
    promoted), so rerunning a finished command never swaps the pair back.
    Raises :class:`PromotionRefused` (nothing changed) or :class:`PromotionFailed`;
    no driver error (PyMySQL, kazoo, socket) escapes: before the first change it
    is a refusal, after it a failure that says what state the pair was left in.
    """
    opts = opts or Options()
    if mode not in MODES:
        raise PromotionRefused(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not pair or "/" in pair:
        raise PromotionRefused(f"pair name {pair!r} must be non-empty without '/'")
    nodes = [n for n in dict.fromkeys(nodes) if n]
    if len(nodes) != 2:
        raise PromotionRefused(f"pair {pair} must have exactly two servers, got {nodes}")
    if expect_master and expect_master not in nodes:
        raise PromotionRefused(f"expect_master {expect_master} is not a server of pair {pair} "
                               f"({', '.join(nodes)}); nothing changed")
    res = Result(mode=mode, pair=pair)
    run = _Run(store, pair, res, check)
    run.nodes = nodes
    try:
        return _promote(run, mode, master, expect_master, opts)
    except (PromotionRefused, PromotionFailed):
        raise
    except ERRORS as exc:
        raise _unexpected(run, exc) from exc


def _unexpected(run: _Run, exc: BaseException) -> ShardfleetError:
    """A refusal (nothing changed yet) or a failure naming the step reached, for an error
    no step expected (a server or ZooKeeper gone mid-statement, a missing privilege)."""
    what = _describe(exc)
    log.warning("promote %s: %s", run.pair, what)
    if isinstance(exc, LockLost) and run.begun:
        return run.lost(exc)
    if not run.begun:
        return PromotionRefused(f"promotion of {run.pair} ({', '.join(run.nodes)}) stopped "
                                f"before any change: {what}; nothing changed")
    step = (run.journal.data or {}).get("step", "start")
    return PromotionFailed(
        f"promotion of {run.pair} ({run.res.mode}) failed after step {step!r}: {what}. The "
        "pair's ranges may be left frozen (writes to them wait); the journal "
        f"{run.journal.path} records the steps: fix the cause and rerun the same command "
        "to continue")


def _describe(exc: BaseException) -> str:
    """One line for a driver error (the MySQL error number when there is one)."""
    code = mysql_code(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KazooException):
        return f"ZooKeeper: {type(exc).__name__} {text}".strip()
    if code and not isinstance(exc, ShardfleetError):
        msg = exc.args[-1] if len(exc.args) > 1 else text
        return f"MySQL error {code}: {msg}"
    return text


def _rerun_cmd(pair: str, mode: str, expect: str) -> str:
    return (f"ansible-playbook playbooks/promote.yml -e pair={pair}"
            f"{' -e mode=emergency' if mode == 'emergency' else ''} -e expect_master={expect}")


def _promote(run: _Run, mode: str, master: str | None, expect_master: str | None,
             opts: Options) -> Result:
    store, res = run.store, run.res
    with _held(run, opts) as runner:
        # read under the locks: a second command that waited for them decides on the map
        # the first one left, not on the one it saw before waiting
        cur = store.read()
        if cur.map is None:
            raise PromotionRefused("there is no shard map in ZooKeeper")
        res.map_before = cur.map.table()
        p = _prepare(run, cur.map, mode, master, expect_master, opts)
        if p is None:
            return res
        runner.kind = run.kind()  # the mode a resumed journal decided
        p.execute(runner)
        after = store.read().map if not run.check else None
        res.map_after = after.table() if after else ""
        res.changes = shardmap.diff(cur.map, after) if after else [
            f"~ {r.describe()} -> master={p.new} standby={p.old}" for r in p.ranges]
        res.changed = True
        if not run.check:
            run.journal.save(dict(run.journal.data or {}, done=True, finished_at=time.time(),
                                  timings=res.timings, warnings=res.warnings,
                                  errant=res.errant))
    res.next_step = _next_step(res)
    return res


def _resume(run: _Run, journal: dict[str, Any] | None, mode: str,
            master: str | None) -> tuple[str, str | None]:
    """An interrupted promotion (its journal unfinished) is finished, not started anew:
    the mode is the journal's, except that a planned one whose master died may continue
    as an emergency (same target): a planned promotion cannot finish without its master."""
    res = run.res
    if not journal or journal.get("done"):
        return mode, master
    if journal["mode"] == "planned" and mode == "emergency":
        run.switched = True
        res.warnings.append(
            f"continuing the unfinished planned promotion to {journal['new_master']} "
            f"as an emergency promotion (journal step {journal.get('step')})")
    else:
        mode = journal["mode"]
        res.warnings.append(f"resuming the unfinished {mode} promotion to "
                            f"{journal['new_master']} (journal step {journal.get('step')})")
    res.mode, res.resumed = mode, True
    return mode, journal["new_master"]


def _prepare(run: _Run, m: ShardMap, mode: str, master: str | None,
             expect_master: str | None, opts: Options) -> _Promotion | None:
    """Under the runner's locks: the map's and the journal's refusals (before any
    change), then the promotion to run; None when there is nothing to do (``_already``)."""
    pair, nodes, res = run.pair, run.nodes, run.res
    journal = run.journal.load()
    mode, master = _resume(run, journal, mode, master)
    ranges = pair_ranges(m, nodes)
    if not ranges:
        raise PromotionRefused(f"pair {pair} ({', '.join(nodes)}) has no range in the map")
    masters = {r.master for r in ranges}
    if len(masters) != 1:
        raise PromotionRefused(f"pair {pair}'s ranges have different masters {masters}; "
                               "fix the map first")
    old = masters.pop()
    new = master or next(n for n in nodes if n != old)
    if new not in nodes:
        raise PromotionRefused(f"{new} is not a server of pair {pair} ({', '.join(nodes)})")
    res.ranges = [list(r.bounds) for r in ranges]
    if new == old and not res.resumed:
        peer = next((n for n in nodes if n != old), None)
        _already(res, ranges, run.store, m, journal, opts, peer, run.check)
        return None
    if expect_master:
        _check_expected(res, old, expect_master, journal)
    if res.resumed and new == old:
        # the map was flipped before the run stopped: only the unfreeze is left
        old = journal["old_master"] if journal else next(n for n in nodes if n != new)
    res.old_master, res.new_master = old, new
    rebuilding = [r for r in ranges if r.extra.get("rebuild") == new]
    if rebuilding and not res.resumed and master is None and journal \
            and journal.get("new_master") == old:
        # a rerun after an emergency promotion: it is done; the old master awaits rebuild
        _already(res, ranges, run.store, m, journal, opts, new, run.check)
        return None
    if rebuilding and not res.resumed:
        raise PromotionRefused(f"{new} is marked for rebuild in the map: it is not a "
                               "standby to promote (playbooks/rebuild-standby.yml first)")
    if not expect_master and master is None and not res.resumed:
        _check_not_a_rerun(res, old, mode, journal, opts)
    not_standby = [r for r in ranges if new not in (r.standby, r.master)]
    if not_standby:
        raise PromotionRefused(f"{new} is not the standby of {not_standby[0].describe()}: "
                               "it does not hold that range's data")
    run.start = {"mode": mode, "pair": pair, "old_master": old, "new_master": new,
                 "ranges": res.ranges, "done": False, "step": "start",
                 "steps": (journal or {}).get("steps", []) if res.resumed else [],
                 "started_at": time.time()}
    if res.resumed and journal and journal.get("channel"):
        run.start["channel"] = journal["channel"]  # what an earlier run removed
    return _Promotion(run, mode, old, new, ranges, opts)


def _check_not_a_rerun(res: Result, current: str, mode: str,
                       journal: dict[str, Any] | None, opts: Options) -> None:
    """A plain request (neither *expect_master* nor *master*) right after a finished
    promotion to the current master looks like the same command run again (an SSH
    session dropped and the operator cannot tell whether it finished): it would promote
    the pair back. Refuse it within ``opts.rerun_window``; a deliberate promotion back
    names the master it expects. Only the same mode counts as the same command: an
    emergency after a planned promotion (its new master died) is a new request."""
    if not journal or not journal.get("done") or journal.get("failed") \
            or journal.get("new_master") != current or journal.get("mode") != mode:
        return
    finished = float(journal.get("finished_at") or 0)
    age = time.time() - finished
    if age > opts.rerun_window:
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(finished))
    raise PromotionRefused(
        f"the promotion already happened: {res.pair}'s {journal.get('mode')} promotion from "
        f"{journal.get('old_master')} to {current} finished at {when} ({age / 60:.0f} min "
        "ago); this request names no expected master, so it looks like the same command "
        "run again, which would promote the pair back. Nothing changed. To promote back "
        f"deliberately, rerun with -e expect_master={current}")


def _check_expected(res: Result, current: str, expect: str,
                    journal: dict[str, Any] | None) -> None:
    """Refuse unless the map's master is *expect* (or an unfinished promotion from it is
    being continued): a rerun of a finished command must not promote the pair back."""
    if current == expect:
        return
    if journal and not journal.get("done") and journal.get("old_master") == expect:
        return  # the unfinished promotion from expect (its flip may be done): continue it
    if journal and journal.get("done") and not journal.get("failed") \
            and journal.get("old_master") == expect and journal.get("new_master") == current:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                             time.gmtime(float(journal.get("finished_at") or 0)))
        raise PromotionRefused(
            f"the promotion already happened: {res.pair}'s master is {current} since the "
            f"{journal.get('mode')} promotion from {expect} finished at {when}; nothing "
            "changed. To promote again (back to " + expect + "), rerun with "
            f"-e expect_master={current}")
    raise PromotionRefused(
        f"{res.pair}'s master is {current}, not {expect} (expect_master): the promotion "
        "already happened or someone else promoted; nothing changed. Look first "
        "(ansible-playbook playbooks/fleet-status.yml); to promote from the current master "
        f"rerun with -e expect_master={current}")


def _already(res: Result, ranges: list[ShardRange], store: ZooKeeperMapStore, m: ShardMap,
             journal: dict[str, Any] | None, opts: Options, peer: str | None = None,
             check: bool = False) -> Result:
    """The requested master is the master already: no change (and say so), but for a pair
    whose nodes restarted (:func:`_resume_pair`). Called under the pair's locks."""
    res.old_master = res.new_master = ranges[0].master
    res.map_after = m.table()
    res.steps.append("nothing to do: it is the master")
    conn, why = try_connect(res.new_master, opts)
    if conn is None:
        res.warnings.append(f"the master {res.new_master} does not answer: {why}")
    else:
        try:
            _resume_pair(res, conn, peer, _marked(ranges), opts, check)
        finally:
            _close(conn)
    frozen = [r for r in ranges if r.state == "frozen"]
    if frozen:
        res.warnings.append("ranges are frozen: " + ", ".join(r.describe() for r in frozen))
    if any(r.extra.get("rebuild") for r in ranges):
        res.next_step = ("rebuild the old master and re-attach it: ansible-playbook "
                         f"playbooks/rebuild-standby.yml -e pair={res.pair}")
    return res


def _resume_cmd(pair: str, master: str) -> str:
    return f"ansible-playbook playbooks/promote.yml -e pair={pair} -e promote_master={master}"


def _resume_pair(res: Result, conn: Any, peer: str | None, marked: set[str], opts: Options,
                 check: bool) -> None:
    """The pair as the map says after its nodes restarted: every node boots read_only (so
    that a returning dead master takes no writes) and starts no replica (so that it pulls
    no tail), and the map still names its master. Under the pair's locks:

    * the map's master takes writes again when its peer is read-only or does not answer
      (nothing else in the pair can be writable); with its peer writable the map and the
      servers disagree and nothing is touched (refused);
    * a channel of the pair stopped without an error (a boot) is started again, unless
      the peer is marked for rebuild (its data diverged: the rebuild re-attaches it).
    A channel stopped on an error is left for a human (it is said in the warnings)."""
    master = res.new_master
    pconn, _ = try_connect(peer, opts) if peer else (None, "")
    try:
        if replication.is_read_only(conn):
            if pconn is not None and not replication.is_read_only(pconn):
                raise PromotionRefused(
                    f"the map names {master} master of {res.pair}, but {master} is "
                    f"read_only and its peer {peer} is writable: the map and the servers "
                    "disagree; nothing changed. Look first (playbooks/fleet-status.yml)")
            res.changed = True
            if check:
                res.steps.append(f"make the master {master} writable again: it is "
                                 "read_only (would)")
            else:
                replication.set_read_only(conn, False)
                res.steps.append(f"made the master {master} writable again: it was read_only "
                                 "(a restart: every node boots read-only)")
                log.warning("promote %s: the master %s was read_only; made writable",
                            res.pair, master)
        if peer in marked:
            _semisync_off_for_rebuild(res, conn, master, peer, check)
            return
        for c, who in ((conn, master), (pconn, peer)):
            if c is None:
                continue
            ch = replication.peer_channel(c)
            if ch is None or (ch.get("Slave_IO_Running"), ch.get("Slave_SQL_Running")) != (
                    "No", "No"):
                continue
            if ch.get("Last_IO_Errno") or ch.get("Last_SQL_Errno"):
                res.warnings.append(f"{who}: replication stopped on an error: "
                                    f"{ch.get('Last_IO_Error') or ch.get('Last_SQL_Error')}")
                continue
            res.changed = True
            if check:
                res.steps.append(f"start {who}'s replication from its peer (would)")
                continue
            with c.cursor() as cur:
                cur.execute(replication.channel_sql("START", ch))
            res.steps.append(f"started {who}'s replication from its peer: it was stopped "
                             "(a restart: no node starts its replica at boot)")
    finally:
        _close(pconn)


def _semisync_off_for_rebuild(res: Result, conn: Any, master: str, peer: str | None,
                              check: bool) -> None:
    """The master's peer awaits a rebuild, so nothing can acknowledge its commits: semi-sync
    off, as the emergency left it (a restart brings back the configured ON, and every
    commit waits out ``rpl_semi_sync_master_timeout`` until it falls back); the rebuild
    turns it on again."""
    if not semisync_state(conn)["master_enabled"]:
        return
    res.changed = True
    if check:
        res.steps.append(f"turn semi-sync off on {master}: its peer {peer} awaits a rebuild "
                         "(would)")
        return
    replication.set_semisync_master(conn, False)
    res.steps.append(f"turned semi-sync off on {master}: its peer {peer} awaits a rebuild "
                     "and cannot acknowledge (the rebuild turns it on again)")
    log.warning("promote %s: semi-sync off on %s until %s is rebuilt", res.pair, master, peer)


def _next_step(res: Result) -> str:
    if res.mode == "emergency":
        return (f"{res.old_master} must not serve again as it is: start it (it boots "
                f"read_only), then rebuild it as the standby: ansible-playbook "
                f"playbooks/rebuild-standby.yml -e pair={res.pair}")
    return (f"nothing required: {res.old_master} is the standby and replicates from "
            f"{res.new_master}; verify with ansible-playbook playbooks/fleet-status.yml")


class _Promotion:
    """One promotion's step tables over its pair (planned, emergency): each row a name,
    "is it done?" read from the map and the servers, the action, the check-mode text."""

    def __init__(self, run: _Run, mode: str, old: str, new: str, ranges: list[ShardRange],
                 opts: Options) -> None:
        self.run, self.res, self.mode, self.opts = run, run.res, mode, opts
        self.old, self.new, self.ranges = old, new, ranges
        self.bounds = {r.bounds for r in ranges}
        self.mconn: Any = None
        self.sconn: Any = None
        self.why = ""                       # why the old master does not answer
        self.ch: dict[str, Any] | None = None  # the new master's channel from the old
        self.stopper: _Stopper | None = None
        self.fence_failed = self.stop_failed = False
        self.received = ""
        self.t_freeze = 0.0

    # -- running -------------------------------------------------------------
    def execute(self, runner: Runner) -> None:
        try:
            if self.mode == "planned":
                self._connect_planned()
                runner.run(self.planned_steps(), check=self.run.check)
                if not self.run.check:
                    self._check_old_replicates()
            else:
                self._connect_emergency()
                runner.run(self.emergency_steps(), check=self.run.check)
                if self.run.check:
                    _semisync_warnings(self.res, self.mconn, self.why)
        finally:
            _close(self.mconn)
            _close(self.sconn)

    def planned_steps(self) -> list[Step]:
        o, n, row = self.old, self.new, self.run.row
        return [
            row("caught_up", _never, self._catch_up, always=True),
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

    def emergency_steps(self) -> list[Step]:
        o, n, row = self.old, self.new, self.run.row
        return [
            row("frozen", self._frozen, self._freeze, "freeze (would)"),
            row("old_fenced", self._flipped, self._fence_emergency,
                f"fence {o} (would, if it answers)"),
            row("received_final", self._nothing_to_receive, self._receive_final),
            row("drained", self._flipped, self._drain_relay_log,
                f"{n}: stop the I/O thread, apply the relay log (would)\n"
                f"{n}: stop replication from {o} (would)"),
            row("errant_checked", self._flipped, self._check_errant),
            row("new_writable", self._new_writable, self._make_writable_emergency,
                f"{n} read_only=OFF (would)"),
            row("flipped", self._flipped, self._flip_emergency,
                f"write the swapped map with rebuild={o} (would)"),
            row("replication_stopped", self._no_channel, self._stop_replication),
            row("channel_removed", self._no_channel, self._remove_channel),
        ]

    # -- "is it done?" -------------------------------------------------------
    def _mine(self) -> list[ShardRange]:
        m = self.run.store.read().map
        return [r for r in m.ranges if r.bounds in self.bounds] if m else []

    def _is_flipped(self, r: ShardRange) -> bool:
        """*r* as the flip leaves it: on the new master, not frozen by this promotion,
        the old master marked for rebuild (emergency) or not (planned)."""
        frozen = r.state == "frozen" and freeze_owner(r) == owner(self.run.pair)
        marked = r.extra.get("rebuild") == self.old if self.mode == "emergency" \
            else "rebuild" not in r.extra
        return r.master == self.new and r.standby == self.old and not frozen and marked

    def _flipped(self) -> bool:
        """The map names the new master for every range of the pair (the flip is done)."""
        rs = self._mine()
        return len(rs) == len(self.bounds) and all(self._is_flipped(r) for r in rs)

    def _frozen(self) -> bool:
        """The map shows the pair's ranges frozen by this promotion, or already flipped."""
        rs = self._mine()
        return len(rs) == len(self.bounds) and all(
            (r.state == "frozen" and freeze_owner(r) == owner(self.run.pair))
            or self._is_flipped(r) for r in rs)

    def _new_writable(self) -> bool:
        """The new master has read_only=OFF (emergency: and semi-sync master off)."""
        if replication.is_read_only(self.sconn):
            return False
        return self.mode == "planned" or not semisync_state(self.sconn)["master_enabled"]

    def _nothing_to_receive(self) -> bool:
        return self.mconn is None or self.fence_failed or self._flipped()

    def _no_channel(self) -> bool:
        """The new master has no replication channel from the old one."""
        return replication.peer_channel(self.sconn) is None

    # -- the servers ---------------------------------------------------------
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

    def _connect_emergency(self) -> None:
        old, new, run, opts = self.old, self.new, self.run, self.opts
        # The standby first: what it has heard from the master so far, before the probe.
        self.sconn, swhy = try_connect(new, opts)
        if self.sconn is None:
            raise PromotionRefused(f"the standby {new} does not answer ({swhy}): nothing to "
                                   "promote")
        probe = min(opts.probe_timeout, opts.connect_timeout)
        (self.mconn, self.why, refusing), heard = Listening(self.sconn, opts).probe(
            old, replace(opts, connect_timeout=probe, read_timeout=probe))
        if self.mconn is not None:  # alive: the connection the steps use has the usual bounds
            _close(self.mconn)
            self.mconn, self.why, refusing = reach(old, opts)
            if self.mconn is None and not refusing:
                raise PromotionRefused(f"the master {old} answered, then did not ({self.why}): "
                                       "it is not dead; rerun this command; nothing changed")
        if refusing:
            # alive: even forced, it could not be fenced, and two masters would take writes
            raise _alive_refusing(old, self.why)
        if self.mconn is not None and run.switched and not opts.force:
            raise PromotionRefused(
                f"the master {old} answers: the unfinished planned promotion of {run.pair} to "
                f"{new} can finish as planned (zero loss): "
                f"{_rerun_cmd(run.pair, 'planned', old)}; nothing changed")
        if self.mconn is not None and not opts.force and not self.res.resumed:
            restarted = ""
            if replication.is_read_only(self.mconn):
                restarted = (f" It is read_only (it restarted: every node boots read-only): "
                             f"to let it serve again as the map says, "
                             f"{_resume_cmd(run.pair, old)}.")
            raise PromotionRefused(f"the master {old} answers: use mode=planned (zero loss), "
                                   "or force=true if it must be replaced anyway; nothing "
                                   f"changed.{restarted}")
        if self.mconn is None:
            self.res.timings["silence_checked"] = round(time.monotonic() - run.t0, 3)
            if heard:
                # cut off from this control node only: it cannot be fenced from here, and
                # routers that still reach it would keep writing there (even forced)
                raise PromotionRefused(
                    f"the master {old} does not answer this control node ({self.why}), but "
                    f"its standby {new} still receives from it ({heard}): it is alive, cut "
                    "off from here only, and an emergency promotion would leave two masters "
                    f"taking writes. Run the promotion from a host that reaches {old} "
                    f"(mode=planned, zero loss), or stop {old} (e.g. stop its instance), then "
                    "rerun this command; " + (
                        "the unfinished promotion's frozen ranges stay frozen until then"
                        if self.res.resumed else "nothing changed"))
        self.res.semisync = {"standby": semisync_state(self.sconn)}
        if self.mconn is not None:
            self.res.semisync["master"] = semisync_state(self.mconn)
        self.ch = replication.peer_channel(self.sconn)

    # -- the map -------------------------------------------------------------
    def _freeze(self) -> None:
        """Routers hold writes to the pair's ranges instead of sending them."""
        self.t_freeze = time.monotonic()
        _write_map(self.run.store, lambda m: _freeze(m, self.bounds, self.run.pair))
        self.run.step("frozen")

    def _flip_map(self, rebuild: bool) -> None:
        _write_map(self.run.store, lambda m: _flip(m, self.bounds, self.new, self.old,
                                                   rebuild, self.run.pair))

    # -- planned -------------------------------------------------------------
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

    def _guard(self, fn: Callable[[], T],
               failure: Callable[[BaseException], Exception]) -> Callable[[], T]:
        """*fn*, with a driver error turned into *failure(exc)* (check mode: as it is)."""
        if self.run.check:
            return fn

        def guarded() -> T:
            try:
                return fn()
            except LockLost as exc:  # another run may hold the pair: act no more
                raise self.run.lost(exc) from exc
            except ERRORS as exc:
                raise failure(exc) from exc
        return guarded

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
            f"{_describe(exc)}. State left: ranges FROZEN (writes wait), {old} read_only, "
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

    # -- emergency -----------------------------------------------------------
    def _fence_emergency(self) -> None:
        """Best effort: the old master read_only=ON if it answers (forced)."""
        if self.mconn is None:
            self.res.warnings.append(f"{self.old} did not answer ({self.why}); it boots "
                                     "read_only=ON, so it takes no writes when it comes back")
            return
        try:
            replication.set_read_only(self.mconn, True)
        except pymysql.err.MySQLError as exc:
            self.fence_failed = True
            self.res.warnings.append(f"could not set {self.old} read_only: {exc}")
            return
        self.run.step("old_fenced")

    def _receive_final(self) -> None:
        """Forced mode, the old master fenced and readable: its last GTID position is known,
        so wait (bounded) until the standby has received and applied it before its I/O
        thread is stopped; stopping it at once would drop whatever was still on the wire
        (or never fetched, if the I/O thread was stopped) although the old master had
        acknowledged it. A replication error or the bound: PromotionFailed, ranges frozen
        and the old master read-only (nothing lost; the rerun continues)."""
        old, new, sconn, ch = self.old, self.new, self.sconn, self.ch
        final = replication.gtid_position(self.mconn)
        self.res.gtid["master_final"] = final
        if ch is not None and not ch.get("Last_SQL_Errno") and not ch.get("Last_IO_Errno") \
                and (ch.get("Slave_IO_Running"), ch.get("Slave_SQL_Running")) != ("Yes", "Yes"):
            with sconn.cursor() as c:
                c.execute(replication.channel_sql("START", ch))
            self.res.warnings.append(f"{new}'s replication from {old} was stopped (no error): "
                                     "started it to fetch the fenced master's last transactions")
        try:
            replication.wait_for_gtid(sconn, final, self.opts.drain_timeout)
        except replication.ReplicationTimeout as exc:
            st = replication.peer_channel(sconn) or {}
            raise PromotionFailed(
                f"{new} did not receive and apply the fenced master {old}'s last position "
                f"{final} within {self.opts.drain_timeout}s ({exc}; IO "
                f"{st.get('Slave_IO_Running')} SQL {st.get('Slave_SQL_Running')} "
                f"{st.get('Last_Error') or ''}). Ranges left frozen, {old} read-only: nothing "
                "is lost. Fix the replication and rerun the same command") from None
        self.run.step("received_final", position=final)

    def _drain_relay_log(self) -> None:
        """Stop the standby's I/O thread, wait until it applied every relay log event it
        received, then stop its SQL thread (a returning old master cannot push its
        unacknowledged tail into the new master)."""
        if self.ch is None:
            self.res.channel_removed = dict((self.run.journal.data or {}).get("channel") or {})
            if not self.res.channel_removed:
                self.res.warnings.append(f"{self.new} has no replication channel from "
                                         f"{self.old}")
            self.received = ""
            return
        # The I/O thread may sit in connect() to the dead master for seconds, and STOP
        # waits for it: stop it from a side connection while the relay log drains (a
        # dead master sends nothing meanwhile; a forced one is fenced).
        self.stopper = _Stopper(self.new, self.ch, self.opts)
        ch = self._apply_relay_log()
        self.received = self.res.gtid["received"] = str(ch.get("Gtid_IO_Pos") or "")
        with self.sconn.cursor() as c:
            c.execute(replication.channel_sql("STOP", ch, "SQL_THREAD"))
        self.res.channel_removed = replication.channel_record(ch)
        self.run.step("drained", received=self.received, channel=self.res.channel_removed)

    def _apply_relay_log(self) -> dict[str, Any]:
        """Wait (bounded) until the SQL thread applied everything received; the channel."""
        new, sconn, ch = self.new, self.sconn, self.ch or {}
        if ch.get("Slave_SQL_Running") != "Yes" and not ch.get("Last_SQL_Errno"):
            # stopped by hand, not by an error (or by an interrupted planned promotion's
            # operator): what it received must be applied, or acknowledged writes are lost
            with sconn.cursor() as c:
                c.execute(replication.channel_sql("START", ch, "SQL_THREAD"))
            self.res.warnings.append(f"{new}'s replication SQL thread was stopped (no "
                                     "error): started it to apply the relay log")
        deadline = time.monotonic() + self.opts.drain_timeout
        while True:
            ch = replication.peer_channel(sconn) or {}
            if _applied_all_received(ch) or ch.get("Slave_SQL_Running") != "Yes":
                break
            if time.monotonic() > deadline:
                raise PromotionFailed(
                    f"{new} did not apply its relay log within {self.opts.drain_timeout}s "
                    f"(ranges left frozen; rerun to continue): read "
                    f"{ch.get('Read_Master_Log_Pos')} exec {ch.get('Exec_Master_Log_Pos')} "
                    f"({ch.get('Slave_SQL_Running_State')})")
            time.sleep(0.01)
        if ch.get("Slave_SQL_Running") != "Yes" and not _applied_all_received(ch):
            raise PromotionFailed(
                f"{new}'s SQL thread stopped before applying its relay log "
                f"({ch.get('Last_Error')}); ranges left frozen: fix it, rerun")
        return ch

    def _check_errant(self) -> None:
        """GTIDs written on the standby the master never had: reported."""
        res, new, sconn = self.res, self.new, self.sconn
        sbin = replication.gtid_position(sconn)
        res.gtid["standby_binlog"] = sbin
        master_has = replication.gtid_applied(self.mconn) if self.mconn is not None \
            else self.received
        res.errant = errant_against(sbin, master_has, replication.server_id(sconn))
        if res.errant:
            res.warnings.append(
                f"ERRANT transactions on {new} that {self.old} never had: "
                f"{', '.join(res.errant)}; they were written on the standby directly; "
                "review them")
        self.run.step("errant_checked", errant=res.errant)
        _semisync_warnings(res, self.mconn, self.why)

    def _make_writable_emergency(self) -> None:
        replication.set_read_only(self.sconn, False)
        self.run.step("new_writable")
        if self.res.semisync["standby"].get("master_enabled"):
            # no standby can acknowledge: without this the first commit waits the whole
            # rpl_semi_sync_master_timeout; rebuild_standby turns it on again
            replication.set_semisync_master(self.sconn, False)
            self.res.warnings.append(f"semi-sync is off on {self.new} until its standby is "
                                     "rebuilt (nothing can acknowledge): writes are "
                                     "asynchronous meanwhile")

    def _flip_emergency(self) -> None:
        """Master and standby swapped, ``rebuild: <old master>`` on the ranges."""
        self._flip_map(True)
        self.run.step("flipped")

    def _stop_replication(self) -> None:
        """Wait for the side connection's STOP of the I/O thread (started by the drain;
        by this step when an earlier run drained)."""
        if self.stopper is None:
            self.ch = replication.peer_channel(self.sconn) or {}
            if not self.res.channel_removed:
                self.res.channel_removed = replication.channel_record(self.ch)
            self.stopper = _Stopper(self.new, self.ch, self.opts)
        self.stopper.join(self.opts.drain_timeout)
        if self.stopper.is_alive() or self.stopper.error:
            self.stop_failed = True
            n, o = self.new, self.old
            self.res.warnings.append(f"{n}'s replication I/O thread from {o} did not stop "
                                     f"({self.stopper.error or 'still waiting'}), so its "
                                     f"channel was not removed: run "
                                     f"{replication.channel_sql('STOP', self.ch)} and "
                                     f"{replication.channel_sql('RESET', self.ch, 'ALL')} "
                                     f"on {n} before "
                                     f"{o} comes back or {n} restarts")
            return
        self.run.step("replication_stopped")

    def _remove_channel(self) -> None:
        """A stopped channel still restarts with the server (and reconnects to the
        returned old master, applying its unacknowledged tail): remove it. The journal
        keeps what it was; rebuild_standby recreates it."""
        if self.stop_failed:
            return
        with self.sconn.cursor() as c:
            c.execute(replication.channel_sql("RESET", self.ch, "ALL"))
        self.run.step("channel_removed", channel=self.res.channel_removed)


def _record_failure(run: _Run, exc: BaseException) -> None:
    """Note the failure in the (unfinished) journal; best effort, ZooKeeper may be the cause."""
    try:
        run.journal.save(dict(run.journal.data or {}, failed=_describe(exc),
                              failed_at=time.time()))
    except (ShardfleetError, KazooException, OSError):
        log.warning("promote %s: could not record the failure in %s", run.pair,
                    run.journal.path, exc_info=True)


def _planned_rollback(run: _Run, old: str, new: str, bounds: set[tuple[int, int]],
                      exc: BaseException, opts: Options) -> PromotionFailed:
    """Undo a planned promotion that failed before the standby became writable.

    The master writable again and the ranges unfrozen, when the master answers (on a
    fresh connection: the promotion's own may be what broke). When it does not, the
    ranges stay frozen and the journal unfinished: it may be dead, and only an
    emergency promotion (same new master) may then finish what this one started.
    """
    what = _describe(exc)
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
        _write_map(run.store, lambda m: _unfreeze(m, bounds, run.pair))
        run.step("rolled_back", error=what)
        run.journal.save(dict(run.journal.data or {}, done=True, failed=what))
    except ERRORS as again:
        return _rollback_failed(run, old, new, what, again)
    finally:
        _close(conn)
    return PromotionFailed(f"rolled back (master {old} writable again, ranges unfrozen; "
                           f"nothing changed): {what}")


def _rollback_failed(run: _Run, old: str, new: str, what: str,
                     again: BaseException) -> PromotionFailed:
    _record_failure(run, again)
    return PromotionFailed(
        f"the planned promotion of {run.pair} stopped ({what}) and its rollback failed "
        f"({_describe(again)}). State left: ranges possibly FROZEN, {old} possibly "
        f"read_only, {new} read_only; rerun the same command: "
        f"{_rerun_cmd(run.pair, 'planned', old)}")


def _applied_all_received(ch: dict[str, Any]) -> bool:
    if "has read all relay log" in str(ch.get("Slave_SQL_Running_State") or ""):
        return True  # every complete transaction received is applied
    return (ch.get("Master_Log_File") == ch.get("Relay_Master_Log_File")
            and int(ch.get("Read_Master_Log_Pos") or 0) == int(ch.get("Exec_Master_Log_Pos") or 0))


class _Stopper:
    """``STOP SLAVE IO_THREAD`` on its own connection and thread."""

    def __init__(self, server: str, ch: dict[str, Any], opts: Options) -> None:
        import threading

        self.error = ""
        self._t = threading.Thread(target=self._run, args=(server, ch, opts), daemon=True,
                                   name="shardfleet-stop-io")
        self._t.start()

    def _run(self, server: str, ch: dict[str, Any], opts: Options) -> None:
        conn = None
        try:
            conn = _connect(server, opts)
            with conn.cursor() as c:
                c.execute(replication.channel_sql("STOP", ch, "IO_THREAD"))
        except (DatabaseError, pymysql.err.MySQLError) as exc:
            self.error = str(exc)
        finally:
            _close(conn)

    def join(self, timeout: float) -> None:
        self._t.join(timeout)

    def is_alive(self) -> bool:
        return self._t.is_alive()


def _semisync_warnings(res: Result, mconn: Any, why: str) -> None:
    st = res.semisync.get("standby", {})
    if not st.get("replica_enabled"):
        res.warnings.append("SEMI-SYNC IS OFF on the standby: replication was asynchronous; "
                            "writes acknowledged by the old master may be LOST")
    m = res.semisync.get("master")
    if m is not None:
        if not m.get("master_enabled") or str(m.get("master_status")).upper() != "ON":
            res.warnings.append("SEMI-SYNC HAD FALLEN BACK TO ASYNCHRONOUS on the old master "
                                f"(status {m.get('master_status')!r}): acknowledged writes "
                                "may be lost")
    elif st.get("replica_enabled"):
        res.warnings.append("the old master is unreachable, so whether semi-sync had fallen "
                            "back to asynchronous cannot be read; the standby had semi-sync "
                            f"on (status now {st.get('replica_status') or 'unknown'})")


# -- re-attaching a rebuilt old master -----------------------------------------

SHARD_DB_RE = schema.SHARD_DATABASE_REGEXP


def _client_defaults(tmpdir: str, opts: Options) -> str:
    """A client option file with the password (never on a command line) and the TLS
    options of *opts* (the dump and the load connect over TCP)."""
    from shardfleet import physical

    return physical.client_defaults(tmpdir, opts.user, opts.password, opts.tls)


def copy_shards(source: str, dest: str, databases: list[str], opts: Options) -> None:
    """``mariadb-dump`` the shard databases (and the db-level grants in ``mysql.db``) of
    *source* into *dest* without binary logging; the dump sets *dest*'s
    ``gtid_slave_pos`` to the snapshot's position (``--gtid --master-data``)."""
    import shutil
    import subprocess
    import tempfile

    dump = shutil.which("mariadb-dump") or shutil.which("mysqldump")
    client = shutil.which("mariadb") or shutil.which("mysql")
    if not dump or not client:
        raise PromotionFailed("mariadb-dump and the mariadb client are needed where the "
                              "rebuild runs (apt-get install mariadb-client)")
    sh, _, sp = source.rpartition(":")
    dh, _, dp = dest.rpartition(":")
    with tempfile.TemporaryDirectory(prefix="sf-rebuild-") as tmp:
        cnf = _client_defaults(tmp, opts)
        load = [client, f"--defaults-extra-file={cnf}", "-h", dh, "-P", dp,
                f"--init-command={replication.SKIP_BINLOG_SQL}"]
        jobs = [[dump, f"--defaults-extra-file={cnf}", "-h", sh, "-P", sp,
                 "--single-transaction", "--gtid", "--master-data=1", "--routines",
                 "--triggers", "--databases", *databases],
                [dump, f"--defaults-extra-file={cnf}", "-h", sh, "-P", sp,
                 "--single-transaction", "mysql", "db"]]
        for argv in jobs:
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as d:
                loader = subprocess.run([*load, "mysql"], stdin=d.stdout,
                                        capture_output=True, check=False)
                d.stdout.close()  # type: ignore[union-attr]
                derr = d.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
                d.wait()
            if d.returncode or loader.returncode:
                raise PromotionFailed(f"copying {source} -> {dest} failed: "
                                      f"{(derr or loader.stderr.decode(errors='replace'))[-500:]}")


def _recreate_channel(store: ZooKeeperMapStore, pair: str, node: str, nch: dict[str, Any],
                      opts: Options) -> dict[str, Any]:
    """The master's channel from *node* to create (a ``SHOW SLAVE STATUS``-shaped row).

    Host, port, user, name and retry come from what the emergency recorded in its journal
    when it removed the channel (it pointed at *node*, the old master); without that
    record, from the map's address of *node* and the user *node* itself replicates with.
    The password cannot be read back from any server: it must be given.
    """
    if not opts.replication_password:
        raise PromotionRefused(
            f"the master has no replication channel from {node} (an emergency promotion "
            "removed it) and the rebuild must recreate it: give the replication account's "
            "password (module option replication_password, the mysql role's "
            "mysql_replication_password; library Options.replication_password); "
            "nothing changed")
    j = Journal(store, f"promote-{pair}").load() or {}
    rec = dict(j.get("channel") or {}) if j.get("old_master") == node else {}
    host, _, port = node.rpartition(":")
    return {"Connection_name": rec.get("name") or "",
            "Master_Host": rec.get("host") or host.strip("[]"),
            "Master_Port": int(rec.get("port") or port),
            "Master_User": rec.get("user") or str(nch.get("Master_User") or "")
            or opts.replication_user,
            "Connect_Retry": int(rec.get("connect_retry") or 10)}




def rebuild_standby(store: ZooKeeperMapStore, pair: str, nodes: list[str], *,
                    opts: Options | None = None, check: bool = False) -> Result:
    """Re-attach the node the map marks ``rebuild`` as the pair's standby.

    The node must answer (start it; it boots read-only) and keep its replication
    channel to its peer (the ``mysql`` role sets it up). Its shard databases are
    replaced by a consistent copy of the master's, its binary log history reset to
    the copy's GTID position (the old master's unacknowledged tail is gone), then
    it replicates from the master and the master from it again; the mark is
    cleared. No mark: no change.
    """
    opts = opts or Options()
    nodes = [n for n in dict.fromkeys(nodes) if n]
    if opts.copy not in ("logical", "physical"):
        raise PromotionRefused(f"copy must be 'logical' or 'physical', not {opts.copy!r}")
    res = Result(mode="rebuild", pair=pair)
    run = _Run(store, pair, res, check, name=f"rebuild-{pair}")
    run.nodes = nodes
    if _rebuild_target(store, pair, nodes, res)[2] is None and not _in_flight(run):
        return res  # no mark and no unfinished rebuild: no lock needed
    try:
        with _held(run, opts) as runner:
            # decided under the locks: the same command started beside a running one
            # waited for them, and finds the rebuild it waited for done (no mark left)
            cur, ranges, node = _rebuild_target(store, pair, nodes, res)
            if node is None:
                node = _unfinished_rebuild(run, ranges)
            if node is None:
                return res
            assert cur.map is not None
            rb = _Rebuild(run, node, ranges, opts)
            try:
                if rb.connect():
                    runner.run(rb.steps(), check=check)
                    rb.finish(cur.map)
            except _CopyNeeded:
                rb.copy_needed()
            finally:
                rb.close()
    except (PromotionRefused, PromotionFailed):
        raise
    except ERRORS as exc:
        raise _rebuild_unexpected(run, res.old_master or "the node", exc) from exc
    return res


def _in_flight(run: _Run) -> dict[str, Any] | None:
    """The pair's rebuild journal when a run of it stopped before finishing."""
    j = run.journal.load()
    return j if j and not j.get("done") else None


def _unfinished_rebuild(run: _Run, ranges: list[ShardRange]) -> str | None:
    """No range marks a node, yet a rebuild's journal is in flight: that run cleared the
    mark and stopped before its last check (the master lost mid-check). The node it
    rebuilt, to finish that rebuild (its steps find themselves done); None when there is
    no such journal. Refused when the map no longer names that node the standby."""
    j = _in_flight(run)
    if j is None:
        return None
    node, master = str(j.get("node") or ""), str(j.get("master") or "")
    if not all((r.master, r.standby) == (master, node) for r in ranges):
        raise PromotionRefused(
            f"the rebuild journal {run.journal.path} is in flight (step {j.get('step')!r}, "
            f"{node} as the standby of {master}) but the map's ranges of {run.pair} name "
            "other servers and mark none for rebuild; nothing changed. Look first "
            "(ansible-playbook playbooks/fleet-status.yml)")
    res = run.res
    res.steps = []
    res.old_master, res.new_master, res.resumed = node, master, True
    res.warnings.append(f"finishing the unfinished rebuild of {node} (journal step "
                        f"{j.get('step')!r}): the map names it the standby already")
    return node


def _marked(ranges: list[ShardRange]) -> set[str]:
    """The servers the ranges mark for rebuild (an emergency's old master)."""
    return {str(r.extra["rebuild"]) for r in ranges if r.extra.get("rebuild")}


def _rebuild_target(store: ZooKeeperMapStore, pair: str, nodes: list[str], res: Result
                    ) -> tuple[Any, list[ShardRange], str | None]:
    """(the map read, the pair's ranges, the node marked for rebuild, or None: nothing to
    do, said in *res*); refusals for a map that names no such pair or two marks."""
    cur = store.read()
    if cur.map is None:
        raise PromotionRefused("there is no shard map in ZooKeeper")
    ranges = pair_ranges(cur.map, nodes)
    if not ranges:
        raise PromotionRefused(f"pair {pair} ({', '.join(nodes)}) has no range in the map")
    res.ranges = [list(r.bounds) for r in ranges]
    res.map_before = cur.map.table()
    marked = _marked(ranges)
    if not marked:
        res.steps = ["nothing to do: no server of the pair is marked for rebuild"]
        res.map_after = res.map_before
        return cur, ranges, None
    if len(marked) > 1:
        raise PromotionRefused(f"ranges mark different servers for rebuild: {marked}")
    node = marked.pop()
    res.old_master, res.new_master = node, ranges[0].master
    return cur, ranges, node


def _rebuild_unexpected(run: _Run, node: str, exc: BaseException) -> ShardfleetError:
    """The rebuild's error boundary: a refusal before any change, else a failure that
    says the state the node is in and the command that continues."""
    what = _describe(exc)
    log.warning("rebuild %s: %s", run.pair, what)
    if not run.begun:
        return PromotionRefused(f"rebuild of {node} in {run.pair} stopped before any change: "
                                f"{what}; nothing changed")
    step = (run.journal.data or {}).get("step", "start")
    state = {
        "replicating": "The node replicates from its master and back, read_only, still "
                       "marked for rebuild",
        "mark_cleared": "The map names the node the standby again (the mark is cleared); "
                        "only the rebuild's last check of both channels did not finish",
    }.get(step, "The node is fenced (read_only, replication stopped) and still marked for "
                "rebuild")
    return PromotionFailed(
        f"rebuild of {node} in {run.pair} failed after step {step!r}: {what}. {state}; the "
        "pair serves from its master. Fix the cause and run playbooks/rebuild-standby.yml "
        f"again (the journal {run.journal.path} is in flight until then)")


# The warning of a rebuild that makes a new copy for a node it fenced that does not answer
# (playbooks/rebuild-standby.yml matches it: that node is left out of the mysql role).
RECOPY = "a new copy replaces its data directory"


class _CopyNeeded(Exception):
    """The physical rebuild stops here: the node's copy is made outside the library."""


class _Rebuild:
    """The rebuild's step table: the node fenced and cleared, the master's shards copied,
    replication both ways, the map's mark cleared."""

    def __init__(self, run: _Run, node: str, ranges: list[ShardRange], opts: Options) -> None:
        self.run, self.res, self.opts = run, run.res, opts
        self.node, self.master, self.ranges = node, ranges[0].master, ranges
        self.nconn: Any = None
        self.mconn: Any = None
        self.nch: dict[str, Any] | None = None
        self.mch: dict[str, Any] | None = None
        self.recreate: dict[str, Any] | None = None
        self.dbs: list[str] = []
        self.resumed: dict[str, Any] = {}  # an unfinished journal of this same rebuild
        self.after: ShardMap | None = None

    def close(self) -> None:
        _close(self.nconn)
        _close(self.mconn)

    def connect(self) -> bool:
        """Both servers answer, the node has its channel (refusals: nothing changed); False
        in check mode when the node does not answer (said in the result)."""
        node, master, res, opts, run = self.node, self.master, self.res, self.opts, self.run
        journal = run.journal.load() or {}
        if not journal.get("done") and (journal.get("node"), journal.get("master")) == (
                node, master):
            self.resumed = journal
            res.resumed = True
        self.nconn, why = try_connect(node, opts)
        if self.nconn is None and self._copy_was_installing():
            # this rebuild fenced the node and named a copy, and the copy's install was
            # cut short (killed with the node stopped and its data directory half or
            # wholly moved aside): the node may never start again as it is. Its data is
            # replaced whole by the next copy, and a node that does not answer takes no
            # writes: name a new copy without it (rebuild-standby.yml then leaves the
            # node out of the mysql role, which would fail to start it)
            res.warnings.append(f"{node} does not answer ({why}) after this rebuild fenced "
                                f"it for a physical copy: {RECOPY}")
            res.resumed = res.recopy = True
            if run.check:
                res.changed = True
                res.steps.append(f"copy {master}'s data directory to {node} (would)")
                return False
            raise _CopyNeeded()
        if self.nconn is None and run.check:
            res.changed = True
            res.warnings.append(f"{node} does not answer ({why}): start it or apply the "
                                "mysql role before the rebuild")
            res.steps.append(f"rebuild {node} as the standby of {master} (would)")
            return False
        if self.nconn is None:
            raise PromotionRefused(f"{node} does not answer ({why}): start it (it boots "
                                   "read_only) or rebuild it with the mysql role first")
        self.mconn, mwhy = try_connect(master, opts)
        if self.mconn is None:
            raise PromotionRefused(f"the master {master} does not answer ({mwhy})")
        self.nch = replication.peer_channel(self.nconn)
        self.mch = replication.peer_channel(self.mconn)
        if self.nch is None and opts.copy == "physical" and (
                opts.copy_position or self._did("fenced_and_cleared")):
            # its data directory was replaced by a copy (this run's, or one an earlier
            # run of this rebuild installed before it was killed or refused): the channel
            # went with it, and the re-attach creates it
            self.nch = self._node_channel()
        elif self.nch is None:
            raise PromotionRefused(
                f"{node} has no replication channel from its peer {master}: apply the "
                "mysql role to it first (playbooks/rebuild-standby.yml does)")
        # an emergency removed the master's channel to the old master: recreate it
        if self.mch is None:
            self.recreate = _recreate_channel(run.store, run.pair, node, self.nch, opts)
        self.dbs = self._shard_dbs(self.mconn)
        run.start = {"mode": "rebuild", "pair": run.pair, "node": node, "master": master,
                     "done": False, "steps": list(self.resumed.get("steps", [])),
                     "started_at": time.time()}
        return True

    def steps(self) -> list[Step]:
        node, master, row = self.node, self.master, self.run.row
        physical = self.opts.copy == "physical"
        return [
            row("fenced_and_cleared", self._fenced, self._fence_and_clear,
                f"{node} read_only=ON, replication stopped (would)"),
            row("master_writable", self._master_writable, self._make_master_writable,
                f"{master} read_only=OFF: the map names it master (would)"),
            row("copied", self._copied, self._copy_physical if physical else self._copy,
                (f"copy {master}'s data directory to {node} with mariadb-backup (would)"
                 if physical else
                 f"copy {len(self.dbs)} shard databases {master} -> {node} (would)") + "\n"
                f"reset {node}'s binlog history to the copy's GTID (would)"),
            row("replicating", self._replicating, self._replicate,
                "replicate both ways, clear the rebuild mark (would)"),
            row("mark_cleared", self._mark_cleared, self._clear_mark),
        ]

    # -- "is it done?" -------------------------------------------------------
    def _copy_was_installing(self) -> bool:
        """A first call (no copy position yet) of a physical rebuild whose earlier run
        fenced the node and named a copy: that copy may have been installing."""
        return (self.opts.copy == "physical" and not self.opts.copy_position
                and self._did("fenced_and_cleared") and bool(self.resumed.get("copy_id")))

    def _did(self, step: str) -> bool:
        """An earlier run of this same rebuild recorded *step* (its journal unfinished)."""
        return any(s.get("step") == step for s in self.resumed.get("steps", []))

    def _fenced(self) -> bool:
        """Copied already, or (physical) fenced by an earlier call: the node restarted on
        its copy since, read-only as every node boots."""
        return self._copied() or (self.opts.copy == "physical"
                                  and self._did("fenced_and_cleared"))

    def _copied(self) -> bool:
        """The earlier run copied, and every shard database of the master is on the node
        (then its clearing is done too)."""
        return self._did("copied") and set(self.dbs) <= set(self._shard_dbs(self.nconn))

    def _replicating(self) -> bool:
        """The earlier run got both ways replicating, and both channels run."""
        return self._did("replicating") and all(
            (ch := replication.peer_channel(c)) is not None
            and (ch.get("Slave_IO_Running"), ch.get("Slave_SQL_Running")) == ("Yes", "Yes")
            for c in (self.nconn, self.mconn))

    def _master_writable(self) -> bool:
        """The master the map names takes writes (it is read_only after a restart)."""
        return not replication.is_read_only(self.mconn)

    def _mark_cleared(self) -> bool:
        """No range of the pair marks the node for rebuild in the map."""
        m = self.run.store.read().map
        bounds = {r.bounds for r in self.ranges}
        return m is not None and not any(r.bounds in bounds and r.extra.get("rebuild")
                                         for r in m.ranges)

    # -- the actions ---------------------------------------------------------
    @staticmethod
    def _shard_dbs(conn: Any) -> list[str]:
        return schema.shard_databases_on(conn)

    def _make_master_writable(self) -> None:
        """The map's master restarted since the emergency and booted read_only, as every
        node does: writes to the pair fail (1290) until it is writable again. Safe here:
        the rebuild holds the pair's locks and the only other node is fenced (the step
        before)."""
        replication.set_read_only(self.mconn, False)
        self.res.warnings.append(
            f"the master {self.master} was read_only (it restarted since the emergency: "
            "every node boots read-only); made writable again, the map names it master")
        self.run.step("master_writable")

    def _fence_and_clear(self) -> None:
        """The node read-only, both channels stopped, the node's shard databases dropped
        (not binlogged; a physical copy replaces the whole data directory instead)."""
        replication.set_read_only(self.nconn, True)
        with self.nconn.cursor() as c:
            c.execute(replication.channel_sql("STOP", self.nch))
        if self.mch is not None:
            with self.mconn.cursor() as c:
                c.execute(replication.channel_sql("STOP", self.mch))
        if self.opts.copy == "physical":
            self.run.step("fenced_and_cleared", databases=0)
            return
        with self.nconn.cursor() as c:
            c.execute(replication.SKIP_BINLOG_SQL)
            for name in self._shard_dbs(self.nconn):
                c.execute(f"DROP DATABASE `{name}`")
        self.run.step("fenced_and_cleared", databases=len(self.dbs))

    def _copy(self) -> None:
        """A consistent copy of the master's shards; the node's binlog history reset to
        the copy's GTID position; the node replicates from the master."""
        copy_shards(self.master, self.node, self.dbs, self.opts)
        pos = replication.gtid_replica_pos(self.nconn)
        replication.reset_binlog_history(self.nconn, pos, flush_privileges=True)
        # the dump's CHANGE MASTER reset the channel's heartbeat (emergencies rely on it)
        replication.set_heartbeat(self.nconn, str((self.nch or {}).get("Connection_name") or ""))
        with self.nconn.cursor() as c:
            c.execute(replication.channel_sql("START", self.nch))
        self.res.gtid["copy"] = pos
        self.run.step("copied", position=pos)

    def _copy_physical(self) -> None:
        """Without the copy's position: stop here, the caller makes the copy (the result
        says from where to where). With it: the node runs on the copy; its binlog history
        set to the copy's GTID position, its channel from the master (re)created."""
        pos = self.opts.copy_position
        if not pos:
            raise _CopyNeeded()
        named = str(self.resumed.get("copy_id") or "")
        if self.opts.copy_id and named and named != self.opts.copy_id:
            raise PromotionRefused(
                f"another run of this rebuild named a newer copy ({named}) after this run's "
                f"({self.opts.copy_id}): {self.node} may run on that one, at another position; "
                "nothing changed. Rerun playbooks/rebuild-standby.yml alone (it makes a new "
                "copy)")
        missing = sorted(set(self.dbs) - set(self._shard_dbs(self.nconn)))
        if missing:
            raise PromotionFailed(
                f"{self.node} lacks {len(missing)} of the master's shard databases "
                f"({', '.join(missing[:3])}...): it does not run on a copy of {self.master}. "
                "Run playbooks/rebuild-standby.yml again (it makes the copy first)")
        name = str((self.nch or {}).get("Connection_name") or "")
        host, _, port = self.master.rpartition(":")
        replication.stop_all_channels(self.nconn)  # none, or the copy's leftovers
        replication.reset_binlog_history(self.nconn, pos, applied_too=True)
        replication.change_master(self.nconn, host.strip("[]"), int(port),
                                  self.opts.replication_user, self.opts.replication_password,
                                  name=name, connect_retry=int((self.nch or {}).get(
                                      "Connect_Retry") or 10))
        with self.nconn.cursor() as c:
            c.execute(replication.channel_sql("START", self.nch))
        self.res.gtid["copy"] = pos
        self.run.step("copied", position=pos, copy="physical")

    def _node_channel(self) -> dict[str, Any]:
        """The node's channel from the master, to be created (a physical copy replaced the
        data directory that held its configuration)."""
        if not self.opts.replication_password:
            raise PromotionRefused(
                f"{self.node} runs on a copy and needs its channel from {self.master} "
                "created: give the replication account's password (replication_password); "
                "nothing changed")
        return {"Connection_name": "", "Connect_Retry": 10}

    def copy_needed(self) -> None:
        """The physical copy the caller must make now (the journal stays unfinished: the
        registry shows the rebuild in flight and refuses other operations on the pair)."""
        # each copy named gets an id of its own: a run of the same rebuild started beside
        # this one names a newer copy, and the re-attach of the older one is refused
        # (its data may be the newer copy's, at another position)
        copy_id = secrets.token_hex(6)
        self.run.begin()
        self.run.step("copy_named", copy_id=copy_id, copy_source=self.master)
        self.res.changed = True
        self.res.copy = {"source": self.master, "target": self.node, "copy_id": copy_id}
        self.res.next_step = (f"copy {self.master}'s data directory to {self.node} "
                              "(shardfleet.physical; playbooks/rebuild-standby.yml runs it), "
                              "then run the rebuild again with the copy's GTID position")

    def _replicate(self) -> None:
        """The master replicates from the node again (its channel recreated if an emergency
        removed it), semi-sync on again; wait until the node caught up."""
        node, master, mch, recreate = self.node, self.master, self.mch, self.recreate
        if mch is not None and self._did("copied"):  # resumed: it may run since then
            with self.mconn.cursor() as c:
                c.execute(replication.channel_sql("STOP", mch))
        replication.set_replica_pos(self.mconn, replication.gtid_position(self.nconn))
        with self.mconn.cursor() as c:
            if recreate is not None:
                replication.change_master(
                    self.mconn, recreate["Master_Host"], recreate["Master_Port"],
                    recreate["Master_User"], self.opts.replication_password,
                    name=str(recreate.get("Connection_name") or ""),
                    connect_retry=int(recreate["Connect_Retry"] or 2))
                self.res.steps.append(f"recreated {master}'s channel from {node}")
            c.execute(replication.channel_sql("START", mch or recreate))
        if semisync_state(self.nconn)["replica_enabled"]:  # an emergency turned it off
            replication.set_semisync_master(self.mconn, True)
        replication.wait_for_gtid(self.nconn, replication.gtid_position(self.mconn),
                                  self.opts.catchup_timeout, self._catching_up)
        self.run.step("replicating")

    def _catching_up(self) -> None:
        """Between the catch-up's waits: a node whose channel from the master stopped with
        an error will not catch up; say why now, not after the whole timeout."""
        ch = replication.peer_channel(self.nconn) or {}
        err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error") or ""
        if err and "No" in (ch.get("Slave_IO_Running"), ch.get("Slave_SQL_Running")):
            raise PromotionFailed(f"{self.node} stopped replicating from {self.master} while "
                                  f"catching up: {err}")

    def _clear_mark(self) -> None:
        """One map write: the node the ranges' standby again, the mark removed."""
        bounds = {r.bounds for r in self.ranges}

        def clear(m: ShardMap) -> ShardMap:
            out = []
            for r in m.ranges:
                if r.bounds in bounds and r.extra.get("rebuild"):
                    extra = {k: v for k, v in r.extra.items() if k != "rebuild"}
                    r = replace(r, standby=self.node, extra=extra)
                out.append(r)
            return ShardMap.from_ranges(out, m.mod_shard_count)

        self.after = _write_map(self.run.store, clear)
        self.run.step("mark_cleared")

    def finish(self, before: ShardMap) -> None:
        """Warnings for a channel not running; the journal done; the result."""
        res, run = self.res, self.run
        res.changed = True
        if run.check:
            return
        for ch_conn, who in ((self.nconn, self.node), (self.mconn, self.master)):
            ch = replication.wait_peer_channel_running(ch_conn, 30.0)
            if ch.get("Slave_IO_Running") != "Yes" or ch.get("Slave_SQL_Running") != "Yes":
                res.warnings.append(f"{who}: replication IO {ch.get('Slave_IO_Running')} "
                                    f"SQL {ch.get('Slave_SQL_Running')} "
                                    f"{ch.get('Last_Error') or ch.get('Last_IO_Error')}")
        run.journal.save(dict(run.journal.data or {}, done=True, finished_at=time.time()))
        after = self.after or run.store.read().map
        res.map_after = after.table() if after else ""
        res.changes = shardmap.diff(before, after) if after else []
        res.next_step = (f"nothing required: {self.node} is the standby of {self.master} "
                         "again; verify with playbooks/fleet-status.yml")
