"""Before a promotion's table runs, under the runner's locks: the request read against
the map and the journal (refusals change nothing), a resumed promotion's mode and
target, and the pair that already has the requested master (restarted nodes resumed)."""

from __future__ import annotations

import logging
import time
from typing import Any

from shardfleet import replication
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.promote.common import PromotionRun, semisync_state
from shardfleet.operations.promote.promotion import Promotion
from shardfleet.operations.types import (
    Options,
    PromotionRefused,
    Result,
    close,
    marked,
    pair_ranges,
    try_connect,
)
from shardfleet.shardmap import ShardMap, ShardRange

log = logging.getLogger("shardfleet.promote")


def _resume(run: PromotionRun, journal: dict[str, Any] | None, mode: str,
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


def _prepare(run: PromotionRun, m: ShardMap, mode: str, master: str | None,
             expect_master: str | None, opts: Options) -> Promotion | None:
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
    return Promotion(run, mode, old, new, ranges, opts)


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
            _resume_pair(res, conn, peer, marked(ranges), opts, check)
        finally:
            close(conn)
    frozen = [r for r in ranges if r.state == "frozen"]
    if frozen:
        res.warnings.append("ranges are frozen: " + ", ".join(r.describe() for r in frozen))
    if any(r.extra.get("rebuild") for r in ranges):
        res.next_step = ("rebuild the old master and re-attach it: ansible-playbook "
                         f"playbooks/rebuild-standby.yml -e pair={res.pair}")
    return res


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
        close(pconn)


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
