#!/usr/bin/env python3
"""The split's clone at volume (not a test): how its rate grows with ``clone_parallel``,
against the physical copy's raw limit, side by side in one run.

Starts a source MariaDB, a target pair and ZooKeeper on 127.0.0.1, fills the source's 32
shards with about --gib GiB (JSON bodies of about 1 KiB, mapping rows; generation is not
measured), then times the split's ``clone`` step (shardfleet.split, the product path:
one snapshot, rows through this process into the target master, binlogged, applied by
the target's standby) of the upper 16 shards with 1, 2 and 4 connections, in rounds that
rotate the order (the machine is shared), and once ``mariadb-backup --stream | mbstream
-x`` of the whole source (the physical copy's raw limit, bench/copy_volume.py). Printed:
each side's best round in MB/s of the moving data (InnoDB's data length), the ratios
between them, and the physical limit's rate, as "figure, goal, OK/MISSED" where the
issue names a goal. Every loop is bounded in count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from copy_volume import generate, raw_limit  # noqa: E402

from shardfleet import physical, provision  # noqa: E402
from shardfleet.schema import default_schema  # noqa: E402
from shardfleet.testing import MariaDBServer, ZooKeeperServer  # noqa: E402
from shardfleet.testing.kit import APP_USER, SplitFleet, make_server, pair_up  # noqa: E402

MOVING = (16, 31)
BIG = ["--innodb-buffer-pool-size=512M", "--innodb-log-file-size=256M",
       "--max-allowed-packet=64M"]


def moving_bytes(src: MariaDBServer) -> int:
    dbs = [f"db{s:05d}" for s in range(MOVING[0], MOVING[1] + 1)]
    return int(src.sql("SELECT COALESCE(SUM(DATA_LENGTH + INDEX_LENGTH), 0) FROM "
                       "information_schema.TABLES WHERE TABLE_SCHEMA IN "
                       f"({', '.join(['%s'] * len(dbs))})", dbs)[0][0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="source data (default 1 GiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parallel", default="1,2,4", help="clone_parallel values to compare")
    args = ap.parse_args()
    sides = [int(x) for x in args.parallel.split(",")]
    base = Path(tempfile.mkdtemp(prefix="sf-bench-clone-"))
    zk = ZooKeeperServer(base).start()
    src = make_server(base, 11, extra=BIG)
    ta, tb = make_server(base, 31, "a", BIG), make_server(base, 32, "b", BIG)
    pair_up(ta, tb)
    fleet = SplitFleet(src, ta, tb, zk.address)
    best: dict[int, float] = {}
    try:
        print(f"generating about {args.gib} GiB over 32 shards ...", flush=True)
        generate(src, 32, args.gib)
        conn = src.connect(client_flag=provision.multi_statement_flags())
        provision.ensure_shards(conn, list(range(32)), default_schema(), app_user=APP_USER)
        conn.close()
        src.sql("FLUSH TABLES")
        size = moving_bytes(src)
        print(f"moving data (shards {MOVING[0]}..{MOVING[1]}): {size / 2**20:.0f} MiB")
        for rnd in range(args.rounds):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            for n in order:
                fleet.reset(source=False)
                with fleet.split(moving=MOVING, clone_parallel=n) as sp:
                    t0 = time.monotonic()
                    res = {r.step: r for r in sp.run("clone")}["clone"]
                    s = time.monotonic() - t0
                best[n] = min(best.get(n, s), s)
                print(f"round {rnd + 1}: clone_parallel={n}: {s:.1f}s "
                      f"({size / s / 2**20:.1f} MB/s), {res.details.get('rows')} rows",
                      flush=True)
        work = base / "work"
        work.mkdir()
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            cnf = physical.client_defaults(tmp, "root", MariaDBServer.root_password)
            rs, rp, rn = raw_limit(src, work, cnf)
        print(f"\nsplit clone of {size / 2**20:.0f} MiB (best of {args.rounds} rounds):")
        one = best[sides[0]]
        for n in sides:
            print(f"  clone_parallel={n}: {best[n]:.1f}s = {size / best[n] / 2**20:.1f} MB/s, "
                  f"{one / best[n]:.2f}x clone_parallel={sides[0]}")
        print(f"  physical raw limit (mariadb-backup | mbstream, whole source, no prepare): "
              f"{rn / rs / 2**20:.1f} MB/s; prepare {rp:.1f}s")
        fastest = min(best.values())
        print(f"  physical raw limit / fastest clone = "
              f"{(rn / rs) / (size / fastest):.1f}x by rate")
    finally:
        fleet.close()
        for s in (src, ta, tb):
            s.stop(remove=True)
        zk.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
