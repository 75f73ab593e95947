"""shardfleet.fleet.shard_hosts against a real ZooKeeper: what fleet-down, fleet-up and
fleet-add ask before removing or creating a host. Besides the map's masters and
standbys, a ZooKeeper host (it holds the map) and a server of an operation in flight (a
split's target pair, which the map does not name yet) are never removed; no map at the
path read (a wrong shards_cluster) is "cannot tell", a refusal, not "nothing held"; and a
host to create may not take a name or address the map still names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore

from .test_modules import run_module, zk_args

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MASTER, STANDBY = "10.9.9.1:3306", "10.9.9.2:3306"
TARGET, TARGET_STANDBY = "10.9.9.21:3306", "10.9.9.22:3306"


@pytest.fixture
def fleet_map(tmp_path, zookeeper):
    """A cluster with a map (one pair) and a split of it onto 10.9.9.21/22 in flight."""
    cluster = "hh" + uuid.uuid4().hex[:8]
    res, _ = run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster), "ranges": [
        {"range": [0, 4095], "master": MASTER, "standby": STANDBY}]})
    assert not res.get("failed"), res
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        journal = {"kind": "split", "step": "catching_up", "source": MASTER,
                   "target": TARGET, "target_standby": TARGET_STANDBY,
                   "started_at": time.time(), "updated_at": time.time()}
        store.write_raw(f"{store.root}/{cluster}/ops/journal/split-hh",
                        json.dumps(journal).encode(), NO_NODE)
    finally:
        store.close()
    return zk_args(zookeeper, cluster)


def test_a_split_target_in_flight_and_a_zookeeper_host_are_not_removed(tmp_path, fleet_map):
    res, _ = run_module(tmp_path, "shard_hosts", {
        **fleet_map, "remove": {"sf-mysql005a": ["10.9.9.21"], "spare": ["10.9.9.99"]}})
    assert res["failed"] and "refusing to remove 1 host(s)" in res["msg"], res
    assert "sf-mysql005a is a server of split split-hh (step catching_up" in res["msg"], res
    res, _ = run_module(tmp_path, "shard_hosts", {
        **fleet_map, "remove": {"sf-zk1": ["127.0.0.1"]}})
    assert res["failed"] and "sf-zk1 is ZooKeeper server 127.0.0.1:" in res["msg"], res
    res, _ = run_module(tmp_path, "shard_hosts", {
        **fleet_map, "unlisted": {"sf-mysql005b": ["10.9.9.22"], "old": ["10.9.9.98"]}},
        check=True)
    assert not res.get("failed") and res["removable"] == ["old"], res
    assert list(res["kept"]) == ["sf-mysql005b"] and "split-hh" in res["kept"]["sf-mysql005b"][0]


def test_no_map_at_the_cluster_read_refuses_every_removal(tmp_path, zookeeper, fleet_map):
    wrong = zk_args(zookeeper, "typo" + uuid.uuid4().hex[:6])
    res, _ = run_module(tmp_path, "shard_hosts", {**wrong, "remove": {"x": ["10.9.9.1"]}})
    assert res["failed"], f"removed with no map to check against: {res}"
    assert f"there is no shard map at /shardfleet/{wrong['cluster']}/map" in res["msg"], res
    assert "shards_cluster" in res["msg"] and "nothing was removed" in res["msg"], res
    res, _ = run_module(tmp_path, "shard_hosts", {**wrong, "unlisted": {"y": ["10.9.9.77"]}})
    assert not res.get("failed") and res["removable"] == [] and "y" in res["kept"], res
    res, _ = run_module(tmp_path, "shard_hosts", {
        **wrong, "remove": {"x": ["10.9.9.1"]}, "data_may_go": True})
    assert res["removable"] == ["x"] and "x" in res["allowed"], res


def test_a_host_to_add_may_not_reuse_what_the_map_still_names(tmp_path, zookeeper, fleet_map):
    """fleet-add after `fleet-down -e fleet_data_may_go=true` of the standby: the map still
    names 10.9.9.2; a new empty server there would take its traffic."""
    res, _ = run_module(tmp_path, "shard_hosts", {
        **fleet_map, "add": {"sf-mysql003a": ["10.9.9.2"], "sf-mysql003b": []}})
    assert res["failed"] and "sf-mysql003a (10.9.9.2) is standby of [0, 4095]" in res["msg"], res
    assert "sf-mysql003b" not in res["msg"], res
    res, _ = run_module(tmp_path, "shard_hosts", {
        **fleet_map, "add": {"sf-mysql006a": [], "sf-mysql006b": []}})
    assert not res.get("failed"), res
    assert {"10.9.9.1", "10.9.9.2", "10.9.9.21", "10.9.9.22", "127.0.0.1"} <= set(res["named"])
    wrong = zk_args(zookeeper, "typo" + uuid.uuid4().hex[:6])
    res, _ = run_module(tmp_path, "shard_hosts", {**wrong, "add": {"sf-mysql006a": []}})
    assert res["failed"] and "there is no shard map at" in res["msg"], res


# -- playbooks/fleet-add.yml: its first play, against this ZooKeeper -----------------------
# (no container is created: the fleet's label matches none, and the image named does not
# exist, so the imported fleet-up.yml stops at its first check after added-pairs.yml is
# written)

def _fleet_add(tmp_path, zookeeper, cluster, added=None):
    inv = tmp_path / f"inv-{uuid.uuid4().hex[:6]}"
    inv.mkdir()
    label = "hh-test-" + uuid.uuid4().hex[:8]
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {
        "vars": {"shardfleet_network_subnet": "10.9.9.0/24", "shardfleet_fleet_label": label,
                 "shardfleet_network": label, "shardfleet_image": f"localhost/{label}:none",
                 "shards_cluster": cluster, "zookeeper_admin_password": ""},
        "children": {"fleet": {"children": {
            "mysql": {"hosts": {
                "sf-mysql001a": {"shardfleet_pair": "pair001", "shardfleet_side": "a",
                                 "shardfleet_container_ip": "10.9.9.11"},
                "sf-mysql001b": {"shardfleet_pair": "pair001", "shardfleet_side": "b",
                                 "shardfleet_container_ip": "10.9.9.12"}}},
            "zookeeper": {"hosts": {"sf-zk1": {
                "shardfleet_address": zookeeper.address.rpartition(":")[0],
                "zookeeper_client_port": zookeeper.port}}}}}}}}))
    if added is not None:
        (inv / "added-pairs.yml").write_text(added)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    p = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv),
                        "-e", f"ansible_python_interpreter={sys.executable}", "-e",
                        "pair=pair003", str(ROOT / "playbooks" / "fleet-add.yml")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    written = inv / "added-pairs.yml"
    return p.returncode, p.stdout + p.stderr, (written.read_text() if written.exists() else "")


def test_fleet_add_gives_no_new_host_an_address_the_map_still_names(tmp_path, zookeeper):
    """sf-mysql002b (10.9.9.61) was removed with fleet_data_may_go and its entry dropped
    from the inventory; the map still names it the standby. fleet-add PAIR=pair003 took
    the lowest free address, .61, for a new empty server."""
    cluster = "ha" + uuid.uuid4().hex[:8]
    res, _ = run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster), "ranges": [
        {"range": [0, 4095], "master": "10.9.9.11:3306", "standby": "10.9.9.61:3306"}]})
    assert not res.get("failed"), res
    rc, out, written = _fleet_add(tmp_path, zookeeper, cluster)
    hosts = yaml.safe_load(written)["all"]["children"]["fleet"]["children"]["mysql"]["hosts"]
    ips = {h: v["shardfleet_container_ip"] for h, v in hosts.items()}
    assert ips == {"sf-mysql003a": "10.9.9.62", "sf-mysql003b": "10.9.9.63"}, out[-3000:]
    assert rc != 0 and "Check the image exists" in out, "fleet-up did not stop at the image"


def test_fleet_add_refuses_to_recreate_an_added_host_the_map_still_names(tmp_path, zookeeper):
    """pair003 was added, then sf-mysql003a removed with fleet_data_may_go: the map still
    names it the master. Its container is gone, so fleet-add would create it again, empty,
    at that address: refused, nothing written."""
    cluster = "hb" + uuid.uuid4().hex[:8]
    res, _ = run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster), "ranges": [
        {"range": [0, 2047], "master": "10.9.9.11:3306", "standby": "10.9.9.12:3306"},
        {"range": [2048, 4095], "master": "10.9.9.61:3306", "standby": "10.9.9.62:3306"}]})
    assert not res.get("failed"), res
    added = yaml.safe_dump({"all": {"children": {
        "fleet": {"children": {"mysql": {"hosts": {
            "sf-mysql003a": {"shardfleet_pair": "pair003", "shardfleet_side": "a",
                             "shardfleet_container_ip": "10.9.9.61"},
            "sf-mysql003b": {"shardfleet_pair": "pair003", "shardfleet_side": "b",
                             "shardfleet_container_ip": "10.9.9.62"}}}}},
        "pair003": {"hosts": {"sf-mysql003a": None, "sf-mysql003b": None}}}}})
    rc, out, written = _fleet_add(tmp_path, zookeeper, cluster, added)
    flat = " ".join(out.split())
    assert rc != 0 and "refusing to create 2 host(s)" in flat, out[-3000:]
    assert "sf-mysql003a (10.9.9.61) is master of [2048, 4095]" in flat, out[-3000:]
    assert written == added, "fleet-add rewrote its inventory although refused"
    assert "Check the image exists" not in out, "fleet-up ran after the refusal"
