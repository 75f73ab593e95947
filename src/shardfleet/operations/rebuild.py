"""The rebuild: re-attach the node the map marks ``rebuild`` (an emergency's old master)
as its pair's standby; a step table on the runner (journal ``rebuild-<pair>``; "done?"
in brackets): fenced_and_cleared [copied], master_writable [the map's master takes
writes], copied [an unfinished journal of the same rebuild says so and the shards are
on the node], replicating [the journal says so and both channels run], mark_cleared [no
range of the pair marks the node]."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Any

from shardfleet import replication, schema, shardmap
from shardfleet.errors import ShardfleetError
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.runner import Journal, Run, Step
from shardfleet.operations.types import (
    Options,
    PromotionFailed,
    PromotionRefused,
    Result,
    close,
    copy_shards,
    marked,
    owner,
    pair_ranges,
    try_connect,
    write_map,
)
from shardfleet.shardmap import ShardMap, ShardRange

# The warning of a rebuild that makes a new copy for a node it fenced that does not answer
# (playbooks/rebuild-standby.yml matches it: that node is left out of the mysql role).
RECOPY = "a new copy replaces its data directory"

# what the node is left as when the rebuild fails after a step (the journal's)
_LEFT = {
    "replicating": "The node replicates from its master and back, read_only, still "
                   "marked for rebuild",
    "mark_cleared": "The map names the node the standby again (the mark is cleared); "
                    "only the rebuild's last check of both channels did not finish",
}


class RebuildRun(Run):
    """One rebuild on the runner: journal ``rebuild-<pair>`` (header kind ``rebuild``,
    the name's first word)."""

    refusal, failure = PromotionRefused, PromotionFailed

    def _node(self) -> str:
        return self.res.old_master or "the node"

    def refused(self, what: str) -> ShardfleetError:
        return PromotionRefused(f"rebuild of {self._node()} in {self.pair} stopped before "
                                f"any change: {what}; nothing changed")

    def failed(self, step: str, what: str) -> ShardfleetError:
        state = _LEFT.get(step, "The node is fenced (read_only, replication stopped) and "
                                "still marked for rebuild")
        return PromotionFailed(
            f"rebuild of {self._node()} in {self.pair} failed after step {step!r}: {what}. "
            f"{state}; the pair serves from its master. Fix the cause and run "
            "playbooks/rebuild-standby.yml again (the journal "
            f"{self.journal.path} is in flight until then)")


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
    run = RebuildRun(store, f"rebuild-{pair}", res, check, pair=pair)
    run.nodes = nodes
    if _rebuild_target(store, pair, nodes, res)[2] is None and not run.unfinished():
        return res  # no mark and no unfinished rebuild: no lock needed
    with run.boundary(), run.held(opts.lock_timeout) as runner:
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
    return res


def _unfinished_rebuild(run: RebuildRun, ranges: list[ShardRange]) -> str | None:
    """No range marks a node, yet a rebuild's journal is in flight: that run cleared the
    mark and stopped before its last check (the master lost mid-check). The node it
    rebuilt, to finish that rebuild (its steps find themselves done); None when there is
    no such journal. Refused when the map no longer names that node the standby."""
    j = run.unfinished()
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
    marks = marked(ranges)
    if not marks:
        res.steps = ["nothing to do: no server of the pair is marked for rebuild"]
        res.map_after = res.map_before
        return cur, ranges, None
    if len(marks) > 1:
        raise PromotionRefused(f"ranges mark different servers for rebuild: {marks}")
    node = marks.pop()
    res.old_master, res.new_master = node, ranges[0].master
    return cur, ranges, node


class _CopyNeeded(Exception):
    """The physical rebuild stops here: the node's copy is made outside the library."""


class _Rebuild:
    """The rebuild's step table: the node fenced and cleared, the master's shards copied,
    replication both ways, the map's mark cleared."""

    def __init__(self, run: RebuildRun, node: str, ranges: list[ShardRange], opts: Options) -> None:
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
        close(self.nconn)
        close(self.mconn)

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
        if replication.semisync_state(self.nconn)["replica_enabled"]:  # an emergency turned it off
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

        self.after = write_map(self.run.store, clear)
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
        run.journal.note(done=True, finished_at=time.time())
        after = self.after or run.store.read().map
        res.map_after = after.table() if after else ""
        res.changes = shardmap.diff(before, after) if after else []
        res.next_step = (f"nothing required: {self.node} is the standby of {self.master} "
                         "again; verify with playbooks/fleet-status.yml")


# -- the master's channel -----------------------------------------------------------

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
    j = Journal(store, owner(pair)).load() or {}
    rec = dict(j.get("channel") or {}) if j.get("old_master") == node else {}
    host, _, port = node.rpartition(":")
    return {"Connection_name": rec.get("name") or "",
            "Master_Host": rec.get("host") or host.strip("[]"),
            "Master_Port": int(rec.get("port") or port),
            "Master_User": rec.get("user") or str(nch.get("Master_User") or "")
            or opts.replication_user,
            "Connect_Retry": int(rec.get("connect_retry") or 10)}
