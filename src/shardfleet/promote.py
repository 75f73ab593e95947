"""Promotion and the rebuild of a standby: their old import path.

The promotion (planned and emergency) lives in :mod:`shardfleet.operations.promote`,
the rebuild of an emergency's old master in :mod:`shardfleet.operations.rebuild`, and
what both share (the run's journal and step rows, whether a server answers, the map
helpers, the errors) in :mod:`shardfleet.operations.runner` and
:mod:`shardfleet.operations.types`. The names callers have used stay importable here.
"""

from __future__ import annotations

from shardfleet.operations.promote import MODES, Listening, promote
from shardfleet.operations.promote.common import (
    _flip,
    _freeze,
    _unfreeze,
    errant_against,
    replica_status,
    semisync_state,
)
from shardfleet.operations.rebuild import RECOPY, rebuild_standby
from shardfleet.operations.types import (
    Options,
    PromotionFailed,
    PromotionRefused,
    Result,
    copy_shards,
    owner,
    pair_ranges,
    reach,
    try_connect,
)
from shardfleet.shardmap import ShardMap

__all__ = ["MODES", "RECOPY", "Listening", "Options", "PromotionFailed", "PromotionRefused",
           "Result", "ShardMap", "_flip", "_freeze", "_unfreeze", "copy_shards",
           "errant_against", "owner", "pair_ranges", "promote", "reach", "rebuild_standby",
           "replica_status", "semisync_state", "try_connect"]
