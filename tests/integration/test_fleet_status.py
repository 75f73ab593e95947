"""playbooks/fleet-status.yml on a static inventory of plain hosts (no containers, no
socket, no container addresses): a real master-master MariaDB pair and ZooKeeper on
loopback. The map is the source of truth; the table shows what each server says next to
it, and the play fails, naming the problem, where they disagree. No password reaches the
output or the profile it writes."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.shardmap import ShardMap
from shardfleet.testing import MariaDBServer, free_port, sigint_default
from shardfleet.testing.kit import make_server, pair_up, start_all, wait_pair_synced

from .conftest import make_shards

ROOT = Path(__file__).resolve().parents[2]
VAULT = {"vault_mysql_admin_password": MariaDBServer.root_password,
         "vault_mysql_app_password": "sf-app-test",
         "vault_zookeeper_admin_password": "zk-status-secret",
         "vault_redis_password": "redis-status-secret"}


@pytest.fixture(scope="module")
def status_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("status")

    def setup(a: MariaDBServer, b: MariaDBServer) -> None:
        pair_up(a, b)
        b.sql("SET GLOBAL read_only = ON")
        make_shards(a, list(range(8)))
        wait_pair_synced(a, b)

    servers = start_all([lambda: make_server(base, 71, "a"), lambda: make_server(base, 72, "b")],
                        setup)
    yield servers
    for s in servers:
        s.stop(remove=True)


@pytest.fixture
def fleet(tmp_path, zookeeper, status_pair):
    """A static inventory naming the pair and ZooKeeper by address and port, its vault
    file, and a fresh cluster whose map puts shards 0-7 on the pair."""
    a, b = status_pair
    cluster = "s" + uuid.uuid4().hex[:10]
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    store.write(ShardMap.from_ranges([
        {"range": [0, 3], "master": a.address, "standby": b.address, "state": "open"},
        {"range": [4, 7], "master": a.address, "standby": b.address, "state": "open"},
    ], mod_shard_count=8), NO_NODE)
    store.close()
    inv = tmp_path / "inventory"
    (inv / "group_vars" / "all").mkdir(parents=True)
    zk_host, zk_port = zookeeper.address.rsplit(":", 1)
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "children": {
            "mysql": {"hosts": {
                "db-a": {"shardfleet_address": "127.0.0.1", "mysql_port": a.port,
                         "shardfleet_pair": "pair001", "shardfleet_side": "a"},
                "db-b": {"shardfleet_address": "127.0.0.1", "mysql_port": b.port,
                         "shardfleet_pair": "pair001", "shardfleet_side": "b"}}},
            "zookeeper": {"hosts": {"zk-1": {"shardfleet_address": zk_host,
                                             "zookeeper_client_port": int(zk_port)}}},
        }}}))
    (inv / "group_vars" / "all" / "main.yml").write_text(yaml.safe_dump({
        "shards_cluster": cluster, "mysql_admin_user": "root",
        "mysql_admin_password": "{{ vault_mysql_admin_password }}",
        "zookeeper_admin_password": "{{ vault_zookeeper_admin_password }}",
        "shardfleet_fleet_label": "statustest"}))
    (inv / "group_vars" / "all" / "vault.yml").write_text(yaml.safe_dump(VAULT))
    return {"inventory": inv, "a": a, "b": b, "profiles": tmp_path / "profiles",
            "cluster": cluster}


def _smoke_module():
    spec = importlib.util.spec_from_file_location("fleet_smoke",
                                                  ROOT / "scripts" / "fleet-smoke.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def status(fleet, *extra: str) -> tuple[int, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    p = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i",
                        str(fleet["inventory"]), str(ROOT / "playbooks" / "fleet-status.yml"),
                        "-e", f"status_profile_dir={fleet['profiles']}", *extra],
                       capture_output=True, text=True, env=env, cwd=fleet["inventory"],
                       timeout=300)
    out = p.stdout + p.stderr
    for secret in VAULT.values():
        assert secret not in out, "a password reached fleet-status.yml's output"
    return p.returncode, out


def flat(out: str) -> str:
    return " ".join(out.split())


def test_the_table_is_the_map_with_what_each_server_says(fleet):
    a, b = fleet["a"], fleet["b"]
    rc, out = status(fleet)
    assert rc == 0, out[-4000:]
    text = flat(out)
    assert "PAIR pair001: 0-3 open, 4-7 open" in text, out[-4000:]
    assert f"master db-a {a.address} read_only=off" in text, out[-4000:]
    assert f"standby db-b {b.address} read_only=ON" in text, out[-4000:]
    # both ways, each channel with its source's inventory name and its lag by GTID
    assert f"default <- {b.address} (db-b): Yes/Yes, 0 trx behind" in text, out[-4000:]
    assert f"default <- {a.address} (db-a): Yes/Yes" in text, out[-4000:]
    assert "PROBLEMS: none" in text and "operations in flight: none" in text
    assert "=standalone" in text, out[-4000:]

    # the local fleet's profile: addresses and users, no password; passwords come from
    # the environment or the vault file it names
    prof = fleet["profiles"] / "statustest.json"
    assert stat.S_IMODE(prof.stat().st_mode) == 0o600
    raw = prof.read_text()
    assert not any(secret in raw for secret in VAULT.values()), raw
    data = json.loads(raw)
    assert data["mysql"]["pairs"] == {"pair001": {"a": "127.0.0.1", "b": "127.0.0.1"}}
    assert Path(data["secrets"]["file"]) == fleet["inventory"] / "group_vars" / "all" / "vault.yml"
    smoke = _smoke_module()
    got = smoke.passwords(data)
    assert got["mysql_admin"] == MariaDBServer.root_password and got["redis"] == VAULT[
        "vault_redis_password"]
    os.environ["SHARDFLEET_REDIS_PASSWORD"] = "from-the-environment"
    try:
        assert smoke.passwords(data)["redis"] == "from-the-environment"
    finally:
        del os.environ["SHARDFLEET_REDIS_PASSWORD"]


def test_two_writable_nodes_and_a_read_only_master_fail_loudly(fleet):
    a, b = fleet["a"], fleet["b"]
    b.sql("SET GLOBAL read_only = OFF")
    try:
        rc, out = status(fleet)
        assert rc != 0, out[-4000:]
        assert (f"CRITICAL pair001 (ranges 0-3,4-7): two writable nodes: standby "
                f"{b.address} (db-b) (per the map) is writable") in flat(out), out[-4000:]
        rc, out = status(fleet, "-e", "status_fail_on=never")
        assert rc == 0 and "two writable nodes" in flat(out), out[-4000:]
    finally:
        b.sql("SET GLOBAL read_only = ON")
    a.sql("SET GLOBAL read_only = ON")
    try:
        rc, out = status(fleet)
        assert rc != 0 and f"master {a.address} (db-a) (per the map) is read-only" in flat(out), \
            out[-4000:]
    finally:
        a.sql("SET GLOBAL read_only = OFF")


def test_every_channel_is_shown_and_a_stopped_one_is_critical(fleet):
    a, b = fleet["a"], fleet["b"]
    port = free_port()
    a.sql(f"CHANGE MASTER 'split_status' TO MASTER_HOST='127.0.0.1', MASTER_PORT={port}, "
          "MASTER_USER='nobody', MASTER_USE_GTID=slave_pos")
    try:
        rc, out = status(fleet)
        text = flat(out)
        assert rc != 0, out[-4000:]
        assert f"split_status <- 127.0.0.1:{port}: No/No" in text, out[-4000:]
        assert (f"{a.address} (db-a) channel split_status from 127.0.0.1:{port} has "
                "IO=No SQL=No") in text, out[-4000:]
    finally:
        a.sql("RESET SLAVE 'split_status' ALL")
    b.sql("STOP SLAVE")
    try:
        rc, out = status(fleet)
        assert rc != 0 and (f"{b.address} (db-b) channel default from {a.address} has "
                            "IO=No SQL=No") in flat(out), out[-4000:]
    finally:
        b.sql("START SLAVE")


def test_an_unreachable_standby_and_ranges_that_are_not_open_are_reported(fleet, zookeeper):
    a, b = fleet["a"], fleet["b"]
    cluster = yaml.safe_load((fleet["inventory"] / "group_vars" / "all" / "main.yml")
                             .read_text())["shards_cluster"]
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        v = store.read()
        gone = f"127.0.0.1:{free_port()}"
        store.write(ShardMap.from_ranges([
            {"range": [0, 3], "master": a.address, "standby": b.address, "state": "frozen"},
            {"range": [4, 7], "master": a.address, "standby": gone, "state": "open"},
        ], mod_shard_count=8), v.version)
    finally:
        store.close()
    rc, out = status(fleet)
    text = flat(out)
    assert rc != 0, out[-4000:]
    assert "0-3 frozen" in text and "range 0-3 is frozen by hand" in text, out[-4000:]
    assert f"standby {gone} (per the map) is unreachable" in text, out[-4000:]
    # 4-7's pair is not one pair of the inventory: it has no pair name
    assert "PAIR ?: 4-7 open" in text, out[-4000:]


def test_the_exporter_serves_the_fleet_and_sees_a_second_writable_node(fleet, zookeeper):
    """`shardfleet exporter` over HTTP on loopback, reading the same map and servers:
    both channels running, one writable node; then the standby made writable shows as
    two writable nodes and a critical problem once the interval has passed."""
    import threading
    import time
    import urllib.request

    from shardfleet import metrics, status

    a, b = fleet["a"], fleet["b"]
    cluster = yaml.safe_load((fleet["inventory"] / "group_vars" / "all" / "main.yml")
                             .read_text())["shards_cluster"]
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    exporter = metrics.FleetExporter(
        lambda: status.collect(store, "root", MariaDBServer.root_password, sizes=False,
                               labels={a.address: {"host": "db-a", "pair": "pair001"},
                                       b.address: {"host": "db-b", "pair": "pair001"}}),
        store.changed_at, interval=0.5)
    httpd = metrics.serve(exporter, "127.0.0.1", free_port())
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return resp.read().decode()

    try:
        text = scrape()
        assert "shardfleet_up 1.0" in text and "shardfleet_map_version 0.0" in text
        assert 'shardfleet_pair_writable_nodes{pair="pair001"} 1.0' in text
        for me, peer in ((a, b), (b, a)):
            assert (f'shardfleet_replication_running{{channel="default",server="{me.address}",'
                    f'source="{peer.address}"}} 1.0') in text, text
        assert 'shardfleet_problems{severity="critical"} 0.0' in text
        age = [ln for ln in text.splitlines() if ln.startswith("shardfleet_map_age_seconds ")]
        assert age and 0 <= float(age[0].split()[1]) < 3600, age
        b.sql("SET GLOBAL read_only = OFF")
        try:
            time.sleep(0.6)
            text = scrape()
        finally:
            b.sql("SET GLOBAL read_only = ON")
        assert 'shardfleet_pair_writable_nodes{pair="pair001"} 2.0' in text, text
        assert 'shardfleet_problems{severity="critical"} 1.0' in text, text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url.replace("/metrics", "/"), timeout=30)
    finally:
        httpd.shutdown()
        httpd.server_close()
        store.close()


def test_status_watch_shows_a_change_in_the_next_round_and_stops_on_ctrl_c(fleet, zookeeper):
    """`shardfleet status --watch` on the real pair: a standby made writable between two
    rounds is a CRITICAL problem in the next round, and gone again once it is read-only;
    Ctrl-C ends the watch with the last report's code (0: the pair agrees with the map)."""
    b = fleet["b"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDFLEET_MYSQL_")}
    env["SHARDFLEET_MYSQL_PASSWORD"] = MariaDBServer.root_password
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "shardfleet"), "status", "--zk", zookeeper.address,
         "--cluster", fleet["cluster"], "--user", "root", "--no-sizes", "--watch", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=sigint_default)
    rounds: list[str] = []  # the whole reports, in order (rounds[i] is report i + 1)
    reading: list[list[str]] = []  # the report being read, once its header came
    deadline = time.monotonic() + 240

    def until(n: int) -> None:
        """Read until report n has started, so that reports 1 to n - 1 are whole."""
        assert proc.stdout is not None
        while len(rounds) + len(reading) < n:
            assert time.monotonic() < deadline, f"the watch is slow: {rounds[-1:]}"
            line = proc.stdout.readline()
            assert line, "the watch ended on its own"
            if line.startswith("# ") and line.endswith(" every 0.3s (Ctrl-C stops)\n"):
                if reading:
                    rounds.append("".join(reading.pop()))
                reading.append([])
            elif reading:
                reading[0].append(line)

    try:
        until(2)  # report 1 is whole
        assert "two writable nodes" not in flat(rounds[0]), rounds[0]
        b.sql("SET GLOBAL read_only = OFF")
        try:
            changed_at = len(rounds) + 1  # the report running now may or may not see it
            until(changed_at + 2)
            seen = flat(rounds[changed_at])
            assert f"two writable nodes: standby {b.address}" in seen, seen
        finally:
            b.sql("SET GLOBAL read_only = ON")
        fixed_at = len(rounds) + 1
        until(fixed_at + 2)
        assert "two writable nodes" not in flat(rounds[fixed_at]), rounds[fixed_at]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (out[-2000:], err)
    assert "Traceback" not in err and MariaDBServer.root_password not in out + err


def test_the_exporter_serves_memcached_stats_and_a_server_that_stopped(memcached_group,
                                                                     zookeeper, tmp_path):
    """`shardfleet exporter --memcached` (no Debian exporter package for memcached): each
    server's items, memory, connections, hits and misses from `stats`; a server that
    stops answering shows up=0 at the next collection, the exporter keeps serving."""
    import socket
    import urllib.request

    from shardfleet.testing import MemcachedServer

    extra = MemcachedServer(tmp_path).start()
    servers = [m.address for m in memcached_group] + [extra.address]
    with socket.create_connection(("127.0.0.1", memcached_group[0].port), timeout=5) as s:
        s.sendall(b"set exporter-test 0 0 2\r\nok\r\nget exporter-test\r\nget nothing-here\r\n")
        reply = b""
        while not reply.endswith(b"END\r\nEND\r\n") and len(reply) < 4096:
            reply += s.recv(4096)
    port = free_port()
    env = dict(os.environ, SHARDFLEET_MYSQL_PASSWORD="unused",
               SHARDFLEET_MEMCACHED=",".join(servers[:2]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfleet.cli", "exporter", "--zk", zookeeper.address,
         "--cluster", f"memcached-{uuid.uuid4().hex[:8]}", "--listen", f"127.0.0.1:{port}",
         "--memcached", servers[2], "--interval", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def scrape() -> dict[str, float]:
        deadline = time.monotonic() + 60  # the exporter's start on a busy machine
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=30) as resp:
                    text = resp.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "the exporter never listened"
                time.sleep(0.2)
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("shardfleet_memcached_")}

    try:
        first = memcached_group[0].address
        m = scrape()
        for s in servers:  # the environment's two and the option's one
            assert m[f'shardfleet_memcached_up{{server="{s}"}}'] == 1.0, m
        assert m[f'shardfleet_memcached_items{{server="{first}"}}'] >= 1, m
        assert m[f'shardfleet_memcached_gets_total{{result="hit",server="{first}"}}'] >= 1, m
        assert m[f'shardfleet_memcached_gets_total{{result="miss",server="{first}"}}'] >= 1, m
        assert m[f'shardfleet_memcached_limit_bytes{{server="{first}"}}'] > 0, m
        extra.stop(remove=True)
        time.sleep(0.6)
        m = scrape()
        assert m[f'shardfleet_memcached_up{{server="{servers[2]}"}}'] == 0.0, m
        assert f'shardfleet_memcached_items{{server="{servers[2]}"}}' not in m
        assert m[f'shardfleet_memcached_up{{server="{first}"}}'] == 1.0, m
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if extra.running:
            extra.stop(remove=True)
