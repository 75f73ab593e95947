import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfleet import shardmap
from shardfleet.errors import MapError, ShardNotMappedError
from shardfleet.shardmap import ShardMap, ShardRange

MANY = settings()  # examples per profile: tests/conftest.py (ci: 10,000)


def two_pairs():
    return ShardMap.from_ranges([
        {"range": [0, 2047], "master": "a1:3306", "standby": "a2:3306", "state": "open"},
        {"range": [2048, 4095], "master": "b1:3306", "standby": "b2:3306", "state": "open"},
    ])


def test_post_shape_round_trip():
    m = two_pairs()
    doc = json.loads(m.dumps())
    assert doc["mod_shard_count"] == 4096
    assert doc["ranges"][0] == {"range": [0, 2047], "master": "a1:3306",
                                "standby": "a2:3306", "state": "open"}
    assert shardmap.loads(m.dumps()) == m
    # the post's bare list is accepted too
    assert shardmap.loads(json.dumps(doc["ranges"])) == m


def test_lookup():
    m = two_pairs()
    assert m.range_for(0).master == "a1:3306"
    assert m.range_for(2047).master == "a1:3306"
    assert m.range_for(2048).master == "b1:3306"
    assert m.range_for(3429).master == "b1:3306"
    with pytest.raises(ShardNotMappedError, match="4096"):
        m.range_for(4096)


@pytest.mark.parametrize("ranges,needle", [
    ([{"range": [0, 10], "master": "a:1"}, {"range": [10, 20], "master": "b:1"}], "overlaps"),
    ([{"range": [0, 65536], "master": "a:1"}], "out of bounds"),
    ([{"range": [-1, 5], "master": "a:1"}], "out of bounds"),
    ([{"range": [5, 1], "master": "a:1"}], "after last"),
    ([{"range": [0, 1]}], "master None"),
    ([{"range": [0, 1], "master": "nohostport"}], "host:port"),
    ([{"range": [0, 1], "master": "a:1", "standby": "a:1"}], "same server"),
    ([{"range": [0, 1], "master": "a:1", "state": "melting"}], "not one of"),
    ([{"range": [0], "master": "a:1"}], "first, last"),
    ([{"range": ["0", 1], "master": "a:1"}], "first, last"),
    (["x"], "must be an object"),
    ([], "no ranges"),
])
def test_invalid_maps(ranges, needle):
    with pytest.raises(MapError, match=needle):
        ShardMap.from_ranges(ranges)


def test_unknown_host_refused():
    with pytest.raises(MapError, match="not a known host"):
        ShardMap.from_ranges([{"range": [0, 1], "master": "a:1"}], known_hosts={"b:1"})


def test_edits_validate_and_diff():
    m = two_pairs()
    bigger = m.merge([ShardRange(4096, 8191, "c1:3306", "c2:3306", "open")])
    assert [r.bounds for r in bigger.ranges] == [(0, 2047), (2048, 4095), (4096, 8191)]
    with pytest.raises(MapError, match="overlaps"):
        m.merge([ShardRange(4000, 5000, "c1:3306")])
    frozen = m.with_state((2048, 4095), "frozen")
    assert shardmap.diff(m, frozen) == ["~ [2048, 4095] state: open -> frozen"]
    lines = shardmap.diff(m, bigger)
    assert lines == ["+ [4096, 8191] master=c1:3306 standby=c2:3306 state=open"]
    assert shardmap.diff(bigger, m) == ["- [4096, 8191] master=c1:3306 standby=c2:3306 state=open"]
    with pytest.raises(MapError, match="no range"):
        m.remove([(1, 2)])
    assert m.remove([(2048, 4095)]).ranges == (m.ranges[0],)


def test_extra_keys_survive():
    m = ShardMap.from_ranges([{"range": [0, 1], "master": "a:1", "state": "frozen",
                               "frozen_from": "open"}])
    assert shardmap.loads(m.dumps()).ranges[0].extra == {"frozen_from": "open"}


def test_mod_shard_is_md5_big_endian_mod_count():
    import hashlib
    m = two_pairs()
    expect = int.from_bytes(hashlib.md5(b"ada@example.com").digest(), "big") % 4096
    assert m.mod_shard("ada@example.com") == expect


def test_table_lists_every_range():
    t = two_pairs().table()
    assert "0-2047" in t and "b2:3306" in t and t.splitlines()[0].startswith("RANGE")


@st.composite
def maps(draw):
    cuts = sorted(draw(st.sets(st.integers(0, 65535), min_size=1, max_size=12)))
    ranges = []
    for i, first in enumerate(cuts):
        last = cuts[i + 1] - 1 if i + 1 < len(cuts) else draw(st.integers(first, 65535))
        if draw(st.booleans()):
            ranges.append(ShardRange(first, last, f"m{i}:3306", f"s{i}:3306",
                                     draw(st.sampled_from(shardmap.STATES))))
    if not ranges:
        ranges.append(ShardRange(cuts[0], cuts[0], "m:1"))
    return ShardMap.from_ranges(ranges)


@MANY
@given(maps(), st.integers(0, 65535))
def test_generated_maps_round_trip_and_lookup(m, shard):
    assert shardmap.loads(m.dumps()) == m
    linear = next((r for r in m.ranges if r.first <= shard <= r.last), None)
    assert m.find(shard) == linear


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-70000, 70000) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=12,
)
entry = st.fixed_dictionaries({
    "range": st.one_of(st.lists(st.integers(-5, 70000), min_size=0, max_size=3), json_values),
    "master": st.one_of(st.sampled_from(["a:1", "b:2", "", "x"]), json_values),
}, optional={"state": st.one_of(st.sampled_from(shardmap.STATES), st.text(max_size=6)),
             "standby": st.one_of(st.none(), st.sampled_from(["a:1", "c:3"]))})


@MANY
@given(st.one_of(st.lists(entry, max_size=5), json_values,
                 st.fixed_dictionaries({"ranges": st.lists(entry, max_size=4)})))
def test_generated_documents_parse_or_raise_map_error(doc):
    try:
        m = shardmap.from_obj(doc)
    except MapError:
        return
    # whatever parses is a valid map: sorted, disjoint, in bounds
    for a, b in zip(m.ranges, m.ranges[1:], strict=False):
        assert a.last < b.first
    assert all(0 <= r.first <= r.last <= 65535 for r in m.ranges)


@MANY
@given(st.binary(max_size=40))
def test_garbage_bytes_raise_map_error(raw):
    try:
        shardmap.loads(raw)
    except MapError:
        pass


def test_plan_change_present_merges_fields():
    m = two_pairs()
    closed = shardmap.plan_change(m, "present", [{"range": [0, 2047], "state": "closed"}])
    assert closed.range_for(0).state == "closed" and closed.range_for(0).master == "a1:3306"
    grown = shardmap.plan_change(m, "present", [{"range": [4096, 8191], "master": "c:1"}])
    assert len(grown.ranges) == 3
    assert shardmap.plan_change(m, "present", [r.to_dict() for r in m.ranges]) == m


def test_plan_change_exact_absent_and_refusals():
    m = two_pairs()
    only = shardmap.plan_change(m, "exact", [{"range": [0, 9], "master": "x:1"}])
    assert [r.bounds for r in only.ranges] == [(0, 9)]
    assert shardmap.plan_change(m, "absent", [{"range": [2048, 4095]}]).ranges == m.ranges[:1]
    assert shardmap.plan_change(m, "absent", [{"range": [9000, 9001]}]) == m
    with pytest.raises(MapError, match="partly overlaps"):
        shardmap.plan_change(m, "absent", [{"range": [0, 10]}])
    with pytest.raises(MapError, match="fixed at 4096"):
        shardmap.plan_change(m, "present", [], mod_shard_count=8)
    with pytest.raises(MapError, match="overlaps"):
        shardmap.plan_change(m, "present", [{"range": [100, 3000], "master": "z:1"}])
    with pytest.raises(MapError, match="first, last"):
        shardmap.plan_change(m, "present", [{"range": "0-10"}])
    with pytest.raises(MapError, match="no map"):
        shardmap.plan_change(None, "absent", [{"range": [0, 1]}])


@pytest.mark.parametrize("first,last,parts,expect", [
    (0, 4095, 2, [(0, 2047), (2048, 4095)]),
    (0, 4095, 3, [(0, 1365), (1366, 2730), (2731, 4095)]),
    (4096, 8191, 1, [(4096, 8191)]),
])
def test_even_split(first, last, parts, expect):
    assert shardmap.even_split(first, last, parts) == expect


def test_even_split_refuses():
    with pytest.raises(MapError):
        shardmap.even_split(0, 1, 3)
    with pytest.raises(MapError):
        shardmap.even_split(0, 10, 0)


# -- the stored form, read line by line -----------------------------------------
# loads() reads bytes in exactly the stored form through a cache of lines already
# parsed and checked (shardmap._loads_stored). Whatever it accepts must be what the
# whole-document parse builds, and whatever that refuses it must refuse with the
# same message: these tests hold the two against each other.

def whole(data: bytes):
    """What the whole-document parse makes of *data*: a map, or the MapError message."""
    try:
        return shardmap.from_obj(json.loads(data))
    except ValueError:
        return "not valid JSON"
    except MapError as exc:
        return str(exc)


def by_lines(data: bytes):
    """What loads() makes of *data* (bytes: the stored form's road when it applies)."""
    try:
        return shardmap.loads(data)
    except MapError as exc:
        return "not valid JSON" if "not valid JSON" in str(exc) else str(exc)


def entry_line(d) -> bytes:
    return b"  " + json.dumps(d).encode()


def stored(lines, count=4096) -> bytes:
    return (b'{"mod_shard_count": %d, "ranges": [\n' % count + b",\n".join(lines)
            + b"\n]}\n")


def test_stored_form_is_one_line_per_range_and_reads_back_by_lines(monkeypatch):
    m = two_pairs()
    data = m.to_bytes()
    assert data.splitlines()[1:3] == [
        b'  {"range": [0, 2047], "master": "a1:3306", "standby": "a2:3306", "state": "open"},',
        b'  {"range": [2048, 4095], "master": "b1:3306", "standby": "b2:3306", "state": "open"}']
    assert json.loads(data) == m.to_dict() and m.dumps() == data.decode()
    seen = []
    monkeypatch.setattr(shardmap, "_loads_stored",
                        lambda d, f=shardmap._loads_stored: seen.append(f(d)) or seen[-1])
    assert shardmap.loads(data) == m and seen[-1] == m, "the stored form took the whole parse"
    # the lines are kept: the same ranges again, not parsed again
    again = shardmap.loads(data)
    assert all(a is b for a, b in zip(again.ranges, seen[-1].ranges, strict=True))
    assert again.to_bytes() == data
    # out of order: the same map, written back in order
    swapped = stored([m.ranges[1]._line, m.ranges[0]._line])
    assert shardmap.loads(swapped) == m and shardmap.loads(swapped).to_bytes() == data


def test_a_map_differing_in_one_range_is_checked_and_refused():
    """The lines of a good map are cached; a version with one bad line is still refused,
    with the message the whole-document parse gives."""
    good = [entry_line({"range": [i * 16, i * 16 + 15], "master": f"m{i}:3306",
                        "standby": f"s{i}:3306", "state": "open"}) for i in range(256)]
    assert isinstance(shardmap.loads(stored(good)), ShardMap)
    bad_entries = {
        "host:port": {"master": "nohostport"},
        "same server": {"standby": "m7:3306"},
        "not one of": {"state": "melting"},
        "out of bounds": {"range": [112, 65536]},
        "after last": {"range": [127, 112]},
        "overlaps": {"range": [100, 127]},
        "first, last": {"range": [112]},
    }
    for needle, change in bad_entries.items():
        lines = list(good)
        lines[7] = entry_line({**json.loads(good[7]), **change})
        data = stored(lines)
        with pytest.raises(MapError, match=needle):
            shardmap.loads(data)
        assert by_lines(data) == whole(data)
    # every line cached and valid, the map still checked across ranges
    overlapping = stored(good + [good[3]])
    with pytest.raises(MapError, match="overlaps"):
        shardmap.loads(overlapping)
    for count in (0, 65537):
        with pytest.raises(MapError, match="mod_shard_count"):
            shardmap.loads(stored(good, count))
    with pytest.raises(MapError, match="not valid JSON"):
        shardmap.loads(stored(good[:5] + [good[5][:-1]] + good[6:]))
    with pytest.raises(MapError, match="no ranges"):
        shardmap.loads(b'{"mod_shard_count": 4096, "ranges": [\n\n]}\n')


def test_other_layouts_of_the_same_json_read_as_before():
    m = two_pairs()
    for data in (json.dumps(m.to_dict(), indent=2).encode(),  # the layout before this one
                 json.dumps(m.to_dict()).encode(),
                 json.dumps(m.to_dict()["ranges"]).encode(),  # the post's bare list
                 m.to_bytes().replace(b"\n]}\n", b"]}"),
                 m.to_bytes().replace(b'"state": "open"}', b'"state":"open"}'),
                 stored([m.ranges[1]._line, m.ranges[0]._line])):  # out of order
        assert shardmap.loads(data) == m, data


def test_parsed_lines_are_bounded(monkeypatch):
    monkeypatch.setattr(shardmap, "_PARSED", {})
    monkeypatch.setattr(shardmap, "_PARSED_MAX", 10)
    m = ShardMap.from_ranges([{"range": [i, i], "master": "a:1"} for i in range(8)])
    for i in range(8):
        m = m.with_state((i, i), "closed")
        assert shardmap.loads(m.to_bytes()) == m
        assert len(shardmap._PARSED) <= 10 + 8
    assert shardmap.loads(m.to_bytes()) == m


@st.composite
def stored_and_mutated(draw):
    """A valid map's stored form, and that form with one edit to its lines or header."""
    m = draw(maps())
    data = m.to_bytes()
    lines = data.split(b"\n")[1:-2]
    lines = [line.rstrip(b",") for line in lines]
    count = m.mod_shard_count
    kind = draw(st.sampled_from(["entry", "swap", "duplicate", "drop", "count", "bytes",
                                 "field"]))
    i = draw(st.integers(0, len(lines) - 1))
    if kind == "entry":
        lines[i] = entry_line(draw(entry))
    elif kind == "field":
        d = json.loads(lines[i])
        key = draw(st.sampled_from(["range", "master", "standby", "state", "frozen_by"]))
        d[key] = draw(st.one_of(json_values, st.sampled_from(
            [[0, 0], [65535, 65535], "m0:3306", "s0:3306", "open", "frozen", None])))
        lines[i] = entry_line(d)
    elif kind == "swap":
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "duplicate":
        lines.insert(i, lines[i])
    elif kind == "drop":
        del lines[i]
    elif kind == "count":
        count = draw(st.integers(-2, 70000))
    mutated = stored(lines, count)
    if kind == "bytes":
        at = draw(st.integers(0, len(mutated)))
        mutated = mutated[:at] + draw(st.binary(min_size=1, max_size=3)) + mutated[at:]
    return data, mutated


@MANY
@given(stored_and_mutated())
def test_by_lines_and_whole_agree_after_any_one_edit(pair):
    data, mutated = pair
    assert by_lines(data) == whole(data)  # and its lines are cached now
    got = by_lines(mutated)
    assert got == whole(mutated)
    if isinstance(got, ShardMap):  # what is read is what is written back
        assert got.to_bytes() == ShardMap.from_ranges(got.ranges, got.mod_shard_count).to_bytes()
