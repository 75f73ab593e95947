"""The read path's shortcuts agree with the ID layout's own checks."""

from __future__ import annotations

import random

import pytest

from shardfleet import ids
from shardfleet.errors import InvalidIDError
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store, _well_formed


def _accepted(v: object) -> bool:
    try:
        ids.decompose(v)  # type: ignore[arg-type]
    except InvalidIDError:
        return False
    return True


EDGES = [0, 1, -1, ids.MAX_ID, ids.MAX_ID + 1, ids.RESERVED_MASK, ids.SHARD_MASK,
         ids.TYPE_MASK, ids.LOCAL_MASK, ids.LOCAL_MASK + 1, ids.compose(0, 0, 1),
         ids.compose(ids.MAX_SHARD, ids.MAX_TYPE, ids.MAX_LOCAL),
         ids.compose(ids.MAX_SHARD, ids.MAX_TYPE, ids.MAX_LOCAL) + 1, 2**62, 2**62 - 1,
         True, False, 1.0, "5", None]


def test_well_formed_is_what_decompose_accepts():
    rng = random.Random(16)
    values = EDGES + [rng.getrandbits(rng.choice([8, 36, 46, 62, 63, 64, 70]))
                      for _ in range(20_000)]
    for v in values:
        assert _well_formed(v) == _accepted(v), f"{v!r}: shortcut and ids.decompose disagree"


def _store() -> Store:
    m = ShardMap.from_ranges([
        {"range": [0, 9], "master": "10.0.0.1:3306", "state": "open"},
        {"range": [10, 4095], "master": "10.0.0.2:3306", "state": "open"}],
        mod_shard_count=4096)
    return Store(Router(shard_map=m, user="u", password="p"))


def test_group_matches_decompose_and_refuses_bad_ids():
    s = _store()
    rng = random.Random(3)
    page = [ids.compose(rng.randrange(20), rng.choice([1, 2]), rng.randrange(1, 10**6))
            for _ in range(200)]
    want: dict = {}
    for i in page:
        o = ids.decompose(i)
        server = "10.0.0.1:3306" if o.shard < 10 else "10.0.0.2:3306"
        want.setdefault(server, {}).setdefault((o.shard, o.type), []).append(o.local)
    assert s._group(page) == want
    sql = s._many_sql(want["10.0.0.1:3306"])
    assert sql == s._many_sql(want["10.0.0.1:3306"]), "the cached heads give the same text"
    for bad in (0, -5, ids.compose(1, 1, 1) | ids.RESERVED_MASK, True, 2**64):
        with pytest.raises(InvalidIDError):
            s._group(page[:3] + [bad])
