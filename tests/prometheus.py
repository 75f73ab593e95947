"""Prometheus as the tests ask it (its HTTP API): shared by the e2e tier (the local
inventory's monitoring host) and the aws tier (the aws_ec2 inventory's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_targets_up(targets: Callable[[], list[dict[str, Any]]],
                    expected: set[tuple[str, str]], timeout: float = 120) -> list[dict[str, Any]]:
    """Poll Prometheus's active targets (*targets* fetches them) until they are exactly
    *expected* ``(job, instance)`` pairs and every one is up; returns them. The bound
    covers a scrape interval (15 s) and the exporters' start on a busy machine."""
    deadline = time.monotonic() + timeout
    while True:
        active = targets()
        seen = {(t["scrapePool"], t["labels"]["instance"]) for t in active}
        down = [(t["scrapePool"], t["labels"]["instance"], t["health"], t["lastError"])
                for t in active if t["health"] != "up"]
        if seen == expected and not down:
            return active
        assert time.monotonic() < deadline, (
            f"targets missing {sorted(expected - seen)}, unexpected {sorted(seen - expected)}, "
            f"not up {down}")
        time.sleep(3)
