#!/usr/bin/env python3
"""How the fleet's playbooks grow with the number of pairs (not a test): the same steps
on a container fleet of 2 pairs and of 16 pairs, side by side.

For each size it builds its own fleet (sfscale-* containers on network shardfleet-scale,
10.242.3.0/24, so a developer's `make fleet` and the e2e fleet are left alone) with all
4,096 shards spread over the pairs, then times:

* ``fleet-up.yml``, the first ``site.yml``, a rerun with every task checked on every
  host (``-e shardfleet_converged_fast_path=false``, the drift check), the rerun on the
  converged fast path (``changed`` must be 0 for both), and that again with a fork for
  every host (ansible.cfg's forks is 10);
* ``fleet-status.yml``;
* ``fleet-add.yml`` of one new pair, then ``split.yml`` of the top 64 shards of pair001
  onto it under a writer (its longest wait on a moving shard and on the others);
* ``promote.yml`` (planned) of pair001 under a writer on pair001's shards (its longest
  stall);

and the memory of each MariaDB container once the site ran. Every MariaDB runs with the
simulation's settings below (a 32 MB buffer pool): the point is many servers on one
machine, not their throughput.

CPU is split in two: the control node's (ansible-playbook and the podman client it
runs, from the children's rusage) and the rest of the machine's (the containers and
podman's runtime, from /proc/stat). On a real fleet each host has its own CPU; here all
of them share this machine's cores, so the second part is what makes a wall-clock ratio
of this simulation pessimistic. Both are printed per step.

    .venv/bin/python bench/site_scale.py                  # 2 and 16 pairs (about 45 min on 2 cores)
    .venv/bin/python bench/site_scale.py --pairs 2,4      # other sizes
    .venv/bin/python bench/site_scale.py --reruns-only    # fresh site.yml and fast reruns
    .venv/bin/python bench/site_scale.py --keep           # leave the last fleet running

Needs the image (make image) and the venv. Logs stay in .cache/bench/scale-<N>/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardfleet.mapstore import ZooKeeperMapStore  # noqa: E402
from shardfleet.router import Router  # noqa: E402
from shardfleet.shardmap import ShardMap  # noqa: E402
from shardfleet.store import Store  # noqa: E402
from shardfleet.testing.kit import Writer  # noqa: E402
from shardfleet.tls import TLS  # noqa: E402

BIN = ROOT / ".venv" / "bin"
INVENTORY = ROOT / "inventories" / "local"
PREFIX = "sfscale-"
NET = "10.242.3."
# the fleet has TLS (inventories/local): site.yml makes its CA here (label "scale")
FLEET_TLS = TLS(ca_cert=str(ROOT / ".fleet" / "tls" / "scale" / "ca.pem"))
SPLIT_SHARDS = 64  # the split moves the top 64 of pair001's range, whatever its size
# The simulation's MariaDB: many small servers on one machine.
SIM_VARS = {
    "shardfleet_network": "shardfleet-scale",
    "shardfleet_network_subnet": f"{NET}0/24",
    "shardfleet_fleet_label": "scale",
    "mysql_innodb_buffer_pool_size": "32M",
    "mysql_max_connections": 100,
    "mysql_extra_settings": {
        "performance_schema": "OFF",
        "innodb_log_buffer_size": "4M",
        "key_buffer_size": "1M",
        "aria_pagecache_buffer_size": "8M",
        "table_open_cache": 400,
        "table_definition_cache": 400,
    },
}
PLAYBOOK_TIMEOUT = 3600  # seconds, a bound against a hung playbook


@dataclass
class Step:
    name: str
    seconds: float
    control_cpu: float  # ansible-playbook and its children (the podman client)
    machine_cpu: float  # every core's busy time, all processes
    note: str = ""


@dataclass
class Fleet:
    pairs: int
    work: Path
    logs: Path
    secrets: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    played: int = 0  # playbook runs so far (their logs' numbers)
    memory_mib: list[float] = field(default_factory=list)

    @property
    def inventory(self) -> Path:
        return self.work / "inventory"

    @property
    def zk(self) -> str:
        return ",".join(f"{NET}{31 + i}:2181" for i in range(3))

    def play(self, playbook: str, *args: str, label: str = "", check: bool = True,
             note: str = "") -> str:
        cmd = [str(BIN / "ansible-playbook"), "-i", str(self.inventory),
               "-e", f"@{self.work / 'vars.yml'}", str(ROOT / "playbooks" / playbook), *args]
        env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   PATH=f"{BIN}:{os.environ['PATH']}")
        name = label or playbook.removesuffix(".yml")
        with _measure() as m:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, check=False,
                                  timeout=PLAYBOOK_TIMEOUT)
        (self.logs / f"{self.played:02d}-{name}.log").write_text(proc.stdout)
        self.played += 1
        if check and proc.returncode != 0:
            raise SystemExit(f"{self.pairs} pairs: {playbook} {' '.join(args)} failed "
                             f"(rc {proc.returncode}):\n{proc.stdout[-3000:]}")
        self.steps.append(Step(name, m.seconds, m.control, m.machine, note))
        return proc.stdout


class _measure:
    """Wall time, the children's CPU and the machine's busy CPU across a block."""

    def __enter__(self) -> _measure:
        self._t = time.monotonic()
        self._c = _children_cpu()
        self._m = _machine_busy()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self._t
        self.control = _children_cpu() - self._c
        self.machine = _machine_busy() - self._m


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _machine_busy() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _hosts(pairs: int) -> dict:
    mysql = {}
    for p in range(1, pairs + 1):
        for i, side in enumerate("ab"):
            mysql[f"{PREFIX}mysql{p:03d}{side}"] = {
                "shardfleet_pair": f"pair{p:03d}", "shardfleet_side": side,
                "shardfleet_container_ip": f"{NET}{100 + 2 * p - 1 + i}"}
    groups = {
        "mysql": {"hosts": mysql},
        "zookeeper": {"hosts": {f"{PREFIX}zk{i}": {"shardfleet_container_ip": f"{NET}{30 + i}"}
                                for i in (1, 2, 3)}},
        "redis": {"hosts": {f"{PREFIX}redis1": {"shardfleet_container_ip": f"{NET}41"}}},
        "memcached": {"hosts": {f"{PREFIX}memcached1": {"shardfleet_container_ip": f"{NET}51"}}},
        # Prometheus, Alertmanager, the shardfleet exporter (the local inventory's monitoring)
        "monitoring": {"hosts": {f"{PREFIX}monitor1": {"shardfleet_container_ip": f"{NET}56"}}},
    }
    return {"all": {"children": {"fleet": {"children": groups}}}}


def _fleet(pairs: int) -> Fleet:
    work = Path(tempfile.mkdtemp(prefix=f"shardfleet-scale{pairs}."))
    shutil.copytree(INVENTORY, work / "inventory",
                    ignore=shutil.ignore_patterns("added-pairs.yml"))
    (work / "inventory" / "hosts.yml").write_text(
        "---\n" + yaml.safe_dump(_hosts(pairs), sort_keys=True))
    (work / "vars.yml").write_text(yaml.safe_dump(SIM_VARS))
    logs = ROOT / ".cache" / "bench" / f"scale-{pairs}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    vault = yaml.safe_load((INVENTORY / "group_vars" / "all" / "vault.yml").read_text())
    return Fleet(pairs, work, logs, {k: str(v) for k, v in vault.items()})


def _recap_changed(out: str) -> tuple[int, int]:
    """(changed tasks, hosts with a recap line: those that ran a task) of a PLAY RECAP."""
    rows = re.findall(r"^\S+\s+: ok=\d+\s+changed=(\d+)", out, re.M)
    return sum(int(x) for x in rows), len(rows)


def _memory(f: Fleet) -> list[float]:
    """Each MariaDB container's memory in MiB (podman stats: its cgroup's usage)."""
    names = [f"{PREFIX}mysql{p:03d}{s}" for p in range(1, f.pairs + 1) for s in "ab"]
    out = subprocess.run(["podman", "stats", "--no-stream", "--format", "{{.MemUsageBytes}}",
                          *names], capture_output=True, text=True, check=True).stdout
    unit = {"B": 2**-20, "KiB": 2**-10, "kB": 1000 / 2**20, "MiB": 1.0, "GiB": 1024.0}
    mib = []
    for line in out.splitlines():  # e.g. "143.2MiB / 23.54GiB"
        m = re.match(r"\s*([\d.]+)\s*([A-Za-z]+)", line)
        if m and m.group(2) in unit:
            mib.append(float(m.group(1)) * unit[m.group(2)])
    return mib


def _map(f: Fleet) -> ShardMap:
    store = ZooKeeperMapStore(f.zk, "default")
    try:
        m = store.read().map
    finally:
        store.close()
    if m is None:
        raise SystemExit(f"{f.pairs} pairs: ZooKeeper holds no shard map after site.yml")
    return m


def _router(f: Fleet) -> tuple[Router, Store]:
    router = Router(ZooKeeperMapStore(f.zk, "default"), user="shardfleet_app",
                    password=f.secrets["vault_mysql_app_password"], frozen_wait=60,
                    connect_timeout=2, read_timeout=10, tls=FLEET_TLS)
    return router, Store(router)


def _under_writer(f: Fleet, shards: list[int], watched: set[int], playbook: str,
                  *args: str, label: str) -> str:
    """Run *playbook* while a writer writes to *shards*; the note: the writer's longest
    wait on *watched* and on the rest, its longest stall, and its errors."""
    router, store = _router(f)
    w = Writer(store, shards, threads=3, seconds=900, max_ops=90_000, pause=0.01).start()
    try:
        if not w.wait_acks(100, timeout=120):
            raise SystemExit(f"{f.pairs} pairs: the writer made no progress: {w.errors[-3:]}")
        since = time.monotonic()  # the writer's clock
        out = f.play(playbook, *args, label=label)
        w.wait_acks(100, timeout=120)
    finally:
        log = w.stop()
        store.close()
        router.close()
    rest = set(shards) - watched
    stall = w.longest_stall(since=since)
    # the operation's own measure: the split's write hold, the promotion's frozen time
    own = re.search(r'(write_stall_seconds|"frozen_seconds")[:"]*\s*([\d.]+)', out)
    ours = f"{own.group(1).strip(chr(34))} {float(own.group(2)):.3f}s (the playbook's); " \
        if own else ""
    note = (f"{ours}writer: longest wait {log.longest(watched, since):.2f}s on the moved or "
            f"promoted shards, {log.longest(rest, since):.2f}s on others; longest stall "
            f"{stall:.2f}s; {len(log.latencies)} writes, {len(log.errors)} errors")
    f.steps[-1].note = note
    return note


def run(pairs: int, keep: bool, reruns_only: bool = False) -> Fleet:
    f = _fleet(pairs)
    print(f"== {pairs} pairs ({2 * pairs} MariaDB + 3 ZooKeeper, Redis, memcached)", flush=True)
    try:
        f.play("fleet-down.yml", label="fleet-down-stale")
        f.steps.clear()
        f.play("fleet-up.yml")
        f.play("site.yml", label="site-fresh")
        # the converged fast path right after the fresh run (whose shards play stamped the
        # map it registered), every task checked on every host (the fast path off), then
        # the fast path again: the steady state a configuration rerun meets
        reruns = (("site-rerun", ()),
                  ("site-rerun-full", ("-e", "shardfleet_converged_fast_path=false")),
                  ("site-rerun-again", ()))
        for label, args in reruns:
            out = f.play("site.yml", *args, label=label)
            changed, hosts = _recap_changed(out)
            f.steps[-1].note = f"changed={changed}; {hosts} hosts ran a task"
            if changed:
                raise SystemExit(f"{pairs} pairs: {label} changed {changed} tasks; see {f.logs}")
        # the same rerun with a fork for every host (ansible.cfg has forks = 10)
        out = f.play("site.yml", "--forks", str(2 * pairs + 5), label="site-rerun-forks")
        changed, hosts = _recap_changed(out)
        f.steps[-1].note = f"--forks {2 * pairs + 5}: changed={changed}; {hosts} hosts ran a task"
        f.memory_mib = _memory(f)
        if reruns_only:
            return f
        f.play("fleet-status.yml")

        new = f"pair{pairs + 1:03d}"
        f.play("fleet-add.yml", "-e", f"pair={new}")
        m = _map(f)
        source = next(r for r in m.ranges if r.first == 0)
        lo, hi = source.last - SPLIT_SHARDS + 1, source.last
        rng = random.Random(pairs)
        moving = rng.sample(range(lo, hi + 1), 8)
        staying = rng.sample(range(source.first, lo), 4)
        elsewhere = rng.sample(range(source.last + 1, 4096), 4)
        _under_writer(f, moving + staying + elsewhere, set(moving), "split.yml",
                      "-e", "split_source_pair=pair001", "-e", f"split_target_pair={new}",
                      "-e", json.dumps({"split_range": [lo, hi]}), label="split")

        promoted = rng.sample(range(source.first, lo), 8)
        _under_writer(f, promoted, set(promoted), "promote.yml", "-e", "pair=pair001",
                      label="promote-planned")
    finally:
        if not keep:
            f.play("fleet-down.yml", label="fleet-down", check=False)
            f.steps.pop()
        shutil.rmtree(f.work, ignore_errors=True)
    return f


def report(fleets: list[Fleet]) -> None:
    base = fleets[0]
    print()
    head = "".join(f"{f'{f.pairs} pairs':>22}" for f in fleets)
    print(f"{'step':<18}{head}   ratio (wall, control CPU)")
    print(f"{'':<18}" + "".join(f"{'wall s  ctl/all CPU s':>22}" for _ in fleets))
    for i, step in enumerate(base.steps):
        cells = ""
        for f in fleets:
            s = f.steps[i]
            cells += f"{s.seconds:>8.1f} {s.control_cpu:>6.0f}/{s.machine_cpu:<6.0f}"
        last = fleets[-1].steps[i]
        ratio = (f"{last.seconds / step.seconds:5.2f}x {last.control_cpu / step.control_cpu:5.2f}x"
                 if step.seconds and step.control_cpu else "")
        print(f"{step.name:<18}{cells}   {ratio}")
    print()
    for f in fleets:
        for s in f.steps:
            if s.note:
                print(f"{f.pairs:>3} pairs {s.name}: {s.note}")
    for f in fleets:
        if f.memory_mib:
            print(f"{f.pairs:>3} pairs: MariaDB container memory median "
                  f"{statistics.median(f.memory_mib):.0f} MiB, max {max(f.memory_mib):.0f} MiB "
                  f"(buffer pool {SIM_VARS['mysql_innodb_buffer_pool_size']})")
    steps = {s.name: s for s in base.steps}
    print()
    for name, what, goal in (("site-rerun-again", "converged plain rerun", 45),
                             ("site-rerun-full", "full-path rerun", 90)):
        if name in steps:
            print(f"{what} on {base.pairs} pairs: {steps[name].seconds:.1f} s "
                  f"(goal <= {goal} s on 2 pairs, a quiet machine)")
    if len(fleets) > 1:
        a, b = base.steps, fleets[-1].steps
        print()
        for name, what in (("site-rerun", "rerun (converged fast path)"),
                           ("site-rerun-again", "second rerun (converged fast path)"),
                           ("site-rerun-full", "full rerun (fast path off)")):
            i = next((i for i, s in enumerate(a) if s.name == name), None)
            if i is None:
                continue
            print(f"{what} on {fleets[-1].pairs} pairs / on {base.pairs}: "
                  f"{b[i].seconds / a[i].seconds:.2f}x wall"
                  f"{'' if name.endswith('full') else ' (goal <= 1.5x)'}, "
                  f"{b[i].control_cpu / a[i].control_cpu:.2f}x control-node CPU")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="2,16", help="fleet sizes, comma-separated (2,16)")
    ap.add_argument("--keep", action="store_true", help="leave the last fleet running")
    ap.add_argument("--reruns-only", action="store_true",
                    help="the first site.yml and the reruns only (no status, add, split or "
                         "promotion): about 30 min for 2 and 16 pairs")
    args = ap.parse_args()
    sizes = [int(x) for x in args.pairs.split(",")]
    if shutil.which("podman") is None:
        raise SystemExit("podman is missing: run `make host-deps`")
    fleets = []
    for i, n in enumerate(sizes):  # each size's numbers as soon as it is done
        fleets.append(run(n, args.keep and i == len(sizes) - 1, args.reruns_only))
        report(fleets[-1:])
    if len(fleets) > 1:
        report(fleets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
