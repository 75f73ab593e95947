"""Monitoring on the e2e fleet (site.yml's monitoring plays, the local inventory's
sf-monitor1): Prometheus scrapes every exporter, every service listens on the fleet
address only, the monitor user reads status and nothing else, and a real fault (a
standby's replication stopped) fires its alert in Prometheus and Alertmanager, which
clears once the replication runs again.

Prometheus and the exporters are asked over HTTP on the e2e network (10.242.x.0/24)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from typing import Any

import pymysql
import pytest

from tests.e2e.conftest import E2E_TLS, Fleet
from tests.e2e.test_site import mysql
from tests.prometheus import wait_targets_up

pytestmark = pytest.mark.e2e

ACCESS_DENIED = {1044, 1045, 1142, 1143, 1227}
# job -> port, and the inventory group whose every host it scrapes
JOBS = {"node": (9100, None), "mysqld": (9104, "mysql"), "redis": (9121, "redis"),
        "shardfleet": (9150, "monitoring"), "prometheus": (9090, "monitoring"),
        "alertmanager": (9093, "monitoring")}


def _get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the fleet's own
        body = resp.read().decode()
    return json.loads(body) if body.lstrip().startswith(("{", "[")) else body


def _monitor(fleet: Fleet) -> str:
    return fleet.ip(fleet.group("monitoring")[0])


def _prometheus(fleet: Fleet, path: str) -> Any:
    reply = _get(f"http://{_monitor(fleet)}:9090/api/v1/{path}")
    assert reply["status"] == "success", reply
    return reply["data"]


def _firing(fleet: Fleet, alertname: str, **labels: str) -> list[dict[str, Any]]:
    return [a for a in _prometheus(fleet, "alerts")["alerts"]
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())]


def _ran_site(fleet: Fleet) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; see test_site"


def test_prometheus_scrapes_every_exporter_of_the_fleet(fleet: Fleet) -> None:
    _ran_site(fleet)
    every = sorted(fleet.hosts)
    # instance is the inventory name, scraped at the host's fleet address
    expected = {(job, h) for job, (_, group) in JOBS.items()
                for h in (fleet.group(group) if group else every)}
    active = wait_targets_up(
        lambda: _prometheus(fleet, "targets?state=active")["activeTargets"], expected)
    addresses = {(t["scrapePool"], t["labels"]["instance"], t["scrapeUrl"].split("/")[2])
                 for t in active}
    assert addresses == {(job, h, f"{fleet.ip(h)}:{JOBS[job][0]}") for job, h in expected}
    # the MySQL targets carry their pair
    mysqld = {t["labels"]["instance"]: t["labels"].get("pair") for t in active
              if t["scrapePool"] == "mysqld"}
    assert mysqld == {h: fleet.hosts[h]["shardfleet_pair"] for h in fleet.group("mysql")}
    # the exporters read what they serve: MySQL and Redis logged in, the fleet's map read
    up = {r["metric"]["instance"]: r["value"][1]
          for r in _prometheus(fleet, "query?query=mysql_up")["result"]}
    assert up == {h: "1" for h in fleet.group("mysql")}, up
    redis_up = _prometheus(fleet, "query?query=redis_up")["result"]
    assert [r["value"][1] for r in redis_up] == ["1"], redis_up
    sf = _prometheus(fleet, "query?query=shardfleet_up")["result"]
    assert [r["value"][1] for r in sf] == ["1"], sf
    mc = {r["metric"]["server"]: r["value"][1]
          for r in _prometheus(fleet, "query?query=shardfleet_memcached_up")["result"]}
    assert mc == {f"{fleet.ip(h)}:11211": "1" for h in fleet.group("memcached")}, mc
    assert _firing(fleet, "ExporterDown") == []


def test_every_monitoring_service_listens_on_the_fleet_address_only(fleet: Fleet) -> None:
    _ran_site(fleet)
    for host in sorted(fleet.hosts):
        out = subprocess.run(["podman", "exec", host, "ss", "-Hltn"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        ours = [line.split()[3] for line in out.splitlines()
                if line.split()[3].rsplit(":", 1)[1] in {str(p) for p, _ in JOBS.values()}]
        assert ours, f"{host}: no monitoring port listens:\n{out}"
        assert all(a.rsplit(":", 1)[0] == fleet.ip(host) for a in ours), f"{host}: {ours}"


def test_the_monitor_user_reads_status_and_nothing_else(fleet: Fleet) -> None:
    """The exporters' MySQL user (the mysql role's shardfleet_monitor): status, variables,
    every replica channel and performance_schema; no row of any database, no write, no
    mysql.* table, no grant."""
    _ran_site(fleet)
    host = fleet.group("mysql")[0]
    with mysql(fleet, host) as admin, admin.cursor() as cur:
        cur.execute("SELECT SCHEMA_NAME AS db FROM information_schema.SCHEMATA "
                    "WHERE SCHEMA_NAME LIKE 'db%' ORDER BY 1 LIMIT 1")
        shard = cur.fetchone()["db"]
        cur.execute(f"SELECT TABLE_NAME AS t FROM information_schema.TABLES "
                    f"WHERE TABLE_SCHEMA = '{shard}' LIMIT 1")
        table = cur.fetchone()["t"]
    conn = pymysql.connect(host=fleet.ip(host), port=3306, user="shardfleet_monitor",
                           password=fleet.secrets["vault_mysql_monitor_password"],
                           connect_timeout=5, autocommit=True,
                           cursorclass=pymysql.cursors.DictCursor, **E2E_TLS.pymysql_kwargs())
    with conn, conn.cursor() as cur:
        cur.execute("SHOW GLOBAL STATUS LIKE 'Uptime'")
        assert int(cur.fetchone()["Value"]) > 0
        cur.execute("SHOW ALL SLAVES STATUS")
        assert [r["Slave_IO_Running"] for r in cur.fetchall()] == ["Yes"]
        cur.execute("SELECT COUNT(*) AS n FROM information_schema.INNODB_METRICS")
        assert cur.fetchone()["n"] > 0
        cur.execute("SELECT COUNT(*) AS n FROM performance_schema.global_status")
        for sql in (f"SELECT * FROM {shard}.{table} LIMIT 1",
                    f"INSERT INTO {shard}.{table} () VALUES ()",
                    "SELECT User FROM mysql.user", "CREATE DATABASE monitor_was_here",
                    "SET GLOBAL read_only = ON", "SHOW GRANTS FOR 'shardfleet_app'@'%'",
                    "STOP SLAVE"):
            with pytest.raises(pymysql.err.MySQLError) as err:
                cur.execute(sql)
            assert err.value.args[0] in ACCESS_DENIED, (sql, err.value.args)


def test_a_stopped_replication_fires_its_alert_which_clears_when_it_runs(fleet: Fleet) -> None:
    """ShardfleetReplicationStopped (for: 1m) on a real fault: a standby's replication
    stopped fires it in Prometheus and reaches Alertmanager; started again, it clears."""
    _ran_site(fleet)
    a, b = [h for h in fleet.group("mysql") if fleet.hosts[h]["shardfleet_pair"] == "pair002"]
    with mysql(fleet, a) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.read_only AS ro")
        standby = a if cur.fetchone()["ro"] == 1 else b
    server = f"{fleet.ip(standby)}:3306"
    assert _firing(fleet, "ShardfleetReplicationStopped", server=server) == []
    stopped = time.monotonic()
    with mysql(fleet, standby) as conn, conn.cursor() as cur:
        cur.execute("STOP ALL SLAVES")
    try:
        # the exporter's interval (10 s), a scrape (15 s), the rule's 1 min and an
        # evaluation (15 s): 100 s at most on a quiet machine
        deadline = time.monotonic() + 240
        while not _firing(fleet, "ShardfleetReplicationStopped", server=server):
            assert time.monotonic() < deadline, (
                f"no ShardfleetReplicationStopped for {server} after 240 s: "
                f"{_prometheus(fleet, 'alerts')}")
            time.sleep(5)
        fired = time.monotonic() - stopped
        assert fired >= 60, f"fired after {fired:.0f} s, before the rule's 1 minute"
        alert = _firing(fleet, "ShardfleetReplicationStopped", server=server)[0]
        assert alert["labels"]["severity"] == "critical"
        assert alert["annotations"]["runbook"].startswith("docs/monitoring.md#")
        deadline = time.monotonic() + 60
        while True:  # Prometheus sends it on at the next evaluation
            am = _get(f"http://{_monitor(fleet)}:9093/api/v2/alerts")
            if [x for x in am if x["labels"].get("alertname") == "ShardfleetReplicationStopped"
                    and x["labels"].get("server") == server]:
                break
            assert time.monotonic() < deadline, f"Alertmanager never got the alert: {am}"
            time.sleep(3)
    finally:
        with mysql(fleet, standby) as conn, conn.cursor() as cur:
            cur.execute("START ALL SLAVES")
    started = time.monotonic()
    deadline = started + 120
    while _firing(fleet, "ShardfleetReplicationStopped", server=server):
        assert time.monotonic() < deadline, "the alert did not clear in 120 s after START"
        time.sleep(5)
    print(f"\nmonitoring: replication alert fired {fired:.0f} s after the stop "
          f"(rule: for 1m), cleared {time.monotonic() - started:.0f} s after START")
