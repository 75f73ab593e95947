#!/usr/bin/env python3
"""A board page through the caches, cold vs warm, measured side by side in one run (not a test).

Starts the integration servers on 127.0.0.1 (two MariaDB servers standing in for
two pairs, 16 shards each, a ZooKeeper holding the map, two memcached servers
for objects and one Redis for mapping lists), fills boards of 50 pins spread
over >= 8 shards, then times ``store.join("board_has_pins", board, 50)`` — the
mapping page and its 50 pins — three ways:

* ``db``   — a store without caches (the MySQL path: one page query, one
  multi-get statement per server, servers queried concurrently);
* ``cold`` — a store with both caches, empty (each page uses a key prefix never
  used before): both lookups miss, MySQL answers, the caches are filled;
* ``warm`` — the same store with the caches holding the page and its pins.

Rounds rotate the order of the three sides so machine noise hits all of them.
Printed: per round the mean page time of each side; at the end the ratio of
each side's best round (the least disturbed run, as ``timeit`` advises) and the
median of per-round ratios, and the hit ratio of each cache over the warm pages.
Goal: warm >= 10x faster than cold. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from route_overhead import APP, APP_PW, setup  # noqa: E402

from shardfleet import ids  # noqa: E402
from shardfleet.cache import MappingCache, ObjectCache, redis_options  # noqa: E402
from shardfleet.mapstore import ZooKeeperMapStore  # noqa: E402
from shardfleet.router import Router  # noqa: E402
from shardfleet.store import Store  # noqa: E402
from shardfleet.testing import MemcachedServer, RedisServer  # noqa: E402

TIME_CAP = 120.0  # seconds, for the whole measurement
PAGE = 50


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pages", type=int, default=30, help="pages per round per side")
    ap.add_argument("--boards", type=int, default=10, help="boards the pages rotate over")
    args = ap.parse_args()
    import redis

    base = tempfile.mkdtemp(prefix="sf-bench-")
    servers, zk = setup(base)
    mcs = [MemcachedServer(base).start() for _ in range(2)]
    rds = RedisServer(base).start()
    try:
        router = Router(ZooKeeperMapStore(zk.address, "bench"), user=APP, password=APP_PW)
        db = Store(router)
        oc = ObjectCache([m.address for m in mcs])
        mc = MappingCache(redis.Redis(host="127.0.0.1", port=rds.port, **redis_options()))
        cached = Store(router, object_cache=oc, mapping_cache=mc)
        boards = []
        for b in range(args.boards):
            board = db.create("board", {"title": f"board {b}"})
            for n in range(PAGE):
                # repins: pins live on their own (random) shards, so a page spans many
                pin = db.create("pin", {"title": f"pin {b}.{n}", "n": n,
                                        "image": f"https://i.example/{b}/{n}.jpg",
                                        "description": "x" * 300})
                db.add("board_has_pins", board, pin, sequence=1000 + n)
            boards.append(board)
        page0 = db.join("board_has_pins", boards[0], PAGE)[0]
        shards = {ids.shard_of(i) for i, _ in page0}
        assert len(page0) == PAGE and len(shards) >= 8, shards

        prefixes = iter(range(10**9))

        def page_db(board: int) -> None:
            db.join("board_has_pins", board, PAGE)

        def page_cold(board: int) -> None:
            n = next(prefixes)
            oc.prefix, mc.prefix = f"c{n}:o:", f"c{n}:m:"  # caches never used before
            cached.join("board_has_pins", board, PAGE)

        def page_warm(board: int) -> None:
            cached.join("board_has_pins", board, PAGE)

        def timed(fn, warm: bool) -> float:
            t0 = time.perf_counter()
            for i in range(args.pages):
                fn(boards[i % len(boards)])
            return (time.perf_counter() - t0) / args.pages

        # correctness first: all three sides give the same page
        oc.prefix, mc.prefix = "w:o:", "w:m:"
        assert cached.join("board_has_pins", boards[0], PAGE) == db.join(
            "board_has_pins", boards[0], PAGE)
        for b in boards:  # warm every board
            cached.join("board_has_pins", b, PAGE)
        assert cached.join("board_has_pins", boards[0], PAGE) == db.join(
            "board_has_pins", boards[0], PAGE)

        deadline = time.monotonic() + TIME_CAP
        best = {"db": 1e9, "cold": 1e9, "warm": 1e9}
        r_cold, r_db = [], []
        ohits = omiss = mhits = mmiss = 0
        sides = ["db", "cold", "warm"]
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                break
            got = {}
            for side in sides[r % 3:] + sides[:r % 3]:
                if side == "db":
                    got[side] = timed(page_db, False)
                elif side == "cold":
                    got[side] = timed(page_cold, False)
                else:
                    oc.prefix, mc.prefix = "w:o:", "w:m:"
                    oc.stats.reset()
                    mc.stats.reset()
                    got[side] = timed(page_warm, True)
                    ohits, omiss = ohits + oc.stats.hits, omiss + oc.stats.misses
                    mhits, mmiss = mhits + mc.stats.hits, mmiss + mc.stats.misses
            for k, v in got.items():
                best[k] = min(best[k], v)
            r_cold.append(got["cold"] / got["warm"])
            r_db.append(got["db"] / got["warm"])
            print(f"round {r + 1}: page db {got['db'] * 1e3:.2f}ms, cold {got['cold'] * 1e3:.2f}ms,"
                  f" warm {got['warm'] * 1e3:.3f}ms (cold/warm x{r_cold[-1]:.1f})", flush=True)
        cw = best["cold"] / best["warm"]
        dw = best["db"] / best["warm"]
        print(f"\nboard page ({PAGE} pins over {len(shards)} shards on 2 servers):")
        print(f"  cold caches / warm caches = {cw:.1f}x best rounds "
              f"({best['cold'] * 1e3:.2f}ms vs {best['warm'] * 1e3:.3f}ms), "
              f"{statistics.median(r_cold):.1f}x median  (goal >= 10x) "
              f"{'OK' if cw >= 10 else 'MISSED'}")
        print(f"  no caches   / warm caches = {dw:.1f}x best rounds "
              f"({best['db'] * 1e3:.2f}ms vs {best['warm'] * 1e3:.3f}ms), "
              f"{statistics.median(r_db):.1f}x median")
        print(f"  warm hit ratio: objects {ohits / max(1, ohits + omiss):.3f} "
              f"({ohits}/{ohits + omiss}), mapping pages {mhits / max(1, mhits + mmiss):.3f} "
              f"({mhits}/{mhits + mmiss})")
        cached.close()
        db.close()
        oc.close()
        mc.close()
        router.close()
    finally:
        rds.stop(remove=True)
        for m in mcs:
            m.stop(remove=True)
        zk.stop(remove=True)
        for s in servers:
            s.stop(remove=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
