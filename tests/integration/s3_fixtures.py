"""moto's S3 server on 127.0.0.1 for the integration tier (the backup tests import the
fixture from here; the e2e backup test starts one on the fleet network's gateway with
``moto_s3``; the EC2 tier has its own, recording requests, in tests/aws/conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
REGION = "us-east-1"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass
class S3:
    url: str
    pid: int

    def client(self) -> Any:
        from shardfleet.storage import s3_client

        return s3_client(endpoint_url=self.url, region=REGION,
                         access_key=KEYS["AWS_ACCESS_KEY_ID"],
                         secret_key=KEYS["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self) -> str:
        name = "sf-" + uuid.uuid4().hex[:12]
        self.client().create_bucket(Bucket=name)
        return name


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_s3(host: str, workdir: Path, timeout: float = 30) -> Iterator[S3]:
    """moto's server listening on *host* only (a free port there), its log in *workdir*;
    stopped on leaving."""
    exe = BIN / "moto_server"
    if not exe.exists():
        pytest.fail(f"moto_server not found at {exe}: install moto[server] (requirements-dev.txt)")
    port = _free_port(host)
    log = workdir / "moto_server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "-H", host, "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=workdir,
                                env=dict(os.environ, **KEYS))
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer on {url} within {timeout:g} s")
                time.sleep(0.2)
        yield S3(url=url, pid=proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    with moto_s3("127.0.0.1", tmp_path_factory.mktemp("moto-s3")) as s3:
        yield s3
