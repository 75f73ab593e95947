"""The fault campaign's nemesis: seeds, a schedule of faults, and operations run in their
own process so that a fault can SIGKILL them at any instant.

A campaign is a list of runs, each with its own seed; everything random in a run (which
fault, at which instant, with which parameters) comes from ``random.Random(seed)``, so
``SHARDFLEET_FAULT_SEED=<seed> SHARDFLEET_FAULT_RUNS=1`` replays one run's schedule.
Instants are measured from the moment the operation's process is ready (its ZooKeeper
session up), so a replay hits the same instant in time; on a machine under a
different load that instant may fall on another statement of the operation.

:class:`Schedule` records what the nemesis did and what came back, with times; it is
printed in every failure message and written into the run's folder
(:func:`failure_dir`) with the writer's history and the servers' logs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_SEED = "SHARDFLEET_FAULT_SEED"
ENV_RUNS = "SHARDFLEET_FAULT_RUNS"
ENV_DIR = "SHARDFLEET_FAULT_DIR"


def campaign_seeds(default_runs: int) -> list[int]:
    """The seeds of this campaign: ``SHARDFLEET_FAULT_SEED`` (default: a random base,
    printed) and the next ``SHARDFLEET_FAULT_RUNS - 1`` (default *default_runs*; 1 when
    a seed is given without a run count: that replays one run)."""
    seed_env = os.environ.get(ENV_SEED, "").strip()
    runs_env = os.environ.get(ENV_RUNS, "").strip()
    base = int(seed_env) if seed_env else random.SystemRandom().randrange(1, 10**6)
    runs = int(runs_env) if runs_env else (1 if seed_env else default_runs)
    return [base + i for i in range(max(0, runs))]


@dataclass
class Schedule:
    """What one run's nemesis did, in order, with times relative to the run's start."""

    seed: int
    test: str = ""
    t0: float = field(default_factory=time.monotonic)
    events: list[dict[str, Any]] = field(default_factory=list)

    def note(self, what: str, **detail: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 3), "what": what,
                            **detail})

    def describe(self) -> str:
        family = self.test.split("-")[0]
        lines = [f"seed {self.seed} ({self.test}): replay with make faults SEED={self.seed}"
                 + (f" K={family}" if family else "")
                 + f" ({ENV_SEED}={self.seed} {ENV_RUNS}=1)"]
        for e in self.events:
            rest = {k: v for k, v in e.items() if k not in ("t", "what")}
            lines.append(f"  {e['t']:8.3f}s {e['what']}"
                         + (f" {json.dumps(rest, default=str)}" if rest else ""))
        return "\n".join(lines)


class OpProcess:
    """An operation in its own process (``tests/faults/op.py``): started, watched for its
    ``SESSION``, ``READY`` and ``RESULT`` lines, killed with SIGKILL on demand.

    ``SESSION <id> <password>`` (both hex) names the process's ZooKeeper session once
    its store is connected: :attr:`session`, for :func:`expire_session`. ``FINISHED
    <monotonic> <session id>`` says when the operation's work ended (:attr:`finished_at`,
    this machine's monotonic clock) and in which session (:attr:`finished_session`)."""

    def __init__(self, script: Path, spec: dict[str, Any], log_path: Path) -> None:
        self.log_path = log_path
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.ready_at = 0.0
        self.session: tuple[int, bytes] | None = None
        self.finished_at: float | None = None
        self.finished_session: int | None = None
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(spec)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True, name="sf-op-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("SESSION ") and self.session is None:
                parts = line.split()
                try:
                    self.session = (int(parts[1], 16), bytes.fromhex(parts[2]))
                except (IndexError, ValueError):
                    pass
            if line.startswith("FINISHED "):
                parts = line.split()
                try:
                    self.finished_at = float(parts[1])
                    self.finished_session = int(parts[2], 16) if parts[2] != "None" else None
                except (IndexError, ValueError):
                    pass
            if line.startswith("READY") and not self.ready.is_set():
                self.ready_at = time.monotonic()
                self.ready.set()

    def wait_ready(self, timeout: float = 60.0) -> bool:
        return self.ready.wait(timeout)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> bool:
        """SIGKILL the process (its own process group); True if it was still running."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.proc.wait(30)
        return True

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None (the process was killed) when it outlived *timeout*."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self._reader.join(10)
        self.log_path.write_text("\n".join(self.lines) + "\n")
        return rc

    @property
    def result(self) -> str:
        """The ``RESULT`` line without its prefix ("" when the process printed none)."""
        for line in reversed(self.lines):
            if line.startswith("RESULT "):
                return line[len("RESULT "):]
        return ""


class SessionGone(RuntimeError):
    """The session to expire had already ended (its client closed it, or it expired)."""


def expire_session(hosts: str, session: tuple[int, bytes], timeout: float = 10.0) -> None:
    """End the ZooKeeper session *session* (id, password) as a server does when a client
    goes silent for its whole timeout, at once: a second client started with the same
    session id and password (the server moves the session to it and drops the first
    client's connection), then stopped and closed (it closes the session: the server
    deletes its ephemeral znodes, its locks). The first client finds its session expired
    when it reconnects (kazoo: LOST, then a new session). :class:`SessionGone` when the
    server no longer knows the session (its client closed it: the process was ending)."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, client_id=session, timeout=max(timeout, 4.0))
    try:
        client.start(timeout)
        if client.client_id is None or client.client_id[0] != session[0]:
            raise SessionGone(f"session {session[0]:#x} is already gone (the second client "
                              f"got {client.client_id and hex(client.client_id[0])})")
    finally:
        client.stop()
        client.close()


def expire_store_session(store: Any, timeout: float = 30.0) -> None:
    """:func:`expire_session` of a :class:`~shardfleet.mapstore.ZooKeeperMapStore`'s own
    session, then wait until its client runs on a new one (in-process tests: the run that
    held locks on the old session goes on without them)."""
    old = store.session()
    expire_session(store.where, store.client.client_id, timeout)
    deadline = time.monotonic() + timeout
    while store.session() in (None, old) or not store.connected:
        if time.monotonic() >= deadline:
            raise AssertionError(f"{store.where}: session {old:#x} never expired")
        time.sleep(0.05)


def failure_dir(test: str, seed: int) -> Path:
    """The folder a failing run leaves its history, schedule and logs in
    (``$SHARDFLEET_FAULT_DIR``, default ``/tmp/shardfleet-faults``, then
    ``<test>-seed<seed>``)."""
    base = Path(os.environ.get(ENV_DIR) or "/tmp/shardfleet-faults")
    d = base / f"{test}-seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def keep_logs(dest: Path, servers: dict[str, Any], max_bytes: int = 200_000) -> None:
    """Copy the tail of each server's log (``server.log`` of a
    :class:`shardfleet.testing.servers._Process`) into *dest*."""
    for name, s in servers.items():
        log = getattr(s, "log", None)
        if log is None or not Path(log).exists():
            continue
        data = Path(log).read_bytes()[-max_bytes:]
        (dest / f"{name.replace(':', '_')}.log").write_bytes(data)
    for extra in ("zk.log",):
        for name, s in servers.items():
            p = Path(getattr(s, "dir", "/nonexistent")) / extra
            if p.exists():
                shutil.copy(p, dest / f"{name.replace(':', '_')}-{extra}")


__all__ = ["ENV_DIR", "ENV_RUNS", "ENV_SEED", "OpProcess", "Schedule", "campaign_seeds",
           "SessionGone", "expire_session", "failure_dir", "keep_logs"]
