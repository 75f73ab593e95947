"""Client TLS against a real MariaDB that requires it (``--require-secure-transport=ON``):
a throwaway CA made with openssl signs a server certificate naming 127.0.0.1 (an IP SAN),
a second one naming another host, and a client certificate. The library, the Router (a
write and a read through Store), a module (through ansible-playbook) and the CLI connect
with ``ca_cert``; a plaintext connection, a wrong CA, a wrong name and an X509 account
without a client certificate are refused.

MariaDB 10.11 answers a plaintext login under ``require_secure_transport`` with error 1045
(Access denied ... using password: YES), as for a wrong password: each refusal here is
next to the same credential accepted over TLS."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pymysql
import pytest

from shardfleet import provision, replication, topology
from shardfleet.errors import DatabaseError
from shardfleet.router import Router
from shardfleet.schema import default_schema
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer
from shardfleet.tls import TLS

from .certs import X509_USER
from .test_modules import run_module

APP_USER = "sf_tls_app"
APP_PASSWORD = "sf-tls-app-test"
X509_PASSWORD = "sf-x509-test"
SHARDS = list(range(0, 4))
REFUSED = "Access denied"  # plaintext under require_secure_transport (module docstring)


def _tls_server(base: Path, certs: Path, cert: str, server_id: int = 1) -> MariaDBServer:
    return MariaDBServer(base, server_id=server_id, extra=[
        "--innodb-file-per-table=0", f"--ssl-ca={certs / 'ca.pem'}",
        f"--ssl-cert={certs / f'{cert}.pem'}", f"--ssl-key={certs / f'{cert}.key'}",
        "--require-secure-transport=ON"]).start()


def _admin(server: MariaDBServer) -> pymysql.connections.Connection:
    """root over the unix socket (local: no TLS needed, whatever the library does)."""
    return pymysql.connect(unix_socket=str(server.socket), user="root", autocommit=True,
                           password=server.root_password,
                           client_flag=provision.multi_statement_flags())


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    server = _tls_server(tmp_path_factory.mktemp("mariadb-tls"), certs, "server")
    try:
        conn = _admin(server)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE USER '{APP_USER}'@'%%' IDENTIFIED BY %s", (APP_PASSWORD,))
                cur.execute(f"CREATE USER '{X509_USER}'@'%%' IDENTIFIED BY %s REQUIRE X509",
                            (X509_PASSWORD,))
            provision.ensure_shards(conn, SHARDS, default_schema(), app_user=APP_USER)
        finally:
            conn.close()
        yield server
    finally:  # a failed setup leaves no server behind
        server.stop(remove=True)


def ca(certs: Path, name: str = "ca") -> str:
    return str(certs / f"{name}.pem")


def _connections(server: MariaDBServer) -> int:
    """Connections the server accepted so far (this one over its socket included)."""
    conn = _admin(server)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW GLOBAL STATUS LIKE 'Connections'")
            return int(cur.fetchone()[1]) - 1
    finally:
        conn.close()


def _cipher(conn) -> str:
    with conn.cursor() as cur:
        cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        row = cur.fetchone()
    return row[1] if row else ""


def test_a_plaintext_library_connection_is_refused(tls_server, certs):
    """TLS is off unless given, and a server requiring secure transport refuses that (before
    the change PyMySQL's own default, an unverified TLS attempt, connected)."""
    with pytest.raises(DatabaseError, match=REFUSED):
        topology.connect(tls_server.address, "root", tls_server.root_password)
    topology.connect(tls_server.address, "root", tls_server.root_password,
                     tls=TLS(ca_cert=ca(certs))).close()


def test_the_library_connects_with_ca_cert_and_refuses_another_ca(tls_server, certs):
    conn = topology.connect(tls_server.address, "root", tls_server.root_password,
                            tls=TLS(ca_cert=ca(certs)))
    try:
        assert _cipher(conn), "connected without TLS"
    finally:
        conn.close()
    with pytest.raises(DatabaseError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
        topology.connect(tls_server.address, "root", tls_server.root_password,
                         tls=TLS(ca_cert=ca(certs, "other")))


def test_the_router_writes_and_reads_through_store_with_ca_cert(tls_server, certs, tmp_path):
    m = ShardMap.from_ranges([{"range": [0, 3], "master": tls_server.address,
                               "standby": None, "state": "open"}], mod_shard_count=4)
    r = Router(shard_map=m, user=APP_USER, password=APP_PASSWORD, tls=TLS(ca_cert=ca(certs)),
               connect_timeout=10)
    s = Store(r)
    try:
        oid = s.create("pin", {"tls": "yes"})
        assert s.get(oid)["tls"] == "yes"
        # the pool keeps its TLS connections (an idle one is not taken for closed)
        before = _connections(tls_server)
        for _ in range(5):
            assert s.get(oid)["tls"] == "yes"
        assert _connections(tls_server) - before <= 1, "the pool reconnected for each read"
        with r.connection(tls_server.address) as conn:
            assert _cipher(conn), "the router's pool connected without TLS"
    finally:
        s.close()
        r.close()
    plain = Router(shard_map=m, user=APP_USER, password=APP_PASSWORD, connect_timeout=10)
    s = Store(plain)
    try:
        with pytest.raises(Exception, match=REFUSED):
            s.get(oid)
    finally:
        s.close()
        plain.close()


def test_a_module_connects_with_ca_cert(tls_server, certs, tmp_path):
    login = {"login_host": "127.0.0.1", "login_port": tls_server.port, "login_user": "root",
             "login_password": tls_server.root_password}
    args = {**login, "range": [40, 41], "app_user": APP_USER}
    res, out = run_module(tmp_path, "shard_databases", args)
    assert res.get("failed") and REFUSED in res["msg"], res
    res, out = run_module(tmp_path, "shard_databases", {**args, "ca_cert": ca(certs)})
    assert not res.get("failed") and res["databases_created"] == 2, res
    assert tls_server.root_password not in out
    conn = _admin(tls_server)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM information_schema.SCHEMATA "
                        "WHERE SCHEMA_NAME IN ('db00040', 'db00041')")
            assert cur.fetchone()[0] == 2
    finally:
        conn.close()


def test_check_hostname_refuses_a_certificate_naming_another_host(tmp_path_factory, certs):
    server = _tls_server(tmp_path_factory.mktemp("mariadb-wrongname"), certs, "wrongname")
    try:
        for tls in (TLS(ca_cert=ca(certs)), TLS(ca_cert=ca(certs), check_hostname=True)):
            with pytest.raises(DatabaseError, match="mismatch|doesn't match|not valid for"):
                topology.connect(server.address, "root", server.root_password, tls=tls)
        # the name unchecked, the chain still is
        conn = topology.connect(server.address, "root", server.root_password,
                                tls=TLS(ca_cert=ca(certs), check_hostname=False))
        assert _cipher(conn)
        conn.close()
    finally:
        server.stop(remove=True)


def test_an_x509_account_needs_the_client_certificate(tls_server, certs):
    with pytest.raises(DatabaseError, match="wrong credentials|Access denied"):
        topology.connect(tls_server.address, X509_USER, X509_PASSWORD,
                         tls=TLS(ca_cert=ca(certs)))
    conn = topology.connect(tls_server.address, X509_USER, X509_PASSWORD,
                            tls=TLS(ca_cert=ca(certs), client_cert=str(certs / "client.pem"),
                                    client_key=str(certs / "client.key")))
    try:
        assert topology.scalar(conn, "SELECT CURRENT_USER()").startswith(X509_USER + "@")
    finally:
        conn.close()


def test_the_cli_status_connects_with_ca_cert(tls_server, certs, zookeeper):
    """``shardfleet status`` reaches the map's server with --ca-cert (or its environment
    variable), not without; a missing certificate file is a usage error (exit 2)."""
    import json
    import os
    import uuid

    from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore

    cluster = "tls" + uuid.uuid4().hex[:8]
    zk = ZooKeeperMapStore(zookeeper.address, cluster)
    zk.write(ShardMap.from_ranges([{"range": [0, 3], "master": tls_server.address,
                                    "standby": None, "state": "open"}], mod_shard_count=4),
             NO_NODE)
    zk.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDFLEET_MYSQL_")}
    env["SHARDFLEET_MYSQL_PASSWORD"] = tls_server.root_password
    cmd = [str(Path(sys.executable).parent / "shardfleet"), "status", "--zk",
           zookeeper.address, "--cluster", cluster, "--user", "root", "--json", "--no-sizes"]

    def state(*extra: str, **more: str) -> dict:
        p = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120,
                           env={**env, **more})
        assert p.returncode == 0, p.stderr
        assert tls_server.root_password not in p.stdout + p.stderr
        return json.loads(p.stdout)["servers"][tls_server.address]

    plain = state()
    assert not plain["reachable"] and REFUSED in plain["error"], plain
    assert state("--ca-cert", ca(certs))["reachable"]
    assert state(SHARDFLEET_MYSQL_CA_CERT=ca(certs))["reachable"]
    p = subprocess.run([*cmd, "--ca-cert", str(certs / "missing.pem")], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 2 and "missing.pem" in p.stderr, p.stdout + p.stderr


def test_a_channel_the_library_creates_replicates_over_verified_tls(tls_server, certs,
                                                                    tmp_path_factory):
    """replication.change_master on a server with its own CA (ssl_ca, as the mysql role
    sets with mysql_tls_enabled) makes a TLS channel, the source's certificate verified
    (chain and name): under require_secure_transport a plain channel cannot log in."""
    replica = _tls_server(tmp_path_factory.mktemp("mariadb-tls-replica"), certs, "server",
                          server_id=2)
    try:
        for server in (tls_server, replica):
            conn = _admin(server)
            with conn.cursor() as cur:
                cur.execute("SET sql_log_bin = 0")
                cur.execute("CREATE USER IF NOT EXISTS 'sf_tls_repl'@'%%' IDENTIFIED BY %s",
                            ("sf-tls-repl-test",))
                cur.execute("GRANT REPLICATION SLAVE ON *.* TO 'sf_tls_repl'@'%'")
            conn.close()
        conn = _admin(replica)
        try:
            with conn.cursor() as cur:
                cur.execute("SET GLOBAL gtid_slave_pos = %s",
                            (topology.scalar(_admin(tls_server),
                                             "SELECT @@GLOBAL.gtid_binlog_pos"),))
            replication.change_master(conn, "127.0.0.1", tls_server.port, "sf_tls_repl",
                                      "sf-tls-repl-test", name="tls_test")
            with conn.cursor() as cur:
                cur.execute("START SLAVE 'tls_test'")
            src = _admin(tls_server)
            with src.cursor() as cur:
                cur.execute("CREATE DATABASE sf_tls_replicated")
            src.close()
            deadline = time.monotonic() + 60
            while True:
                ch = topology.dict_rows(conn, "SHOW SLAVE 'tls_test' STATUS")[0]
                seen = topology.scalar(conn, "SELECT COUNT(*) FROM information_schema.SCHEMATA"
                                             " WHERE SCHEMA_NAME = 'sf_tls_replicated'")
                if seen:
                    break
                assert time.monotonic() < deadline, f"not replicated: {ch['Last_IO_Error']}"
                time.sleep(0.2)
            assert ch["Master_SSL_Allowed"] == "Yes", ch
            assert ch["Master_SSL_CA_File"] == ca(certs), ch
            assert ch["Master_SSL_Verify_Server_Cert"] == "Yes", ch
            assert replication.server_tls_ca(conn) == ca(certs)
        finally:
            conn.close()
    finally:
        replica.stop(remove=True)
        conn = _admin(tls_server)
        with conn.cursor() as cur:
            cur.execute("DROP DATABASE IF EXISTS sf_tls_replicated")
        conn.close()


def test_a_server_without_tls_gets_a_plain_channel(mariadb_pair):
    """No ssl_ca on the server: no TLS in its CHANGE MASTER (the fleet without TLS)."""
    conn = _admin(mariadb_pair[0])
    try:
        assert replication.server_tls_ca(conn) == ""
        assert "MASTER_SSL" not in replication.change_master_sql("x", tls=False)
    finally:
        conn.close()
