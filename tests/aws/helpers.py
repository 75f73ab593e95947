"""Helpers for the EC2 tier: run the playbook and the inventory against moto.

Only the tests point anything at the emulator: the role, the playbook and the
inventory default to real AWS, and get ``endpoint_url`` from here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REGION = "us-east-1"

# moto ships Amazon Linux images, not Debian ones: the tests point the AMI lookup at them.
TEST_AMI_VARS = {
    "ec2_fleet_ami_owners": ["137112412989"],
    "ec2_fleet_ami_name": "al2023-ami-2023.*-kernel-6.1-x86_64",
    "ec2_fleet_ami_architecture": "x86_64",
}
# Instances of the emulator are not reachable: never wait for SSH on them.
TEST_BASE_VARS = {
    **TEST_AMI_VARS,
    "ec2_fleet_region": REGION,
    "ec2_fleet_admin_cidr": "198.51.100.0/24",
    "ec2_fleet_wait_ssh": False,
}

RECAP = re.compile(
    r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M
)
LIVE_STATES = ["pending", "running", "stopping", "stopped"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Moto:
    url: str
    port: int
    recording: Path

    def client(self, service: str = "ec2") -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def mark(self) -> int:
        """A position in the request recording; pass it to ``requests``."""
        return len(self._lines())

    def requests(self, since: int = 0) -> list[dict[str, str]]:
        """EC2 query API requests (form fields, ``Action`` first) recorded after ``since``."""
        out = []
        for line in self._lines()[since:]:
            entry = json.loads(line)
            body = entry.get("body") or ""
            if entry.get("body_encoded"):
                body = base64.b64decode(body).decode("utf-8", "replace")
            fields = {k: v[-1] for k, v in urllib.parse.parse_qs(body).items()}
            if "Action" in fields:
                out.append(fields)
        return out

    def _lines(self) -> list[str]:
        if not self.recording.exists():
            return []
        return [ln for ln in self.recording.read_text().splitlines() if ln.strip()]


# EC2 API calls that change something; a rerun must send none of them.
MUTATING = re.compile(
    r"^(Create|Delete|Run|Terminate|Authorize|Revoke|Modify|Associate|Disassociate|Attach|Detach|"
    r"Replace|Update|Start|Stop|Reboot)"
)


@dataclass
class PlaybookRun:
    rc: int
    output: str
    ok: int
    changed: int
    failed: int

    def check(self) -> PlaybookRun:
        assert self.rc == 0, f"ansible-playbook failed (rc={self.rc}):\n{self.output[-6000:]}"
        return self


def ansible_env(moto: Moto, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_DEPRECATION_WARNINGS="0",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION=REGION,
        SHARDFLEET_AWS_REGION=REGION,
    )
    # never let a developer's real AWS profile leak into a test
    env.pop("AWS_PROFILE", None)
    env.pop("AWS_SESSION_TOKEN", None)
    env.update(extra)
    return env


def provision(
    moto: Moto, tmp_path: Path, extra_vars: dict[str, Any], *, endpoint_from_env: bool = False
) -> PlaybookRun:
    """Run playbooks/provision-aws.yml against moto with the given extra vars.

    Normally the test passes ``ec2_fleet_endpoint_url``. With ``endpoint_from_env`` it
    runs the playbook as a real user would, with no endpoint variable at all, and lets
    boto3's own endpoint resolution find moto through ``AWS_ENDPOINT_URL``; a proxy on
    a closed local port catches any request that would still head for real AWS.
    """
    vars_file = tmp_path / f"vars-{time.monotonic_ns()}.json"
    endpoint = {} if endpoint_from_env else {"ec2_fleet_endpoint_url": moto.url}
    vars_file.write_text(json.dumps({**TEST_BASE_VARS, **endpoint, **extra_vars}))
    env = ansible_env(moto)
    if endpoint_from_env:
        env.update(
            AWS_ENDPOINT_URL=moto.url,
            HTTPS_PROXY="http://127.0.0.1:9",
            HTTP_PROXY="http://127.0.0.1:9",
            NO_PROXY="127.0.0.1",
        )
    proc = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            str(REPO / "playbooks" / "provision-aws.yml"),
            "-e",
            f"@{vars_file}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    m = RECAP.search(proc.stdout)
    ok, changed, _unreachable, failed = (int(g) for g in m.groups()) if m else (0, -1, 0, -1)
    return PlaybookRun(rc=proc.returncode, output=output, ok=ok, changed=changed, failed=failed)


def write_test_inventory(moto: Moto, dest: Path, compose: dict[str, str] | None = None) -> Path:
    """Copy inventories/aws to ``dest`` and point its aws_ec2 file at moto.

    The shipped file is used as is, plus ``endpoint_url`` and whatever ``compose``
    entries the caller overrides: the test stands in for AWS, not for the inventory.
    """
    src = REPO / "inventories" / "aws"
    shutil.copytree(src, dest, dirs_exist_ok=True)
    sources = sorted(dest.glob("*aws_ec2.yml"))
    assert len(sources) == 1, f"expected one *aws_ec2.yml in inventories/aws, found {sources}"
    data = yaml.safe_load(sources[0].read_text())
    data["endpoint_url"] = moto.url
    data["compose"] = {**data.get("compose", {}), **(compose or {})}
    sources[0].write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def inventory_list(moto: Moto, inventory: Path, cluster: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(inventory), "--list"],
        cwd=REPO,
        env=ansible_env(moto, SHARDFLEET_CLUSTER=cluster),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"ansible-inventory failed:\n{proc.stdout}\n{proc.stderr}"
    return dict(_unwrap_unsafe(json.loads(proc.stdout)))


def _unwrap_unsafe(value: Any) -> Any:
    """ansible-inventory --list writes strings from a plugin as {"__ansible_unsafe": "..."}."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return value["__ansible_unsafe"]
        return {k: _unwrap_unsafe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap_unsafe(v) for v in value]
    return value


def instances(moto: Moto, cluster: str) -> list[dict[str, Any]]:
    """Every live instance of ``cluster`` with its tags as a dict."""
    ec2 = moto.client()
    out = []
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "tag:cluster", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": LIVE_STATES},
        ]
    )
    for page in pages:
        for res in page["Reservations"]:
            for inst in res["Instances"]:
                inst["TagMap"] = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                out.append(inst)
    return out
