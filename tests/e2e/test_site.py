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

from tests.e2e.conftest import E2E_REDIS_TLS, E2E_TLS, Fleet, Run

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


# On the converged fast path a host runs the first play's observation and, in each of its
# plays, the stamp check (decided on the control node) and its skipped follow-ups; the
# play's one line about the fast path runs once. The shards play's map read (its include,
# argument check and read) runs once for the play, on its first MariaDB host.
FAST_TASK = re.compile(r"^(Observe the host|Compare the host's stamp|Say which hosts the fast"
                       r"|Remember a play run in full|End the play for a host converged)")


def tasks_by_host(output: str) -> dict[str, dict[str, str]]:
    """host -> {task name: its last state (ok, changed, skipping, failed)} of a run."""
    out: dict[str, dict[str, str]] = {}
    task = ""
    for line in output.splitlines():
        m = re.match(r"^TASK \[(.+?)\] \*+$", line)
        if m:
            task = m.group(1)
            continue
        m = re.match(r"^(ok|changed|skipping|fatal): \[([^\]\s]+)", line)
        if m and task:
            out.setdefault(m.group(2), {})[task] = m.group(1)
    return out


def slow_hosts(fleet: Fleet, run: Run) -> dict[str, list[str]]:
    """The fleet hosts that ran a task beyond the fast path's, with those tasks (the shards
    map read allowed on one MariaDB host)."""
    ran = tasks_by_host(run.output)
    out = {h: sorted(t for t, state in ran.get(h, {}).items()
                     if state != "skipping" and not FAST_TASK.match(t))
           for h in fleet.hosts}
    readers = [h for h, ts in out.items()
               if ts and all(t.startswith("shardfleet.fleet.shards : ") for t in ts)]
    for h in readers[:1]:
        out[h] = []
    return {h: ts for h, ts in out.items() if ts}


def fast_path_lines(output: str) -> list[str]:
    """Each play's line about the fast path (the yaml callback folds it: unfolded)."""
    return [re.sub(r"\s+", " ", m) for m in re.findall(
        r"^TASK \[Say which hosts the fast path ends \(\w+\)\] \*+\n.*?\n\s+msg: '(.*?)'"
        r"\n(?=\n|\S)",
        output, re.M | re.S)]


def _skip_if_narrowed() -> None:
    if os.environ.get("SHARDFLEET_E2E_SKIP_TAGS"):
        pytest.skip("SHARDFLEET_E2E_SKIP_TAGS narrows the runs: no host is stamped converged")


def test_converged_rerun_takes_the_fast_path(fleet: Fleet) -> None:
    """The first rerun after the fresh run: every play of every host converged, the
    shards play too (its stamp names the map the fresh run registered)."""
    _skip_if_narrowed()
    run = fleet.runs["site-rerun-fast"]
    assert run.rc == 0, f"site.yml fast rerun failed:\n{run.output[-4000:]}"
    changed = {h: c["changed"] for h, c in run.recap().items() if c["changed"]}
    assert not changed, changed
    assert not slow_hosts(fleet, run), f"hosts off the fast path: {slow_hosts(fleet, run)}"
    lines = fast_path_lines(run.output)
    assert len(lines) == 8 and all(x.endswith("full path on no host") for x in lines), lines


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
    ran = tasks_by_host(fleet.runs["site-rerun-vvv"].output)
    for task, groups in PACKAGE_TASKS.items():
        states = {h: tasks[task] for h, tasks in ran.items() if task in tasks}
        assert states, f"the rerun has no task {task!r}"
        skipped = {h for h, state in states.items() if state == "skipping"}
        assert skipped == {h for g in groups for h in fleet.group(g)}, (
            f"{task}: on the converged rerun apt ran on "
            f"{sorted(set(states) - skipped)}, skipped on {sorted(skipped)}")


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


# -- drift: one plain rerun repairs it, on that host only, and the next rerun is fast ------

def _exec(host: str, script: str) -> str:
    p = subprocess.run(["podman", "exec", host, "sh", "-euc", script], capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 0, f"{host}: {script}\n{p.stdout}{p.stderr}"
    return p.stdout


# The rerun reinstalls a removed package with apt, and the tests reach no network: the
# package is first rebuilt from its installed files into a local repository, the only
# source the container's apt then has (put back after the test).
LOCAL_REPO = r"""
P=mariadb-backup; R=/var/local/sf-drift-repo; D=$R/build
rm -rf $R; mkdir -p $D/DEBIAN; chmod -R g-s $R; chmod 0755 $D/DEBIAN
F='Package: ${Package}\nVersion: ${Version}\nArchitecture: ${Architecture}\n'
F="$F"'Maintainer: ${Maintainer}\nDepends: ${Depends}\nDescription: ${binary:Summary}\n'
dpkg-query -W -f="$F" $P > $D/DEBIAN/control
dpkg -L $P | while read -r f; do if [ ! -d "$f" ]; then echo "${f#/}"; fi; done > $R/files
tar -C / -cf - -T $R/files | tar -C $D -xf -
dpkg-deb -b $D $R/$P.deb >/dev/null
{ cat $D/DEBIAN/control; echo "Filename: ./$P.deb"; echo "Size: $(stat -c %s $R/$P.deb)";
  echo "SHA256: $(sha256sum $R/$P.deb | cut -d' ' -f1)"; echo; } > $R/Packages
mkdir -p /etc/apt/sf-drift-saved
mv /etc/apt/sources.list /etc/apt/sf-drift-saved/ 2>/dev/null || true
echo "deb [trusted=yes] file:$R ./" > /etc/apt/sources.list.d/sf-drift.list
dpkg -r $P >/dev/null
"""
RESTORE_SOURCES = r"""
rm -f /etc/apt/sources.list.d/sf-drift.list
S=/etc/apt/sf-drift-saved/sources.list
if [ -f $S ]; then mv $S /etc/apt/; fi
rm -rf /var/local/sf-drift-repo /etc/apt/sf-drift-saved
"""


def _admin(fleet: Fleet, host: str, sql: str) -> list[dict]:
    with mysql(fleet, host) as conn, conn.cursor() as cur:
        cur.execute("SET SESSION sql_log_bin = 0")
        cur.execute(sql)
        return list(cur.fetchall())


def _changed(run: Run, fleet: Fleet) -> set[str]:
    return {h for h, c in run.recap().items() if c["changed"] and h in fleet.hosts}


def test_one_plain_rerun_repairs_each_drift_on_its_host_only(fleet: Fleet) -> None:
    """Each drift on a host of its own (the issue's matrix): a package removed, a replica
    stopped, a writable standby, a managed user dropped, a managed file edited, a service
    stopped and disabled with its port free. One plain rerun repairs each, changing those
    hosts only (the others take the fast path), and the next rerun is fast everywhere."""
    _skip_if_narrowed()
    pair = {p: [h for h in fleet.group("mysql") if fleet.hosts[h]["shardfleet_pair"] == p]
            for p in ("pair001", "pair002")}
    pkg_host, replica_host = pair["pair001"]
    ro = {h: _admin(fleet, h, "SELECT @@GLOBAL.read_only AS r")[0]["r"] for h in pair["pair002"]}
    standby = next(h for h, r in ro.items() if r)
    master = next(h for h, r in ro.items() if not r)
    memcached = fleet.group("memcached")[0]
    exporter_host = fleet.group("zookeeper")[1]
    try:
        _exec(pkg_host, LOCAL_REPO)
        _admin(fleet, replica_host, "STOP SLAVE")
        _admin(fleet, standby, "SET GLOBAL read_only = 0")
        _admin(fleet, master, "DROP USER 'shardfleet_monitor'@'%'")
        _exec(memcached, "sed -i 's/^-c .*/-c 7/' /etc/memcached.conf")
        _exec(exporter_host, "systemctl disable --now prometheus-node-exporter")
        drifted = {pkg_host, replica_host, standby, master, memcached, exporter_host}

        run = fleet.playbook("site.yml")
        assert run.rc == 0, f"site.yml failed:\n{run.output[-4000:]}"
    finally:
        _exec(pkg_host, RESTORE_SOURCES)
    assert _changed(run, fleet) == drifted, (
        f"changed {sorted(_changed(run, fleet))}, drifted {sorted(drifted)}")
    slow = slow_hosts(fleet, run)
    assert set(slow) <= drifted, f"hosts without drift left the fast path: {slow}"
    said = " ".join(fast_path_lines(run.output))
    for host in drifted:
        assert re.search(rf"{host} \(observed state differs: [^)]+\)", said), (host, said)

    # repaired, each
    assert "ii" in _exec(pkg_host, "dpkg-query -W -f='${db:Status-Abbrev}' mariadb-backup")
    st = _admin(fleet, replica_host, "SHOW SLAVE STATUS")[0]
    assert (st["Slave_IO_Running"], st["Slave_SQL_Running"]) != ("No", "No"), st
    assert _admin(fleet, standby, "SELECT @@GLOBAL.read_only AS r")[0]["r"] == 1
    assert _admin(fleet, master, "SELECT COUNT(*) AS n FROM mysql.user "
                                 "WHERE User = 'shardfleet_monitor'")[0]["n"] == 1
    assert "-c 1024" in _exec(memcached, "cat /etc/memcached.conf")
    assert _exec(exporter_host, "systemctl is-active prometheus-node-exporter; "
                                "systemctl is-enabled prometheus-node-exporter").split() == [
        "active", "enabled"]

    again = fleet.playbook("site.yml")
    assert again.rc == 0, f"site.yml failed:\n{again.output[-4000:]}"
    assert not _changed(again, fleet), again.recap()
    assert not slow_hosts(fleet, again), f"off the fast path: {slow_hosts(fleet, again)}"


def test_a_rotated_secret_and_a_changed_variable_are_applied_by_a_plain_rerun(
        fleet: Fleet) -> None:
    """A password rotated with -e (Redis's) and an inventory variable changed for one host
    (Prometheus's retention on the monitoring host): one plain rerun applies both, changing
    only the hosts that use them, and the same rerun again is fast. The rotated password
    stays (no later test reads Redis)."""
    _skip_if_narrowed()
    redis_host, monitor = fleet.group("redis")[0], fleet.group("monitoring")[0]
    host_vars = fleet.inventory / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / f"{monitor}.yml").write_text("monitoring_retention: 16d\n")
    import redis

    rotated = "rotated-" + fleet.secrets["vault_redis_password"][::-1]
    secret_vars = fleet.inventory.parent / "rotated.yml"  # an -e file: no command line holds it
    secret_vars.write_text(f"redis_password: {rotated}\n")
    args = ("-e", f"@{secret_vars}")

    run = fleet.playbook("site.yml", *args)
    assert run.rc == 0, f"site.yml failed:\n{run.output[-4000:]}"
    assert _changed(run, fleet) == {redis_host, monitor}, run.recap()
    assert rotated not in run.output, "the rotated password was printed"
    r = redis.Redis(host=fleet.ip(redis_host), port=6379, password=rotated,
                    socket_timeout=10, **E2E_REDIS_TLS)
    assert r.ping() is True
    assert "16d" in _exec(monitor, "cat /etc/default/prometheus")

    again = fleet.playbook("site.yml", *args)
    assert again.rc == 0, f"site.yml failed:\n{again.output[-4000:]}"
    assert not _changed(again, fleet), again.recap()
    assert not slow_hosts(fleet, again), f"off the fast path: {slow_hosts(fleet, again)}"
