"""What a split moves where, its errors, its constants and the small pure helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardfleet import replication
from shardfleet.errors import ShardfleetError
from shardfleet.shardmap import ShardMap, ShardRange, diff

STEPS = ("check", "clone", "replicate", "cutover", "cleanup")
CLONE_METHODS = ("logical", "physical")
# clone="auto": physical when the moving shards hold more InnoDB data than this (bytes);
# docs/runbooks/split.md says how it was chosen
PHYSICAL_ABOVE = 1 << 30
# Journal ``step`` values in the order a split reaches them ("aborted" restarts).
PROGRESS = {"started": 0, "clone": 1, "replicate": 2, "cutover": 3, "cleanup": 4}
# the steps after which the split is finished (the journal header's ``done``)
FINISHED_BY = ("cutover", "cleanup", "aborted")


class SplitError(ShardfleetError):
    """Raised when a split step is refused or fails; the message says what changed (if anything)."""


class CutoverAborted(SplitError):
    """Raised when the cutover timed out and was undone (fence and freeze lifted, map as before)."""


@dataclass(frozen=True)
class SplitSpec:
    """What to move where. ``moving`` defaults to the upper half of the source's range."""

    source: str
    target: str
    target_standby: str | None = None
    moving: tuple[int, int] | None = None
    name: str | None = None


def upper_half(r: ShardRange) -> tuple[int, int]:
    """The default moving range: the upper half of *r* (0..2047 -> 1024..2047)."""
    if r.size < 2:
        raise SplitError(f"range [{r.first}, {r.last}] has one shard; nothing to split")
    return (r.first + r.size // 2, r.last)


def merge_gtids(base: str, overlay: str) -> str:
    """*base* with every domain of *overlay* set to overlay's GTID (MariaDB lists)."""
    b = replication.parse_gtids(base) if base else {}
    b.update(replication.parse_gtids(overlay) if overlay else {})
    return replication.format_gtids(b)


def map_changes(before: ShardMap | None, after: ShardMap | None) -> list[str]:
    return diff(before, after)


def few(names: Sequence[str], n: int = 4) -> str:
    """The first *n* of *names* and how many more (for messages)."""
    names = list(names)
    return ", ".join(names[:n]) + (f", ... {len(names) - n} more" if len(names) > n else "")
