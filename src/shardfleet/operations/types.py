"""What the operations share: the accounts they use, the options of a promotion or a
rebuild, the report an operation returns (the map before and after, the changes, the
next step), the refusal and the failure they raise, whether a server answers, the map
edits of a pair, and the logical copy of a pair's shards. No operation imports another;
what two of them need lives here or in the runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pymysql
from kazoo.exceptions import KazooException

from shardfleet import replication, topology
from shardfleet.errors import DatabaseError, MapError, ShardfleetError, mysql_code
from shardfleet.mapstore import ZooKeeperMapStore, update
from shardfleet.shardmap import ShardMap, ShardRange
from shardfleet.tls import TLS


class OperationRefused(ShardfleetError):
    """Raised before anything changed: the request is unsafe or makes no sense (another
    operation holds the servers, or the operation's own refusals)."""


class OperationFailed(ShardfleetError):
    """Raised when a step failed after changes began; the message says what state the
    servers were left in, and the journal records every step done."""


class PromotionRefused(OperationRefused):
    """Raised before anything changed: the request is unsafe or makes no sense
    (emergency on a live master, planned on a dead one, unknown pair, lock held)."""


class PromotionFailed(OperationFailed):
    """Raised when a step failed after changes began; the message says what state
    the pair was left in and the journal records every step done."""


@dataclass(frozen=True)
class Credentials:
    """The MySQL accounts a split uses (the ``mysql`` role's users)."""

    admin_user: str
    admin_password: str
    repl_user: str
    repl_password: str
    app_user: str = "shardfleet_app"
    app_host: str = "%"


@dataclass
class Options:
    """Bounds and credentials of one promotion (all times in seconds)."""

    user: str = "shardfleet_admin"
    password: str = ""
    connect_timeout: float = 2.0
    read_timeout: float = 30.0     # every read on an admin connection, the greeting too
    # emergency: the probe of a master that may be dead; a master that does not answer it
    # is dead only if its standby does not hear it either (see Listening)
    probe_timeout: float = 1.0
    silence_timeout: float = 5.0
    catchup_timeout: float = 30.0   # standby catches up before anything is frozen
    drain_timeout: float = 10.0     # standby applies the fenced master's last position
    trx_timeout: float = 2.0        # open write transactions on the fenced master
    lock_timeout: float = 2.0
    force: bool = False
    # a plain request this soon after a finished promotion of the pair is refused as a
    # rerun of the same command (it would swap the pair back); see _check_not_a_rerun
    rerun_window: float = 86400.0
    # the pair's replication account: a rebuild after an emergency recreates the new
    # master's channel to the rebuilt node (the emergency removed it), and MariaDB never
    # shows a channel's password, so it cannot be copied from the other side
    replication_user: str = "shardfleet_repl"
    replication_password: str = ""
    # rebuild: "logical" (mariadb-dump of the shards through the control node) or
    # "physical" (shardfleet.physical: mariadb-backup streamed from the master's host to
    # the node's; the playbook runs the copy between two calls of rebuild_standby, the
    # second with the copy's GTID position)
    copy: str = "logical"
    copy_position: str = ""
    # the copy this call re-attaches the node from (what the call that named the copy
    # returned in Result.copy["copy_id"]): a newer copy named since refuses it
    copy_id: str = ""
    # client TLS of every admin connection and of the logical rebuild's mariadb-dump and
    # mariadb (shardfleet.tls; off by default)
    tls: TLS = field(default_factory=TLS)


@dataclass
class Result:
    changed: bool = False
    mode: str = ""
    pair: str = ""
    old_master: str = ""
    new_master: str = ""
    ranges: list[list[int]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errant: list[str] = field(default_factory=list)
    semisync: dict[str, Any] = field(default_factory=dict)
    gtid: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    map_before: str = ""
    map_after: str = ""
    changes: list[str] = field(default_factory=list)
    resumed: bool = False
    next_step: str = ""
    channel_removed: dict[str, Any] = field(default_factory=dict)
    copy: dict[str, str] = field(default_factory=dict)  # a physical copy to run (rebuild)
    # (rebuild) the node does not answer after this rebuild fenced it for a physical copy:
    # a new copy replaces its data directory whole (RECOPY); leave it out of the mysql role
    recopy: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- the servers: does one answer? ----------------------------------------------

def connect(server: str, opts: Options) -> pymysql.connections.Connection:
    """An admin connection to *server* with the bounds and TLS of *opts*."""
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
        conn = connect(server, opts)
    except (DatabaseError, pymysql.err.MySQLError, OSError) as exc:
        code = mysql_code(exc)
        return None, f"MySQL error {code}: {exc}" if code else str(exc), 1000 <= code < 2000
    try:
        topology.scalar(conn, "SELECT 1")
        return conn, "", False
    except (pymysql.err.MySQLError, OSError) as exc:
        close(conn)
        return None, f"{server}: {describe(exc)}", 1000 <= mysql_code(exc) < 2000


def try_connect(server: str, opts: Options) -> tuple[Any | None, str]:
    """(connection, "") when *server* answers a query, else (None, why)."""
    conn, why, _ = reach(server, opts)
    return conn, why


def close(conn: Any) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


def describe(exc: BaseException) -> str:
    """One line for a driver error (the MySQL error number when there is one)."""
    code = mysql_code(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KazooException):
        return f"ZooKeeper: {type(exc).__name__} {text}".strip()
    if code and not isinstance(exc, ShardfleetError):
        msg = exc.args[-1] if len(exc.args) > 1 else text
        return f"MySQL error {code}: {msg}"
    return text


# -- the map of a pair ------------------------------------------------------------

def pair_ranges(m: ShardMap, nodes: list[str]) -> list[ShardRange]:
    """Ranges whose master (and standby, if any) are both nodes of the pair."""
    ns = set(nodes)
    return [r for r in m.ranges if r.master in ns and (r.standby is None or r.standby in ns)]


def marked(ranges: list[ShardRange]) -> set[str]:
    """The servers the ranges mark for rebuild (an emergency's old master)."""
    return {str(r.extra["rebuild"]) for r in ranges if r.extra.get("rebuild")}


def owner(pair: str) -> str:
    """The name a promotion freezes its pair's ranges under (its journal's name)."""
    return f"promote-{pair}"


def write_map(store: ZooKeeperMapStore, edit: Callable[[ShardMap], ShardMap]) -> ShardMap:
    """One edit through the map-change loop (:func:`shardfleet.mapstore.update`: CAS
    retries, a lost reply decided by content); PromotionFailed when the edit is refused."""
    try:
        return update(store, edit).map
    except MapError as exc:
        raise PromotionFailed(f"the map does not allow this promotion step: {exc}") from None


# -- the logical copy of a pair's shards (a rebuild's, a benchmark's) ---------------

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
