import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfleet import ids
from shardfleet.errors import InvalidIDError, ShardfleetError

POST_VECTORS = [
    (241294492511762325, 3429, 1, 7075733),  # the post's Pin
    (241294561224164665, 3429, 2, 1337),  # a board
    (241294629943640797, 3429, 3, 733),  # a user
]
MANY = settings()  # examples per profile: tests/conftest.py (ci: 10,000)


@pytest.mark.parametrize("value,shard,type_,local", POST_VECTORS)
def test_post_vectors_decompose(value, shard, type_, local):
    assert ids.decompose(value) == ids.ObjectID(shard, type_, local)
    assert ids.decompose(value).shard == shard


@pytest.mark.parametrize("value,shard,type_,local", POST_VECTORS)
def test_post_vectors_compose(value, shard, type_, local):
    assert ids.compose(shard, type_, local) == value
    assert ids.base(shard, type_) + local == value


def test_base_checks_its_parts():
    with pytest.raises(InvalidIDError, match="shard"):
        ids.base(ids.MAX_SHARD + 1, 1)
    with pytest.raises(InvalidIDError, match="type"):
        ids.base(1, -1)


def test_layout_constants_are_derived():
    assert ids.ID_BITS == 64
    assert ids.SHARD_SHIFT == 46 and ids.TYPE_SHIFT == 36
    masks = [ids.RESERVED_MASK, ids.SHARD_MASK, ids.TYPE_MASK, ids.LOCAL_MASK]
    assert sum(bin(m).count("1") for m in masks) == 64
    for a in masks:
        for b in masks:
            if a is not b:
                assert a & b == 0
    assert ids.compose(ids.MAX_SHARD, ids.MAX_TYPE, ids.MAX_LOCAL) == (1 << 62) - 1


@MANY
@given(st.integers(0, ids.MAX_SHARD), st.integers(0, ids.MAX_TYPE),
       st.integers(1, ids.MAX_LOCAL))
def test_round_trip_every_valid_part(shard, type_, local):
    value = ids.compose(shard, type_, local)
    assert 0 < value < 1 << 62
    assert ids.decompose(value) == (shard, type_, local)
    assert ids.parse(str(value)) == value
    assert ids.base(shard, type_) + local == value


@MANY
@given(st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=1 << 64, max_value=1 << 80),
    st.integers(1, (1 << 64) - 1).filter(lambda v: v & ids.RESERVED_MASK),
    st.integers(0, (1 << 62) - 1).map(lambda v: v & ~ids.LOCAL_MASK),
))
def test_rejects_invalid_ids(value):
    with pytest.raises(InvalidIDError):
        ids.decompose(value)


@pytest.mark.parametrize("value,needle", [
    (-1, "negative"), (1 << 64, "64 bits"), (1 << 62 | 5, "reserved"), (1 << 46, "local ID 0"),
    ("241294492511762325", "must be an int"), (1.5, "must be an int"), (True, "must be an int"),
    (None, "must be an int"),
])
def test_invalid_id_messages_name_the_part(value, needle):
    with pytest.raises(InvalidIDError, match=needle):
        ids.decompose(value)


@pytest.mark.parametrize("parts,needle", [
    ((-1, 1, 1), "shard"), ((1 << 16, 1, 1), "shard"), ((1, -1, 1), "type"),
    ((1, 1024, 1), "type"), ((1, 1, 0), "local ID"), ((1, 1, 1 << 36), "local ID"),
    (("1", 1, 1), "shard must be an int"), ((1, 1.0, 1), "type must be an int"),
])
def test_compose_names_the_bad_part(parts, needle):
    with pytest.raises(InvalidIDError, match=needle):
        ids.compose(*parts)


def test_errors_share_one_base():
    assert issubclass(InvalidIDError, ShardfleetError)


@MANY
@given(st.text(max_size=30))
def test_parse_rejects_non_integers_with_library_error(text):
    try:
        value = ids.parse(text)
    except InvalidIDError:
        return
    assert ids.decompose(value)
