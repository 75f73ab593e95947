"""physical.copy_lock between processes: a receiver still waiting for its sender (an async
task of a run that was killed) is preempted by the next copy; one that is receiving is
waited for, then refused with CopyBusy, nothing touched."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfleet import physical

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
sys.path.insert(0, {src!r})
from shardfleet import physical
with physical.copy_lock({datadir!r}) as mark:
    if {state!r} != "waiting":
        mark({state!r})
    print("held", flush=True)
    time.sleep({seconds})
"""


def hold(datadir: Path, state: str, seconds: float = 60) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(
        src=str(ROOT / "src"), datadir=str(datadir), state=state, seconds=seconds)],
        stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_receiver_waiting_for_its_sender_is_preempted(tmp_path):
    datadir = tmp_path / "mysql"
    datadir.mkdir()
    old = hold(datadir, "waiting")
    try:
        t0 = time.monotonic()
        with physical.copy_lock(str(datadir), wait=0) as mark:
            mark("receiving")
            assert old.wait(10) != 0, "the waiting receiver was not stopped"
            text = Path(str(datadir) + ".copy.lock").read_text().split()
            assert text[1] == "receiving"
        assert time.monotonic() - t0 < 20
    finally:
        old.kill()


@pytest.mark.parametrize("state", ["receiving", "installing"])
def test_a_copy_in_progress_is_waited_for_then_refused(tmp_path, state):
    datadir = tmp_path / "mysql"
    datadir.mkdir()
    busy = hold(datadir, state)
    try:
        t0 = time.monotonic()
        with pytest.raises(physical.CopyBusy) as exc, \
                physical.copy_lock(str(datadir), wait=1.0):
            pass
        assert time.monotonic() - t0 >= 1.0
        assert state in str(exc.value) and "nothing was touched" in str(exc.value)
        assert busy.poll() is None, "a copy in progress was stopped"
    finally:
        busy.kill()
        busy.wait()


def test_a_copy_that_ends_while_waited_for_lets_the_next_one_in(tmp_path):
    datadir = tmp_path / "mysql"
    datadir.mkdir()
    busy = hold(datadir, "installing", seconds=1.0)
    try:
        with physical.copy_lock(str(datadir), wait=30) as mark:
            mark("receiving")
        assert busy.wait(10) == 0
    finally:
        busy.kill()
