"""The emergency promotion's step table (the master does not answer; or ``force``)::

    freeze     as planned (routers wait rather than hammer a dead server)
    fence      best effort: the old master read_only=ON if it answers
    drain      stop the standby's I/O thread, wait until it applied every
               relay log event it received, then stop its replication from
               the old master (a returning old master cannot push its
               unacknowledged tail into the new master)
    errant     GTIDs written on the standby the master never had: reported
    writable   standby read_only=OFF
    flip       master and standby swapped, ``rebuild: <old master>`` on the
               ranges (playbooks/rebuild-standby.yml re-attaches it)

A master that does not answer is dead only if its standby does not hear it either
(:class:`~.listening.Listening`). With semi-synchronous replication every acknowledged
commit reached the standby's relay log, so draining the relay log loses none; when
semi-sync is off (or its state cannot be shown) the result says so in ``warnings``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pymysql

from shardfleet import replication
from shardfleet.operations.promote.common import (
    _rerun_cmd,
    _resume_cmd,
    _Stopper,
    errant_against,
    semisync_state,
)
from shardfleet.operations.promote.listening import Listening, applied_all_received
from shardfleet.operations.promote.table import Table
from shardfleet.operations.runner import Step
from shardfleet.operations.types import (
    PromotionFailed,
    PromotionRefused,
    Result,
    close,
    reach,
    try_connect,
)


class Emergency(Table):
    """The emergency table's rows and actions."""

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
            close(self.mconn)
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
            if applied_all_received(ch) or ch.get("Slave_SQL_Running") != "Yes":
                break
            if time.monotonic() > deadline:
                raise PromotionFailed(
                    f"{new} did not apply its relay log within {self.opts.drain_timeout}s "
                    f"(ranges left frozen; rerun to continue): read "
                    f"{ch.get('Read_Master_Log_Pos')} exec {ch.get('Exec_Master_Log_Pos')} "
                    f"({ch.get('Slave_SQL_Running_State')})")
            time.sleep(0.01)
        if ch.get("Slave_SQL_Running") != "Yes" and not applied_all_received(ch):
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


def _alive_refusing(server: str, why: str) -> PromotionRefused:
    return PromotionRefused(
        f"the master {server} is alive but refuses the admin connection ({why}): it is NOT "
        "dead, so an emergency promotion would leave two masters. Fix the access (free "
        "connections, FLUSH HOSTS for a blocked host, the admin password or grants), then "
        "use mode=planned (zero loss); nothing changed")


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
