"""The emergency's "nobody hears the master" window: a master that does not answer the
control node is dead only if its standby does not hear it either (:class:`Listening`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardfleet import replication
from shardfleet.operations.types import Options, reach


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
            if ch.get("Slave_SQL_Running") == "Yes" and applied_all_received(ch):
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


def applied_all_received(ch: dict[str, Any]) -> bool:
    if "has read all relay log" in str(ch.get("Slave_SQL_Running_State") or ""):
        return True  # every complete transaction received is applied
    return (ch.get("Master_Log_File") == ch.get("Relay_Master_Log_File")
            and int(ch.get("Read_Master_Log_Pos") or 0) == int(ch.get("Exec_Master_Log_Pos") or 0))
