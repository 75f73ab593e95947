"""What the fleet looks like right now: server dialect, replication, read_only,
semi-sync, shards present, and ZooKeeper modes.

The MySQL/MariaDB differences live here, picked once from the server's version
string (as community.mysql does): MariaDB (tested) says ``SHOW ALL SLAVES
STATUS`` / ``gtid_binlog_pos`` / ``rpl_semi_sync_master_*``; MySQL 8 (written,
not tested here: no MySQL 8 binaries are reachable) says ``SHOW REPLICA STATUS``
/ ``gtid_executed`` / ``rpl_semi_sync_source_*``.
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

import pymysql
import pymysql.cursors

from shardfleet.errors import DatabaseError, mysql_code
from shardfleet.tls import TLS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dialect:
    name: str  # "mariadb" or "mysql"
    version: str
    replica_status: str
    gtid_position_sql: str
    semisync_prefix: str  # rpl_semi_sync_master / rpl_semi_sync_source
    tablespaces_table: str  # where InnoDB lists file-per-table tablespaces and their sizes

    @property
    def is_mariadb(self) -> bool:
        return self.name == "mariadb"


def dialect_for(version: str) -> Dialect:
    """Pick the SQL dialect from ``SELECT VERSION()``."""
    if "mariadb" in version.lower():
        return Dialect("mariadb", version, "SHOW ALL SLAVES STATUS",
                       "SELECT @@GLOBAL.gtid_binlog_pos", "rpl_semi_sync_master",
                       "information_schema.INNODB_SYS_TABLESPACES")
    return Dialect("mysql", version, "SHOW REPLICA STATUS",
                   "SELECT @@GLOBAL.gtid_executed", "rpl_semi_sync_source",
                   "information_schema.INNODB_TABLESPACES")


def connect(server: str, user: str, password: str, *, timeout: float = 5.0,
            unix_socket: str | None = None, read_timeout: float | None = None,
            tls: TLS | None = None, **kw: Any) -> pymysql.connections.Connection:
    """An admin connection to ``host:port`` (or a unix socket); one-line errors.

    *timeout* bounds the TCP connect; *read_timeout* (default ``max(timeout, 30)``) bounds
    every read, the server's greeting included: a server that accepts connections and never
    answers (stopped, wedged) is given up on after it, not after *timeout*. *tls* (default
    off) are the client TLS options (:mod:`shardfleet.tls`); a unix socket stays plain."""
    host, _, port = server.rpartition(":")
    kw["read_timeout"] = max(timeout, 30) if read_timeout is None else read_timeout
    tls = tls or TLS()
    try:
        if unix_socket:
            return pymysql.connect(unix_socket=unix_socket, user=user, password=password,
                                   autocommit=True, connect_timeout=timeout,
                                   ssl_disabled=True, **kw)
        conn = pymysql.connect(host=host.strip("[]"), port=int(port), user=user,
                               password=password, autocommit=True, connect_timeout=timeout,
                               **tls.pymysql_kwargs(), **kw)
    except pymysql.err.OperationalError as exc:
        what = "wrong credentials" if mysql_code(exc) == 1045 else "cannot connect"
        where = unix_socket or server
        raise DatabaseError(f"{where}: {what}: {exc.args[-1] if exc.args else exc}") from None
    tls.check(conn, server)
    return conn


def dict_rows(conn: Any, sql: str, params: Any = None) -> list[dict[str, Any]]:
    with conn.cursor(pymysql.cursors.DictCursor) as cur:
        cur.execute(sql, params)
        return list(cur.fetchall())


def scalar(conn: Any, sql: str, params: Any = None) -> Any:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        row = cur.fetchone()
        return row[0] if row else None


def server_dialect(conn: Any) -> Dialect:
    return dialect_for(str(scalar(conn, "SELECT VERSION()")))


@dataclass
class ReplicaChannel:
    connection: str
    source: str
    io_running: str
    sql_running: str
    seconds_behind: int | None
    gtid_io_pos: str
    last_error: str
    source_server_id: int = 0  # Master_Server_Id: 0 until the channel has connected


@dataclass
class ServerState:
    server: str
    reachable: bool
    error: str | None = None
    version: str = ""
    server_id: int = 0
    read_only: bool | None = None
    gtid_binlog_pos: str = ""
    gtid_slave_pos: str = ""
    semisync_master: bool | None = None
    semisync_master_clients: int | None = None
    semisync_replica: bool | None = None
    semisync_status: str = ""
    replicas: list[ReplicaChannel] = field(default_factory=list)
    shards: int = 0
    shard_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _status_vars(conn: Any, like: str) -> dict[str, str]:
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL STATUS LIKE %s", (like,))
        return {k.lower(): v for k, v in cur.fetchall()}


def _vars(conn: Any, like: str) -> dict[str, str]:
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL VARIABLES LIKE %s", (like,))
        return {k.lower(): v for k, v in cur.fetchall()}


def replica_channels(conn: Any, dialect: Dialect) -> list[ReplicaChannel]:
    out = []
    for r in dict_rows(conn, dialect.replica_status):
        host = r.get("Master_Host") or r.get("Source_Host") or ""
        port = r.get("Master_Port") or r.get("Source_Port") or ""
        out.append(ReplicaChannel(
            connection=r.get("Connection_name", "") or r.get("Channel_Name", "") or "",
            source=f"{host}:{port}",
            io_running=r.get("Slave_IO_Running") or r.get("Replica_IO_Running") or "",
            sql_running=r.get("Slave_SQL_Running") or r.get("Replica_SQL_Running") or "",
            seconds_behind=r.get("Seconds_Behind_Master", r.get("Seconds_Behind_Source")),
            gtid_io_pos=r.get("Gtid_IO_Pos") or r.get("Retrieved_Gtid_Set") or "",
            last_error=r.get("Last_Error") or r.get("Last_IO_Error") or "",
            source_server_id=int(r.get("Master_Server_Id") or r.get("Source_Server_Id") or 0),
        ))
    return out


def server_state(server: str, user: str, password: str, *, timeout: float = 5.0,
                 with_sizes: bool = True, tls: TLS | None = None) -> ServerState:
    """Everything ``shard_info`` reports about one server; unreachable is a state, not an error."""
    try:
        conn = connect(server, user, password, timeout=timeout, tls=tls)
    except DatabaseError as exc:
        return ServerState(server, False, str(exc))
    try:
        d = server_dialect(conn)
        st = ServerState(server, True, version=d.version)
        st.read_only = bool(int(scalar(conn, "SELECT @@GLOBAL.read_only")))
        st.server_id = int(scalar(conn, "SELECT @@GLOBAL.server_id") or 0)
        st.gtid_binlog_pos = str(scalar(conn, d.gtid_position_sql) or "")
        if d.is_mariadb:
            st.gtid_slave_pos = str(scalar(conn, "SELECT @@GLOBAL.gtid_slave_pos") or "")
        sv = _vars(conn, "rpl_semi_sync_%enabled")
        ss = _status_vars(conn, "rpl_semi_sync_%")
        p = d.semisync_prefix
        st.semisync_master = sv.get(f"{p}_enabled", "OFF").upper() == "ON"
        rep = p.replace("master", "slave").replace("source", "replica")
        st.semisync_replica = sv.get(f"{rep}_enabled", "OFF").upper() == "ON"
        st.semisync_status = ss.get(f"{p}_status", "")
        clients = ss.get(f"{p}_clients")
        st.semisync_master_clients = int(clients) if clients not in (None, "") else None
        st.replicas = replica_channels(conn, d)
        st.shards = int(scalar(conn, "SELECT COUNT(*) FROM information_schema.SCHEMATA "
                                     "WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$'"))
        if with_sizes:
            # InnoDB's tablespace list is read from memory; information_schema.TABLES
            # would open every table of every shard (minutes for 4,096 shards).
            # Tables in the system tablespace (innodb_file_per_table=OFF) are not counted.
            st.shard_bytes = int(scalar(
                conn, f"SELECT COALESCE(SUM(ALLOCATED_SIZE), 0) FROM {d.tablespaces_table} "
                      "WHERE NAME REGEXP '^db[0-9]{5}/'") or 0)
        return st
    except pymysql.err.MySQLError as exc:
        return ServerState(server, True, f"{server}: {exc}")
    finally:
        conn.close()



# -- a node's own data and binary log: what a backup, a restore and the archive read ------

SHARD_DB = re.compile(r"^db\d{5}$")


def shard_tables(conn: Any) -> dict[str, list[str]]:
    """Every shard database (``dbNNNNN``) and its base tables, from the server's catalog."""
    with conn.cursor() as c:
        c.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                  "WHERE TABLE_SCHEMA LIKE 'db%%' AND TABLE_TYPE = 'BASE TABLE' "
                  "ORDER BY TABLE_SCHEMA, TABLE_NAME")
        rows = c.fetchall()
        c.execute("SHOW DATABASES LIKE 'db%%'")
        dbs = [r[0] for r in c.fetchall()]
    out: dict[str, list[str]] = {d: [] for d in dbs if SHARD_DB.match(d)}
    for db, table in rows:
        if db in out and re.match(r"^\w+$", table):
            out[db].append(table)
    return out


def checksum_tables(conn: Any, tables: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """``CHECKSUM TABLE`` of every table, per database (one statement per database).
    Names come from the server's catalog and match ``dbNNNNN`` / ``\\w+`` only."""
    out: dict[str, dict[str, int]] = {}
    with conn.cursor() as c:
        for db, names in tables.items():
            out[db] = {}
            if not names:
                continue
            c.execute("CHECKSUM TABLE " + ", ".join(f"`{db}`.`{t}`" for t in names))
            for full, value in c.fetchall():
                out[db][full.split(".", 1)[1]] = int(value or 0)
    return out


def open_consistent_snapshot(conn: Any) -> tuple[tuple[str, int], list[str]]:
    """Open a consistent snapshot (REPEATABLE READ) on *conn* and return its binlog
    coordinates (``binlog_snapshot_file``/``_position``) and the shard databases that exist
    now (the catalog is not in the snapshot). The transaction stays open: end it with
    ``conn.rollback()``."""
    with conn.cursor() as c:
        c.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        c.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        c.execute("SHOW STATUS LIKE 'binlog_snapshot_%%'")
        st = {k: v for k, v in c.fetchall()}
        c.execute("SHOW DATABASES LIKE 'db%%'")
        dbs = [r[0] for r in c.fetchall() if SHARD_DB.match(r[0])]
    return (st["Binlog_snapshot_file"], int(st["Binlog_snapshot_position"])), dbs


def binlog_enabled(conn: Any) -> tuple[bool, str]:
    """(the binary log is on, ``VERSION()``)."""
    with conn.cursor() as c:
        c.execute("SELECT @@GLOBAL.log_bin, VERSION()")
        log_bin, version = c.fetchone()
    return bool(log_bin), str(version)


def binary_logs(conn: Any, *, flush: bool = False) -> tuple[str, list[tuple[str, int]]]:
    """(``log_bin_basename``, every binary log file on the server with its size, oldest
    first); *flush* closes the current file first (``FLUSH BINARY LOGS``)."""
    with conn.cursor() as c:
        if flush:
            c.execute("FLUSH BINARY LOGS")
        c.execute("SELECT @@GLOBAL.log_bin_basename")
        (basename,) = c.fetchone()
        c.execute("SHOW BINARY LOGS")
        logs = [(str(r[0]), int(r[1])) for r in c.fetchall()]
    return str(basename or ""), logs


# memcached's `stats` fields the exporter serves (no Debian package exports memcached)
MEMCACHED_STATS = ("curr_items", "bytes", "limit_maxbytes", "curr_connections", "get_hits",
                   "get_misses", "evictions", "uptime")


def memcached_stats(server: str, timeout: float = 3.0) -> dict[str, Any]:
    """The ``stats`` of one memcached server (the fields of :data:`MEMCACHED_STATS`), or
    why not (``error``)."""
    host, _, port = server.rpartition(":")
    try:
        with socket.create_connection((host, int(port or 11211)), timeout=timeout) as s:
            s.sendall(b"stats\r\n")
            data = b""
            while not data.endswith(b"END\r\n") and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except (OSError, ValueError) as exc:
        return {"server": server, "error": str(exc)}
    if not data.endswith(b"END\r\n"):
        return {"server": server, "error": f"no stats reply: {data[:80]!r}"}
    fields = dict(line.split(" ", 2)[1:] for line in data.decode("ascii", "replace")
                  .splitlines() if line.startswith("STAT ") and line.count(" ") >= 2)
    out: dict[str, Any] = {"server": server}
    for k in MEMCACHED_STATS:
        try:
            out[k] = int(fields[k])
        except (KeyError, ValueError):
            pass
    return out


def zookeeper_mode(server: str, timeout: float = 3.0) -> dict[str, Any]:
    """The ``srvr`` four-letter word of one ZooKeeper node: its mode, or why not."""
    host, _, port = server.rpartition(":")
    try:
        with socket.create_connection((host, int(port or 2181)), timeout=timeout) as s:
            s.sendall(b"srvr")
            data = b""
            while len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        return {"server": server, "mode": "unreachable", "error": str(exc)}
    text = data.decode("utf-8", "replace")
    if "not in the whitelist" in text:
        return {"server": server, "mode": "unknown", "error": "srvr is not whitelisted"}
    mode = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("Mode:")), "unknown")
    zxid = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("Zxid:")), "")
    return {"server": server, "mode": mode, "zxid": zxid}
