"""Promotion: make a pair's standby its master, planned or in an emergency.

Human-triggered, never automatic. Planned and emergency are step tables on the
operation runner (:class:`shardfleet.operations.runner.Runner`, named
``promote-<pair>``): it holds both servers' locks for the whole run, refuses beside
another operation in flight on them, and skips a step whose "is it done?" (read from
the map and the servers) holds. Each step is recorded in the journal
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

The modules::

    request.py    the request against the map and the journal (refusals), resume
    table.py      what both tables read: "is it done?", the map's freeze and flip
    planned.py    the planned table (the master answers: zero loss)
    emergency.py  the emergency table (the master is dead, or forced)
    listening.py  the emergency's window: does the standby still hear the master?
    common.py     the run (journal, messages), the map edits, the printed commands

MariaDB is what runs and is tested here (the dialect is picked in
:mod:`shardfleet.topology`); the relay-log and GTID details are MariaDB's. The
rebuild of an emergency's old master is :mod:`shardfleet.operations.rebuild`.
"""

from __future__ import annotations

import time

from shardfleet import shardmap
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.promote.common import MODES, PromotionRun
from shardfleet.operations.promote.listening import Listening
from shardfleet.operations.promote.request import _prepare
from shardfleet.operations.types import Options, PromotionFailed, PromotionRefused, Result


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
    run = PromotionRun(store, pair, res, check)
    run.nodes = nodes
    with run.boundary():
        return _promote(run, mode, master, expect_master, opts)


def _promote(run: PromotionRun, mode: str, master: str | None, expect_master: str | None,
             opts: Options) -> Result:
    store, res = run.store, run.res
    with run.held(opts.lock_timeout) as runner:
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
            run.journal.note(done=True, finished_at=time.time(), timings=res.timings,
                             warnings=res.warnings, errant=res.errant)
    res.next_step = _next_step(res, check=run.check)
    return res


def _next_step(res: Result, *, check: bool = False) -> str:
    if check:
        return (f"check mode changed nothing: the same command without --check would make "
                f"{res.new_master} the master of {res.pair} ({res.mode})")
    if res.mode == "emergency":
        return (f"{res.old_master} must not serve again as it is: start it (it boots "
                f"read_only), then rebuild it as the standby: ansible-playbook "
                f"playbooks/rebuild-standby.yml -e pair={res.pair}")
    return (f"nothing required: {res.old_master} is the standby and replicates from "
            f"{res.new_master}; verify with ansible-playbook playbooks/fleet-status.yml")


__all__ = ["MODES", "Listening", "Options", "PromotionFailed", "PromotionRefused", "Result",
           "promote"]
