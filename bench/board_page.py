#!/usr/bin/env python3
"""A board page through the caches, measured against the raw clients' limit, side by side
in one run (not a test).

Starts the integration servers on 127.0.0.1 (two MariaDB servers standing in for
two pairs, 16 shards each, a ZooKeeper holding the map, two memcached servers
for objects and one Redis for mapping lists), fills boards of 50 pins spread
over >= 8 shards, then times a board page (the mapping page and its 50 pins,
JSON-decoded) four ways:

* ``raw``  — the physical limit: what a hand-written script costs for the same
  keys and the same decoded bodies. redis-py reads the page of the board's
  cached sorted set with one ``EVALSHA`` whose script returns ``ZREVRANGE …
  WITHSCORES`` as one packed string (the fastest redis-py route: a plain
  ``ZREVRANGE`` reply of 100 bulk strings costs redis-py's pure-Python parser
  more than the round trip; ``--zrevrange`` times that instead), then raw
  ``get`` commands on the object cache's own pooled pymemcache connections ask
  both memcached servers for the 50 keys, each server's sent before any reply is
  read, the replies parsed by a minimal loop and the bodies decoded with
  ``json.loads``. Each key's server is known in advance (no hashing at all).
* ``warm`` — ``store.join("board_has_pins", board, 50)`` with both caches holding
  the page and its pins. Goal: <= 1.3x raw. The MySQL statements it sends are
  counted on the servers (``Com_select`` deltas, corrected by the delta of the
  counting itself): goal 0 per page.
* ``db``   — a store without caches (one page query, one multi-get statement per
  server, servers queried at once).
* ``cold`` — a store with both caches, empty (each page uses a key prefix never
  used before): both lookups miss, MySQL answers, the caches are filled.
  Goal: cold <= 1.25x db (filling the caches must not double a page's cost).

Rounds rotate the order of the sides so machine noise hits all of them. Printed:
per round the mean page time of each side; at the end each ratio from the sides'
best rounds (the least disturbed runs, as ``timeit`` advises; the goals are judged
on these) and the median of the per-round ratios, as "figure, goal, OK/MISSED".
Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import json
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

TIME_CAP = 150.0  # seconds, for the whole measurement
PAGE = 50
SIDES = ["raw", "warm", "db", "cold"]


class RawPage:
    """The hand-written board page: redis-py for the list, raw memcached sockets for the
    objects (every server asked before any reply is read), json.loads for the bodies.

    Fair to the limit: it uses the same connections as the library (the Redis client's
    and the object cache's pooled memcached connections; on 2 shared cores a
    connection's cost depends on where its server thread is scheduled), and each key's
    server is known in advance (placement computed once, as a script that knows its
    keys would), so it pays no hashing at all."""

    def __init__(self, rds, oc, zkey_of, okey_prefix: str, objects,
                 zrevrange: bool = False) -> None:
        self.rds = rds
        self.zkey_of = zkey_of
        self.prefix = okey_prefix
        self.zrevrange = zrevrange
        self.read = rds.register_script(
            "return table.concat(redis.call('ZREVRANGE', KEYS[1], 0, ARGV[1] - 1, "
            "'WITHSCORES'), ' ')")
        hc = oc.client
        self.pools = [hc.clients[n].client_pool for n in sorted(hc.clients)]
        index = {n: i for i, n in enumerate(sorted(hc.clients))}
        self.where = {oid: index[hc.hasher.get_node(oc.key(oid))] for oid in objects}

    def page(self, board: int) -> list[tuple[int, dict]]:
        if self.zrevrange:
            rows = self.rds.zrevrange(self.zkey_of(board), 0, PAGE - 1, withscores=True)
            order = [int(m) for m, _ in rows]
        else:
            packed = self.read(keys=[self.zkey_of(board)], args=[PAGE]).split()
            order = [int(m) for m in packed[::2]]
        batches: list[list[bytes]] = [[] for _ in self.pools]
        prefix = self.prefix.encode()
        for oid in order:
            batches[self.where[oid]].append(b"%s%d" % (prefix, oid))
        asked = []
        for pool, keys in zip(self.pools, batches, strict=True):
            if keys:
                conn = pool.get()
                conn.sock.sendall(b"get " + b" ".join(keys) + b"\r\n")
                asked.append((pool, conn))
        plen = len(prefix)
        bodies: dict[int, dict] = {}
        for pool, conn in asked:
            sock = conn.sock
            buf = sock.recv(1 << 20)
            while not buf.endswith(b"END\r\n"):
                buf += sock.recv(1 << 20)
            pool.release(conn)
            pos, end = 0, len(buf) - 5
            while pos < end:
                eol = buf.index(b"\r\n", pos)
                _, key, _, size = buf[pos:eol].split()
                start = eol + 2
                stop = start + int(size)
                bodies[int(key[plen:])] = json.loads(buf[start:stop])
                pos = stop + 2
        return [(oid, bodies[oid]) for oid in order]


def com_select(servers) -> int:
    return sum(int(s.sql("SHOW GLOBAL STATUS LIKE 'Com_select'")[0][1]) for s in servers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pages", type=int, default=30, help="pages per round per side")
    ap.add_argument("--boards", type=int, default=10, help="boards the pages rotate over")
    ap.add_argument("--profile", choices=SIDES, help="profile one side instead (cProfile)")
    ap.add_argument("--zrevrange", action="store_true",
                    help="raw side reads the page with a plain ZREVRANGE WITHSCORES")
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
        rclient = redis.Redis(host="127.0.0.1", port=rds.port, **redis_options())
        mc = MappingCache(rclient, prefix="w:m:")
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

        # correctness first: every side gives the same page
        oc.prefix, mc.prefix = "w:o:", "w:m:"
        assert cached.join("board_has_pins", boards[0], PAGE) == db.join(
            "board_has_pins", boards[0], PAGE)
        for b in boards:  # warm every board
            cached.join("board_has_pins", b, PAGE)
        pins = [i for b in boards for i, _ in db.join("board_has_pins", b, PAGE)[0]]
        raw = RawPage(rclient, oc, lambda board: mc.keys("board_has_pins", board)[0], "w:o:",
                      pins, zrevrange=args.zrevrange)
        for b in boards:
            want = db.join("board_has_pins", b, PAGE)[0]
            assert cached.join("board_has_pins", b, PAGE)[0] == want
            assert raw.page(b) == want

        def page_raw(board: int) -> None:
            raw.page(board)

        fns = {"raw": page_raw, "warm": page_warm, "db": page_db, "cold": page_cold}

        def timed(side: str) -> float:
            if side != "cold":
                oc.prefix, mc.prefix = "w:o:", "w:m:"
            fn = fns[side]
            t0 = time.perf_counter()
            for i in range(args.pages):
                fn(boards[i % len(boards)])
            return (time.perf_counter() - t0) / args.pages

        if args.profile:
            import cProfile
            import pstats

            timed(args.profile)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                timed(args.profile)
            prof.disable()
            st = pstats.Stats(prof).sort_stats("tottime")
            st.print_stats(25)
            return 0

        # the counting's own Com_select delta (SHOW STATUS may count on some servers)
        null = com_select(servers)
        null = com_select(servers) - null
        deadline = time.monotonic() + TIME_CAP
        best = dict.fromkeys(SIDES, 1e9)
        ratios: dict[str, list[float]] = {"warm/raw": [], "cold/db": [], "cold/warm": []}
        warm_selects = warm_pages = 0
        ohits = omiss = mhits = mmiss = 0
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                break
            got = {}
            for side in SIDES[r % 4:] + SIDES[:r % 4]:
                if side == "warm":
                    oc.stats.reset()
                    mc.stats.reset()
                    before = com_select(servers)
                    got[side] = timed(side)
                    warm_selects += com_select(servers) - before - null
                    warm_pages += args.pages
                    ohits, omiss = ohits + oc.stats.hits, omiss + oc.stats.misses
                    mhits, mmiss = mhits + mc.stats.hits, mmiss + mc.stats.misses
                else:
                    got[side] = timed(side)
            for k, v in got.items():
                best[k] = min(best[k], v)
            ratios["warm/raw"].append(got["warm"] / got["raw"])
            ratios["cold/db"].append(got["cold"] / got["db"])
            ratios["cold/warm"].append(got["cold"] / got["warm"])
            print(f"round {r + 1}: raw {got['raw'] * 1e6:.0f}us, warm {got['warm'] * 1e6:.0f}us,"
                  f" db {got['db'] * 1e6:.0f}us, cold {got['cold'] * 1e6:.0f}us "
                  f"(warm/raw x{ratios['warm/raw'][-1]:.2f}, cold/db x{ratios['cold/db'][-1]:.2f})",
                  flush=True)

        def line(name: str, a: str, b: str, goal: float | None) -> str:
            x = best[a] / best[b]
            med = statistics.median(ratios[f"{a}/{b}"])
            verdict = "" if goal is None else (
                f"(goal <= {goal}x) {'OK' if x <= goal else 'MISSED'}")
            return (f"  {name:<27} = {x:.2f}x best rounds ({best[a] * 1e6:.0f}us vs "
                    f"{best[b] * 1e6:.0f}us), {med:.2f}x median  {verdict}")

        print(f"\nboard page ({PAGE} pins over {len(shards)} shards on 2 servers, "
              f"2 memcached, 1 Redis):")
        print(line("warm page / raw limit", "warm", "raw", 1.3))
        per_page = warm_selects / max(1, warm_pages)
        print(f"  {'MySQL statements per warm page':<27} = {per_page:.2f} (Com_select delta "
              f"{warm_selects} over {warm_pages} pages)  (goal 0) "
              f"{'OK' if warm_selects == 0 else 'MISSED'}")
        print(line("cold page / no-caches page", "cold", "db", 1.25))
        print(line("cold page / warm page", "cold", "warm", None) + "(for scale)")
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
