#!/usr/bin/env python3
"""The split's clone at volume (not a test): how its rate grows with ``clone_parallel``,
against the physical copy's raw limit, side by side in one run.

Starts a source MariaDB, a target pair and ZooKeeper on 127.0.0.1, fills the source's 32
shards with about --gib GiB (JSON bodies of about 1 KiB, mapping rows; generation is not
measured), then times the split's ``clone`` step (shardfleet.operations.split, the product path:
one snapshot, rows through this process into the target master, binlogged, applied by
the target's standby) of the upper 16 shards with 1, 2 and 4 connections and the
physical clone (``clone="physical"``: mariadb-backup of the whole source streamed to both
target nodes at once, prepared and installed on each, attached: the shards the target
does not take dropped), in rounds that rotate the order (the machine is shared), and
once ``mariadb-backup --stream | mbstream -x`` of the whole source plus its prepare (the
physical copy's raw limit, bench/copy_volume.py). Printed:
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
from shardfleet.testing.kit import (  # noqa: E402
    APP_USER,
    SplitFleet,
    make_server,
    pair_up,
    physical_copy,
)

MOVING = (16, 31)
BIG = ["--innodb-buffer-pool-size=512M", "--innodb-log-file-size=256M",
       "--max-allowed-packet=64M"]


def moving_bytes(src: MariaDBServer) -> int:
    dbs = [f"db{s:05d}" for s in range(MOVING[0], MOVING[1] + 1)]
    return int(src.sql("SELECT COALESCE(SUM(DATA_LENGTH + INDEX_LENGTH), 0) FROM "
                       "information_schema.TABLES WHERE TABLE_SCHEMA IN "
                       f"({', '.join(['%s'] * len(dbs))})", dbs)[0][0])


def label(n: int | str) -> str:
    return "physical clone" if n == "physical" else f"clone_parallel={n}"


def physical_clone(fleet: SplitFleet, by_address: dict[str, MariaDBServer]
                   ) -> tuple[float, str]:
    """The split's physical clone, as split.yml runs it: the copy named, made node to
    node onto both target nodes (physical_copy), attached. (seconds, what it did)"""
    t0 = time.monotonic()
    with fleet.split(moving=MOVING, clone="physical") as sp:
        copy = sp.run("clone")[-1].details["copy"]
    pos, stats = physical_copy(by_address, copy, parallel=4)
    t1 = time.monotonic()
    with fleet.split(moving=MOVING, clone="physical", copy_position=pos,
                     copy_id=copy["copy_id"], copy_stats=stats) as sp:
        res = sp.run("clone")[-1]
    t2 = time.monotonic()
    return t2 - t0, (f"copy {stats['bytes'] / 2**20:.0f} MiB streamed to 2 nodes in "
                     f"{stats['seconds']:.1f}s, prepared and installed by {t1 - t0:.1f}s, "
                     f"attach {t2 - t1:.1f}s ({res.msg[:60]}...)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="source data (default 1 GiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parallel", default="1,2,4", help="clone_parallel values to compare")
    ap.add_argument("--no-physical", action="store_true", help="skip the physical clone")
    args = ap.parse_args()
    sides: list[int | str] = [int(x) for x in args.parallel.split(",")]
    if not args.no_physical:
        sides.append("physical")
    base = Path(tempfile.mkdtemp(prefix="sf-bench-clone-"))
    zk = ZooKeeperServer(base).start()
    src = make_server(base, 11, extra=BIG)
    # target nodes boot read_only, as the mysql role's do (the physical clone's attach
    # checks that a node runs on a fresh copy)
    ta = make_server(base, 31, "a", BIG + ["--read-only=ON"])
    tb = make_server(base, 32, "b", BIG + ["--read-only=ON"])
    pair_up(ta, tb)
    fleet = SplitFleet(src, ta, tb, zk.address)
    best: dict[int | str, float] = {}
    by_address = {x.address: x for x in (src, ta, tb)}
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
                if n == "physical":
                    s, what = physical_clone(fleet, by_address)
                else:
                    with fleet.split(moving=MOVING, clone_parallel=int(n)) as sp:
                        t0 = time.monotonic()
                        res = {r.step: r for r in sp.run("clone")}["clone"]
                        s = time.monotonic() - t0
                    what = f"{res.details.get('rows')} rows"
                best[n] = min(best.get(n, s), s)
                print(f"round {rnd + 1}: {label(n)}: {s:.1f}s "
                      f"({size / s / 2**20:.1f} MB/s of moving data), {what}", flush=True)
        work = base / "work"
        work.mkdir()
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            cnf = physical.client_defaults(tmp, "root", MariaDBServer.root_password)
            rs, rp, rn = raw_limit(src, work, cnf)
        print(f"\nsplit clone of {size / 2**20:.0f} MiB (best of {args.rounds} rounds):")
        one = best[sides[0]]
        for n in sides:
            print(f"  {label(n)}: {best[n]:.1f}s = {size / best[n] / 2**20:.1f} MB/s of "
                  f"moving data, {one / best[n]:.2f}x {label(sides[0])}")
        print(f"  physical raw limit (mariadb-backup | mbstream, whole source): stream "
              f"{rs:.1f}s ({rn / rs / 2**20:.1f} MB/s), prepare {rp:.1f}s, total "
              f"{rs + rp:.1f}s")
        logical = min(v for k, v in best.items() if k != "physical")
        print(f"  physical raw limit / fastest logical clone = "
              f"{(rn / rs) / (size / logical):.1f}x by rate")
        if "physical" in best:
            ph = best["physical"]
            # the clone copies the whole source onto two nodes; the raw limit, once
            print(f"  physical clone (whole source to both target nodes at once, prepared, "
                  f"installed, attached) = {ph / (rs + rp):.2f}x the raw limit's time for "
                  f"one copy; {ph / (2 * (rs + rp)):.2f}x for the bytes it moves (two "
                  f"copies; goal <= 1.5x) "
                  f"{'OK' if ph / (2 * (rs + rp)) <= 1.5 else 'MISSED'}")
            print(f"  physical clone vs fastest logical clone: {logical / ph:.1f}x faster")
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
