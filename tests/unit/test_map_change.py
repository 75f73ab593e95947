"""The map-change vocabulary (freeze with an owner, thaw, flip) and the one read-modify-CAS
loop (mapstore.update) that survives a lost reply, on the in-memory store."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfleet.errors import MapError, MapStoreUnavailable, MapWriteUnknown
from shardfleet.mapstore import MemoryMapStore, update
from shardfleet.shardmap import ShardMap, freeze_owner

MANY = settings()


def two_pairs() -> ShardMap:
    return ShardMap.from_ranges([
        {"range": [0, 2047], "master": "a1:3306", "standby": "a2:3306", "state": "open"},
        {"range": [2048, 4095], "master": "b1:3306", "standby": "b2:3306", "state": "closed",
         "rebuild": "b0:3306"},
    ])


def test_freeze_cuts_a_piece_and_thaw_rejoins_it():
    m = two_pairs()
    f = m.freeze([(1024, 2047)], "split-1024-2047")
    assert [r.bounds for r in f.ranges] == [(0, 1023), (1024, 2047), (2048, 4095)]
    piece = f.range_for(1500)
    assert piece.state == "frozen" and freeze_owner(piece) == "split-1024-2047"
    assert piece.extra["frozen_from"] == "open" and f.range_for(10).state == "open"
    assert f.freeze([(1024, 2047)], "split-1024-2047") == f, "freeze is not idempotent"
    assert f.thaw("split-1024-2047", rejoin=(0, 2047)) == m


def test_another_owners_freeze_is_neither_taken_nor_lifted():
    f = two_pairs().freeze([(1024, 2047)], "split-a")
    with pytest.raises(MapError, match="frozen by split-a"):
        f.freeze([(1024, 2047)], "promote-pair001")
    # two splits of one source: lifting one leaves the other's piece frozen
    g = f.freeze([(512, 1023)], "split-b")
    back = g.thaw("split-b", rejoin=(0, 2047))
    kept = back.range_for(1500)
    assert kept.state == "frozen" and freeze_owner(kept) == "split-a"
    assert back.range_for(600).state == "open"
    assert back.thaw("promote-x") == back
    assert back.thaw("split-a", rejoin=(0, 2047)) == two_pairs()


def test_freeze_refuses_bounds_across_ranges():
    with pytest.raises(MapError, match="not inside one range"):
        two_pairs().freeze([(2000, 2100)], "x")


def test_flip_moves_thaws_and_is_idempotent():
    m = two_pairs().freeze([(2048, 4095)], "promote-pair002")
    f = m.flip("promote-pair002", [(2048, 4095)], master="b2:3306", standby="b1:3306",
               drop=("rebuild",), set_extra={"note": 1})
    r = f.range_for(3000)
    assert (r.master, r.standby, r.state) == ("b2:3306", "b1:3306", "closed")
    assert dict(r.extra) == {"note": 1}
    assert f.flip("promote-pair002", [(2048, 4095)], master="b2:3306", standby="b1:3306",
                  drop=("rebuild",), set_extra={"note": 1}) == f
    with pytest.raises(MapError, match="not frozen by"):
        two_pairs().flip("promote-pair002", [(2048, 4095)], master="c:3306", standby=None)


@MANY
@given(st.integers(0, 4094), st.integers(1, 4095))
def test_freeze_then_thaw_is_the_identity(first, size):
    last = min(4095, first + size - 1)
    m = ShardMap.from_ranges([{"range": [0, 4095], "master": "a:1", "state": "open"}])
    f = m.freeze([(first, last)], "op")
    assert sum(r.size for r in f.ranges) == 4096
    assert f.thaw("op", rejoin=(0, 4095)) == m


class LossyStore(MemoryMapStore):
    """Applies a write, then loses its reply; optionally stays unreadable for a while."""

    def __init__(self, initial: ShardMap) -> None:
        super().__init__(initial)
        self.lose_next = 0
        self.unreadable_reads = 0
        self.unreadable_after_loss = 0
        self.syncs = 0

    def write(self, new, expected_version):
        v = super().write(new, expected_version)
        if self.lose_next:
            self.lose_next -= 1
            self.unreadable_reads = self.unreadable_after_loss
            raise MapStoreUnavailable("connection lost after the request was sent")
        return v

    def sync(self):
        self.syncs += 1

    def read(self):
        if self.unreadable_reads:
            self.unreadable_reads -= 1
            raise MapStoreUnavailable("still away")
        return super().read()


def test_update_decides_a_lost_reply_by_content():
    store = LossyStore(two_pairs())
    store.lose_next = 1
    res = update(store, lambda m: m.freeze([(0, 2047)], "op"))
    assert res.changed and res.version == 1 and store.syncs >= 1
    assert store.read().version == 1, "the edit was written twice"
    assert store.read().map.range_for(5).state == "frozen"
    # nothing left to do: a result, not an error
    again = update(store, lambda m: m.freeze([(0, 2047)], "op"))
    assert not again.changed and again.version == 1


def test_update_waits_out_a_short_absence_after_a_lost_reply():
    store = LossyStore(two_pairs())
    store.lose_next, store.unreadable_after_loss = 1, 3
    res = update(store, lambda m: m.freeze([(0, 2047)], "op"), settle_timeout=5)
    assert res.changed and store.read().version == 1


def test_update_reports_an_unknown_outcome_when_the_store_stays_away():
    store = LossyStore(two_pairs())
    store.lose_next = 1
    store.unreadable_after_loss = 10 ** 6
    with pytest.raises(MapWriteUnknown, match="may or may not have been applied"):
        update(store, lambda m: m.freeze([(0, 2047)], "op"), settle_timeout=0.5)


def test_update_retries_a_lost_compare_and_set():
    store = MemoryMapStore(two_pairs())
    calls = []

    def edit(m):
        calls.append(1)
        if len(calls) == 1:  # another writer gets in between our read and our write
            store.write(m.freeze([(2048, 4095)], "other"), store.read().version)
        return m.freeze([(0, 2047)], "op")

    res = update(store, edit)
    final = store.read().map
    assert res.changed and len(calls) == 2
    assert freeze_owner(final.range_for(5)) == "op"
    assert freeze_owner(final.range_for(3000)) == "other"


def test_a_range_frozen_by_hand_is_adopted_and_stays_frozen_after():
    m = ShardMap.from_ranges([{"range": [0, 9], "master": "a:1", "state": "frozen"}])
    f = m.freeze([(0, 9)], "promote-pair001")
    assert freeze_owner(f.ranges[0]) == "promote-pair001"
    assert f.thaw("promote-pair001") == m
    moved = f.flip("promote-pair001", [(0, 9)], master="b:1", standby="a:1")
    assert moved.ranges[0].state == "frozen" and freeze_owner(moved.ranges[0]) is None


def test_change_ranges_survives_a_lost_reply_and_reports_the_change_once():
    """shard_map's call (open-range.yml's map write): before, a raw compare-and-set whose
    reply was lost failed the task although the range was registered."""
    from shardfleet.mapstore import change_ranges

    store = LossyStore(two_pairs())
    store.lose_next = 1
    new = [{"range": [4096, 8191], "master": "c1:3306", "standby": "c2:3306", "state": "open"}]
    res = change_ranges(store, "present", new)
    assert res.changed and store.read().version == 1, "written twice, or not at all"
    assert res.after.range_for(5000).master == "c1:3306"
    again = change_ranges(store, "present", new)
    assert not again.changed and again.version == 1
    with pytest.raises(MapError, match="overlap"):
        change_ranges(store, "present", [{"range": [8000, 9000], "master": "d1:3306"}])
    assert store.read().version == 1, "a refused plan wrote something"


def test_change_ranges_creates_the_first_map_and_check_writes_nothing():
    from shardfleet.mapstore import change_ranges

    store = MemoryMapStore()
    first = [{"range": [0, 4095], "master": "a1:3306", "state": "open"}]
    planned = change_ranges(store, "present", first, check=True)
    assert planned.changed and store.read().map is None
    made = change_ranges(store, "present", first)
    assert made.changed and made.before is None and store.read().map == made.after
