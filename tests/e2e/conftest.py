"""The e2e fleet: site.yml applied by ansible-playbook to fresh podman containers.

The fleet is the shipped local inventory (inventories/local) renamed so it never
touches a developer's `make fleet`: containers ``sfe2e-*`` instead of ``sf-*``,
network ``shardfleet-e2e`` on 10.242.1.0/24, label ``shardfleet.fleet=e2e``.
Containers from an earlier run are removed first (fresh containers), and again at
the end unless SHARDFLEET_E2E_KEEP=1. SHARDFLEET_E2E_SKIP_TAGS (e.g. ``shards``)
skips plays of site.yml by tag, to test the server roles alone.
SHARDFLEET_E2E_ID / SHARDFLEET_E2E_OCTET (default ``e2e`` / ``1``) rename the fleet
(``sf<ID>-*``, network ``shardfleet-<ID>`` on 10.242.<OCTET>.0/24) so a second run
can go side by side with the first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardfleet.tls import TLS
from tests.integration.s3_fixtures import S3, moto_s3

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOCAL_INVENTORY = REPO / "inventories" / "local"
E2E_ID = os.environ.get("SHARDFLEET_E2E_ID", "e2e")
E2E_OCTET = int(os.environ.get("SHARDFLEET_E2E_OCTET", "1"))
PREFIX_FROM, PREFIX_TO = "sf-", f"sf{E2E_ID}-"
NET_FROM, NET_TO = "10.242.0.", f"10.242.{E2E_OCTET}."
# The fleet's shards (the shards role's shards_last + 1 and shards_mod_shard_count): 2,048
# in CI, 1,024 on each pair, where `make fleet` builds the design's 4,096. Creating them
# is most of a fresh site.yml (365 s of 753 s for 4,096 on a busy machine), and the split
# and rebuild tests copy them. 1,024 on a node is still over 14,000 tablespaces, more
# than a container's 8,192 open files (the physical rebuild's close-files path).
# SHARDFLEET_E2E_SHARDS=4096 runs the tier at the full count.
SHARDS = int(os.environ.get("SHARDFLEET_E2E_SHARDS", "2048"))
E2E_VARS = {
    "shardfleet_network": f"shardfleet-{E2E_ID}",
    "shardfleet_network_subnet": f"10.242.{E2E_OCTET}.0/24",
    "shardfleet_fleet_label": E2E_ID,
    "shards_last": SHARDS - 1,
    "shards_mod_shard_count": SHARDS,
}
# The fleet runs with TLS (inventories/local: mysql_tls_enabled): site.yml makes its CA
# in .fleet/tls/<label>/ (a fresh one each run) and every server refuses plaintext TCP
# clients, so the tests connect as the playbooks do, verifying the servers with it.
TLS_DIR = REPO / ".fleet" / "tls" / E2E_ID
E2E_TLS = TLS(ca_cert=str(TLS_DIR / "ca.pem"))
# Redis serves TLS only (the redis role with shardfleet_tls_enabled): redis-py's options
E2E_REDIS_TLS = {"ssl": True, "ssl_ca_certs": str(TLS_DIR / "ca.pem"), "ssl_check_hostname": True}
# seconds, a bound against a hung playbook: a fresh site.yml takes 280 s on a quiet
# 2-core machine, and passed 900 s beside a fault campaign (the fixture then failed all
# 33 tests)
PLAYBOOK_TIMEOUT = 1800


@dataclass
class Run:
    """One ansible-playbook run: exit code, combined output, wall time."""

    rc: int
    output: str
    seconds: float

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP counters per host."""
        out: dict[str, dict[str, int]] = {}
        for m in re.finditer(r"^(\S+)\s+: ((?:\w+=\d+\s*)+)$", self.output, re.M):
            out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
        return out


_STATUS_ROW = re.compile(
    r"PAIR (?P<pair>\S+): "
    r"|NOT IN THE MAP"
    r"|(?:^|\s)(?P<role>master|standby|pair\d+|-) (?P<node>\S+) \d+\.\d+\.\d+\.\d+:\d+ "
    r"(?:read_only=|DOWN|ERROR)(?P<down>\S*)"
    r"|channel (?:none|\S+ <- \S+(?: \([^)]*\))?: (?P<io_sql>\S+/\S+),)")


def replication_rows(status_output: str) -> dict[str, tuple[str, str]]:
    """fleet-status.yml's MySQL servers: {node: (pair, "IO/SQL")}, "Yes/Yes" when every
    channel of the node runs ("-/-" with none, "DOWN" when it does not answer). The pair
    is the map's (its PAIR header), or the inventory's for a server no range names."""
    rows: dict[str, tuple[str, str]] = {}
    pair, node = "?", None
    for m in _STATUS_ROW.finditer(" ".join(status_output.split())):
        if m.group("pair"):
            pair, node = m.group("pair"), None
        elif m.group(0) == "NOT IN THE MAP":
            pair, node = "-", None
        elif m.group("node"):
            node = m.group("node")
            role = m.group("role")
            mine = role if role not in ("master", "standby") else pair
            down = m.group(0).rstrip().endswith(("DOWN", "ERROR"))
            rows[node] = (mine, "DOWN" if down else "-/-")
        elif node is not None:
            got = m.group("io_sql")
            if got is None:
                continue  # channel none
            mine, have = rows[node]
            rows[node] = (mine, got if have in ("-/-", "Yes/Yes") else have)
    return rows


def assert_pairs_replicate(play: Any, inventory: Path | None = None, *,
                           except_pairs: tuple[str, ...] = (), timeout: float = 120) -> str:
    """Run fleet-status.yml (through *play*: a callable taking the playbook path) until
    every MySQL node of every pair but *except_pairs* shows replication IO/SQL Yes/Yes
    (bounded; a node just restarted may take a moment to connect); the last output."""
    deadline = time.monotonic() + timeout
    while True:
        rc, out = play(REPO / "playbooks" / "fleet-status.yml")
        rows = replication_rows(out)
        bad = {n: v for n, v in rows.items() if v[0] not in except_pairs and v[1] != "Yes/Yes"}
        # rc: a node of an excepted pair may be down (unreachable, failed); the table says
        if rows and not bad:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"fleet-status.yml: pairs not replicating both ways: {bad} "
                                 f"(rc {rc})\n{out[-3000:]}")
        time.sleep(3)


def awaiting_rebuild(fleet: Fleet, shard_map: Any) -> tuple[str, ...]:
    """Pairs the map marks for a standby rebuild (after an emergency promotion): their old
    master does not replicate until rebuild-standby.yml runs."""
    by_ip = {f"{v['shardfleet_container_ip']}:3306": v.get("shardfleet_pair")
             for v in fleet.hosts.values() if v.get("shardfleet_pair")}
    return tuple(sorted({str(by_ip.get(r.master)) for r in shard_map.ranges
                         if r.extra.get("rebuild") and by_ip.get(r.master)}))


@dataclass
class Fleet:
    inventory: Path
    extra_vars: Path
    hosts: dict[str, dict[str, Any]]  # inventory name -> host vars (with group)
    secrets: dict[str, str]
    runs: dict[str, Run] = field(default_factory=dict)

    def playbook(self, name: str, *args: str, inventory: Path | None = None) -> Run:
        """ansible-playbook *name* with *args* on the fleet's inventory (or *inventory*: a
        test's copy with pairs it added)."""
        env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_FORCE_COLOR="0", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
        start = time.monotonic()
        proc = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", str(inventory or self.inventory),
             "-e", f"@{self.extra_vars}",
             str(REPO / "playbooks" / name), *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=PLAYBOOK_TIMEOUT, check=False)
        run = Run(proc.returncode, proc.stdout, time.monotonic() - start)
        logs = os.environ.get("SHARDFLEET_E2E_LOGS")  # every run's output, for a profile
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            n = len(list(Path(logs).iterdir()))
            (Path(logs) / f"{n:03d}-{name}.log").write_text(
                f"# {' '.join(args)} rc={run.rc} {run.seconds:.0f}s\n{run.output}")
        return run

    def group(self, name: str) -> list[str]:
        return sorted(h for h, v in self.hosts.items() if v["group"] == name)

    def ip(self, host: str) -> str:
        return str(self.hosts[host]["shardfleet_container_ip"])


def _write_inventory(dest: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    # pairs a developer added to the shipped inventory (make fleet-add) are not this fleet's
    shutil.copytree(LOCAL_INVENTORY, dest, ignore=shutil.ignore_patterns("added-pairs.yml"))
    text = (LOCAL_INVENTORY / "hosts.yml").read_text()
    text = text.replace(f" {PREFIX_FROM}", f" {PREFIX_TO}").replace(NET_FROM, NET_TO)
    (dest / "hosts.yml").write_text(text)
    inv = yaml.safe_load(text)
    hosts: dict[str, dict[str, Any]] = {}
    for group, body in inv["all"]["children"]["fleet"]["children"].items():
        for host, hv in body["hosts"].items():
            hosts[host] = dict(hv, group=group)
    assert hosts and all(h.startswith(PREFIX_TO) for h in hosts), hosts
    vault = yaml.safe_load((LOCAL_INVENTORY / "group_vars" / "all" / "vault.yml").read_text())
    return hosts, {k: str(v) for k, v in vault.items()}


@pytest.fixture(scope="session")
def fleet(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: run `make host-deps`")
    image = os.environ.get("SHARDFLEET_IMAGE", "localhost/shardfleet-base:bookworm")
    if subprocess.run(["podman", "image", "exists", image], check=False).returncode != 0:
        pytest.fail(f"image {image} is missing: run `make image`")
    tmp = tmp_path_factory.mktemp("e2e")
    hosts, secrets = _write_inventory(tmp / "inventory")
    extra = tmp / "e2e-vars.yml"
    extra.write_text(yaml.safe_dump(E2E_VARS))
    f = Fleet(tmp / "inventory", extra, hosts, secrets)

    down = f.playbook("fleet-down.yml")  # fresh containers: nothing left from an earlier run
    assert down.rc == 0, down.output[-3000:]
    shutil.rmtree(TLS_DIR, ignore_errors=True)  # and a fresh CA
    try:
        up = f.playbook("fleet-up.yml")
        assert up.rc == 0, f"fleet-up.yml failed:\n{up.output[-3000:]}"
        f.runs["fleet-up"] = up
        skip = os.environ.get("SHARDFLEET_E2E_SKIP_TAGS", "")
        site_args = ["--skip-tags", skip] if skip else []
        f.runs["site-fresh"] = f.playbook("site.yml", *site_args)
        # the reruns are test_site's (a session of the operation tests alone, make
        # e2e's second fleet, goes without them)
        site_tests = any(item.path.name == "test_site.py" for item in request.session.items)
        if f.runs["site-fresh"].rc == 0 and site_tests:
            # The first rerun takes the converged fast path (test_site: the fresh run's
            # stamps, the shards play's naming the map it registered); the next checks
            # every task on every host (the fast path off: the roles' idempotence) and is
            # also the -vvv run the password test reads.
            f.runs["site-rerun-fast"] = f.playbook("site.yml", *site_args)
            f.runs["site-rerun-vvv"] = f.playbook(
                "site.yml", "-vvv", "-e", "shardfleet_converged_fast_path=false", *site_args)
        yield f
    finally:
        timings = ", ".join(f"{k} {v.seconds:.0f}s" for k, v in f.runs.items())
        print(f"\ne2e timings: {timings}")
        if os.environ.get("SHARDFLEET_E2E_KEEP") != "1":
            f.playbook("fleet-down.yml")


@pytest.fixture(scope="session")
def s3(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """moto's S3 on the fleet network's gateway address (this machine's side of the
    bridge), a free port there: backup.yml's --check (tests/e2e/checkmode.py) and the
    backup test's backups."""
    net = E2E_VARS["shardfleet_network"]
    p = subprocess.run(["podman", "network", "inspect", net], capture_output=True, text=True,
                       check=True)
    gateways = [s.get("gateway") for n in json.loads(p.stdout)
                for s in (n.get("subnets") or [])] or _cni_gateways(p.stdout)
    gateway = next((g for g in gateways if g), None)
    assert gateway, f"podman network {net} has no gateway: {p.stdout[:2000]}"
    with moto_s3(gateway, tmp_path_factory.mktemp("moto-e2e"), timeout=60) as server:
        yield server


def _cni_gateways(text: str) -> list[str]:
    """A CNI network's gateways (podman's inspect of a CNI network shows its conflist)."""
    return re.findall(r'"gateway":\s*"([\d.]+)"', text)
