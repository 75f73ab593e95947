"""The custom modules' contract, run by ansible-playbook against real MariaDB and ZooKeeper:
check mode changes nothing, diff is right, a second run reports no change, bad input fails
cleanly with nothing written, and secrets never reach the output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.schema import default_schema

from .conftest import APP_USER

ROOT = Path(__file__).resolve().parents[2]
NTABLES = len(default_schema().tables)


def run_module(tmp_path, module: str, args: dict, *, check=False, diff=False) -> tuple[dict, str]:
    """Run one module task through ansible-playbook; return its registered result and the
    whole output (for secret checks)."""
    result_file = tmp_path / f"result-{uuid.uuid4().hex[:6]}.json"
    fqcn = module if "." in module else f"shardfleet.fleet.{module}"  # the collection's
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "t", fqcn: args, "register": "r", "ignore_errors": True},
        {"name": "save", "ansible.builtin.copy": {"content": "{{ r | to_json }}",
                                                  "dest": str(result_file)},
         "check_mode": False, "diff": False}]}]
    pb = tmp_path / f"pb-{uuid.uuid4().hex[:6]}.yml"
    pb.write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    cmd = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c",
           "local", "-e", f"ansible_python_interpreter={sys.executable}", str(pb)]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result_file.exists(), p.stdout + p.stderr
    return json.loads(result_file.read_text()), p.stdout + p.stderr


def login(server):
    return {"login_host": "127.0.0.1", "login_port": server.port, "login_user": "root",
            "login_password": server.root_password}


def count_dbs(server, first, last):
    names = {f"db{i:05d}" for i in range(first, last + 1)}
    rows = server.sql("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA")
    return len(names & {r[0] for r in rows})


def test_shard_databases_check_apply_idempotent(tmp_path, mariadb_pair):
    a = mariadb_pair[0]
    args = {**login(a), "range": [100, 115], "app_user": APP_USER}
    res, out = run_module(tmp_path, "shard_databases", args, check=True, diff=True)
    assert res["changed"] and res["databases_created"] == 16
    assert res["tables_created"] == 16 * NTABLES
    assert "+ database db00100" in res["diff"]["after"]
    assert count_dbs(a, 100, 115) == 0, "check mode created databases"
    assert a.root_password not in out
    res, _ = run_module(tmp_path, "shard_databases", args)
    assert res["changed"] and res["databases_created"] == 16 and res["grants_added"] == 16
    assert count_dbs(a, 100, 115) == 16
    grants = a.sql("SELECT COUNT(*) FROM mysql.db WHERE User=%s AND Db BETWEEN "
                   "'db00100' AND 'db00115' AND Select_priv='Y' AND Create_priv='N'", (APP_USER,))
    assert grants == [(16,)]
    res, _ = run_module(tmp_path, "shard_databases", args)
    assert not res["changed"] and res["databases_created"] == 0 and res["tables_created"] == 0


def test_shard_databases_reports_drift_never_alters(tmp_path, mariadb_pair):
    a = mariadb_pair[0]
    args = {**login(a), "range": [120, 121], "app_user": APP_USER}
    run_module(tmp_path, "shard_databases", args)
    a.sql("ALTER TABLE db00120.pins ADD COLUMN extra INT")
    res, _ = run_module(tmp_path, "shard_databases", {**args, "check_definitions": "always"})
    assert not res["changed"]
    assert [(d["database"], d["table"]) for d in res["drifted"]] == [("db00120", "pins")]
    cols = a.sql("SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE "
                 "TABLE_SCHEMA='db00120' AND TABLE_NAME='pins'")
    assert ("extra",) in cols


def test_shard_databases_checks_definitions_again_only_when_the_schema_changed(
        tmp_path, mariadb_pair):
    """The definition check (every table's definition opened: about 10 s for 2,048 shards)
    runs when no clean check of the range against this schema is recorded on the server:
    a converged rerun skips it, a changed schema brings it back, and drift keeps it
    coming back until the tables are fixed."""
    a = mariadb_pair[0]
    args = {**login(a), "range": [130, 131], "app_user": APP_USER}
    res, _ = run_module(tmp_path, "shard_databases", {**args, "check_definitions": "never"},
                        check=True)
    assert res["changed"] and not res["definitions_checked"]
    res, _ = run_module(tmp_path, "shard_databases", args, check=True)
    assert res["definitions_checked"]
    recorded = ("SELECT first_shard, last_shard, shard_count FROM "
                "shardfleet_provision.definition_checks WHERE first_shard=130")
    assert a.sql("SELECT COUNT(*) FROM information_schema.TABLES WHERE "
                 "TABLE_SCHEMA='shardfleet_provision'") == [(0,)] or a.sql(recorded) == [], \
        "check mode recorded a check"
    res, _ = run_module(tmp_path, "shard_databases", args)
    assert res["changed"] and res["definitions_checked"] and res["drifted"] == []
    res, _ = run_module(tmp_path, "shard_databases", args)
    assert not res["changed"] and not res["definitions_checked"] and res["drifted"] == []
    assert a.sql(recorded) == [(130, 131, 2)]

    # altered by hand after the clean check: only an explicit check sees it
    a.sql("ALTER TABLE db00131.pins ADD COLUMN extra INT")
    res, _ = run_module(tmp_path, "shard_databases", args)
    assert not res["definitions_checked"] and res["drifted"] == []
    res, _ = run_module(tmp_path, "shard_databases", {**args, "check_definitions": "always"})
    assert [(d["database"], d["table"]) for d in res["drifted"]] == [("db00131", "pins")]

    # a changed schema (a lookup's value now JSON): checked again, every shard's table seen
    text = (ROOT / "src" / "shardfleet" / "schema.yml").read_text()
    assert "{name: user_by_email, value: id}" in text
    changed = tmp_path / "schema.yml"
    changed.write_text(text.replace("{name: user_by_email, value: id}",
                                    "{name: user_by_email, value: json}"))
    for _ in range(2):  # drift records nothing: the next run checks (and warns) again
        res, out = run_module(tmp_path, "shard_databases", {**args, "schema": str(changed)})
        assert not res["changed"] and res["definitions_checked"]
        assert sorted((d["database"], d["table"]) for d in res["drifted"]) == [
            ("db00130", "user_by_email"), ("db00131", "pins"), ("db00131", "user_by_email")]
        assert "differ from the schema" in out


def test_shard_databases_absent_refuses_rows_unless_forced(tmp_path, mariadb_pair):
    a = mariadb_pair[0]
    args = {**login(a), "range": [130, 133], "app_user": APP_USER}
    run_module(tmp_path, "shard_databases", args)
    a.sql("INSERT INTO db00131.pins (body) VALUES ('{}')")
    gone = {**args, "state": "absent"}
    res, _ = run_module(tmp_path, "shard_databases", gone)
    assert res["failed"] and "hold rows" in res["msg"] and "db00131" in res["msg"]
    assert count_dbs(a, 130, 133) == 4, "a refused drop dropped something"
    res, _ = run_module(tmp_path, "shard_databases", {**gone, "force": True}, check=True,
                        diff=True)
    assert res["changed"] and res["databases_dropped"] == 4 and "db00130" in res["diff"]["before"]
    assert count_dbs(a, 130, 133) == 4
    res, _ = run_module(tmp_path, "shard_databases", {**gone, "force": True})
    assert res["changed"] and count_dbs(a, 130, 133) == 0
    assert a.sql("SELECT COUNT(*) FROM mysql.db WHERE Db BETWEEN 'db00130' AND 'db00133'") \
        == [(0,)]
    res, _ = run_module(tmp_path, "shard_databases", {**gone, "force": True})
    assert not res["changed"]


@pytest.mark.parametrize("change,needle", [
    ({"range": [5, 1]}, "not first <= last"),
    ({"range": [0, 70000]}, "out of range"),
    ({"login_password": "not-the-password-x1"}, "wrong credentials"),
    ({"login_port": 1}, "cannot connect"),
    ({"schema": "BAD"}, "does not parse"),
])
def test_shard_databases_bad_input_fails_cleanly(tmp_path, mariadb_pair, change, needle):
    a = mariadb_pair[0]
    bad = tmp_path / "bad.yml"
    bad.write_text("objects: [\n")
    args = {**login(a), "range": [140, 141], "app_user": APP_USER, **change}
    if args.get("schema") == "BAD":
        args["schema"] = str(bad)
    res, out = run_module(tmp_path, "shard_databases", args)
    assert res["failed"] and needle in res["msg"], res["msg"]
    assert "Traceback (most recent call last)" not in json.dumps(res), "a traceback leaked"
    assert count_dbs(a, 140, 141) == 0
    assert a.root_password not in out


def zk_args(zookeeper, cluster):
    return {"zookeeper_hosts": [zookeeper.address], "cluster": cluster}


def test_shard_map_check_diff_apply_idempotent(tmp_path, zookeeper, mariadb_pair):
    a, b = mariadb_pair
    cluster = "m" + uuid.uuid4().hex[:8]
    ranges = [{"range": [0, 2047], "master": a.address, "state": "open"},
              {"range": [2048, 4095], "master": b.address, "state": "open"}]
    args = {**zk_args(zookeeper, cluster), "ranges": ranges}
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        res, _ = run_module(tmp_path, "shard_map", args, check=True, diff=True)
        assert res["changed"] and res["diff"]["before"] == "" and "0-2047" in res["diff"]["after"]
        assert store.read().map is None, "check mode wrote the map"
        res, _ = run_module(tmp_path, "shard_map", args)
        assert res["changed"] and res["version"] == 0
        assert store.read().map.range_for(3000).master == b.address
        res, _ = run_module(tmp_path, "shard_map", args)
        assert not res["changed"] and res["version"] == 0
        # close one range: only the state changes, shown in the diff
        close = {**zk_args(zookeeper, cluster), "ranges": [{"range": [0, 2047],
                                                              "state": "closed"}]}
        res, _ = run_module(tmp_path, "shard_map", close, diff=True)
        assert res["changes"] == ["~ [0, 2047] state: open -> closed"]
        assert store.read().map.range_for(5).state == "closed"
        assert store.read().version == 1
        # absent, then exact
        res, _ = run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster),
                                                     "ranges": [{"range": [2048, 4095]}],
                                                     "state": "absent"})
        assert res["changed"] and [r["range"] for r in res["map"]["ranges"]] == [[0, 2047]]
        res, _ = run_module(tmp_path, "shard_map", {**args, "state": "exact"})
        assert res["changed"] and len(store.read().map.ranges) == 2
    finally:
        store.close()


@pytest.mark.parametrize("ranges,extra,needle", [
    ([{"range": [2000, 3000], "master": "127.0.0.1:1"}], {}, "overlaps"),
    ([{"range": [65000, 65536], "master": "127.0.0.1:1"}], {}, "out of bounds"),
    ([{"range": [5000, 5001], "master": "nowhere:3306"}], {"known_hosts": ["x:1"]},
     "not a known host"),
    ([{"range": [5000, 5001]}], {}, "master None"),
    ([{"range": [0, 2047], "state": "melted"}], {}, "not one of"),
    ([{"range": [0, 1]}], {"state": "absent"}, "partly overlaps"),
    ([], {"mod_shard_count": 1024}, "fixed at 4096"),
])
def test_shard_map_refuses_bad_maps_writing_nothing(tmp_path, zookeeper, mariadb_pair, ranges,
                                                    extra, needle):
    a, b = mariadb_pair
    cluster = "b" + uuid.uuid4().hex[:8]
    good = [{"range": [0, 2047], "master": a.address},
            {"range": [2048, 4095], "master": b.address}]
    run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster), "ranges": good})
    store = ZooKeeperMapStore(zookeeper.address, cluster)
    try:
        before = store.read()
        res, _ = run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster),
                                                     "ranges": ranges, **extra})
        assert res["failed"] and needle in res["msg"], res["msg"]
        assert store.read() == before
    finally:
        store.close()


def test_shard_map_unreachable_zookeeper(tmp_path):
    from shardfleet.testing import free_port
    res, _ = run_module(tmp_path, "shard_map", {
        "zookeeper_hosts": [f"127.0.0.1:{free_port()}"], "zookeeper_timeout": 2,
        "ranges": [{"range": [0, 1], "master": "a:1"}]})
    assert res["failed"] and "unreachable" in res["msg"]


def test_shard_info_and_status_command(tmp_path, zookeeper, cluster, mariadb_pair):
    a, b = mariadb_pair
    res, out = run_module(tmp_path, "shard_info", {
        **zk_args(zookeeper, cluster), "login_user": "root",
        "login_password": a.root_password}, check=True)
    assert not res["changed"] and res["version"] == 0
    assert [p["master"] for p in res["pairs"]] == [a.address, b.address]
    sa = res["servers"][a.address]
    assert sa["reachable"] and sa["read_only"] is False and sa["shards"] >= 16
    assert sa["gtid_binlog_pos"]
    assert res["zookeeper"] == [{"server": zookeeper.address, "mode": "standalone",
                                 "zxid": res["zookeeper"][0]["zxid"]}]
    assert a.root_password not in out
    env = dict(os.environ, SHARDFLEET_MYSQL_PASSWORD=a.root_password)
    shardfleet = str(Path(sys.executable).parent / "shardfleet")
    p = subprocess.run([shardfleet, "status", "--zk", zookeeper.address, "--cluster", cluster,
                        "--user", "root"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "0-15" in p.stdout and a.address in p.stdout and "standalone" in p.stdout
    p = subprocess.run([shardfleet, "status", "--zk", zookeeper.address, "--cluster", cluster,
                        "--user", "root", "--json"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert json.loads(p.stdout)["servers"][b.address]["shards"] >= 16
    # as a Nagios check: 0 when the servers agree with the map, 2 on a critical problem
    # (the map's master read-only), 2 when ZooKeeper cannot be read
    check = [shardfleet, "status", "--zk", zookeeper.address, "--cluster", cluster,
             "--user", "root", "--check", "--no-sizes"]
    p = subprocess.run(check, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "PROBLEMS: none" in p.stdout, p.stdout + p.stderr
    a.sql("SET GLOBAL read_only = ON")
    try:
        p = subprocess.run(check, capture_output=True, text=True, env=env, timeout=60)
    finally:
        a.sql("SET GLOBAL read_only = OFF")
    assert p.returncode == 2 and f"CRITICAL pair (ranges 0-15): master {a.address} (per the " \
        "map) is read-only" in p.stdout, p.stdout + p.stderr
    from shardfleet.testing import free_port
    p = subprocess.run([*check[:3], f"127.0.0.1:{free_port()}", *check[4:]],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stdout.startswith("CRITICAL ZooKeeper"), p.stdout + p.stderr


def test_shard_hosts_keeps_and_refuses_what_the_map_names(tmp_path, zookeeper, mariadb_pair):
    """Nothing removes a server the map names: a host to remove that the map names is
    refused naming its ranges (unless data_may_go), an unlisted one is kept and
    reported; an unreachable ZooKeeper keeps everything (or refuses a removal)."""
    from shardfleet.testing import free_port

    a, b = mariadb_pair
    cluster = "h" + uuid.uuid4().hex[:8]
    run_module(tmp_path, "shard_map", {**zk_args(zookeeper, cluster), "ranges": [
        {"range": [0, 2047], "master": a.address, "standby": "10.9.9.2:3306"},
        {"range": [2048, 4095], "master": "10.9.9.3:3306"}]})
    zk = zk_args(zookeeper, cluster)
    res, _ = run_module(tmp_path, "shard_hosts", {
        **zk, "unlisted": {"gone1": ["10.9.9.9"], "kept3": ["10.9.9.3"]},
        "remove": {"other": ["10.9.9.7"]}}, check=True)
    assert not res.get("failed"), res
    assert sorted(res["removable"]) == ["gone1", "other"], res
    assert res["kept"] == {"kept3": ["master of [2048, 4095] (open)"]}, res
    assert any("kept kept3" in w for w in res["warnings"]), res
    res, _ = run_module(tmp_path, "shard_hosts", {
        **zk, "remove": {"mysql2": ["10.9.9.2"], "db1": ["127.0.0.1", "db1"]}})
    assert res["failed"] and "refusing to remove 2 host(s)" in res["msg"], res
    assert "mysql2 is standby of [0, 2047]" in res["msg"], res["msg"]
    assert "fleet_data_may_go=true" in res["msg"], res["msg"]
    res, _ = run_module(tmp_path, "shard_hosts", {
        **zk, "remove": {"mysql2": ["10.9.9.2"]}, "data_may_go": True})
    assert res["removable"] == ["mysql2"] and "mysql2" in res["allowed"], res
    dead = {"zookeeper_hosts": [f"127.0.0.1:{free_port()}"], "zookeeper_timeout": 2}
    res, _ = run_module(tmp_path, "shard_hosts", {**dead, "unlisted": {"x": ["10.9.9.3"]}})
    assert not res.get("failed") and res["removable"] == [] and "x" in res["kept"], res
    res, _ = run_module(tmp_path, "shard_hosts", {**dead, "remove": {"x": ["10.9.9.8"]}})
    assert res["failed"] and "cannot read the shard map" in res["msg"], res
    res, _ = run_module(tmp_path, "shard_hosts", {"zookeeper_hosts": dead["zookeeper_hosts"]})
    assert not res.get("failed") and res["removable"] == [], "nothing to decide: no contact"
