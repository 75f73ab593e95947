"""rebuild-standby.yml on the control node against loopback MariaDB and ZooKeeper: its
``--check`` after an emergency promotion (the runbooks tell on-call to look first), a
run with nothing marked, and a logical rebuild. A static inventory and ``--limit
localhost`` leave out the mysql role's play (it needs the fleet's hosts); the plays that
decide and rebuild run on the control node. Before the fix every one of these failed
with ``'rebuild_target_host' is undefined`` (rc 2)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shardfleet import promote
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.shardmap import ShardMap
from shardfleet.testing import MariaDBServer, ZooKeeperServer
from shardfleet.testing.kit import (
    REPL_PASSWORD,
    REPL_USER,
    make_server,
    pair_up,
    start_all,
    wait_pair_synced,
)

ROOT = Path(__file__).resolve().parents[2]
PAIR = "pair001"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("rb")
    zk = ZooKeeperServer(base).start()

    def setup(a, b):
        pair_up(a, b)
        b.sql("SET GLOBAL read_only = ON")
        for i in range(4):
            a.sql(f"CREATE DATABASE IF NOT EXISTS db{i:05d}")
        wait_pair_synced(a, b)

    a, b = start_all([lambda: make_server(base, 81, "a"), lambda: make_server(base, 82, "b")],
                     setup)
    yield zk, a, b
    for s in (a, b):
        s.stop(remove=True)
    zk.stop(remove=True)


def _inventory(tmp_path, zk, a, b, cluster):
    inv = tmp_path / "inv"
    inv.mkdir()
    host, port = zk.address.rsplit(":", 1)
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {
        "vars": {"ansible_python_interpreter": sys.executable, "shards_cluster": cluster,
                 "mysql_admin_user": "root", "mysql_admin_password": MariaDBServer.root_password,
                 "mysql_replication_user": REPL_USER, "mysql_replication_password": REPL_PASSWORD,
                 "zookeeper_admin_password": ""},
        "hosts": {"localhost": {"ansible_connection": "local"}},
        "children": {
            "mysql": {"hosts": {
                "db-a": {"shardfleet_address": "127.0.0.1", "mysql_port": a.port,
                         "shardfleet_pair": PAIR},
                "db-b": {"shardfleet_address": "127.0.0.1", "mysql_port": b.port,
                         "shardfleet_pair": PAIR}}},
            "zookeeper": {"hosts": {"zk-1": {"shardfleet_address": host,
                                             "zookeeper_client_port": int(port)}}}}}}))
    return inv


def _play(inv, *args):
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    p = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv),
                        "--limit", "localhost", str(ROOT / "playbooks" / "rebuild-standby.yml"),
                        "-e", f"pair={PAIR}", *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return p.returncode, p.stdout + p.stderr


@contextlib.contextmanager
def _pair_map(zk, a, b) -> Iterator[ZooKeeperMapStore]:
    """A store on a fresh cluster whose map gives shards 0-3 to the pair (*a* master)."""
    store = ZooKeeperMapStore(zk.address, "rb" + uuid.uuid4().hex[:8])
    try:
        store.write(ShardMap.from_ranges([{"range": [0, 3], "master": a.address,
                                           "standby": b.address}], mod_shard_count=4), NO_NODE)
        yield store
    finally:
        store.close()


def _opts():
    return promote.Options(user="root", password=MariaDBServer.root_password,
                           replication_user=REPL_USER, replication_password=REPL_PASSWORD)


def test_check_after_an_emergency_and_a_rerun_with_nothing_marked(tmp_path, env):
    zk, a, b = env
    with _pair_map(zk, a, b) as store:
        o = _opts()
        o.force = True
        r = promote.promote(store, PAIR, [a.address, b.address], mode="emergency", opts=o)
        print("emergency:", r.steps)
        before = store.read_raw(store.path)
        assert b"rebuild" in before[0], before
        inv = _inventory(tmp_path, zk, a, b, store.cluster)
        rc, out = _play(inv, "--check")
        print(out[-6000:])
        after = store.read_raw(store.path)
        assert after == before, "check mode changed the map"
        assert rc == 0, "rebuild-standby.yml --check failed after the emergency"
        # the same after the rebuild itself (logical, the library): nothing marked
        promote.rebuild_standby(store, PAIR, [a.address, b.address], opts=_opts())
        assert b"rebuild" not in store.read_raw(store.path)[0]
        rc, out = _play(inv)
        print(out[-4000:])
        assert rc == 0 and "nothing to do" in out, "a rerun with nothing marked failed"


def test_a_run_with_nothing_marked(tmp_path, env):
    zk, a, b = env
    with _pair_map(zk, a, b) as store:
        inv = _inventory(tmp_path, zk, a, b, store.cluster)
        rc, out = _play(inv)
        print(out[-3000:])
        assert rc == 0 and "nothing to do" in out, "a run with nothing marked failed"


def test_check_with_the_old_master_down_then_a_logical_rebuild(tmp_path, env):
    zk, a, b = env
    with _pair_map(zk, a, b) as store:
        a.sql("SET GLOBAL read_only = OFF")
        o = _opts()
        o.force = True
        promote.promote(store, PAIR, [a.address, b.address], mode="emergency", opts=o)
        before = store.read_raw(store.path)
        inv = _inventory(tmp_path, zk, a, b, store.cluster)
        a.stop()
        try:
            rc, out = _play(inv, "--check")
            print(out[-3000:])
            assert rc == 0 and "does not answer" in out, "check with the node down failed"
            assert store.read_raw(store.path) == before
        finally:
            a.start()
        rc, out = _play(inv, "-e", "rebuild_copy=logical")
        print(out[-3000:])
        assert rc == 0, "the logical rebuild failed"
        assert b"rebuild" not in store.read_raw(store.path)[0]
