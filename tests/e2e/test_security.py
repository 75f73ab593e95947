"""Security checks on the e2e fleet: what the application and replication users
can and cannot do. Two shard-style databases of the test's own (db65000, db65001:
valid shard names far above the fleet's shards, so the shards play never owns them)
are granted the way the shards role grants (one GRANT per database).

MariaDB checks read_only before some privileges (CREATE TABLE on a read-only
node fails with 1290 whatever the user may do), so the privilege checks run on
pair001's writable master: the node the shards play made writable, else side a
made writable here (and read-only again afterwards); the other node is the
read-only standby."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pymysql
import pytest

from tests.e2e.conftest import Fleet
from tests.e2e.test_site import mysql

pytestmark = pytest.mark.e2e

ACCESS_DENIED = {1044, 1045, 1142, 1143, 1227}  # db / login / table / column / privilege denied
READ_ONLY = 1290  # --read-only: the privilege check passed, read_only refused the write
APP_PRIVS = "SELECT, INSERT, UPDATE, DELETE"


SHARDS = ("db65000", "db65001")


@pytest.fixture(scope="module")
def shards(fleet: Fleet) -> Iterator[tuple[str, str]]:
    """Two shard databases on pair001 with per-database grants; yields (master, standby)."""
    a, b = [n for n in fleet.group("mysql") if fleet.hosts[n]["shardfleet_pair"] == "pair001"]
    with mysql(fleet, b) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.read_only AS ro")
        b_writable = cur.fetchone()["ro"] == 0
    master, standby = (b, a) if b_writable else (a, b)
    with mysql(fleet, master) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.read_only AS ro")
        made_writable = cur.fetchone()["ro"] == 1
        if made_writable:
            cur.execute("SET GLOBAL read_only = OFF")
        for db in SHARDS:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
            cur.execute(f"CREATE TABLE IF NOT EXISTS {db}.e2e_rows (id BIGINT AUTO_INCREMENT"
                        " PRIMARY KEY, data JSON NOT NULL)")
            cur.execute(f"INSERT INTO {db}.e2e_rows (data) VALUES ('{{\"secret\": 1}}')")
            cur.execute(f"GRANT {APP_PRIVS} ON {db}.* TO 'shardfleet_app'@'%'")
    deadline = time.monotonic() + 30
    while True:  # the grants and rows replicate to the standby
        with mysql(fleet, standby) as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) AS n FROM mysql.db WHERE User = 'shardfleet_app'"
                        " AND Db IN %s", (SHARDS,))
            if cur.fetchone()["n"] >= 2:
                break
        assert time.monotonic() < deadline, "shard grants never replicated to the standby"
        time.sleep(0.5)
    try:
        yield master, standby
    finally:
        with mysql(fleet, master) as conn, conn.cursor() as cur:
            for db in SHARDS:
                cur.execute(f"DROP DATABASE IF EXISTS {db}")
                try:  # DROP DATABASE keeps grants; these would outlive the test
                    cur.execute(f"REVOKE {APP_PRIVS} ON {db}.* FROM 'shardfleet_app'@'%'")
                except pymysql.MySQLError:
                    pass
            if made_writable:
                cur.execute("SET GLOBAL read_only = ON")


def denied(conn: pymysql.connections.Connection, sql: str) -> int:
    """Run *sql*, expecting an error; return its MySQL error code."""
    with conn.cursor() as cur:
        try:
            cur.execute(sql)
        except pymysql.MySQLError as exc:
            return int(exc.args[0])
    raise AssertionError(f"{sql!r} succeeded")


@pytest.mark.parametrize("sql", [
    "CREATE TABLE db65000.evil (id INT)",
    "CREATE DATABASE db65099",
    "DROP TABLE db65000.e2e_rows",
    "DROP DATABASE db65000",
    "ALTER TABLE db65000.e2e_rows ADD COLUMN evil INT",
    "SELECT * FROM mysql.user",
    "SELECT * FROM mysql.db",
    "GRANT SELECT ON db65000.* TO 'shardfleet_repl'@'%'",
    "SET GLOBAL read_only = OFF",
])
def test_app_user_cannot(fleet: Fleet, shards: tuple[str, str], sql: str) -> None:
    master, standby = shards
    with mysql(fleet, master, "app") as conn:
        code = denied(conn, sql)
        assert code in ACCESS_DENIED, \
            f"app user on the writable {master}: {sql!r} failed with {code}, not access denied"
    with mysql(fleet, standby, "app") as conn:
        code = denied(conn, sql)
        assert code in ACCESS_DENIED | {READ_ONLY}, \
            f"app user on {standby}: {sql!r} failed with {code}"


def test_app_user_writes_its_shards_on_the_master_only(
        fleet: Fleet, shards: tuple[str, str]) -> None:
    master, standby = shards
    with mysql(fleet, master, "app") as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO db65000.e2e_rows (data) VALUES ('{}')")
        cur.execute("UPDATE db65000.e2e_rows SET data = '{\"v\": 2}' WHERE id = %s",
                    (cur.lastrowid,))
        cur.execute("SELECT COUNT(*) AS n FROM db65000.e2e_rows")
        assert cur.fetchone()["n"] >= 2
    with mysql(fleet, standby, "app") as conn, conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) AS n FROM db65000.e2e_rows")  # reads work on the standby
        # INSERT is granted, so the refusal must come from read_only, not privileges.
        code = denied(conn, "INSERT INTO db65000.e2e_rows (data) VALUES ('{}')")
        assert code == READ_ONLY, \
            f"INSERT on the read-only standby failed with {code}, expected {READ_ONLY}"


def test_one_shard_can_be_revoked_alone(fleet: Fleet, shards: tuple[str, str]) -> None:
    a, _ = shards
    with mysql(fleet, a) as conn, conn.cursor() as cur:
        cur.execute(f"REVOKE {APP_PRIVS} ON db65001.* FROM 'shardfleet_app'@'%'")
    try:
        with mysql(fleet, a, "app") as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) AS n FROM db65000.e2e_rows")  # still open
            assert denied(conn, "SELECT * FROM db65001.e2e_rows") in ACCESS_DENIED
    finally:
        with mysql(fleet, a) as conn, conn.cursor() as cur:
            cur.execute(f"GRANT {APP_PRIVS} ON db65001.* TO 'shardfleet_app'@'%'")


def test_app_user_has_no_global_or_wildcard_grant(fleet: Fleet, shards: tuple[str, str]) -> None:
    with mysql(fleet, shards[0]) as conn, conn.cursor() as cur:
        cur.execute("SHOW GRANTS FOR 'shardfleet_app'@'%'")
        grants = [next(iter(r.values())) for r in cur.fetchall()]
    assert grants[0].startswith("GRANT USAGE ON *.* TO"), grants
    per_shard = re.compile(rf"^GRANT {APP_PRIVS} ON `db\d{{5}}`\.\* TO `shardfleet_app`@`%`$")
    odd = [g for g in grants[1:] if not per_shard.match(g)]
    assert not odd, f"app user grants that are not one shard database each: {odd[:5]}"
    assert {f"`{db}`" for db in SHARDS} <= {g.split(" ON ")[1].split(".")[0] for g in grants[1:]}


def test_replication_user_cannot_read_shard_data(fleet: Fleet, shards: tuple[str, str]) -> None:
    master, _ = shards
    for node in shards:
        # On the read-only standby, read_only may answer a DDL before the privilege check.
        ddl_refusals = ACCESS_DENIED if node == master else ACCESS_DENIED | {READ_ONLY}
        with mysql(fleet, node, "repl") as conn:
            assert denied(conn, "SELECT * FROM db65000.e2e_rows") in ACCESS_DENIED
            assert denied(conn, "SELECT * FROM mysql.user") in ACCESS_DENIED
            assert denied(conn, "CREATE DATABASE db65098") in ddl_refusals
            with conn.cursor() as cur:
                cur.execute("SHOW DATABASES")
                visible = {next(iter(r.values())) for r in cur.fetchall()}
            assert not {*SHARDS, "mysql"} & visible, visible
            shard_dbs = [d for d in visible if re.fullmatch(r"db\d{5}", d)]
            assert not shard_dbs, f"the replication user sees shard databases {shard_dbs[:5]}"


def test_replication_user_has_only_replication_privileges(
        fleet: Fleet, shards: tuple[str, str]) -> None:
    with mysql(fleet, shards[0]) as conn, conn.cursor() as cur:
        cur.execute("SHOW GRANTS FOR 'shardfleet_repl'@'%'")
        grants = [next(iter(r.values())) for r in cur.fetchall()]
    # MariaDB shows REPLICATION CLIENT by its 10.5+ name, BINLOG MONITOR.
    assert len(grants) == 1 and grants[0].startswith(
        "GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO `shardfleet_repl`@`%`"), grants


def test_every_server_refuses_a_plaintext_client_and_takes_tls(fleet: Fleet) -> None:
    """TLS is on in the fleet (inventories/local): each server refuses a plaintext TCP login
    with the right password (require_secure_transport: error 1045, as for a wrong one),
    takes the same login over TLS verified against the fleet's CA (chain and the
    server's address as an IP SAN), and refuses a client that trusts another CA."""
    import ssl

    for host in fleet.group("mysql"):
        password = fleet.secrets["vault_mysql_app_password"]
        with pytest.raises(pymysql.MySQLError) as refused:
            pymysql.connect(host=fleet.ip(host), port=3306, user="shardfleet_app",
                            password=password, connect_timeout=5, ssl_disabled=True)
        assert refused.value.args[0] == 1045, (host, refused.value)
        with mysql(fleet, host, "app") as conn, conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            assert cur.fetchone()["Value"].startswith("TLS"), host
        with pytest.raises(pymysql.MySQLError, match="CERTIFICATE_VERIFY_FAILED"):
            pymysql.connect(host=fleet.ip(host), port=3306, user="shardfleet_app",
                            password=password, connect_timeout=5,
                            ssl=ssl.create_default_context())  # the system's CAs only


def test_every_replication_channel_runs_over_verified_tls(fleet: Fleet) -> None:
    """Each node's channel from its peer (the mysql role's) uses TLS with the peer's
    certificate verified, and runs: the peer's require_secure_transport would refuse it
    otherwise."""
    for host in fleet.group("mysql"):
        with mysql(fleet, host) as conn, conn.cursor() as cur:
            cur.execute("SHOW ALL SLAVES STATUS")
            channels = cur.fetchall()
        assert channels, f"{host} has no replication channel"
        for ch in channels:
            assert ch["Master_SSL_Allowed"] == "Yes", (host, ch["Connection_name"])
            assert ch["Master_SSL_Verify_Server_Cert"] == "Yes", (host, ch["Connection_name"])
            assert ch["Master_SSL_CA_File"] == "/etc/mysql/tls/ca.pem", host
            assert ch["Slave_IO_Running"] == "Yes", (host, ch["Last_IO_Error"])
