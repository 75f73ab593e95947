#!/usr/bin/env python3
"""Smoke test of a running fleet, from this machine (the `make fleet` last step).

Reads the connection profile playbooks/fleet-status.yml writes
(.fleet/<label>.json, default .fleet/local.json) and checks, in order:

1. every MySQL node answers the admin user over TCP, boots read_only=ON and
   replicates from its peer; the application user can log in;
2. ZooKeeper serves /shardfleet to anyone and refuses an anonymous write there;
3. Redis refuses a client without the password and round-trips a key with it (and, on a
   fleet with TLS, refuses a plaintext client; MySQL too, in 1);
4. memcached round-trips an item;
5. the routing library writes an object and reads it back (shardfleet.store.Store
   over shardfleet.router.Router, the map read from ZooKeeper), on a shard of an
   open range, as the application user;
6. with monitoring: Prometheus scrapes every target and each answers, and no alert
   fires (a fresh fleet is healthy); Alertmanager answers.

The profile holds no password: each comes from the environment variable the profile
names under "secrets" (SHARDFLEET_MYSQL_PASSWORD, SHARDFLEET_APP_PASSWORD,
SHARDFLEET_ZK_PASSWORD, SHARDFLEET_REDIS_PASSWORD: the command's names), else from the
vault file it names there (plain YAML on the local fleet; an encrypted vault needs the
environment).

Exit status 0 when every check that could run passed. Talks only to the fleet's
own containers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}")
    if not ok:
        failures.append(name)


def passwords(p: dict[str, Any]) -> dict[str, str]:
    """Each password the profile's "secrets" names: from its environment variable, else
    from the vault file (read only when something is missing). Raises ValueError naming
    what is missing."""
    import os

    sec = p.get("secrets") or {}
    env, keys = sec.get("env") or {}, sec.get("keys") or {}
    out = {k: os.environ[v] for k, v in env.items() if os.environ.get(v)}
    missing = [k for k in keys if k not in out]
    if missing:
        path = Path(sec.get("file") or "")
        try:
            import yaml

            text = path.read_text()
            if text.startswith("$ANSIBLE_VAULT"):
                raise ValueError(f"{path} is encrypted")
            data = yaml.safe_load(text) or {}
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"no password for {', '.join(missing)} in the environment "
                             f"({', '.join(env[k] for k in missing if k in env)}) and the "
                             f"vault file cannot be read: {exc}") from None
        for k in missing:
            if data.get(keys[k]):
                out[k] = str(data[keys[k]])
    still = [k for k in keys if k not in out]
    if still:
        raise ValueError(f"no password for {', '.join(still)}: set "
                         f"{', '.join(env.get(k, k) for k in still)}")
    return out


def mysql_checks(p: dict[str, Any]) -> None:
    import pymysql

    from shardfleet.tls import TLS

    my = p["mysql"]
    tls = TLS(ca_cert=my.get("ca_cert") or None)
    for pair, sides in sorted(my["pairs"].items()):
        for side, host in sorted(sides.items()):
            node = f"{pair}{side} ({host})"
            try:
                conn = pymysql.connect(host=host, port=my["port"], user=my["admin"]["user"],
                                       password=p["passwords"]["mysql_admin"], connect_timeout=5,
                                       cursorclass=pymysql.cursors.DictCursor,
                                       **tls.pymysql_kwargs())
                with conn, conn.cursor() as cur:
                    cur.execute("SELECT @@GLOBAL.read_only AS ro")
                    ro = cur.fetchone()["ro"]
                    cur.execute("SHOW REPLICA STATUS")
                    rs = cur.fetchone() or {}
                check(f"mysql {node} admin login", True)
                check(f"mysql {node} replication running",
                      rs.get("Slave_IO_Running") == "Yes" and rs.get("Slave_SQL_Running") == "Yes",
                      f"IO={rs.get('Slave_IO_Running')} SQL={rs.get('Slave_SQL_Running')}")
                # read_only is ON until the shards play makes the master writable.
                print(f"       read_only={'ON' if ro else 'OFF'}")
            except pymysql.MySQLError as exc:
                check(f"mysql {node} admin login", False, str(exc))
            try:
                pymysql.connect(host=host, port=my["port"], user=my["app"]["user"],
                                password=p["passwords"]["mysql_app"], connect_timeout=5,
                                **tls.pymysql_kwargs()).close()
                check(f"mysql {node} app login" + (" over TLS" if tls.enabled else ""), True)
            except pymysql.MySQLError as exc:
                check(f"mysql {node} app login", False, str(exc))
            if tls.enabled:  # the fleet has TLS: the server must not take a plaintext login
                try:
                    pymysql.connect(host=host, port=my["port"], user=my["app"]["user"],
                                    password=p["passwords"]["mysql_app"], connect_timeout=5,
                                    ssl_disabled=True).close()
                    check(f"mysql {node} refuses a plaintext client", False, "it logged in")
                except pymysql.MySQLError as exc:
                    check(f"mysql {node} refuses a plaintext client",
                          exc.args and exc.args[0] == 1045, str(exc))


def zookeeper_checks(p: dict[str, Any]) -> None:
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoAuthError

    zk = KazooClient(hosts=p["zookeeper"]["hosts"], timeout=10)
    zk.start(timeout=20)
    try:
        root = p["zookeeper"]["root"]
        check(f"zookeeper {root} exists", zk.exists(root) is not None)
        try:
            zk.create(f"{root}/smoke-anonymous", b"x")
            check("zookeeper refuses an anonymous write", False, "the write was accepted")
            zk.delete(f"{root}/smoke-anonymous")
        except NoAuthError:
            check("zookeeper refuses an anonymous write", True)
    finally:
        zk.stop()
        zk.close()


def cache_checks(p: dict[str, Any]) -> None:
    import redis
    from pymemcache.client.base import Client

    r = p["redis"]
    # TLS only when the profile names the fleet's CA: the server's name checked too
    tls = ({"ssl": True, "ssl_ca_certs": r["ca_cert"], "ssl_check_hostname": True}
           if r.get("ca_cert") else {})
    if tls:
        try:
            redis.Redis(host=r["host"], port=r["port"], password=p["passwords"]["redis"],
                        socket_timeout=5).ping()
            check("redis refuses a plaintext client", False, "it answered")
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            check("redis refuses a plaintext client", True)
    try:
        redis.Redis(host=r["host"], port=r["port"], socket_timeout=5, **tls).ping()
        check("redis refuses a client without the password", False)
    except redis.exceptions.AuthenticationError:
        check("redis refuses a client without the password", True)
    except redis.exceptions.ResponseError as exc:
        check("redis refuses a client without the password", "NOAUTH" in str(exc), str(exc))
    client = redis.Redis(host=r["host"], port=r["port"], password=p["passwords"]["redis"],
                         socket_timeout=5, **tls)
    client.set("shardfleet:smoke", "ok", ex=60)
    check("redis round trip", client.get("shardfleet:smoke") == b"ok")

    m = p["memcached"]
    mc = Client((m["host"], m["port"]), connect_timeout=5, timeout=5)
    mc.set("shardfleet-smoke", b"ok", expire=60)
    check("memcached round trip", mc.get("shardfleet-smoke") == b"ok")
    mc.close()


def router_roundtrip(p: dict[str, Any], cluster: str) -> None:
    """Write an object through the routing library and read it back."""
    from shardfleet import ids
    from shardfleet.mapstore import ZooKeeperMapStore
    from shardfleet.router import Router
    from shardfleet.store import Store
    from shardfleet.tls import TLS

    zk = p["zookeeper"]
    mapstore = ZooKeeperMapStore(zk["hosts"], cluster, root=zk["root"])
    try:
        if mapstore.read().map is None:
            check("shard map registered", False, f"no map at {mapstore.path}")
            return
        router = Router(mapstore, user=p["mysql"]["app"]["user"],
                        password=p["passwords"]["mysql_app"],
                        tls=TLS(ca_cert=p["mysql"].get("ca_cert") or None))
        store = Store(router)
        try:
            body = {"smoke": True, "at": time.time()}
            object_id = store.create("pin", body)
            got = store.get(object_id)
            oid = ids.decompose(object_id)
            check(f"router round trip (object {object_id}: shard {oid.shard}, pin, local ID "
                  f"{oid.local}, on {router.range_for(oid.shard).master})",
                  got.get("at") == body["at"], repr(got))
        finally:
            store.close()
    finally:
        close = getattr(mapstore, "close", None)
        if close:
            close()


def monitoring_checks(p: dict[str, Any]) -> None:
    """Prometheus's targets all up and no alert firing; Alertmanager ready (the profile's
    "monitoring", written when the fleet runs it). A target is scraped every 15 s: a
    fleet that just came up gets a minute to show every one up."""
    import urllib.request

    mon = p.get("monitoring")
    if not mon:
        return

    def get(url: str) -> Any:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the fleet's own
            return json.loads(resp.read().decode())

    deadline = time.monotonic() + 90
    while True:
        targets = get(f"{mon['prometheus']}/api/v1/targets?state=active")["data"]["activeTargets"]
        down = [f"{t['scrapePool']} {t['labels'].get('instance')} ({t['health']}"
                f"{': ' + t['lastError'] if t['lastError'] else ''})"
                for t in targets if t["health"] != "up"]
        if targets and not down or time.monotonic() > deadline:
            break
        time.sleep(3)
    check(f"Prometheus scrapes {len(targets)} targets, every one up", bool(targets) and not down,
          "; ".join(down) or ("no target" if not targets else ""))
    firing = sorted({a["labels"]["alertname"] for a in get(f"{mon['prometheus']}/api/v1/alerts")
                     ["data"]["alerts"] if a["state"] == "firing"})
    check("no alert firing", not firing, ", ".join(firing))
    with urllib.request.urlopen(f"{mon['alertmanager']}/-/ready", timeout=10) as resp:  # noqa: S310
        check("Alertmanager ready", resp.status == 200)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / ".fleet" / "local.json"))
    ap.add_argument("--cluster", default="default", help="shard map cluster name")
    args = ap.parse_args()
    try:
        profile = json.loads(Path(args.profile).read_text())
    except (OSError, ValueError) as exc:
        print(f"fleet smoke test FAILED: cannot read the profile {args.profile}: {exc} "
              "(playbooks/fleet-status.yml writes it)")
        return 1
    print(f"fleet smoke test ({args.profile})")
    try:
        profile["passwords"] = passwords(profile)
    except ValueError as exc:
        print(f"fleet smoke test FAILED: {exc}")
        return 1
    # each group of checks reports its own failures; an error it did not expect (a server
    # gone, a missing profile key) is one failed line too, never a traceback
    for name, run in (("mysql", lambda: mysql_checks(profile)),
                      ("zookeeper", lambda: zookeeper_checks(profile)),
                      ("caches", lambda: cache_checks(profile)),
                      ("router round trip", lambda: router_roundtrip(profile, args.cluster)),
                      ("monitoring", lambda: monitoring_checks(profile))):
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - reported as one line
            check(name, False, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
    if failures:
        print(f"fleet smoke test FAILED: {', '.join(failures)}")
        return 1
    print("fleet smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
