"""Promotion's pure parts (no servers; kept beside the promotion tests): errant GTIDs,
and the map edits freeze / unfreeze / flip keeping every other key of a range."""

from __future__ import annotations

from shardfleet.operations.promote.common import _flip, _freeze, _unfreeze, errant_against
from shardfleet.operations.types import pair_ranges
from shardfleet.shardmap import ShardMap

A, B, C = "10.0.0.1:3306", "10.0.0.2:3306", "10.0.0.3:3306"


def base() -> ShardMap:
    return ShardMap.from_ranges([
        {"range": [0, 9], "master": A, "standby": B, "state": "open", "note": "x"},
        {"range": [10, 19], "master": A, "standby": B, "state": "closed"},
        {"range": [20, 29], "master": C, "standby": None, "state": "open"},
    ])


def test_errant_only_counts_the_standbys_own_transactions():
    # domain 12 written by the standby (server 12) up to 9; the master has 12 up to 7
    assert errant_against("11-11-100,12-12-9", "11-11-90,12-12-7", 12) == ["12-12-8..9"]
    assert errant_against("11-11-100,12-12-8", "12-12-7", 12) == ["12-12-8"]
    # the master's own domain arrives by replication: never errant, even when "ahead"
    assert errant_against("11-11-100", "11-11-90", 12) == []
    assert errant_against("12-12-5", "12-12-5", 12) == []
    assert errant_against("12-12-3", "", 12) == ["12-12-1..3"]


def test_pair_ranges_finds_only_the_pairs():
    assert [r.bounds for r in pair_ranges(base(), [A, B])] == [(0, 9), (10, 19)]
    assert pair_ranges(base(), [B, "10.0.0.9:3306"]) == []
    assert [r.bounds for r in pair_ranges(base(), [C, B])] == [(20, 29)]  # no standby


def test_freeze_then_unfreeze_restores_state_and_keys():
    bounds = {(0, 9), (10, 19)}
    frozen = _freeze(base(), bounds, "pair001")
    r0, r1, r2 = frozen.ranges
    assert (r0.state, r1.state, r2.state) == ("frozen", "frozen", "open")
    assert r0.extra["frozen_from"] == "open" and r1.extra["frozen_from"] == "closed"
    assert _freeze(frozen, bounds, "pair001") == frozen  # idempotent
    assert _unfreeze(frozen, bounds, "pair001") == base()
    assert _unfreeze(frozen, bounds, "pair002") == frozen  # not its freeze


def test_flip_swaps_unfreezes_and_marks_rebuild():
    bounds = {(0, 9), (10, 19)}
    flipped = _flip(_freeze(base(), bounds, "p"), bounds, B, A, True, "p")
    r0, r1, r2 = flipped.ranges
    assert (r0.master, r0.standby, r0.state, r0.extra) == (B, A, "open",
                                                            {"note": "x", "rebuild": A})
    assert (r1.master, r1.state, r1.extra.get("rebuild")) == (B, "closed", A)
    assert r2 == base().ranges[2]
    planned = _flip(_freeze(base(), bounds, "p"), bounds, B, A, False, "p")
    assert "rebuild" not in planned.ranges[0].extra
    assert ShardMap.from_ranges(  # round trip through JSON keeps the mark
        [r.to_dict() for r in flipped.ranges]) == flipped

