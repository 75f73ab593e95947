"""The split's physical clone: a ``mariadb-backup`` copy of a source node onto both target
nodes (named here, made between the nodes by the caller, watched, then attached), and the
target pair's own replication made again around it."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from shardfleet import physical, provision, replication
from shardfleet.errors import MapConflictError
from shardfleet.operations.runner import StepResult
from shardfleet.tls import StreamTLS

from .check import estimate
from .context import SplitContext, log
from .spec import SplitError, few


class PhysicalMixin(SplitContext):
    def _clone_physical(self, t0: float) -> StepResult:
        """The Jetpants way: a physical copy of a source node onto both target nodes, then
        the shards the target does not take dropped there.

        Without ``copy_position`` (the first call): names the copy to make (a new
        ``copy_id`` each time, in the journal's ``copy``) and stops there
        (``StepResult.waits``): the caller streams one ``mariadb-backup`` of
        ``copy["source"]`` to both ``copy["targets"]`` at once (one backup, so one GTID
        position), each node preparing it and installing it in place of its data
        directory (``shard_copy``; ``split.yml`` does it), then runs the split again with
        the copy's position and id.

        With them, the copy is attached (:meth:`_attach_copy`)."""
        data = self.journal.data if self.journal else None
        if self.progress(data) < 0:
            self._record("started")
        if not self.copy_position:
            return self._name_copy(t0)
        return self._attach_copy(t0)

    def _copy_source(self) -> str:
        """The node a physical clone copies: the source range's standby per the map (the
        master's disks and buffer pool stay the application's), else the master (no
        standby, or the map marks it for rebuild)."""
        r = self.original
        assert r is not None
        if r.standby and r.extra.get("rebuild") != r.standby:
            return r.standby
        return r.master

    def _name_copy(self, t0: float) -> StepResult:
        src = self._copy_source()
        targets = self.target_nodes
        copy = {"source": src, "targets": targets, "copy_id": secrets.token_hex(6),
                "bytes_estimated": estimate(self.conn(src),
                                            sorted(self._shard_dbs(src)))["bytes"]}
        retry = [int(r.get("Connect_Retry") or 0) for r in replication.replica_rows(
            self.conn(targets[0])) if not r.get("Connection_name")]
        self._note(clone_method="physical", copy=copy, copy_attaching=None,
                   target_connect_retry=(retry or [self.pair_connect_retry])[0],
                   clone_progress={"phase": "copying", "copy_id": copy["copy_id"],
                                   "bytes_estimated": copy["bytes_estimated"],
                                   "started_at": round(time.time(), 3)})
        self._unfence_receivers(targets)  # an abort's cancel of older copies lifted
        return StepResult("clone", True, f"copy {src}'s data directory to {targets[0]} and "
                          f"{targets[1]} (physical, ~{copy['bytes_estimated']} bytes of "
                          "InnoDB data), then run the split again with the copy's GTID "
                          "position", time.monotonic() - t0, {"copy": copy}, waits=True)

    def watch_copy(self, receivers: Sequence[str], secret: str, *, timeout: float = 7200.0,
                   interval: float = 2.0, silence: float = 300.0) -> dict[str, Any]:
        """The copy's progress while it runs, for on-call: polls the receivers
        (:func:`shardfleet.physical.status`, the copy's secret) every *interval* seconds
        and writes ``clone_progress`` into the journal (phase, bytes received of the
        estimate, rate, ETA) until every receiver is done (installed, failed, or gone
        after it received), or *timeout*, or when no receiver answered for *silence*
        seconds (one that failed before it listened; the caller's wait for the copy's
        tasks says why: the watch only reports). Only while the journal still names the copy
        this run made: a newer run's copy is never touched, and the journal is written
        by version (a concurrent write wins; this round is skipped). Returns the last
        progress written. Takes no lock: it changes nothing but the progress. With a
        ``ca_cert`` in the split's TLS, the receivers are asked over TLS, verified by it."""
        data = self.resolve() or {}
        copy = dict(data.get("copy") or {})
        copy_id = str(copy.get("copy_id") or "")
        if not copy_id:
            raise SplitError("no physical copy is named in the journal: nothing to watch")
        estimated = int(copy.get("bytes_estimated") or 0)
        seen: dict[str, dict[str, Any]] = {}
        gone: set[str] = set()
        deadline = time.monotonic() + timeout
        heard = time.monotonic()
        # the fleet's copies run over TLS when its MySQL connections do (shard_copy's
        # tls_dir): the receivers are verified against the same CA
        stream = StreamTLS(self.tls.ca_cert) if self.tls and self.tls.ca_cert else None
        while True:
            for r in receivers:
                st = physical.status(r, secret, timeout=min(5.0, interval * 2), tls=stream)
                if st is not None:
                    seen[r] = st
                    heard = time.monotonic()
                elif r in seen:
                    gone.add(r)
            progress = copy_progress(receivers, seen, copy_id, estimated)
            self._note_copy_progress(copy_id, progress)
            finished = all(r in gone or seen.get(r, {}).get("phase") in ("installed", "failed")
                           for r in receivers)
            now = time.monotonic()
            if finished or now > deadline or now - heard > silence:
                return progress
            time.sleep(interval)

    def _note_copy_progress(self, copy_id: str, progress: dict[str, Any]) -> None:
        assert self.journal is not None
        data = self.journal.load() or {}
        if (data.get("copy") or {}).get("copy_id") != copy_id or data.get("step") != "started":
            return  # another run's copy, or past the clone
        try:
            self.journal.save({**data, "clone_progress": progress})
        except MapConflictError:
            pass  # written meanwhile: the next round writes again
        log.info("copy %s: %s, %d of ~%d bytes", copy_id, progress["phase"],
                 progress["bytes_done"], progress["bytes_estimated"])

    def _attach_copy(self, t0: float) -> StepResult:
        """Both target nodes run on the copy named *copy_id*, installed at
        ``copy_position``: make them this split's target pair.

        Refused, nothing changed, when no copy was named, when another run named a newer
        copy since, when this copy's attach was begun by an earlier run (the target pair
        may have moved past its position: attaching again would rewind it; a rerun of
        the split makes a new copy), or when a node does not hold the moving databases
        or is writable. Then, on both nodes: replication stopped and its channels removed
        (the source node's, carried by the copy), the shard databases outside the moving
        range dropped (not binlogged), the binlog history reset to the copy's position;
        the pair replicates both ways from it, the split's channel from the source's
        master starts at it, and the pair is checked to replicate both ways."""
        assert self.journal is not None and self.journal.data is not None
        copy = dict(self.journal.data.get("copy") or {})
        named = str(copy.get("copy_id") or "")
        pos = self.copy_position
        self._refuse_attach(copy, named)
        nodes = self.target_nodes
        self._note(copy_attaching=named)
        dropped = sum(len(d) for d in self._on_both(nodes, lambda n: self._reset_node(
            n, sorted(self._shard_dbs(n) - set(self.databases)), pos)))
        self._unfence_receivers(nodes)  # carried by a copy of a node once fenced
        self._pair_up(nodes)
        self._create_channel(pos)
        problems = self._pair_health()
        if problems:
            raise SplitError(f"the target pair does not replicate both ways after the copy "
                             f"was attached: {'; '.join(problems)}")
        took = time.monotonic() - t0
        stats = {k: self.copy_stats[k] for k in ("bytes", "seconds") if k in self.copy_stats}
        self._note(clone_progress={"phase": "attached", "copy_id": named, **stats})
        res = self._record("clone", clone_gtid=pos, clone_method="physical",
                           copy_source=copy.get("source"), copy_bytes=stats.get("bytes"),
                           copy_seconds=stats.get("seconds"), dropped_on_target=dropped,
                           clone_seconds=round(took, 3))
        return StepResult("clone", True, f"attached the physical copy of {copy.get('source')} "
                          f"at GTID {pos} on {nodes[0]} and {nodes[1]} (dropped {dropped} "
                          "shard database(s) the target does not take)", took,
                          {"clone_gtid": res["clone_gtid"], "copy": copy})

    def _refuse_attach(self, copy: dict[str, Any], named: str) -> None:
        """SplitError (nothing changed) unless the copy *named* may be attached now."""
        assert self.journal is not None and self.journal.data is not None
        if not named:
            raise SplitError("no physical copy was named for this split: run it without "
                             "copy_position first (that names the copy to make); nothing "
                             "changed")
        if self.copy_id and self.copy_id != named:
            raise SplitError(f"another run of this split named a newer copy ({named}) after "
                             f"this run's ({self.copy_id}): the target may run on that one, "
                             "at another position; nothing changed. Run the split again "
                             "alone (it makes a new copy)")
        if self.journal.data.get("copy_attaching") == named:
            raise SplitError(f"the attach of copy {named} was begun by an earlier run and cut "
                             "short: the target pair may have moved past the copy's position; "
                             "nothing changed. Run the split again (it makes a new copy)")
        for n in self.target_nodes:
            missing = sorted(set(self.databases) - self._shard_dbs(n))
            if missing:
                raise SplitError(f"{n} lacks {len(missing)} moving shard database(s) "
                                 f"({few(missing)}): it does not run on the copy of "
                                 f"{copy.get('source')}; nothing changed. Run the split again "
                                 "(it makes the copy first)")
            if not replication.is_read_only(self.conn(n)):
                raise SplitError(f"{n} is writable: a node that runs on a fresh copy boots "
                                 "read_only, so this is not the copy; nothing changed")

    # -- the target pair's nodes ---------------------------------------------
    def _unfence_receivers(self, nodes: Sequence[str], *, binlog: bool = False) -> None:
        """A new copy (or clone) onto *nodes*: an abort's cancel of the copies into them
        lifted. *binlog*: dropped on the first node and replicated to its peer (a logical
        clone, which talks to the target's master only); else on each node, not binlogged."""
        for n in nodes[:1] if binlog else nodes:
            with self._unlogged(n, on=not binlog):
                self._exec(n, f"DROP DATABASE IF EXISTS `{physical.FENCE_DB}`")

    @contextmanager
    def _unlogged(self, node: str, *, on: bool = True) -> Iterator[None]:
        """Statements on *node* not binlogged (each node of a pair its own) while held
        (*on*; else binlogged as ever)."""
        if not on:
            yield
            return
        with replication.unlogged(self.conn(node)):
            yield

    def _reset_node(self, node: str, drop: list[str], pos: str) -> list[str]:
        """A target node made fresh at GTID *pos* ('' for none): its replication channels
        stopped and removed, the shard databases *drop* dropped (not binlogged: each node
        drops its own), binlog history reset to *pos*, ``gtid_slave_pos`` set to it.
        Returns *drop*."""
        c = self.conn(node)
        for ch in replication.replica_rows(c):
            replication.remove_channel(c, str(ch.get("Connection_name") or ""))
        with self._unlogged(node):
            provision.apply_drop(c, drop, app_user=self.creds.app_user,
                                 app_host=self.creds.app_host)
        replication.reset_binlog_history(self.conn(node), pos, applied_too=True)
        return drop

    def _on_both(self, nodes: Sequence[str], work: Callable[[str], list[str]]
                 ) -> list[list[str]]:
        """*work* on each node at once (a thread and a connection each: dropping a
        thousand shard databases takes a while on every node); the first failure raised."""
        for n in nodes:
            self.conn(n)  # connected here, one thread: each worker then uses its own
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            return list(pool.map(work, nodes))

    def _pair_up(self, nodes: Sequence[str]) -> None:
        """The target pair's own replication, both ways, from each node's current
        position (the default channel, as the ``mysql`` role makes it, with the connect
        retry its channel had before the copy)."""
        data = (self.journal.data if self.journal else None) or {}
        retry = int(data.get("target_connect_retry") or self.pair_connect_retry)
        for me, peer in ((nodes[0], nodes[1]), (nodes[1], nodes[0])):
            host, _, port = peer.rpartition(":")
            replication.change_master(self.conn(me), host.strip("[]"), int(port),
                                      self.creds.repl_user, self.creds.repl_password,
                                      connect_retry=retry)
            replication.start_channel(self.conn(me))

    def _pair_health(self, timeout: float = 30.0) -> list[str]:
        """Wait (bounded) until the target master and its standby replicate from each other
        (both threads running, no error); what is still wrong after *timeout*."""
        servers = [self.spec.target] + ([self.spec.target_standby]
                                        if self.spec.target_standby else [])
        deadline = time.monotonic() + timeout
        while True:
            problems = []
            for server in servers:
                rows = [r for r in replication.replica_rows(self.conn(server))
                        if not r.get("Connection_name")]
                if self.spec.target_standby and not rows:
                    problems.append(f"{server} has no replication from its peer")
                for r in rows:
                    if (r.get("Slave_IO_Running"), r.get("Slave_SQL_Running")) != ("Yes", "Yes"):
                        problems.append(
                            f"{server}: replication from {r.get('Master_Host')}:"
                            f"{r.get('Master_Port')} IO {r.get('Slave_IO_Running')} SQL "
                            f"{r.get('Slave_SQL_Running')} ({r.get('Last_IO_Error') or ''}"
                            f"{r.get('Last_SQL_Error') or ''})")
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.2)


def copy_progress(receivers: Sequence[str], seen: dict[str, dict[str, Any]], copy_id: str,
                  estimated: int) -> dict[str, Any]:
    """A copy's progress from its receivers' last status (*seen*): the slowest one's bytes
    of the estimate, rate, ETA, each receiver's phase."""
    states = [seen.get(r, {}) for r in receivers]
    done_bytes = min(int(st.get("bytes") or 0) for st in states)
    secs = max(float(st.get("seconds") or 0) for st in states)
    rate = done_bytes / secs if secs > 0 else 0.0
    phases = sorted({str(st.get("phase") or "starting") for st in states})
    return {"phase": "/".join(phases), "copy_id": copy_id,
            "bytes_done": done_bytes, "bytes_estimated": estimated,
            "bytes_per_second": round(rate), "seconds": round(secs, 1),
            "eta_seconds": (round(max(0, estimated - done_bytes) / rate)
                            if rate > 0 and estimated else None),
            "receivers": {r: seen.get(r, {}).get("phase", "starting") for r in receivers}}
