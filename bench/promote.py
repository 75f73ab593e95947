#!/usr/bin/env python3
"""Promotion timings on this machine (not a test): a real semi-sync master-master
MariaDB pair and ZooKeeper as host processes, a writer through the routing library.

* planned: the writer's longest stall during ``promote(mode="planned")``, over
  several promotions back and forth (goal < 1 s);
* emergency: SIGKILL the master, then the time from starting ``promote(mode=
  "emergency")`` to the first acknowledged write on the new master (goal < 5 s),
  followed by ``rebuild_standby`` (timed) so the pair is whole again;
* emergency on a silent master (SIGSTOP: nothing answers, no heartbeat reaches the
  standby): when the promotion decided it was dead, froze and flipped the map, and the
  first acknowledged write on the new master (goal < 5 s). The writer's write in flight
  on the stopped master waits for its answer; the router ends it when the map moves
  (it surfaces as a write that may have happened), or else it waits out the router's
  10 s read timeout and the writer's next write comes after it. ``--silent-only`` runs
  this case alone.

The container fleet's numbers (the playbooks, podman kill) come from
tests/e2e/test_zz_promote.py, which prints them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from shardfleet import ids  # noqa: E402
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore  # noqa: E402
from shardfleet.operations.promote import promote  # noqa: E402
from shardfleet.operations.rebuild import rebuild_standby  # noqa: E402
from shardfleet.operations.types import Options  # noqa: E402
from shardfleet.router import Router  # noqa: E402
from shardfleet.shardmap import ShardMap  # noqa: E402
from shardfleet.store import Store  # noqa: E402
from shardfleet.testing import MariaDBServer, ZooKeeperServer  # noqa: E402
from tests.integration.conftest import APP_PASSWORD, APP_USER  # noqa: E402
from tests.integration.test_promote import (  # noqa: E402
    REPL_PASSWORD,
    REPL_USER,
    Writer,
    _start,
    _wire,
    missing_ids,
    roles,
)


def setup(base: Path) -> list[MariaDBServer]:
    a, b = _start(base, 1), _start(base, 2)
    _wire(a, b)
    return [a, b]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--planned", type=int, default=5, help="planned promotions (default 5)")
    ap.add_argument("--silent-only", action="store_true",
                    help="only the emergency promotion of a silent (SIGSTOPped) master")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sf-bench-promote-"))
    zk = ZooKeeperServer(base).start()
    pair = setup(base)
    opts = Options(user="root", password=MariaDBServer.root_password, connect_timeout=2,
                   replication_user=REPL_USER, replication_password=REPL_PASSWORD)
    store = ZooKeeperMapStore(zk.address, "bench")
    master, standby = roles(pair)
    store.write(ShardMap.from_ranges([{"range": [0, 7], "master": master.address,
                                       "standby": standby.address, "state": "open"}],
                                     mod_shard_count=8), NO_NODE)
    router = Router(ZooKeeperMapStore(zk.address, "bench"), user=APP_USER,
                    password=APP_PASSWORD, frozen_wait=10, connect_timeout=2, read_timeout=10)
    st = Store(router)
    nodes = [s.address for s in pair]
    try:
        if not args.silent_only:
            kill_cases(args, st, store, pair, nodes, opts)
        silent_case(st, store, pair, nodes, opts)
    finally:
        st.close()
        router.close()
        store.close()
        for s in pair:
            s.stop(remove=True)
        zk.stop(remove=True)
        shutil.rmtree(base, ignore_errors=True)
    return 0


def kill_cases(args: argparse.Namespace, st: Store, store: ZooKeeperMapStore,
               pair: list[MariaDBServer], nodes: list[str], opts: Options) -> None:
    stalls, frozen = [], []
    w = Writer(st, max_seconds=300, near=ids.compose(0, 1, 1)).start()
    w.wait_acks(200)
    for _ in range(args.planned):
        t0 = time.monotonic()
        # back and forth on purpose: each run names the master it expects
        res = promote(store, "pair001", nodes, mode="planned", opts=opts,
                      expect_master=roles(pair)[0].address)
        w.wait_acks(200)
        stalls.append(w.longest_stall(since=t0 - 0.2))
        frozen.append(res.timings["frozen_seconds"])
    w.stop()
    lost = sum(len(missing_ids(s.connect(), w.acked)) for s in roles(pair)[:1])
    print(f"planned x{args.planned}: longest write stall max {max(stalls):.3f}s "
          f"median {sorted(stalls)[len(stalls) // 2]:.3f}s (goal < 1 s); frozen "
          f"max {max(frozen):.3f}s; {len(w.acked)} acked, {lost} lost")

    master, standby = roles(pair)
    w = Writer(st, max_seconds=120, near=ids.compose(0, 1, 1)).start()
    w.wait_acks(200)
    master.kill()
    t0 = time.monotonic()
    res = promote(store, "pair001", nodes, mode="emergency", opts=opts)
    t_done = time.monotonic()
    w.wait_acks(200)
    w.stop()
    first = w.first_ack_after(t0)
    lost = len(missing_ids(standby.connect(), w.acked))
    print(f"emergency: promote() {t_done - t0:.3f}s (dead decided "
          f"{res.timings.get('silence_checked', float('nan')):.3f}s, frozen "
          f"{res.timings.get('frozen', float('nan')):.3f}s); start -> first acknowledged write "
          f"on the new master {(first or float('nan')) - t0:.3f}s (goal < 5 s); "
          f"{len(w.acked)} acked, {lost} lost")
    master.start()
    t0 = time.monotonic()
    rebuild_standby(store, "pair001", nodes, opts=opts)
    print(f"rebuild_standby (8 shards): {time.monotonic() - t0:.2f}s")


def silent_case(st: Store, store: ZooKeeperMapStore, pair: list[MariaDBServer],
                nodes: list[str], opts: Options) -> None:
    # a master nobody hears (SIGSTOP: its sockets stay open, nothing answers; as a host
    # that vanished): deciding it is dead waits for the probe and the standby's silence
    master, standby = roles(pair)
    w = Writer(st, max_seconds=120, near=ids.compose(0, 1, 1)).start()
    w.wait_acks(200)
    assert master.proc is not None
    errors_before = len(w.errors)
    os.kill(master.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:  # the second emergency of the pair within a day names the master it expects
        res = promote(store, "pair001", nodes, mode="emergency", opts=opts,
                      expect_master=master.address)
        w.wait_acks(200)
    finally:
        master.kill()
    w.stop()
    # the first ack after the flip is the new master's: the old one stopped at t0, and
    # an ack just after t0 is an answer it sent before (promote()'s clock starts a
    # hair after t0, so t0 + its offset is at or before the flip)
    flipped = res.timings.get("flipped", float("nan"))
    first = w.first_ack_after(t0 + flipped)
    lost = len(missing_ids(standby.connect(), w.acked))
    errors = w.errors[errors_before:]
    print(f"emergency, silent master: dead decided {res.timings['silence_checked']:.3f}s, "
          f"frozen {res.timings['frozen']:.3f}s, map flipped {flipped:.3f}s; start -> "
          f"first acknowledged write on the new master "
          f"{(first or float('nan')) - t0:.3f}s (goal < 5 s); {len(w.acked)} acked, "
          f"{lost} lost; {len(errors)} write error(s) meanwhile"
          + (f", the first: {errors[0][:160]}" if errors else ""))
    master.start()
    rebuild_standby(store, "pair001", nodes, opts=opts)


if __name__ == "__main__":
    sys.exit(main())
