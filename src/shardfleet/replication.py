"""Replication primitives the split and promotion operations are built from.

MariaDB (tested) and MySQL 8 (dialect chosen in :mod:`shardfleet.topology`,
not tested here) differ in names; every function takes an open admin
connection. Positions are compared by GTID, never by ``Seconds_Behind_Master``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shardfleet import topology
from shardfleet.errors import DatabaseError, ShardfleetError

log = logging.getLogger(__name__)


class ReplicationTimeout(ShardfleetError):
    """Raised when a server did not apply a GTID position within the bounded wait."""


def gtid_position(conn: Any) -> str:
    """The server's binlog GTID position (what it has written), e.g. ``"1-11-42,2-12-7"``."""
    return str(topology.scalar(conn, topology.server_dialect(conn).gtid_position_sql) or "")


def gtid_applied(conn: Any) -> str:
    """Every GTID the server has applied or written (MariaDB ``gtid_current_pos``)."""
    d = topology.server_dialect(conn)
    if d.is_mariadb:
        return str(topology.scalar(conn, "SELECT @@GLOBAL.gtid_current_pos") or "")
    return str(topology.scalar(conn, "SELECT @@GLOBAL.gtid_executed") or "")


# A session whose statements stay out of the binary log (not replicated): a node's own
# cleanup, a copy loaded into a node that gets its GTID position set afterwards.
SKIP_BINLOG_SQL = "SET SESSION sql_log_bin=0"


def gtid_replica_pos(conn: Any) -> str:
    """Where the server's replication would start (MariaDB ``gtid_slave_pos``): after a
    dump replayed with its master data, the copy's position."""
    return str(topology.scalar(conn, "SELECT @@GLOBAL.gtid_slave_pos") or "")


def set_replica_pos(conn: Any, position: str) -> None:
    """Where the server's (stopped) channels start replicating: GTID *position*."""
    with conn.cursor() as c:
        c.execute("SET GLOBAL gtid_slave_pos = %s", (position,))


def server_id(conn: Any) -> int:
    return int(topology.scalar(conn, "SELECT @@GLOBAL.server_id"))


def reset_binlog_history(conn: Any, position: str, *, applied_too: bool = False,
                         flush_privileges: bool = False) -> None:
    """Start the server's binary log history anew at GTID *position*: its own log
    files removed (``RESET MASTER``: a copy's or an old tenure's history is gone), the
    binlog state set to *position* so the GTIDs it already holds are never written
    again; *applied_too*: its replication position as well (a node running on a
    physical copy). *flush_privileges* first: a copy that replaced ``mysql.*`` is what
    the server checks from now on."""
    with conn.cursor() as c:
        if flush_privileges:
            c.execute("FLUSH PRIVILEGES")
        c.execute("RESET MASTER")
        if position:  # "": RESET MASTER left the state empty already
            c.execute("SET GLOBAL gtid_binlog_state = %s", (position,))
        if applied_too:
            c.execute("SET GLOBAL gtid_slave_pos = %s", (position,))


def errant_gtids(own_binlog: str, peer_has: str, own_server_id: int) -> list[str]:
    """GTIDs a node wrote itself (*own_binlog*, its server id) beyond what its peer is
    known to have (*peer_has*).

    Only domains whose last transaction the node wrote count: a domain the peer wrote
    arrives by replication and is never errant.
    """
    have = parse_gtids(peer_has)
    out = []
    for dom, (srv, seq) in sorted(parse_gtids(own_binlog).items()):
        if srv != own_server_id:
            continue
        known = have.get(dom, (0, 0))[1]
        if seq > known:
            out.append(f"{dom}-{srv}-{known + 1}..{seq}" if seq > known + 1
                       else f"{dom}-{srv}-{seq}")
    return out


def semisync_state(conn: Any) -> dict[str, Any]:
    """Semi-sync settings and status of one node (MariaDB names)."""
    with conn.cursor() as c:
        c.execute("SHOW GLOBAL VARIABLES LIKE 'rpl_semi_sync_%enabled'")
        v = {k.lower(): str(val) for k, val in c.fetchall()}
        c.execute("SHOW GLOBAL STATUS LIKE 'rpl_semi_sync_%'")
        s = {k.lower(): str(val) for k, val in c.fetchall()}
    return {
        "master_enabled": v.get("rpl_semi_sync_master_enabled", "OFF").upper() == "ON",
        "replica_enabled": v.get("rpl_semi_sync_slave_enabled", "OFF").upper() == "ON",
        "master_status": s.get("rpl_semi_sync_master_status", ""),
        "replica_status": s.get("rpl_semi_sync_slave_status", ""),
        "master_no_tx": int(s.get("rpl_semi_sync_master_no_tx", "0") or 0),
        "master_yes_tx": int(s.get("rpl_semi_sync_master_yes_tx", "0") or 0),
        "master_clients": int(s.get("rpl_semi_sync_master_clients", "0") or 0),
    }


# -- replication channels -----------------------------------------------------

def replica_rows(conn: Any) -> list[dict[str, Any]]:
    """Raw replica channel rows, through the server's dialect (MariaDB
    ``SHOW ALL SLAVES STATUS``)."""
    return topology.dict_rows(conn, topology.server_dialect(conn).replica_status)


def peer_channel(conn: Any) -> dict[str, Any] | None:
    """A pair node's channel from its peer (a pair node has exactly one; beside a
    split's named channel, the peer's is the default one)."""
    rows = replica_rows(conn)
    if len(rows) > 1:
        rows = [r for r in rows if not r.get("Connection_name")]
    return rows[0] if rows else None


def wait_peer_channel_running(conn: Any, timeout: float) -> dict[str, Any]:
    """The node's channel from its peer once both threads run (a thread that was just
    started shows "Preparing" or "Connecting" for a moment; on a busy machine, longer),
    or as it is after *timeout* ({} when there is none)."""
    deadline = time.monotonic() + timeout
    while True:
        ch = peer_channel(conn) or {}
        running = (ch.get("Slave_IO_Running"), ch.get("Slave_SQL_Running")) == ("Yes", "Yes")
        if running or not ch or time.monotonic() > deadline:
            return ch
        time.sleep(0.1)


def channel_sql(verb: str, row: dict[str, Any] | None, thread: str = "") -> str:
    """:func:`slave_sql` for the channel of a replica status *row*."""
    return slave_sql(verb, str((row or {}).get("Connection_name") or ""), thread)


def channel_record(row: dict[str, Any]) -> dict[str, Any]:
    """What a channel was (no password: MariaDB never shows it), enough to recreate it."""
    return {"name": str(row.get("Connection_name") or ""),
            "host": str(row.get("Master_Host") or ""),
            "port": int(row.get("Master_Port") or 0),
            "user": str(row.get("Master_User") or ""),
            "connect_retry": int(row.get("Connect_Retry") or 0),
            "using_gtid": str(row.get("Using_Gtid") or "")}


def stop_all_channels(conn: Any) -> None:
    """Stop every replication channel of the server (none is fine)."""
    with conn.cursor() as c:
        c.execute("STOP ALL SLAVES")


def parse_gtids(pos: str) -> dict[int, tuple[int, int]]:
    """MariaDB ``domain-server-seq`` list -> ``{domain: (server, seq)}``."""
    out: dict[int, tuple[int, int]] = {}
    for part in (p.strip() for p in pos.split(",") if p.strip()):
        try:
            d, s, n = (int(x) for x in part.split("-"))
        except ValueError:
            raise DatabaseError(f"not a MariaDB GTID: {part!r}") from None
        out[d] = (s, n)
    return out


def format_gtids(pos: dict[int, tuple[int, int]]) -> str:
    """``{domain: (server, seq)}`` -> the MariaDB ``domain-server-seq`` list, by domain
    (the inverse of :func:`parse_gtids`)."""
    return ",".join(f"{d}-{srv}-{seq}" for d, (srv, seq) in sorted(pos.items()))


def gtid_covers(have: str, want: str) -> bool:
    """True when position *have* includes every domain's sequence of *want* (MariaDB)."""
    h = parse_gtids(have)
    return all(d in h and h[d][1] >= n for d, (_, n) in parse_gtids(want).items())


#: The longest single wait :func:`wait_for_gtid` asks a server for. A catch-up may take
#: minutes (a rebuilt node applying what its master took during the copy), longer than an
#: admin connection's read timeout: one long ``MASTER_GTID_WAIT`` outlived it and ended as
#: a bare "lost connection (timed out)" with the server still catching up. Half a second
#: leaves a reply time on connections with read timeouts of a second or two (the probes).
WAIT_SLICE = 0.5


def wait_for_gtid(conn: Any, position: str, timeout: float,
                  check: Callable[[], None] | None = None) -> None:
    """Block until the server has applied *position* (bounded by *timeout*);
    ReplicationTimeout otherwise. The server is asked in waits of at most
    :data:`WAIT_SLICE` seconds, so any connection read timeout above that holds; *check*,
    called between them, may raise to end the wait early (e.g. the channel stopped with
    an error: waiting longer cannot help)."""
    if not position:
        return
    sql = ("SELECT MASTER_GTID_WAIT(%s, %s)" if topology.server_dialect(conn).is_mariadb
           else "SELECT WAIT_FOR_EXECUTED_GTID_SET(%s, %s)")
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        res = topology.scalar(conn, sql, (position, max(0.0, min(WAIT_SLICE, left))))
        if res is not None and int(res) == 0:
            return
        if left <= WAIT_SLICE:
            raise ReplicationTimeout(f"server did not apply GTID {position} within "
                                     f"{timeout}s (it is at {gtid_applied(conn)})")
        if check is not None:
            check()


#: Seconds between the heartbeats an idle master sends each replica (MariaDB's default is
#: half of slave_net_timeout: 30 s). A standby that keeps counting them, or keeps receiving
#: events, still hears its master: that is how an emergency promotion tells a master cut
#: off from the control node only from a dead one (:mod:`shardfleet.promote`).
HEARTBEAT_PERIOD = 0.25


def change_master_sql(name: str = "", *, tls: bool = False) -> str:
    """``CHANGE MASTER`` to a source by GTID, with the fleet's heartbeat; parameters: host,
    port, user, password, connect retry (s), heartbeat period (s), and with *tls* the CA
    file (a path on the replica's server): the channel then connects over TLS, the source's
    certificate checked against that CA and against the host name given. MariaDB."""
    quoted = f" '{name}'" if name else ""
    tls_sql = (", MASTER_SSL = 1, MASTER_SSL_CA = %s, MASTER_SSL_VERIFY_SERVER_CERT = 1"
               if tls else "")
    return (f"CHANGE MASTER{quoted} TO MASTER_HOST = %s, MASTER_PORT = %s, MASTER_USER = %s, "
            "MASTER_PASSWORD = %s, MASTER_CONNECT_RETRY = %s, MASTER_USE_GTID = slave_pos, "
            f"MASTER_HEARTBEAT_PERIOD = %s{tls_sql}")


def server_tls_ca(conn: Any) -> str:
    """The CA file *conn*'s server verifies TLS peers with (its ``ssl_ca``), or "" when the
    server has no TLS. A server the ``mysql`` role gave TLS (``mysql_tls_enabled``) has one,
    and every channel the library creates on it then replicates over TLS, verified against
    that CA: the servers' own configuration is the one place that says so."""
    row = topology.dict_rows(conn, "SELECT @@GLOBAL.have_ssl AS have_ssl, "
                                   "@@GLOBAL.ssl_ca AS ssl_ca")[0]
    return str(row["ssl_ca"] or "") if row["have_ssl"] == "YES" else ""


def change_master(conn: Any, host: str, port: int, user: str, password: str, *,
                  name: str = "", connect_retry: int = 2,
                  heartbeat: float = HEARTBEAT_PERIOD) -> None:
    """Point channel *name* (the default one when empty) of *conn*'s server at a source,
    over TLS when the server has a CA of its own (:func:`server_tls_ca`)."""
    ca = server_tls_ca(conn)
    params: tuple[Any, ...] = (host, int(port), user, password, int(connect_retry), heartbeat)
    with conn.cursor() as c:
        c.execute(change_master_sql(name, tls=bool(ca)), params + ((ca,) if ca else ()))


def set_heartbeat(conn: Any, name: str = "", period: float = HEARTBEAT_PERIOD) -> None:
    """Give a stopped channel the fleet's heartbeat period again. MariaDB resets it to its
    default (half of slave_net_timeout) on every ``CHANGE MASTER`` that does not name it,
    such as the ``MASTER_USE_GTID`` one a ``mariadb-dump --master-data`` replays."""
    quoted = f" '{name}'" if name else ""
    with conn.cursor() as c:
        c.execute(f"CHANGE MASTER{quoted} TO MASTER_HEARTBEAT_PERIOD = %s", (period,))


def heard(channel: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What a replica channel (a ``SHOW ALL SLAVES STATUS`` row) has received from its
    master so far: whether its I/O thread is connected, position read, heartbeats counted,
    GTIDs received. It changes while the master sends anything (events or heartbeats) and
    when the thread reconnects. None when there is no channel or its I/O thread is
    stopped (``No``: it will hear nothing); a thread ``Connecting`` (between two retries
    after a blip) or ``Preparing`` is still listening, so silence is only what does not
    change over time."""
    if not channel or channel.get("Slave_IO_Running") in (None, "No"):
        return None
    return (channel.get("Slave_IO_Running"), channel.get("Master_Log_File"),
            channel.get("Read_Master_Log_Pos"), channel.get("Slave_received_heartbeats"),
            channel.get("Gtid_IO_Pos"))


# a replica's connect error when its master's host answered with a reset: the port is
# closed, no server listens there (errno 111, ECONNREFUSED)
_REFUSED = re.compile(r"\(111\b|Connection refused")


def refused(channel: dict[str, Any] | None) -> bool:
    """The channel's I/O thread is not connected and its last attempt was refused by the
    master's host (nothing listens on the port: the server is not running)."""
    if not channel or channel.get("Slave_IO_Running") == "Yes":
        return False
    return int(channel.get("Last_IO_Errno") or 0) == 2003 \
        and bool(_REFUSED.search(str(channel.get("Last_IO_Error") or "")))


def reconnect_now(conn: Any, name: str = "") -> None:
    """Restart channel *name*'s I/O thread, so a thread waiting out its retry period
    (``Connecting`` after a blip; the fleet's is 10 s) tries its master at once."""
    with conn.cursor() as c:
        c.execute(slave_sql("STOP", name, "IO_THREAD"))
        c.execute(slave_sql("START", name, "IO_THREAD"))


def is_read_only(conn: Any) -> bool:
    """Whether *conn*'s server has global read_only on."""
    return bool(int(topology.scalar(conn, "SELECT @@GLOBAL.read_only")))


def set_read_only(conn: Any, on: bool) -> bool:
    """Set global read_only; returns True when it changed."""
    cur = is_read_only(conn)
    if cur == on:
        return False
    with conn.cursor() as c:
        c.execute(f"SET GLOBAL read_only = {'ON' if on else 'OFF'}")
    return True


def slave_sql(verb: str, name: str = "", thread: str = "") -> str:
    """``STOP``/``START``/``RESET SLAVE`` of one replication connection (*name* as
    ``SHOW ALL SLAVES STATUS`` gives it, quoted; empty: the default connection), with an
    optional *thread* (``IO_THREAD``, ``SQL_THREAD``, or ``ALL`` after RESET)."""
    quoted = " '" + name.replace("\\", "\\\\").replace("'", "''") + "'" if name else ""
    return f"{verb} SLAVE{quoted}{(' ' + thread) if thread else ''}"


def clear_skip_counter(conn: Any, name: str = "") -> None:
    """Set the ``sql_slave_skip_counter`` of replication connection *name* (empty: the
    default connection) to 0: the counter is per connection, chosen by the session's
    ``default_master_connection``, which is put back afterwards."""
    with conn.cursor() as c:
        c.execute("SET @@SESSION.default_master_connection = %s", (name,))
        try:
            c.execute("SET GLOBAL sql_slave_skip_counter = 0")
        finally:
            c.execute("SET @@SESSION.default_master_connection = ''")


def set_semisync_master(conn: Any, on: bool) -> None:
    """Turn the master side of semi-sync on or off (at runtime: a restart brings back what
    the configuration says)."""
    with conn.cursor() as c:
        c.execute(f"SET GLOBAL rpl_semi_sync_master_enabled = {'ON' if on else 'OFF'}")


#: InnoDB refreshes ``information_schema.INNODB_TRX`` only when nobody has read it for
#: 0.1 s (trx0i_s.cc), so polling it faster keeps serving one old view; read it no more
#: often than this.
TRX_VIEW_PERIOD = 0.11


def innodb_trx_view(conn: Any, sql: str, params: Any = None) -> list[tuple[Any, ...]] | None:
    """Rows of *sql* (a query over ``information_schema.INNODB_TRX``) from a view of InnoDB's
    transactions taken after this call began, or None when InnoDB served an older one.

    The call opens a transaction of its own first; a view that shows it is fresh. The second
    read follows within 0.1 s, so it sees the same version of InnoDB's cache."""
    with conn.cursor() as cur:
        cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        try:
            cur.execute("SELECT COUNT(*) FROM information_schema.INNODB_TRX "
                        "WHERE trx_mysql_thread_id = CONNECTION_ID()")
            if not cur.fetchone()[0]:
                return None
            cur.execute(sql, params)
            return list(cur.fetchall())
        finally:
            cur.execute("ROLLBACK")


def open_write_transactions(conn: Any) -> int | None:
    """Transactions that hold row locks or modified rows (what read_only waits on); None
    when InnoDB's view of them was not refreshed (see :func:`innodb_trx_view`)."""
    rows = innodb_trx_view(conn, "SELECT COUNT(*) FROM information_schema.INNODB_TRX "
                                 "WHERE trx_rows_modified > 0 OR trx_rows_locked > 0")
    return None if rows is None else int(rows[0][0] or 0)


def wait_no_write_transactions(conn: Any, timeout: float) -> int:
    """Wait (bounded) until no write transaction is open; returns how many remain (-1: InnoDB's
    view was never refreshed within the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        n = open_write_transactions(conn)
        if n == 0 or time.monotonic() + TRX_VIEW_PERIOD > deadline:
            return -1 if n is None else n
        time.sleep(TRX_VIEW_PERIOD)


# -- a split's channel, snapshot and nodes (MariaDB: multi-source by name) -------------

def binlog_settings(conn: Any) -> dict[str, Any]:
    """What a split needs of a server's binary log: ``log_bin``, ``fmt`` (binlog_format),
    ``sid`` (server_id), ``dom`` (gtid_domain_id), ``lsu`` (log_slave_updates)."""
    return topology.dict_rows(
        conn, "SELECT @@GLOBAL.log_bin AS log_bin, @@GLOBAL.binlog_format AS fmt, "
              "@@GLOBAL.server_id AS sid, @@GLOBAL.gtid_domain_id AS dom, "
              "@@GLOBAL.log_slave_updates AS lsu")[0]


def set_ignore_duplicates(conn: Any, on: bool = True) -> None:
    """``gtid_ignore_duplicates``: an event group whose GTID the server applied already
    (an echo through another channel) is skipped."""
    with conn.cursor() as c:
        c.execute(f"SET GLOBAL gtid_ignore_duplicates = {'ON' if on else 'OFF'}")


def set_channel_databases(conn: Any, name: str, databases: Sequence[str]) -> None:
    """The databases replication connection *name* applies (its ``replicate_do_db``; the
    connection stopped)."""
    quoted = name.replace("`", "``")
    with conn.cursor() as c:
        c.execute(f"SET GLOBAL `{quoted}`.replicate_do_db = %s", (",".join(databases),))


def stop_channel(conn: Any, name: str = "") -> None:
    """STOP SLAVE of replication connection *name* (empty: the default one)."""
    with conn.cursor() as c:
        c.execute(slave_sql("STOP", name))


def start_channel(conn: Any, name: str = "", *, until: str | None = None) -> None:
    """START SLAVE of replication connection *name*, ``UNTIL master_gtid_pos`` *until*
    when given."""
    with conn.cursor() as c:
        if until is None:
            c.execute(slave_sql("START", name))
        else:
            c.execute(slave_sql("START", name) + " UNTIL master_gtid_pos = %s", (until,))


def remove_channel(conn: Any, name: str = "") -> None:
    """Stop replication connection *name* and forget it (``RESET SLAVE ... ALL``)."""
    with conn.cursor() as c:
        c.execute(slave_sql("STOP", name))
        c.execute(slave_sql("RESET", name, "ALL"))


@contextmanager
def unlogged(conn: Any) -> Iterator[None]:
    """*conn*'s statements stay out of the binary log while held (each node of a pair
    its own change); logged again afterwards."""
    with conn.cursor() as c:
        c.execute(SKIP_BINLOG_SQL)
    try:
        yield
    finally:
        with conn.cursor() as c:
            c.execute("SET SESSION sql_log_bin = 1")


@contextmanager
def commits_blocked(conn: Any, lock_wait: int) -> Iterator[None]:
    """Commits on *conn*'s server wait while held (``BACKUP STAGE BLOCK_COMMIT``; writes
    wait, none fails), *lock_wait* seconds at most for the stage's own locks."""
    with conn.cursor() as c:
        c.execute("SET SESSION lock_wait_timeout = %s", (int(lock_wait),))
        c.execute("BACKUP STAGE START")
        c.execute("BACKUP STAGE BLOCK_COMMIT")
    try:
        yield
    finally:
        with conn.cursor() as c:
            c.execute("BACKUP STAGE END")


def start_snapshot(conn: Any) -> tuple[str, int]:
    """Open a consistent-snapshot transaction (REPEATABLE READ) on *conn*; the binlog
    file and position it corresponds to (MariaDB ``binlog_snapshot_*``)."""
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        cur.execute("SHOW STATUS LIKE 'binlog_snapshot_%'")
        st = {k.lower(): v for k, v in cur.fetchall()}
    return str(st["binlog_snapshot_file"]), int(st["binlog_snapshot_position"])


def binlog_gtid_pos(conn: Any, file: str, pos: int) -> str:
    """The GTID position of binlog *file* at *pos* (MariaDB ``BINLOG_GTID_POS``)."""
    return str(topology.scalar(conn, "SELECT BINLOG_GTID_POS(%s, %s)", (file, pos)) or "")
