"""The split's replication: its named channel on the target (created from the clone's GTID,
started, stopped, removed) and the replicate step that waits for the catch-up."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shardfleet import replication
from shardfleet.operations.runner import StepResult

from .context import SplitContext, log
from .spec import PROGRESS, SplitError, merge_gtids


class ReplicateMixin(SplitContext):
    def _channel(self, server: str, name: str | None = None) -> dict[str, Any] | None:
        """*server*'s replication connection *name* (default: the split's), as ``SHOW ALL
        SLAVES STATUS`` shows it, or None."""
        want = self.connection_name if name is None else name
        for r in replication.replica_rows(self.conn(server)):
            if str(r.get("Connection_name") or "") == want:
                return r
        return None

    def replicate(self) -> StepResult:
        t0 = time.monotonic()
        data = self.journal.data if self.journal else None
        done = self.progress(data)
        if done < PROGRESS["clone"]:
            raise SplitError(f"split {self.name} has not been cloned yet; run the clone step")
        if done >= PROGRESS["cutover"]:
            return StepResult("replicate", False, "past the cutover: the split's replication "
                              "is gone")
        assert data is not None
        tgt = self.spec.target
        changed = self._ensure_replicating(str(data["clone_gtid"]))
        pos = replication.gtid_position(self.conn(self.spec.source))
        self._wait_applied(pos, self.catchup_timeout, "catch up")
        lag = time.monotonic() - t0
        if done < PROGRESS["replicate"]:
            self._record("replicate", replicate_gtid=pos, catchup_seconds=round(lag, 3))
            changed = True
        return StepResult("replicate", changed, f"{tgt} replicates the moving shards from "
                          f"{self.spec.source} and has applied {pos}", lag,
                          {"replicate_gtid": pos})

    def _ensure_replicating(self, clone_gtid: str) -> bool:
        """The split's channel exists and runs, applying every moving database; True when
        this changed anything."""
        tgt = self.spec.target
        ch = self._channel(tgt)
        if ch is None:
            self._create_channel(clone_gtid)
            return True
        if (ch.get("Slave_SQL_Running") != "Yes" or ch.get("Slave_IO_Running") != "Yes"
                or set(str(ch.get("Replicate_Do_DB") or "").split(",")) != set(self.databases)
                or str(ch.get("Until_Condition") or "None") != "None"):
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error")
            if ch.get("Last_SQL_Errno"):
                raise SplitError(f"the split's replication on {tgt} stopped with an error: "
                                 f"{err}; abort the split (step abort) and run it again")
            # stopped without an error, or left by the clone applying only the databases
            # an earlier attempt copied (UNTIL the new snapshot): every moving database now
            replication.stop_channel(self.conn(tgt), self.connection_name)
            replication.set_channel_databases(self.conn(tgt), self.connection_name,
                                              self.databases)
            self._start_channel(self.connection_name)
            return True
        return False

    def _create_channel(self, clone_gtid: str, *, databases: Sequence[str] | None = None,
                        start: bool = True) -> None:
        """The split's channel on the target from *clone_gtid*, applying *databases* (all
        the moving ones by default); started unless *start* is false (the target's other
        channels are started again either way)."""
        tgt, name = self.spec.target, self.connection_name
        c = self.conn(tgt)
        running = [r["Connection_name"] for r in replication.replica_rows(c)
                   if r.get("Slave_IO_Running") == "Yes" or r.get("Slave_SQL_Running") == "Yes"]
        host, _, port = self.spec.source.rpartition(":")
        slave_pos = merge_gtids(replication.gtid_replica_pos(c), clone_gtid)
        replication.stop_all_channels(c)
        try:
            # The target's standby echoes the source's GTIDs back to the target's
            # master (server_id differs from the master's own): ignore the duplicates.
            replication.set_ignore_duplicates(c, True)
            replication.set_replica_pos(c, slave_pos)
            replication.change_master(c, host.strip("[]"), int(port), self.creds.repl_user,
                                      self.creds.repl_password, name=name)
            replication.set_channel_databases(
                c, name, self.databases if databases is None else databases)
        finally:
            for other in running + [name]:
                if other == name and (not start or self._channel(tgt) is None):
                    continue
                self._start_channel(other)

    def _start_channel(self, name: str, *, until: str | None = None) -> None:
        """START SLAVE of the target's channel *name* (``UNTIL master_gtid_pos`` *until*),
        first clearing a skip counter an earlier stop left on it.

        With ``gtid_ignore_duplicates`` on (set by :meth:`_create_channel`), MariaDB skips an
        event group whose GTID it applied already by setting the channel's
        ``sql_slave_skip_counter`` to 1 until the group's end (``exec_relay_log_event`` in
        sql/slave.cc). The target's channel from its standby gets such groups all through
        the split: the standby's echo of the source transactions the split's channel
        applied. A STOP SLAVE while one is still arriving leaves the counter at 1, and the
        next START skips the next group the channel reads, a new transaction: its GTID
        counts as applied, its changes are lost, both threads say Yes (fault campaign,
        seed 500073: a row written on the target's standby after the cutover never reached
        the target). Nothing here sets the counter on purpose, and a started channel
        begins at a group's start (GTID mode: from ``gtid_slave_pos``), so a leftover
        counter only ever skips a transaction that was not applied."""
        tgt = self.spec.target
        ch = self._channel(tgt, name)
        if (ch is not None and int(ch.get("Skip_Counter") or 0)
                and ch.get("Slave_SQL_Running") != "Yes"):
            log.warning("split %s: %s's replication connection %r was stopped with "
                        "sql_slave_skip_counter %s (a skipped duplicate left unfinished); "
                        "cleared before starting it", self.name if self.journal else "",
                        tgt, name, ch.get("Skip_Counter"))
            replication.clear_skip_counter(self.conn(tgt), name)
        replication.start_channel(self.conn(tgt), name, until=until)

    def _wait_applied(self, pos: str, timeout: float, what: str) -> None:
        """Wait (bounded) until the target applied *pos*: a split channel that stopped
        with an error fails the wait at once, naming the error."""
        def stopped() -> None:
            ch = self._channel(self.spec.target) or {}
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error") or ""
            if ch and err and "No" in (ch.get("Slave_SQL_Running"), ch.get("Slave_IO_Running")):
                raise SplitError(f"target did not {what}: the split's replication from "
                                 f"{self.spec.source} stopped: {err}")

        try:
            replication.wait_for_gtid(self.conn(self.spec.target), pos, timeout, stopped)
        except replication.ReplicationTimeout as exc:
            ch = self._channel(self.spec.target) or {}
            err = ch.get("Last_SQL_Error") or ch.get("Last_IO_Error") or ""
            raise SplitError(f"target did not {what}: {exc}"
                             f"{'; replication error: ' + err if err else ''}") from None

    def _remove_channel(self) -> bool:
        if self._channel(self.spec.target) is None:
            return False
        replication.remove_channel(self.conn(self.spec.target), self.connection_name)
        return True
