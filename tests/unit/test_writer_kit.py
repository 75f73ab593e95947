"""The test kit's writer (shardfleet.testing.kit.Writer) says why it stopped acknowledging.

A CI run failed "writer stopped" after a loaded machine's physical copy: the writer had
used up its operation bound and ended, which the message could not tell from a stall.
A writer that has ended makes ``wait_acks`` answer at once, and ``status`` names the
bound; a blocked one shows where its thread is.
"""

from __future__ import annotations

import threading
import time

from shardfleet import ids
from shardfleet.testing.kit import Writer


class FakeStore:
    """Creates that succeed at once (or block on *gate* when given)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.n = 0
        self.gate = gate

    def create(self, kind: int, body: dict, near: int | None = None) -> int:
        if self.gate is not None:
            self.gate.wait(10)
        self.n += 1
        return ids.compose(1, kind, self.n)


def test_an_ended_writer_answers_at_once_and_says_its_bound_ran_out():
    w = Writer(FakeStore(), None, threads=1, seconds=60, max_ops=50, updates=0.0).start()
    try:
        assert w.wait_acks(50, timeout=10, total=True)
        t0 = time.monotonic()
        assert not w.wait_acks(1, timeout=10)
        assert time.monotonic() - t0 < 2, "waited out the timeout for a writer that had ended"
        status = w.status()
        assert "0/1 threads running (ended: its 60 s or 50 operations" in status, status
        assert "50 acks" in status, status
    finally:
        w.stop()


def test_a_blocked_writer_shows_where_it_waits():
    gate = threading.Event()
    w = Writer(FakeStore(gate), None, threads=1, seconds=60, max_ops=10, updates=0.0).start()
    try:
        assert not w.wait_acks(1, timeout=0.5)
        status = w.status()
        assert "1/1 threads running, 0 acks (last never" in status, status
        assert "in create" in status and "gate.wait" in status, status
    finally:
        gate.set()
        w.stop()
