#!/usr/bin/env python3
"""Routing overhead, measured side by side in one run (not a test).

Starts the integration servers (two MariaDB servers standing in for two pairs,
16 shards each, and a ZooKeeper holding the map) on 127.0.0.1, then measures:

1. ``store.get(id)`` through the router vs a raw PyMySQL primary-key select of
   the same row on the same server, over a connection with the same options
   (both parse the JSON body). Goal <= 1.10x.
2. ``store.get_many`` of 50 IDs over >= 8 shards vs one ``store.get`` per ID.
   Goal >= 5x faster.

Rounds alternate the two sides so machine noise hits both. Two estimates are
printed: the median of the per-round ratios, and the ratio of each side's best
round (the least disturbed run, as ``timeit`` advises); the goal is judged on
the best-round ratio. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardfleet import ids, provision  # noqa: E402
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore  # noqa: E402
from shardfleet.router import Router  # noqa: E402
from shardfleet.schema import default_schema  # noqa: E402
from shardfleet.shardmap import ShardMap  # noqa: E402
from shardfleet.store import Store  # noqa: E402
from shardfleet.testing import MariaDBServer, ZooKeeperServer  # noqa: E402

APP, APP_PW = "sf_app", "bench-app"
TIME_CAP = 120.0  # seconds, for the whole measurement


def setup(base: str):
    servers = [MariaDBServer(base, server_id=i + 1, extra=["--innodb-file-per-table=0"]).start()
               for i in range(2)]
    for s, shards in zip(servers, (range(0, 16), range(16, 32)), strict=True):
        s.sql(f"CREATE USER '{APP}'@'%%' IDENTIFIED BY %s", (APP_PW,))
        conn = s.connect(client_flag=provision.multi_statement_flags())
        provision.ensure_shards(conn, list(shards), default_schema(), app_user=APP)
        conn.close()
    zk = ZooKeeperServer(base).start()
    m = ShardMap.from_ranges([
        {"range": [0, 15], "master": servers[0].address, "state": "open"},
        {"range": [16, 31], "master": servers[1].address, "state": "open"}],
        mod_shard_count=32)
    ZooKeeperMapStore(zk.address, "bench").write(m, NO_NODE)
    return servers, zk


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--gets", type=int, default=300, help="single gets per round per side")
    ap.add_argument("--pages", type=int, default=20, help="50-ID fetches per round per side")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="sf-bench-")
    servers, zk = setup(base)
    try:
        router = Router(ZooKeeperMapStore(zk.address, "bench"), user=APP, password=APP_PW)
        store = Store(router)
        rng = random.Random(7)
        made = [store.create("pin", {"title": f"pin {i}", "n": i, "pad": "x" * 200})
                for i in range(400)]
        one = made[0]
        oid = ids.decompose(one)
        server = servers[0] if oid.shard < 16 else servers[1]
        # the same connection options as the router's pool, so the ratio is the routing
        # overhead (ID decode, map lookup, pool checkout), not socket settings
        raw = router.pool(server.address).connect()
        sql = f"SELECT body FROM `db{oid.shard:05d}`.`pins` WHERE local_id=%s"

        def raw_get():
            with raw.cursor() as cur:
                cur.execute(sql, (oid.local,))
                return json.loads(cur.fetchone()[0])

        assert raw_get() == store.get(one)
        # Two pages of 50 IDs: over 8 shards (the case: 4 shards on each server)
        # and over as many shards as a random sample of all objects touches (~28 of 32).
        by_shard: dict[int, list[int]] = {}
        for i in made:
            by_shard.setdefault(ids.shard_of(i), []).append(i)
        eight = sorted(by_shard)[:4] + sorted(by_shard)[-4:]
        pool8 = [i for s in eight for i in by_shard[s]]
        pages = {"8": rng.sample(pool8, 50), "wide": rng.sample(made, 50)}
        nshards = {k: len({ids.shard_of(i) for i in p}) for k, p in pages.items()}
        assert nshards["8"] == 8 and nshards["wide"] >= 8, nshards
        for p in pages.values():
            assert store.get_many(p).bodies() == [store.get(i) for i in p]
        deadline = time.monotonic() + TIME_CAP
        r1: list[float] = []
        r2: dict[str, list[float]] = {k: [] for k in pages}
        best = {"get": 1e9, "raw": 1e9}
        best.update({f"many{k}": 1e9 for k in pages})
        best.update({f"each{k}": 1e9 for k in pages})
        for i in range(args.rounds):
            if time.monotonic() > deadline:
                break
            if i % 2:
                a = timed(raw_get, args.gets)
                b = timed(lambda: store.get(one), args.gets)
            else:
                b = timed(lambda: store.get(one), args.gets)
                a = timed(raw_get, args.gets)
            r1.append(b / a)
            best.update(get=min(best["get"], b), raw=min(best["raw"], a))
            line = f"round {i + 1}: get {b * 1e6:.0f}us vs raw {a * 1e6:.0f}us (x{b / a:.3f})"
            for k, p in pages.items():
                def many(p=p):
                    return store.get_many(p)

                def each(p=p):
                    return [store.get(x) for x in p]

                if i % 2:
                    c, d = timed(each, args.pages), timed(many, args.pages)
                else:
                    d, c = timed(many, args.pages), timed(each, args.pages)
                r2[k].append(c / d)
                best[f"many{k}"] = min(best[f"many{k}"], d)
                best[f"each{k}"] = min(best[f"each{k}"], c)
                line += f"; {nshards[k]} shards x{c / d:.1f}"
            print(line, flush=True)
        g = best["get"] / best["raw"]
        print(f"\nrouter.get / raw PyMySQL select = {g:.3f}x best rounds "
              f"({best['get'] * 1e6:.1f}us vs {best['raw'] * 1e6:.1f}us), "
              f"{statistics.median(r1):.3f}x median  (goal <= 1.10x) "
              f"{'OK' if g <= 1.10 else 'MISSED'}")
        for k in pages:
            m = best[f"each{k}"] / best[f"many{k}"]
            goal = f"(goal >= 5x) {'OK' if m >= 5 else 'MISSED'}" if k == "8" else "(for scale)"
            print(f"get_many(50 IDs over {nshards[k]} shards) vs one get per ID = {m:.1f}x "
                  f"faster best rounds ({best[f'many{k}'] * 1e3:.2f}ms vs "
                  f"{best[f'each{k}'] * 1e3:.2f}ms), {statistics.median(r2[k]):.1f}x median  "
                  f"{goal}")
        raw.close()
        router.close()
        store.close()
    finally:
        zk.stop(remove=True)
        for s in servers:
            s.stop(remove=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
