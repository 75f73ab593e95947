"""The caches on the container fleet: site.yml's memcached and Redis in front of its shards.

Uses the e2e tier's session fleet (tests/e2e/conftest.py: fresh ``sfe2e-*``
containers with site.yml applied); it stops the cache services for a moment and
starts them again.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.e2e.conftest import E2E_REDIS_TLS, E2E_TLS, Fleet

pytestmark = pytest.mark.e2e


def _service(container: str, action: str, unit: str) -> None:
    subprocess.run(["podman", "exec", container, "systemctl", action, unit], check=True,
                   timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_caches_serve_the_fleet_and_a_stopped_cache_is_a_miss(fleet: Fleet) -> None:
    import redis

    from shardfleet.cache import MappingCache, ObjectCache, redis_options
    from shardfleet.mapstore import ZooKeeperMapStore
    from shardfleet.router import Router
    from shardfleet.store import Store

    assert fleet.runs["site-fresh"].rc == 0, "site.yml must converge first"
    zk = ",".join(f"{fleet.ip(h)}:2181" for h in fleet.group("zookeeper"))
    router = Router(ZooKeeperMapStore(zk, "default"), user="shardfleet_app",
                    password=fleet.secrets["vault_mysql_app_password"], tls=E2E_TLS)
    mem_hosts, redis_host = fleet.group("memcached"), fleet.group("redis")[0]
    oc = ObjectCache([f"{fleet.ip(h)}:11211" for h in mem_hosts], prefix=f"e2e{time.time_ns()}:o:")
    mc = MappingCache(redis.Redis(host=fleet.ip(redis_host),
                                  password=fleet.secrets["vault_redis_password"],
                                  **redis_options(1.0), **E2E_REDIS_TLS),
                      prefix=f"e2e{time.time_ns()}:m:")
    store = Store(router, object_cache=oc, mapping_cache=mc)
    try:
        board = store.create("board", {"title": "e2e"})
        pins = [store.create("pin", {"n": i}, near=board) for i in range(6)]
        for seq, p in enumerate(pins):
            store.add("board_has_pins", board, p, sequence=seq + 1)
        page = store.join("board_has_pins", board, 50)[0]
        assert [b["n"] for _, b in page] == [5, 4, 3, 2, 1, 0]
        oc.stats.reset()
        mc.stats.reset()
        assert store.join("board_has_pins", board, 50)[0] == page
        assert (oc.stats.hits, mc.stats.hits) == (6, 1), "the warm page comes from the caches"
        store.update(pins[0], {"n": 100})
        store.remove("board_has_pins", board, pins[5])
        assert [b["n"] for _, b in store.join("board_has_pins", board, 50)[0]] == [4, 3, 2, 1, 100]

        for h in mem_hosts:
            _service(h, "stop", "memcached")
        _service(redis_host, "stop", "redis-server")
        try:
            for _ in range(3):
                got = store.join("board_has_pins", board, 50)[0]
                assert [b["n"] for _, b in got] == [4, 3, 2, 1, 100], "MySQL answers"
            store.update(pins[1], {"n": 101})  # writes succeed with the caches down
            assert store.get(pins[1])["n"] == 101
            assert oc.health.errors > 0 and mc.health.errors > 0
        finally:
            for h in mem_hosts:
                _service(h, "start", "memcached")
            _service(redis_host, "start", "redis-server")
    finally:
        store.close()
        router.close()
