"""provision-aws.yml against moto: network, least-privilege groups, placement, idempotence.

The tests in this module share one provisioned cluster and run in file order:
first run -> rerun -> grow -> shrink (nothing terminated) -> terminate when asked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aws.helpers import (
    BIN,
    MUTATING,
    REPO,
    Moto,
    PlaybookRun,
    ansible_env,
    instances,
    inventory_list,
    provision,
    write_test_inventory,
)

pytestmark = pytest.mark.integration

CLUSTER = "sfaws-it"
# host name stem per component, as in inventories/local (sf-mysql001a, sf-zk1, ...)
STEM = {"mysql": "mysql", "zookeeper": "zk", "redis": "redis", "memcached": "memcached",
        "monitoring": "monitor"}
VPC_CIDR = "10.42.0.0/16"
SUBNETS = ["10.42.0.0/20", "10.42.16.0/20", "10.42.32.0/20"]
ADMIN = "198.51.100.0/24"
DATA_VOLUME = {"size": 50, "iops": 4000, "throughput": 250}


def table(pairs: int, zookeeper: int = 3) -> dict[str, Any]:
    return {
        "ec2_fleet_cluster": CLUSTER,
        "ec2_fleet_admin_cidr": ADMIN,
        "ec2_fleet_components": {
            "mysql": {"count": pairs, "instance_type": "r6i.large", "data_volume": DATA_VOLUME},
            "zookeeper": {"count": zookeeper, "instance_type": "t3.small"},
            "redis": {"count": 1, "instance_type": "r6i.large"},
            "memcached": {"count": 1, "instance_type": "r6i.large"},
            "monitoring": {"count": 1, "instance_type": "t3.medium"},
        },
    }


def by_name(moto: Moto) -> dict[str, dict[str, Any]]:
    return {i["TagMap"]["Name"]: i for i in instances(moto, CLUSTER)}


@pytest.fixture(scope="module")
def first_run(moto_server: Moto, tmp_path_factory: pytest.TempPathFactory) -> PlaybookRun:
    tmp = tmp_path_factory.mktemp("provision")
    return provision(moto_server, tmp, table(pairs=2)).check()


@pytest.fixture
def vars_dir(tmp_path: Path) -> Path:
    return tmp_path


def test_first_run_builds_vpc_subnets_in_three_zones_and_internet_route(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    assert first_run.changed > 0, "the first run reported no change"
    ec2 = moto_server.client()
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:cluster", "Values": [CLUSTER]}])["Vpcs"]
    assert [v["CidrBlock"] for v in vpcs] == [VPC_CIDR], f"expected one VPC {VPC_CIDR}: {vpcs}"
    vpc_id = vpcs[0]["VpcId"]
    subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["Subnets"]
    assert sorted(s["CidrBlock"] for s in subnets) == SUBNETS
    zones = {s["AvailabilityZone"] for s in subnets}
    assert len(zones) == 3, f"subnets share availability zones: {zones}"
    igws = ec2.describe_internet_gateways(
        Filters=[{"Name": "attachment.vpc-id", "Values": [vpc_id]}]
    )["InternetGateways"]
    assert len(igws) == 1, "expected one internet gateway attached to the VPC"
    tables = ec2.describe_route_tables(
        Filters=[
            {"Name": "vpc-id", "Values": [vpc_id]},
            {"Name": "tag:cluster", "Values": [CLUSTER]},
        ]
    )["RouteTables"]
    assert len(tables) == 1
    routes = {r.get("DestinationCidrBlock"): r.get("GatewayId") for r in tables[0]["Routes"]}
    assert routes.get("0.0.0.0/0") == igws[0]["InternetGatewayId"]
    associated = {a.get("SubnetId") for a in tables[0]["Associations"]}
    assert {s["SubnetId"] for s in subnets} <= associated


def test_instances_carry_tags_and_mysql_pair_sides_sit_in_different_zones(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    found = by_name(moto_server)
    expected = {
        f"{CLUSTER}-mysql001a", f"{CLUSTER}-mysql001b",
        f"{CLUSTER}-mysql002a", f"{CLUSTER}-mysql002b",
        f"{CLUSTER}-zk1", f"{CLUSTER}-zk2", f"{CLUSTER}-zk3",
        f"{CLUSTER}-redis1", f"{CLUSTER}-memcached1", f"{CLUSTER}-monitor1",
    }  # fmt: skip
    assert set(found) == expected
    for name, inst in found.items():
        tags = inst["TagMap"]
        assert tags["cluster"] == CLUSTER, name
        assert name.startswith(f"{CLUSTER}-{STEM[tags['component']]}"), name
        assert inst["State"]["Name"] == "running", name
    for pair in ("001", "002"):
        a, b = found[f"{CLUSTER}-mysql{pair}a"], found[f"{CLUSTER}-mysql{pair}b"]
        assert (a["TagMap"]["pair"], a["TagMap"]["side"]) == (f"pair{pair}", "a")
        assert (b["TagMap"]["pair"], b["TagMap"]["side"]) == (f"pair{pair}", "b")
        za, zb = a["Placement"]["AvailabilityZone"], b["Placement"]["AvailabilityZone"]
        assert za != zb, f"pair {pair}: both sides in {za}"
    zk_zones = {found[f"{CLUSTER}-zk{i}"]["Placement"]["AvailabilityZone"] for i in (1, 2, 3)}
    assert len(zk_zones) == 3, f"ZooKeeper quorum not spread over zones: {zk_zones}"
    assert found[f"{CLUSTER}-zk1"]["InstanceType"] == "t3.small"
    assert found[f"{CLUSTER}-mysql001a"]["InstanceType"] == "r6i.large"


def test_each_instance_is_in_its_own_component_group_only(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    for name, inst in by_name(moto_server).items():
        groups = [g["GroupName"] for g in inst["SecurityGroups"]]
        assert groups == [f"{CLUSTER}-{inst['TagMap']['component']}"], f"{name}: {groups}"


def test_ami_is_the_newest_match_of_the_owner_and_name_filters(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    images = moto_server.client().describe_images(
        Owners=["137112412989"],
        Filters=[
            {"Name": "name", "Values": ["al2023-ami-2023.*-kernel-6.1-x86_64"]},
            {"Name": "architecture", "Values": ["x86_64"]},
        ],
    )["Images"]
    assert images, "moto no longer ships the test AMI: adjust TEST_AMI_VARS"
    newest = max(images, key=lambda i: i["CreationDate"])["ImageId"]
    assert {i["ImageId"] for i in by_name(moto_server).values()} == {newest}


def test_mysql_instances_get_a_gp3_data_volume_and_the_others_none(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    ec2 = moto_server.client()
    for name, inst in by_name(moto_server).items():
        data = [b for b in inst["BlockDeviceMappings"] if b["DeviceName"] == "/dev/sdf"]
        if inst["TagMap"]["component"] != "mysql":
            assert not data, f"{name} has a data volume"
            continue
        assert len(data) == 1, f"{name}: no data volume on /dev/sdf"
        vol = ec2.describe_volumes(VolumeIds=[data[0]["Ebs"]["VolumeId"]])["Volumes"][0]
        assert vol["VolumeType"] == "gp3", name
        assert vol["Size"] == DATA_VOLUME["size"], name
        assert vol["AvailabilityZone"] == inst["Placement"]["AvailabilityZone"]
    # moto drops IOPS and throughput of a launch's block device mapping: read the request.
    launches = [r for r in moto_server.requests() if r["Action"] == "RunInstances"]
    mysql = [r for r in launches if f"{CLUSTER}-mysql" in str(r)]
    assert len(mysql) == 4, f"expected 4 MySQL launches, saw {len(mysql)}"
    for req in mysql:
        mapping = {k.removeprefix("BlockDeviceMapping.1."): v for k, v in req.items()}
        assert mapping.get("DeviceName") == "/dev/sdf", req
        assert mapping.get("Ebs.VolumeType") == "gp3", req
        assert mapping.get("Ebs.VolumeSize") == str(DATA_VOLUME["size"]), req
        assert mapping.get("Ebs.Iops") == str(DATA_VOLUME["iops"]), req
        assert mapping.get("Ebs.Throughput") == str(DATA_VOLUME["throughput"]), req
    others = [r for r in launches if f"{CLUSTER}-mysql" not in str(r)]
    assert others and not any("BlockDeviceMapping.1.DeviceName" in r for r in others)


def test_security_groups_allow_exactly_the_fleets_own_traffic(
    moto_server: Moto, first_run: PlaybookRun
) -> None:
    ec2 = moto_server.client()
    groups = ec2.describe_security_groups(Filters=[{"Name": "tag:cluster", "Values": [CLUSTER]}])[
        "SecurityGroups"
    ]
    names = {g["GroupId"]: g["GroupName"].removeprefix(f"{CLUSTER}-") for g in groups}
    assert set(names.values()) == {"mysql", "zookeeper", "redis", "memcached", "monitoring",
                                   "client"}
    actual: set[tuple[str, int, int, str]] = set()
    for g in groups:
        for perm in g["IpPermissions"]:
            assert perm["IpProtocol"] == "tcp", f"{g['GroupName']}: non-TCP rule {perm}"
            for pair in perm.get("UserIdGroupPairs", []):
                source = names.get(pair["GroupId"], f"FOREIGN:{pair['GroupId']}")
                actual.add((names[g["GroupId"]], perm["FromPort"], perm["ToPort"], source))
            for rng in perm.get("IpRanges", []):
                actual.add((names[g["GroupId"]], perm["FromPort"], perm["ToPort"], rng["CidrIp"]))
            assert not perm.get("Ipv6Ranges") and not perm.get("PrefixListIds"), perm
    expected = {
        ("mysql", 3306, 3306, "mysql"),
        ("mysql", 3306, 3306, "client"),
        ("mysql", 4444, 4444, "mysql"),
        ("zookeeper", 2181, 2181, "zookeeper"),
        ("zookeeper", 2181, 2181, "mysql"),
        ("zookeeper", 2181, 2181, "client"),
        ("zookeeper", 2888, 2888, "zookeeper"),
        ("zookeeper", 3888, 3888, "zookeeper"),
        ("redis", 6379, 6379, "client"),
        ("memcached", 11211, 11211, "client"),
        # monitoring: the shardfleet exporter reads MySQL, ZooKeeper and memcached;
        # Prometheus scrapes every exporter; on-call reaches Prometheus and Alertmanager
        ("mysql", 3306, 3306, "monitoring"),
        ("zookeeper", 2181, 2181, "monitoring"),
        ("memcached", 11211, 11211, "monitoring"),
        ("mysql", 9100, 9100, "monitoring"),
        ("mysql", 9104, 9104, "monitoring"),
        ("zookeeper", 9100, 9100, "monitoring"),
        ("redis", 9100, 9100, "monitoring"),
        ("redis", 9121, 9121, "monitoring"),
        ("memcached", 9100, 9100, "monitoring"),
        ("monitoring", 9090, 9090, "monitoring"),
        ("monitoring", 9093, 9093, "monitoring"),
        ("monitoring", 9100, 9100, "monitoring"),
        ("monitoring", 9150, 9150, "monitoring"),
        ("monitoring", 9090, 9090, "client"),
        ("monitoring", 9093, 9093, "client"),
    } | {(c, 22, 22, ADMIN) for c in ("mysql", "zookeeper", "redis", "memcached", "monitoring")}
    assert actual == expected, (
        f"unexpected rules: {sorted(actual - expected)}; missing rules: {sorted(expected - actual)}"
    )


def test_aws_ec2_inventory_groups_hosts_by_tag_like_the_local_inventory(
    moto_server: Moto, first_run: PlaybookRun, tmp_path: Path
) -> None:
    inv = write_test_inventory(moto_server, tmp_path / "inv")
    data = inventory_list(moto_server, inv, CLUSTER)
    hostvars = data["_meta"]["hostvars"]
    hosts = {
        g: set(data.get(g, {}).get("hosts", []))
        for g in ("mysql", "zookeeper", "redis", "memcached", "monitoring")
    }
    assert hosts == {
        "mysql": {f"{CLUSTER}-mysql00{p}{s}" for p in (1, 2) for s in "ab"},
        "zookeeper": {f"{CLUSTER}-zk{i}" for i in (1, 2, 3)},
        "redis": {f"{CLUSTER}-redis1"},
        "memcached": {f"{CLUSTER}-memcached1"},
        "monitoring": {f"{CLUSTER}-monitor1"},
    }
    for name in hosts["mysql"]:
        hv = hostvars[name]
        assert hv["shardfleet_pair"] == f"pair{name[-4:-1]}", name
        assert hv["shardfleet_side"] == name[-1], name
    live = by_name(moto_server)
    for name, hv in hostvars.items():
        assert hv["ansible_host"] == live[name]["PublicIpAddress"], name
        assert hv["shardfleet_address"] == live[name]["PrivateIpAddress"], name
    extra = set(data) - {"_meta", "all", "ungrouped", "aws_ec2", "fleet", *hosts}
    assert not extra, f"the aws inventory makes groups the local one lacks: {extra}"
    # ZooKeeper ids follow the Name (zk2 -> 2) whatever order EC2 lists instances in.
    ids = subprocess.run(
        [str(BIN / "ansible"), "-i", str(inv), "zookeeper", "-o",
         "-m", "ansible.builtin.debug", "-a", "var=zookeeper_id"],
        cwd=REPO, env=ansible_env(moto_server, SHARDFLEET_CLUSTER=CLUSTER),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ids.returncode == 0, ids.stdout + ids.stderr
    for i in (1, 2, 3):
        assert re.search(rf"{CLUSTER}-zk{i} \| SUCCESS => .*\"zookeeper_id\": {i}\b", ids.stdout), (
            f"zk{i} does not get zookeeper_id {i}:\n{ids.stdout}"
        )


def test_aws_inventory_matches_the_local_one_in_groups_hostvars_and_role_variables(
    moto_server: Moto, first_run: PlaybookRun, tmp_path: Path
) -> None:
    local = inventory_list(moto_server, REPO / "inventories" / "local", CLUSTER)
    aws = inventory_list(moto_server, write_test_inventory(moto_server, tmp_path / "inv"), CLUSTER)

    def members(data: dict[str, Any], group: str) -> set[str]:
        entry = data.get(group, {})
        found = set(entry.get("hosts", []))
        for child in entry.get("children", []):
            found |= members(data, child)
        return found

    def groups(data: dict[str, Any]) -> set[str]:
        return {g for g in data if g not in ("_meta", "all") and members(data, g)}

    assert groups(aws) - {"aws_ec2"} == groups(local), "the two inventories group hosts differently"
    assert members(aws, "fleet") == set(aws["_meta"]["hostvars"]), "fleet must hold every host"
    for data, where in ((local, "local"), (aws, "aws")):
        for host in members(data, "mysql"):
            hv = data["_meta"]["hostvars"][host]
            assert re.fullmatch(r"pair\d{3}", str(hv.get("shardfleet_pair"))), f"{where} {host}"
            assert hv.get("shardfleet_side") in ("a", "b"), f"{where} {host}"
    # Every variable the local group_vars give the roles is set for AWS too, in the
    # same group; only the container plumbing of the local fleet is local-only (its
    # connection, and a temporary directory under the containers' root home).
    local_only = re.compile(
        r"^(ansible_(connection|remote_tmp)|shardfleet_(network|image|fleet_label).*)$"
    )
    for local_dir in sorted((REPO / "inventories/local/group_vars").iterdir()):
        local_vars: dict[str, Any] = {}
        for f in sorted(local_dir.glob("*.yml")) if local_dir.is_dir() else [local_dir]:
            if f.name != "vault.yml":
                local_vars.update(yaml.safe_load(f.read_text()) or {})
        aws_dir = REPO / "inventories/aws/group_vars" / local_dir.name
        aws_vars: dict[str, Any] = {}
        for f in sorted(aws_dir.glob("*.yml")) if aws_dir.is_dir() else [aws_dir]:
            if f.exists():
                aws_vars.update(yaml.safe_load(f.read_text()) or {})
        missing = {k for k in local_vars if not local_only.match(k)} - set(aws_vars)
        assert not missing, f"inventories/aws/group_vars/{local_dir.name} lacks {sorted(missing)}"


def test_rerun_changes_nothing(moto_server: Moto, first_run: PlaybookRun, vars_dir: Path) -> None:
    before = {n: i["InstanceId"] for n, i in by_name(moto_server).items()}
    mark = moto_server.mark()
    # Rerun as against real AWS: no endpoint variable, boto3 resolves the endpoint itself.
    rerun = provision(moto_server, vars_dir, table(pairs=2), endpoint_from_env=True).check()
    assert rerun.changed == 0, f"a rerun changed {rerun.changed} tasks:\n{rerun.output[-6000:]}"
    assert {n: i["InstanceId"] for n, i in by_name(moto_server).items()} == before
    writes = [r["Action"] for r in moto_server.requests(mark) if MUTATING.match(r["Action"])]
    assert not writes, f"a rerun sent EC2 write calls: {writes}"


def test_growing_the_pair_count_adds_only_the_new_pair(
    moto_server: Moto, first_run: PlaybookRun, vars_dir: Path
) -> None:
    before = {n: i["InstanceId"] for n, i in by_name(moto_server).items()}
    mark = moto_server.mark()
    grown = provision(moto_server, vars_dir, table(pairs=3)).check()
    assert grown.changed > 0
    after = by_name(moto_server)
    assert {n: after[n]["InstanceId"] for n in before} == before, "existing instances were replaced"
    new = set(after) - set(before)
    assert new == {f"{CLUSTER}-mysql003a", f"{CLUSTER}-mysql003b"}
    # Two launches; anything else written must concern the new instances only
    # (ec2_instance re-applies the security groups of an instance it just launched).
    writes = [r for r in moto_server.requests(mark) if MUTATING.match(r["Action"])]
    assert [r["Action"] for r in writes].count("RunInstances") == 2, writes
    new_ids = {after[n]["InstanceId"] for n in new}
    stray = [
        r for r in writes if r["Action"] != "RunInstances" and r.get("InstanceId") not in new_ids
    ]
    assert not stray, f"growing touched existing resources: {stray}"
    za = after[f"{CLUSTER}-mysql003a"]["Placement"]["AvailabilityZone"]
    zb = after[f"{CLUSTER}-mysql003b"]["Placement"]["AvailabilityZone"]
    assert za != zb, f"new pair: both sides in {za}"


def test_shrinking_the_count_terminates_nothing(
    moto_server: Moto, first_run: PlaybookRun, vars_dir: Path
) -> None:
    before = {n: i["InstanceId"] for n, i in by_name(moto_server).items()}
    assert f"{CLUSTER}-mysql003a" in before, "needs the grown fleet of the previous test"
    mark = moto_server.mark()
    shrunk = provision(moto_server, vars_dir, table(pairs=2)).check()
    assert shrunk.changed == 0, shrunk.output[-6000:]
    writes = [r["Action"] for r in moto_server.requests(mark) if MUTATING.match(r["Action"])]
    assert not writes, f"shrinking without ec2_fleet_terminate_extra sent: {writes}"
    after = by_name(moto_server)
    assert {n: i["InstanceId"] for n, i in after.items()} == before
    assert all(i["State"]["Name"] == "running" for i in after.values())


def test_terminate_extra_removes_only_what_the_table_dropped(
    moto_server: Moto, first_run: PlaybookRun, vars_dir: Path
) -> None:
    before = {n: i["InstanceId"] for n, i in by_name(moto_server).items()}
    run = provision(
        moto_server, vars_dir, {**table(pairs=2), "ec2_fleet_terminate_extra": True}
    ).check()
    assert run.changed > 0
    after = {n: i["InstanceId"] for n, i in by_name(moto_server).items()}
    assert set(before) - set(after) == {f"{CLUSTER}-mysql003a", f"{CLUSTER}-mysql003b"}
    assert all(before[n] == after[n] for n in after)


def test_all_counts_zero_with_terminate_extra_empties_the_cluster(
    moto_server: Moto, first_run: PlaybookRun, vars_dir: Path
) -> None:
    empty = table(pairs=0, zookeeper=0)
    for component in ("redis", "memcached", "monitoring"):
        empty["ec2_fleet_components"][component]["count"] = 0
    provision(moto_server, vars_dir, {**empty, "ec2_fleet_terminate_extra": True}).check()
    assert by_name(moto_server) == {}, "instances survived a teardown with every count at 0"


@pytest.mark.parametrize("cidr", ["", "0.0.0.0/0"])
def test_ssh_needs_an_explicit_admin_cidr_that_is_not_the_world(
    moto_server: Moto, tmp_path: Path, cidr: str
) -> None:
    run = provision(moto_server, tmp_path, {**table(pairs=1), "ec2_fleet_admin_cidr": cidr})
    assert run.rc != 0 and "ec2_fleet_admin_cidr" in run.output, run.output[-3000:]


def test_the_shipped_defaults_point_at_real_aws() -> None:
    text = "\n".join(
        p.read_text()
        for p in [
            REPO / "roles/ec2_fleet/defaults/main.yml",
            REPO / "playbooks/provision-aws.yml",
            *sorted((REPO / "inventories/aws").rglob("*.yml")),
        ]
    )
    assert "127.0.0.1" not in text and "localhost:" not in text
    assert (
        "endpoint_url:"
        not in (REPO / "inventories/aws").joinpath("shardfleet.aws_ec2.yml").read_text()
    )
