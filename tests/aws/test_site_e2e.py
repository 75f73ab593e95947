"""End to end: the aws_ec2 inventory against moto runs playbooks/site.yml on containers.

provision-aws.yml builds a small fleet in moto (1 MySQL pair, 1 ZooKeeper, 1 Redis, 1
memcached, 1 monitoring host). Each "instance" is then a podman container named like its
Name tag, on a podman network of the test's own whose addresses are the instances'
private IPs, so the shipped inventory's ``shardfleet_address`` (the private IP) is used
unchanged. Only the connection is composed differently: the collection's
``shardfleet.fleet.podman`` (pipelined ``podman exec``) to the container named by the
Name tag, instead of SSH to the public address. site.yml then runs unchanged, and the
fleet must work: the pair replicates both ways across "zones", ZooKeeper answers, Redis
and memcached serve the other hosts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aws.helpers import (
    BIN,
    REPO,
    Moto,
    ansible_env,
    instances,
    inventory_list,
    provision,
    write_test_inventory,
)
from tests.prometheus import wait_targets_up

pytestmark = pytest.mark.e2e

# Container names are the Name tags: the cluster name is the test's own prefix.
CLUSTER = "sfaws"
NETWORK = "sfaws-e2e"
LABEL = "shardfleet.fleet=sfaws-e2e"
VPC_CIDR = "10.243.0.0/16"  # also the podman network's subnet: containers take the private IPs
SUBNETS = ["10.243.0.0/24", "10.243.1.0/24"]
IMAGE_DEFAULT = "localhost/shardfleet-base:bookworm"
PODMAN_RUN = [
    "--runtime=runc",
    "--systemd=always",
    "--ulimit=nofile=8192:8192",
    "--ulimit=nproc=8192:8192",
]
FLEET_VARS = {
    "ec2_fleet_cluster": CLUSTER,
    "ec2_fleet_vpc_cidr": VPC_CIDR,
    "ec2_fleet_subnet_cidrs": SUBNETS,
    "ec2_fleet_components": {
        "mysql": {
            "count": 1,
            "instance_type": "r6i.large",
            "data_volume": {"size": 100, "iops": 3000, "throughput": 125},
        },
        "zookeeper": {"count": 1, "instance_type": "t3.small"},
        "redis": {"count": 1, "instance_type": "t3.small"},
        "memcached": {"count": 1, "instance_type": "t3.small"},
        "monitoring": {"count": 1, "instance_type": "t3.small"},
    },
}
# How the test reaches the "instances": everything else comes from the shipped file.
CONTAINER_COMPOSE = {
    "ansible_connection": "'shardfleet.fleet.podman'",
    "ansible_host": "ec2_tags.Name",
    "ansible_user": "'root'",
    "shardfleet_become": "false",
}


# seconds, a bound against a hung site.yml (6 containers, 256 shards): 4 min on a quiet
# 2-core machine; beside make test's other lanes and two CPU hogs it ran past 900 s
SITE_TIMEOUT = 1800


def podman(*args: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def remove_own_containers() -> None:
    """Remove this test's containers and network (leftovers of an earlier run too)."""
    listed = podman("ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}")
    names = set(listed.stdout.split())
    listed = podman("ps", "--all", "--filter", f"name=^{CLUSTER}-", "--format", "{{.Names}}")
    names |= {n for n in listed.stdout.split() if n.startswith(f"{CLUSTER}-")}
    # On a loaded machine podman may give up waiting for a container's processes to die
    # after its SIGKILL ("given PIDs did not die within timeout"): the next try finds
    # them gone.
    for attempt in range(4):
        if not names:
            break
        gone = podman("rm", "--force", "--time", "10", *sorted(names), timeout=300,
                      check=attempt == 3)
        if gone.returncode == 0:
            break
        time.sleep(5)
        names = {n for n in names
                 if podman("container", "exists", n, check=False).returncode == 0}
    if podman("network", "exists", NETWORK, check=False).returncode == 0:
        podman("network", "rm", "--force", NETWORK)


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make host-deps` (scripts/bootstrap-host.sh)")
    name = os.environ.get("SHARDFLEET_IMAGE") or IMAGE_DEFAULT
    if podman("image", "exists", name, check=False).returncode != 0:
        script = REPO / "scripts" / "build-image.sh"
        if not script.exists():
            pytest.fail(f"image {name} is missing and scripts/build-image.sh does not exist")
        proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"build-image.sh failed:\n{proc.stdout[-3000:]}{proc.stderr}"
    return name


@pytest.fixture(scope="module")
def fleet(
    moto_server: Moto, image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Provision in moto, then boot one container per instance; yields the inventory."""
    tmp = tmp_path_factory.mktemp("e2e")
    started = time.monotonic()
    provision(moto_server, tmp, FLEET_VARS).check()
    provisioned = time.monotonic() - started

    inv = write_test_inventory(moto_server, tmp / "inventory", compose=CONTAINER_COMPOSE)
    # The local fleet's test-only secrets stand in for the vault a real fleet encrypts.
    local_vault = REPO / "inventories" / "local" / "group_vars" / "all" / "vault.yml"
    shutil.copy(local_vault, inv / "group_vars" / "all" / "vault.yml")
    data = inventory_list(moto_server, inv, CLUSTER)
    hostvars: dict[str, dict[str, Any]] = data["_meta"]["hostvars"]
    addresses = {name: hv["shardfleet_address"] for name, hv in hostvars.items()}
    assert len(addresses) == 6, f"expected 6 instances in the inventory: {sorted(addresses)}"

    remove_own_containers()
    try:
        podman("network", "create", "--subnet", VPC_CIDR, "--label", LABEL, NETWORK)
        for name, ip in sorted(addresses.items()):
            hosts = [f"--add-host={o}:{oip}" for o, oip in sorted(addresses.items()) if o != name]
            podman(
                "run", "--detach", "--name", name, "--hostname", name, "--label", LABEL,
                "--network", NETWORK, "--ip", ip, *hosts, *PODMAN_RUN,
                image, "/lib/systemd/systemd",
            )  # fmt: skip
        for name in addresses:
            deadline = time.monotonic() + 90
            while True:
                state = podman("exec", name, "systemctl", "is-system-running", check=False)
                if state.stdout.strip() in ("running", "degraded"):
                    break
                assert time.monotonic() < deadline, f"{name}: systemd did not boot: {state.stdout}"
                time.sleep(1)
        yield {
            "inventory": inv,
            "data": data,
            "addresses": addresses,
            "hostvars": hostvars,
            "provision_seconds": provisioned,
        }
    finally:
        remove_own_containers()


# The e2e tier (tests/e2e) proves site.yml's 4,096 shards; here the question is the
# inventory, so the shards play creates 256 to keep the tier inside the CI budget.
SHARD_VARS = ["-e", "shards_last=255", "-e", "shards_mod_shard_count=256"]


def tls_dir(inventory: Path) -> str:
    """The test fleet's CA directory (the aws inventory has TLS on; SHARDFLEET_TLS_DIR)."""
    return str(inventory.parent / "tls")


def run_site(moto: Moto, inventory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(REPO / "playbooks" / "site.yml"),
         *SHARD_VARS, "-e", "shardfleet_tls_ca_generate=true"],
        cwd=REPO,
        env=ansible_env(moto, SHARDFLEET_CLUSTER=CLUSTER, SHARDFLEET_TLS_DIR=tls_dir(inventory)),
        capture_output=True,
        text=True,
        timeout=SITE_TIMEOUT,
    )


def sh(container: str, script: str, timeout: int = 60) -> str:
    proc = podman("exec", container, "sh", "-c", script, check=False, timeout=timeout)
    assert proc.returncode == 0, f"{container}: `{script}` failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def wait_for(container: str, script: str, expect: str, seconds: int = 60) -> str:
    deadline = time.monotonic() + seconds
    while True:
        proc = podman("exec", container, "sh", "-c", script, check=False)
        if expect in proc.stdout:
            return proc.stdout
        assert time.monotonic() < deadline, (
            f"{container}: `{script}` never printed {expect!r}; last:\n{proc.stdout}\n{proc.stderr}"
        )
        time.sleep(1)


TCP_ASK = (
    "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); "
    "s.sendall(sys.argv[3].encode().decode('unicode_escape').encode()); "
    "import time; time.sleep(0.3); print(s.recv(4096).decode())"
)


def ask(container: str, host: str, port: int, message: str) -> str:
    """Send ``message`` to host:port from inside ``container`` and return the reply."""
    proc = podman(
        "exec", container, "python3", "-c", TCP_ASK, host, str(port), message, check=False
    )
    assert proc.returncode == 0, f"{container} -> {host}:{port}: {proc.stderr}"
    return proc.stdout


def test_site_yml_through_the_aws_inventory_builds_a_working_fleet(
    moto_server: Moto, fleet: dict[str, Any]
) -> None:
    names = {
        g: sorted(fleet["data"][g]["hosts"])
        for g in ("mysql", "zookeeper", "redis", "memcached", "monitoring")
    }
    assert names == {
        "mysql": [f"{CLUSTER}-mysql001a", f"{CLUSTER}-mysql001b"],
        "zookeeper": [f"{CLUSTER}-zk1"],
        "redis": [f"{CLUSTER}-redis1"],
        "memcached": [f"{CLUSTER}-memcached1"],
        "monitoring": [f"{CLUSTER}-monitor1"],
    }
    live = {i["TagMap"]["Name"]: i for i in instances(moto_server, CLUSTER)}
    side_a, side_b = names["mysql"]
    assert (
        live[side_a]["Placement"]["AvailabilityZone"]
        != live[side_b]["Placement"]["AvailabilityZone"]
    )

    started = time.monotonic()
    site = run_site(moto_server, fleet["inventory"])
    elapsed = time.monotonic() - started
    output = site.stdout + site.stderr
    assert site.returncode == 0, f"site.yml failed through the aws inventory:\n{output[-8000:]}"
    print(f"provision {fleet['provision_seconds']:.0f}s, site.yml {elapsed:.0f}s")

    addr = fleet["addresses"]
    # The pair replicates both ways, each side from the other's private (VPC) address.
    for me, peer in ((side_a, side_b), (side_b, side_a)):
        status = sh(me, "mysql -e 'SHOW SLAVE STATUS\\G'")
        assert "Slave_IO_Running: Yes" in status and "Slave_SQL_Running: Yes" in status, (
            f"{me}: replication not running:\n{status}"
        )
        assert f"Master_Host: {addr[peer]}" in status, f"{me} does not replicate from {peer}"
    sh(side_a, "mysql -e 'CREATE DATABASE IF NOT EXISTS sfaws_e2e'")
    wait_for(side_b, "mysql -N -e 'SHOW DATABASES'", "sfaws_e2e", seconds=30)

    zk = names["zookeeper"][0]
    assert "imok" in ask(names["mysql"][0], addr[zk], 2181, "ruok"), "ZooKeeper did not answer ruok"
    vault = yaml.safe_load((fleet["inventory"] / "group_vars" / "all" / "vault.yml").read_text())
    # TLS on (the aws inventory's default): Redis answers a verified TLS client with the
    # password and no plaintext one; MySQL refuses a plaintext login over TCP
    redis = addr[names["redis"][0]]
    plain_redis = podman("exec", names["mysql"][0], "python3", "-c", TCP_ASK, redis, "6379",
                         f"AUTH {vault['vault_redis_password']}\\r\\nPING\\r\\n", check=False)
    assert "+PONG" not in plain_redis.stdout, "Redis answered a plaintext client"
    reply = sh(names["redis"][0], f"printf 'AUTH %s\\nPING\\n' '{vault['vault_redis_password']}' | "
               f"redis-cli --tls --cacert /etc/redis/tls/ca.pem -h {redis} -p 6379")
    assert "PONG" in reply, f"Redis did not answer PING after AUTH over TLS: {reply!r}"
    plain = podman("exec", side_a, "mysql", "--skip-ssl", "-h", addr[side_b], "-u",
                   "shardfleet_app", f"-p{vault['vault_mysql_app_password']}", "-e", "SELECT 1",
                   check=False)
    assert plain.returncode != 0 and "Access denied" in plain.stderr, plain.stderr
    for me in (side_a, side_b):
        assert "Master_SSL_Verify_Server_Cert: Yes" in sh(me, "mysql -e 'SHOW SLAVE STATUS\\G'")
    reply = ask(names["mysql"][0], addr[names["memcached"][0]], 11211, "version\\r\\n")
    assert reply.startswith("VERSION"), f"memcached did not answer version: {reply!r}"

    # Monitoring through the aws inventory: Prometheus on the monitoring host (its private
    # address) scrapes every exporter of every host, and every target answers.
    mon = names["monitoring"][0]
    expected = {("node", h) for hs in names.values() for h in hs} | {
        ("mysqld", h) for h in names["mysql"]} | {("redis", h) for h in names["redis"]} | {
        (job, mon) for job in ("shardfleet", "prometheus", "alertmanager")}
    wait_targets_up(lambda: json.loads(sh(
        mon, f"python3 -c \"import urllib.request; print(urllib.request.urlopen("
             f"'http://{addr[mon]}:9090/api/v1/targets').read().decode())\""))["data"]
        ["activeTargets"], expected)

    # fleet-status.yml through the same inventory: the map-centred table, read from the
    # control node (no socket, no container addresses, no fleet label), the caches asked
    # on their hosts; the passwords never printed and no profile written.
    profiles = REPO / ".fleet"
    before = set(profiles.glob("*")) if profiles.exists() else set()
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(fleet["inventory"]),
         str(REPO / "playbooks" / "fleet-status.yml")],
        cwd=REPO, env=ansible_env(moto_server, SHARDFLEET_CLUSTER=CLUSTER,
                                  SHARDFLEET_TLS_DIR=tls_dir(fleet["inventory"])),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    text = " ".join(out.split())
    assert proc.returncode == 0, f"fleet-status.yml failed (aws inventory):\n{out[-6000:]}"
    for secret in vault.values():
        assert str(secret) not in out, "a password reached fleet-status.yml's output"
    assert "PROBLEMS: none" in text, out[-6000:]
    for me, peer in ((side_a, side_b), (side_b, side_a)):
        assert f"{me} {addr[me]}:3306 read_only=" in text, out[-6000:]
        assert f"default <- {addr[peer]}:3306 ({peer}): Yes/Yes" in text, out[-6000:]
    assert f"master {side_a} {addr[side_a]}:3306 read_only=off" in text or (
        f"master {side_b} {addr[side_b]}:3306 read_only=off" in text), out[-6000:]
    assert "=standalone" in text or "=leader" in text, out[-6000:]
    assert f"redis {names['redis'][0]} {addr[names['redis'][0]]}:6379 PONG" in text, out[-6000:]
    assert f"memcached {names['memcached'][0]} {addr[names['memcached'][0]]}:11211 VERSION" \
        in text, out[-6000:]
    after = set(profiles.glob("*")) if profiles.exists() else set()
    assert after == before, f"fleet-status.yml wrote a profile (aws inventory): {after - before}"
