"""Fixtures for the EC2 tier: a moto_server on 127.0.0.1 standing in for the EC2 API.

The server is started once per test session on a free port and stopped at the end.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.aws.helpers import BIN, Moto, free_port


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    exe = BIN / "moto_server"
    if not exe.exists():
        pytest.fail(f"moto_server not found at {exe}: install moto[server] (requirements-dev.txt)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("moto")
    log = workdir / "moto_server.log"
    recording = workdir / "recording.jsonl"
    # moto keeps a copy of every API request: the tests read what was asked of EC2
    # (moto drops some fields, e.g. a gp3 volume's IOPS and throughput at launch).
    env = dict(os.environ, MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=str(recording))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer on {url} within 30 s")
                time.sleep(0.2)
        yield Moto(url=url, port=port, recording=recording)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
