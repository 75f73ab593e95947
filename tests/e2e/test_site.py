"""site.yml on fresh containers: it converges, a rerun changes nothing, the fleet
works (replication both ways, ZooKeeper ensemble, caches), and its -vvv output
holds none of the passwords."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import pymysql
import pytest

from tests.e2e.conftest import E2E_REDIS_TLS, E2E_TLS, Fleet

pytestmark = pytest.mark.e2e


def mysql(fleet: Fleet, host: str, user: str = "admin") -> pymysql.connections.Connection:
    names = {"admin": "shardfleet_admin", "app": "shardfleet_app", "repl": "shardfleet_repl"}
    secret = {"admin": "vault_mysql_admin_password", "app": "vault_mysql_app_password",
              "repl": "vault_mysql_replication_password"}[user]
    return pymysql.connect(host=fleet.ip(host), port=3306, user=names[user],
                           password=fleet.secrets[secret], connect_timeout=5,
                           autocommit=True, cursorclass=pymysql.cursors.DictCursor,
                           **E2E_TLS.pymysql_kwargs())


def four_letter(host: str, word: bytes) -> str:
    with socket.create_connection((host, 2181), timeout=5) as sock:
        sock.sendall(word)
        data = b""
        for _ in range(20):  # bounded
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.decode()


def test_fresh_site_converges(fleet: Fleet) -> None:
    run = fleet.runs["site-fresh"]
    assert run.rc == 0, f"site.yml failed on fresh containers:\n{run.output[-4000:]}"
    recap = run.recap()
    # and the control node, which makes the fleet's CA (TLS on: tls-ca.yml)
    assert set(recap) == {*fleet.hosts, "localhost"}, f"recap hosts {sorted(recap)} != inventory"
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in recap.values()), recap


def test_rerun_changes_nothing(fleet: Fleet) -> None:
    run = fleet.runs["site-rerun-vvv"]
    assert run.rc == 0, f"site.yml rerun failed:\n{run.output[-4000:]}"
    changed = {h: c["changed"] for h, c in run.recap().items() if c["changed"]}
    assert not changed, f"site.yml rerun is not idempotent: changed per host {changed}"


# On the converged fast path a host runs its plays' stamp checks and nothing else. With
# the local fleet's keeper a play's check runs once (under the play's first host), as do
# the shards play's map read (its include, argument check and read) and the library's
# check: one MariaDB host runs those seven, every other host at most the checks of the
# plays it is first in.
FAST_PATH_TASKS = {"mysql": 7, "zookeeper": 2, "redis": 2, "memcached": 2, "monitoring": 2}


def _skip_if_narrowed() -> None:
    if os.environ.get("SHARDFLEET_E2E_SKIP_TAGS"):
        pytest.skip("SHARDFLEET_E2E_SKIP_TAGS narrows the runs: no host is stamped converged")


def test_converged_rerun_takes_the_fast_path(fleet: Fleet) -> None:
    """The first rerun after the fresh run: every play of every host converged, the
    shards play too (its stamp names the map the fresh run registered)."""
    _skip_if_narrowed()
    run = fleet.runs["site-rerun-fast"]
    assert run.rc == 0, f"site.yml fast rerun failed:\n{run.output[-4000:]}"
    recap = run.recap()
    for host, vals in fleet.hosts.items():
        # a host that ran no task at all (its plays checked on the keeper) has no recap line
        c = recap.get(host, {"ok": 0, "changed": 0, "skipped": 0})
        assert c["changed"] == 0, (host, c)
        assert c["ok"] + c["skipped"] <= FAST_PATH_TASKS[vals["group"]], (
            f"{host} ran {c['ok']} tasks and skipped {c['skipped']} on a converged fleet: "
            f"not the fast path ({FAST_PATH_TASKS[vals['group']]} at most)")
    busy = sorted(h for h in fleet.group("mysql")
                  if sum(recap.get(h, {}).get(k, 0) for k in ("ok", "skipped")))
    assert len(busy) <= 1, f"MariaDB hosts beyond the plays' first ran tasks: {busy}"


def test_a_stopped_service_sends_its_host_down_the_full_path(fleet: Fleet) -> None:
    _skip_if_narrowed()
    host = fleet.group("memcached")[0]
    subprocess.run(["podman", "exec", host, "systemctl", "stop", "memcached"], check=True,
                   timeout=60)
    run = fleet.playbook("site.yml")
    assert run.rc == 0, f"site.yml failed:\n{run.output[-4000:]}"
    recap = run.recap()
    assert recap[host]["changed"] >= 1 and recap[host]["ok"] > 10, (
        f"{host}, its memcached stopped, took the fast path: {recap[host]}")
    active = subprocess.run(["podman", "exec", host, "systemctl", "is-active", "memcached"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert active.stdout.strip() == "active", active.stdout + active.stderr
    others = {h: c for h, c in recap.items() if h in fleet.hosts and h != host
              and c["ok"] + c["skipped"] > FAST_PATH_TASKS[fleet.hosts[h]["group"]]}
    assert not others, f"converged hosts left the fast path: {others}"


# The package installs of every role: on a converged host dpkg-query finds every package
# and apt (which opens its whole cache, seconds a host under load) is skipped.
# task -> the groups whose hosts run it (the library also goes to the monitoring host,
# for the shardfleet exporter)
PACKAGE_TASKS = {
    "shardfleet.fleet.mysql : Install MariaDB and PyMySQL": ("mysql",),
    "shardfleet.fleet.zookeeper : Install ZooKeeper and kazoo": ("zookeeper",),
    "shardfleet.fleet.redis : Install Redis": ("redis",),
    "shardfleet.fleet.memcached : Install memcached": ("memcached",),
    "shardfleet.fleet.shards : Install the library's Debian dependencies": ("mysql", "monitoring"),
    "shardfleet.fleet.monitoring : Install the packages": (
        "mysql", "zookeeper", "redis", "memcached", "monitoring"),
}


def test_rerun_skips_every_package_install(fleet: Fleet) -> None:
    out = fleet.runs["site-rerun-vvv"].output
    task_re = re.compile(r"^TASK \[(.+?)\] \*+\n(.*?)(?=^TASK \[|^PLAY RECAP)", re.M | re.S)
    sections: dict[str, str] = {}  # a task of several plays: all its sections
    for m in task_re.finditer(out):
        sections[m.group(1)] = sections.get(m.group(1), "") + m.group(2)
    for task, groups in PACKAGE_TASKS.items():
        assert task in sections, f"the rerun has no task {task!r}"
        ran = re.findall(r"^(ok|changed|skipping|fatal): \[([^\]]+)\]", sections[task], re.M)
        skipped = {h for state, h in ran if state == "skipping"}
        assert skipped == {h for g in groups for h in fleet.group(g)}, (
            f"{task}: on the converged rerun apt ran on "
            f"{sorted({h for s, h in ran if s != 'skipping'})}, skipped on {sorted(skipped)}")


def test_vvv_output_has_no_password(fleet: Fleet) -> None:
    out = fleet.runs["site-rerun-vvv"].output
    assert len(out) > 10_000, "the -vvv run produced suspiciously little output"
    leaked = [name for name, value in fleet.secrets.items() if value in out]
    assert not leaked, f"ansible-playbook -vvv site.yml printed the values of {leaked}"


def test_rows_replicate_both_ways_in_every_pair(fleet: Fleet) -> None:
    nodes = fleet.group("mysql")
    pairs: dict[str, list[str]] = {}
    for n in nodes:
        pairs.setdefault(fleet.hosts[n]["shardfleet_pair"], []).append(n)
    for pair, (a, b) in sorted(pairs.items()):
        with mysql(fleet, a) as conn, conn.cursor() as cur:
            cur.execute("CREATE DATABASE IF NOT EXISTS e2e_repl")
            cur.execute("CREATE TABLE IF NOT EXISTS e2e_repl.t (id INT AUTO_INCREMENT PRIMARY KEY,"
                        " origin VARCHAR(64) NOT NULL)")
        for writer in (a, b):
            deadline = time.monotonic() + 30
            while True:  # the table reaches b asynchronously
                try:
                    with mysql(fleet, writer) as conn, conn.cursor() as cur:
                        # The admin user writes despite read_only (READ_ONLY ADMIN).
                        cur.execute("INSERT INTO e2e_repl.t (origin) VALUES (%s)", (writer,))
                    break
                except pymysql.err.ProgrammingError:
                    assert time.monotonic() < deadline, f"{pair}: table never reached {writer}"
                    time.sleep(0.5)
        for reader, writer in ((a, b), (b, a)):
            deadline = time.monotonic() + 30
            while True:
                with mysql(fleet, reader) as conn, conn.cursor() as cur:
                    cur.execute("SELECT COUNT(*) AS n FROM e2e_repl.t WHERE origin = %s", (writer,))
                    if cur.fetchone()["n"] >= 1:
                        break
                assert time.monotonic() < deadline, \
                    f"{pair}: a row written on {writer} never reached {reader}"
                time.sleep(0.5)


def test_pairs_replicate_with_at_most_one_writable_node(fleet: Fleet) -> None:
    """site.yml leaves every node replicating by GTID and at most one node of a pair
    writable (the master, once the shards play ran; none before it)."""
    writable: dict[str, list[str]] = {}
    for n in fleet.group("mysql"):
        with mysql(fleet, n) as conn, conn.cursor() as cur:
            cur.execute("SELECT @@GLOBAL.read_only AS ro")
            if cur.fetchone()["ro"] == 0:
                writable.setdefault(fleet.hosts[n]["shardfleet_pair"], []).append(n)
            cur.execute("SHOW REPLICA STATUS")
            rs = cur.fetchone()
            running = bool(rs) and rs["Slave_IO_Running"] == rs["Slave_SQL_Running"] == "Yes"
            assert running, f"{n} replication is not running: {rs and rs['Last_Error']}"
            assert rs["Using_Gtid"] == "Slave_Pos", f"{n} does not replicate by GTID"
    both = {pair: nodes for pair, nodes in writable.items() if len(nodes) > 1}
    assert not both, f"both nodes of a pair are writable: {both}"


def test_zookeeper_has_one_leader_two_followers(fleet: Fleet) -> None:
    modes = []
    for n in fleet.group("zookeeper"):
        srvr = four_letter(fleet.ip(n), b"srvr")
        modes += [ln.split(":", 1)[1].strip() for ln in srvr.splitlines() if ln.startswith("Mode:")]
    assert sorted(modes) == ["follower", "follower", "leader"], modes


def test_zookeeper_four_letter_words_are_narrow(fleet: Fleet) -> None:
    n = fleet.group("zookeeper")[0]
    assert four_letter(fleet.ip(n), b"ruok") == "imok"
    assert "not in the whitelist" in four_letter(fleet.ip(n), b"dump")


def test_zookeeper_refuses_anonymous_write(fleet: Fleet) -> None:
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoAuthError

    hosts = ",".join(f"{fleet.ip(n)}:2181" for n in fleet.group("zookeeper"))
    zk = KazooClient(hosts=hosts, timeout=10)
    zk.start(timeout=20)
    try:
        assert zk.exists("/shardfleet") is not None
        with pytest.raises(NoAuthError):
            zk.create("/shardfleet/e2e-anonymous", b"x")
        with pytest.raises(NoAuthError):
            zk.set("/shardfleet", b"x")
    finally:
        zk.stop()
        zk.close()
    admin = KazooClient(hosts=hosts, timeout=10, auth_data=[
        ("digest", f"shardfleet_admin:{fleet.secrets['vault_zookeeper_admin_password']}")])
    admin.start(timeout=20)
    try:
        path = admin.create("/shardfleet/e2e-admin", b"ok", ephemeral=True)
        assert admin.get(path)[0] == b"ok"
    finally:
        admin.stop()
        admin.close()


def test_redis_requires_tls_and_the_password(fleet: Fleet) -> None:
    """Redis serves TLS only: a plaintext client gets no answer, a TLS one that trusts
    other CAs is refused, and over TLS verified against the fleet's CA (the host's
    address in its certificate) it still wants the password."""
    import ssl

    import redis

    host = fleet.ip(fleet.group("redis")[0])
    password = fleet.secrets["vault_redis_password"]
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        redis.Redis(host=host, password=password, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis(host=host, password=password, socket_timeout=5, ssl=True,
                    ssl_ca_certs=ssl.get_default_verify_paths().cafile or None,
                    ssl_check_hostname=True).ping()
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        redis.Redis(host=host, socket_timeout=5, **E2E_REDIS_TLS).set("e2e:anonymous", 1)
    r = redis.Redis(host=host, password=password, socket_timeout=5, **E2E_REDIS_TLS)
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    r.set("e2e:key", "v", ex=30)
    assert r.get("e2e:key") == b"v"


def test_memcached_answers_on_the_fleet_address(fleet: Fleet) -> None:
    from pymemcache.client.base import Client

    mc = Client((fleet.ip(fleet.group("memcached")[0]), 11211), connect_timeout=5, timeout=5)
    try:
        mc.set("e2e-key", b"v", expire=30)
        assert mc.get("e2e-key") == b"v"
    finally:
        mc.close()
