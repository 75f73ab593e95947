"""The shard map: which pair serves which range of shards, and in what state.

The map is the one place ranges are modelled. Its JSON form keeps the post's
shape, one entry per range, arrays for the bounds::

    {"mod_shard_count": 4096,
     "ranges": [{"range": [0, 511], "master": "mysql001a:3306",
                 "standby": "mysql001b:3306", "state": "open"}, ...]}

That is also the stored form (:meth:`ShardMap.to_bytes`, what ZooKeeper and a
router's cache file hold), written one range per line: a map of 4,096 ranges is
about 400 KiB, and a new version differs from the last in a line or two, which is
what lets a router read it cheaply (:func:`loads`). A bare list of range entries
is also accepted on input (mod_shard_count then defaults to 4096), as is any other
layout of the same JSON. ``mod_shard_count`` is the initial shard count that mod-shard
keys hash over; it is fixed forever once the map exists.

States: ``open`` accepts new objects, ``closed`` serves existing ones (and new
objects placed near existing ones), ``frozen`` refuses writes during a cutover.
"""

from __future__ import annotations

import bisect
import json
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import repeat
from typing import Any, cast

from shardfleet import ids
from shardfleet.errors import MapError, ShardNotMappedError

STATES = ("open", "closed", "frozen")
DEFAULT_MOD_SHARD_COUNT = 4096
_HOSTPORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
_KNOWN_KEYS = {"range", "master", "standby", "state"}


@dataclass(frozen=True)
class ShardRange:
    """One entry of the map: shards ``first..last`` (inclusive) on one pair.

    ``extra`` keeps any other keys of the entry (for example ``frozen_from``,
    which an operation in progress sets, or ``rebuild``) so they survive a
    round trip through the map.
    """

    first: int
    last: int
    master: str
    standby: str | None = None
    state: str = "open"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __contains__(self, shard: object) -> bool:
        return isinstance(shard, int) and self.first <= shard <= self.last

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    @property
    def bounds(self) -> tuple[int, int]:
        return (self.first, self.last)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"range": [self.first, self.last], "master": self.master,
                             "standby": self.standby, "state": self.state}
        d.update({k: self.extra[k] for k in sorted(self.extra)})
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "range") -> ShardRange:
        if not isinstance(d, dict):
            raise MapError(f"{where}: an entry must be an object, got {type(d).__name__}")
        r = d.get("range")
        if (not isinstance(r, list | tuple) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise MapError(f"{where}: 'range' must be [first, last] integers, got {r!r}")
        extra = {k: v for k, v in d.items() if k not in _KNOWN_KEYS}
        return cls(r[0], r[1], d.get("master"), d.get("standby"),  # type: ignore[arg-type]
                   d.get("state", "open"), extra)

    def describe(self) -> str:
        return (f"[{self.first}, {self.last}] master={self.master} "
                f"standby={self.standby or '-'} state={self.state}")

    @cached_property
    def _line(self) -> bytes:
        """This entry's line in the stored form, computed once (a range is immutable,
        and no edit changes ``extra`` in place: each builds a new range)."""
        return _INDENT + json.dumps(self.to_dict()).encode("ascii")


def _check_range(r: ShardRange, where: str, known_hosts: set[str] | None) -> None:
    for name, v in (("first", r.first), ("last", r.last)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise MapError(f"{where}: {name} shard {v!r} is not an integer")
        if not 0 <= v <= ids.MAX_SHARD:
            raise MapError(f"{where}: {name} shard {v} is out of bounds 0..{ids.MAX_SHARD}")
    if r.first > r.last:
        raise MapError(f"{where}: first shard {r.first} is after last shard {r.last}")
    if not isinstance(r.master, str) or not _HOSTPORT.match(r.master):
        raise MapError(f"{where}: master {r.master!r} must be 'host:port'")
    if r.standby is not None:
        if not isinstance(r.standby, str) or not _HOSTPORT.match(r.standby):
            raise MapError(f"{where}: standby {r.standby!r} must be 'host:port' or null")
        if r.standby == r.master:
            raise MapError(f"{where}: master and standby are the same server {r.master}")
    if r.state not in STATES:
        raise MapError(f"{where}: state {r.state!r} is not one of {', '.join(STATES)}")
    if known_hosts is not None:
        for host in (r.master, r.standby):
            if host is not None and host not in known_hosts:
                raise MapError(f"{where}: server {host} is not a known host")


@dataclass(frozen=True)
class ShardMap:
    """An immutable, validated map. Build one with :meth:`from_ranges` or :func:`loads`."""

    ranges: tuple[ShardRange, ...]
    mod_shard_count: int = DEFAULT_MOD_SHARD_COUNT
    _starts: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_ranges(cls, ranges: Iterable[ShardRange | Mapping[str, Any]],
                    mod_shard_count: int = DEFAULT_MOD_SHARD_COUNT,
                    known_hosts: Iterable[str] | None = None) -> ShardMap:
        """Validate and build a map; raises :class:`MapError` naming the first problem."""
        items = [r if isinstance(r, ShardRange) else ShardRange.from_dict(r, f"ranges[{i}]")
                 for i, r in enumerate(ranges)]
        known = set(known_hosts) if known_hosts is not None else None
        for i, r in enumerate(items):
            _check_range(r, f"range [{r.first}, {r.last}]" if isinstance(r.first, int)
                         else f"ranges[{i}]", known)
        return cls._assemble(items, mod_shard_count)

    @classmethod
    def _assemble(cls, items: list[ShardRange], mod_shard_count: Any) -> ShardMap:
        """The checks across ranges, then the map; every range in *items* is checked
        already (:func:`_check_range`). Sorts *items* in place."""
        if (not isinstance(mod_shard_count, int) or isinstance(mod_shard_count, bool)
                or not 1 <= mod_shard_count <= ids.MAX_SHARD + 1):
            raise MapError(f"mod_shard_count {mod_shard_count!r} is not in 1..{ids.MAX_SHARD + 1}")
        items.sort(key=_FIRST)
        starts = tuple(map(_FIRST, items))
        # each range must start after the last shard of the one before it; the pass runs
        # in C (map, operator), the loop below only names the first overlap
        if any(map(operator.le, starts[1:], map(_LAST, items))):
            for a, b in zip(items, items[1:], strict=False):
                if b.first <= a.last:
                    raise MapError(f"range [{b.first}, {b.last}] overlaps range "
                                   f"[{a.first}, {a.last}]")
        if not items:
            raise MapError("the map has no ranges")
        return cls(tuple(items), mod_shard_count, starts)

    # -- lookups ---------------------------------------------------------
    def find(self, shard: int) -> ShardRange | None:
        i = bisect.bisect_right(self._starts, shard) - 1
        if i >= 0:
            r = self.ranges[i]
            if shard <= r.last:
                return r
        return None

    def range_for(self, shard: int) -> ShardRange:
        """The range holding *shard*; raises :class:`ShardNotMappedError` if none does."""
        r = self.find(shard)
        if r is None:
            raise ShardNotMappedError(f"shard {shard} is not in any range of the map")
        return r

    def open_ranges(self) -> list[ShardRange]:
        return [r for r in self.ranges if r.state == "open"]

    def servers(self) -> set[str]:
        return {h for r in self.ranges for h in (r.master, r.standby) if h}

    def ranges_of(self, server: str) -> list[ShardRange]:
        """Ranges whose master or standby is *server*."""
        return [r for r in self.ranges if server in (r.master, r.standby)]

    def mod_shard(self, key: str | bytes) -> int:
        """The shard a mod-shard key lives on: md5 (big-endian) mod the initial shard count."""
        import hashlib

        raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
        return int.from_bytes(hashlib.md5(raw).digest(), "big") % self.mod_shard_count

    # -- edits (each returns a new, validated map) -----------------------
    def merge(self, ranges: Iterable[ShardRange], known_hosts: Iterable[str] | None = None
              ) -> ShardMap:
        """Add *ranges*; an entry with the same bounds as an existing one replaces it."""
        new = {r.bounds: r for r in self.ranges}
        for r in ranges:
            new[r.bounds] = r
        return ShardMap.from_ranges(new.values(), self.mod_shard_count, known_hosts)

    def remove(self, bounds: Iterable[tuple[int, int]]) -> ShardMap:
        """Remove the ranges with exactly these bounds (unknown bounds are an error)."""
        drop = set(bounds)
        missing = drop - {r.bounds for r in self.ranges}
        if missing:
            raise MapError("no range with bounds " + ", ".join(f"[{a}, {b}]" for a, b in
                                                              sorted(missing)))
        return ShardMap.from_ranges([r for r in self.ranges if r.bounds not in drop],
                                    self.mod_shard_count)

    def replace_range(self, old: ShardRange, *new: ShardRange) -> ShardMap:
        """Replace the entry *old* (matched by bounds) by *new* entries."""
        if old.bounds not in {r.bounds for r in self.ranges}:
            raise MapError(f"no range with bounds [{old.first}, {old.last}]")
        rest = [r for r in self.ranges if r.bounds != old.bounds]
        return ShardMap.from_ranges(rest + list(new), self.mod_shard_count)

    def with_state(self, bounds: tuple[int, int], state: str) -> ShardMap:
        r = next((x for x in self.ranges if x.bounds == bounds), None)
        if r is None:
            raise MapError(f"no range with bounds [{bounds[0]}, {bounds[1]}]")
        return self.replace_range(r, replace(r, state=state))

    # -- the map-change vocabulary of operations ---------------------------
    # Every operation (split, promotion) changes the map with these three edits and
    # nothing else. Each is idempotent: applied to its own result it returns an equal
    # map, which is how :func:`shardfleet.mapstore.update` tells, after a lost reply,
    # that its write landed. A range frozen by one operation carries ``frozen_by``
    # (the operation's name) and ``frozen_from`` (its state before); another owner's
    # freeze is refused, never overwritten or lifted.

    def frozen_by(self, owner: str) -> list[ShardRange]:
        """Ranges frozen by the operation *owner*."""
        return [r for r in self.ranges if r.state == "frozen" and freeze_owner(r) == owner]

    def freeze(self, bounds: Iterable[tuple[int, int]], owner: str) -> ShardMap:
        """Freeze the ranges with *bounds* for *owner* (routers hold writes to them).

        Bounds inside one larger range cut it: the remainders keep everything, the
        piece is frozen. Already frozen by *owner*: unchanged. Frozen by hand (no
        owner): adopted, and its thaw leaves it frozen. Frozen by another operation,
        or spanning more than one range: :class:`MapError`.
        """
        m = self
        for first, last in sorted(set(bounds)):
            holder = [r for r in m.ranges if r.first <= last and first <= r.last]
            if len(holder) != 1 or not (holder[0].first <= first and last <= holder[0].last):
                raise MapError(f"shards {first}..{last} are not inside one range of the map ("
                               + (", ".join(f"[{r.first}, {r.last}]" for r in holder)
                               or "no range") + ")")
            r = holder[0]
            if r.state == "frozen":
                held_by = freeze_owner(r)
                if held_by is not None and held_by != owner:
                    raise MapError(f"range [{r.first}, {r.last}] is frozen by {held_by}, "
                                   f"not {owner}")
                if held_by == owner and r.bounds == (first, last):
                    continue
                # frozen by hand (no owner): adopted; its thaw gives back "frozen"
            extra = {**r.extra, FROZEN_FROM: r.extra.get(FROZEN_FROM, r.state)
                     if r.state == "frozen" else r.state, FROZEN_BY: owner}
            extra.pop(_LEGACY_OWNER, None)
            piece = replace(r, first=first, last=last, state="frozen", extra=extra)
            out = [piece]
            if r.first < first:
                out.append(replace(r, last=first - 1))
            if last < r.last:
                out.append(replace(r, first=last + 1))
            m = m.replace_range(r, *out)
        return m

    def thaw(self, owner: str, bounds: Iterable[tuple[int, int]] | None = None, *,
             rejoin: tuple[int, int] | None = None) -> ShardMap:
        """Give the ranges frozen by *owner* (all, or those with *bounds*) their state back.

        *rejoin*: the bounds of the range a :meth:`freeze` cut; once no piece inside
        it is frozen and all agree on everything but bounds, they become one range
        again (the map as it was). Ranges not frozen by *owner* are left alone, so a
        thaw never lifts another operation's freeze.
        """
        want = set(bounds) if bounds is not None else None
        out = [_thawed(r) if r.state == "frozen" and freeze_owner(r) == owner
               and (want is None or r.bounds in want) else r for r in self.ranges]
        m = ShardMap.from_ranges(out, self.mod_shard_count)
        if rejoin is not None:
            inside = [r for r in m.ranges if rejoin[0] <= r.first and r.last <= rejoin[1]]
            cover = sum(r.size for r in inside) == rejoin[1] - rejoin[0] + 1
            same = {(r.master, r.standby, r.state, tuple(sorted(r.extra.items())))
                    for r in inside}
            if len(inside) > 1 and cover and len(same) == 1:
                whole = replace(inside[0], first=rejoin[0], last=rejoin[1])
                rest = [r for r in m.ranges if r not in inside]
                m = ShardMap.from_ranges(rest + [whole], self.mod_shard_count)
        return m

    def flip(self, owner: str, bounds: Iterable[tuple[int, int]], *, master: str,
             standby: str | None, drop: Iterable[str] = (),
             set_extra: Mapping[str, Any] | None = None) -> ShardMap:
        """Move the ranges with *bounds*, frozen by *owner*, to *master*/*standby* and thaw
        them, in one edit. A range already on *master* and not frozen by *owner* is done
        (unchanged). *drop* names extra keys to remove, *set_extra* keys to set. Any other
        state (not frozen by *owner*, bounds missing): :class:`MapError`, nothing flipped.
        """
        m = self
        for b in sorted(set(bounds)):
            r = next((x for x in m.ranges if x.bounds == b), None)
            if r is None:
                raise MapError(f"no range with bounds [{b[0]}, {b[1]}] to flip")
            if r.master == master and not (r.state == "frozen" and freeze_owner(r) == owner):
                continue
            if r.state != "frozen" or freeze_owner(r) != owner:
                raise MapError(f"range [{r.first}, {r.last}] is not frozen by {owner} "
                               f"({r.describe()}); not flipping it")
            t = _thawed(r)
            extra = {k: v for k, v in t.extra.items() if k not in set(drop)}
            extra.update(set_extra or {})
            m = m.replace_range(r, replace(t, master=master, standby=standby, extra=extra))
        return m

    # -- serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"mod_shard_count": self.mod_shard_count,
                "ranges": [r.to_dict() for r in self.ranges]}

    def dumps(self, indent: int | None = None) -> str:
        """The stored form as text; with *indent*, the same JSON indented that much."""
        if indent is None:
            return self.to_bytes().decode("ascii")
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def to_bytes(self) -> bytes:
        """The stored form: the JSON object, one range per line, in order::

            {"mod_shard_count": 4096, "ranges": [
              {"range": [0, 2047], "master": "a1:3306", "standby": "a2:3306", "state": "open"},
              {"range": [2048, 4095], "master": "b1:3306", "standby": "b2:3306", "state": "open"}
            ]}

        ASCII only (``json.dumps`` escapes the rest); each line is computed once per range.
        """
        return self._stored

    @cached_property
    def _stored(self) -> bytes:
        return (_HEAD_FORMAT % self.mod_shard_count + b",\n".join(r._line for r in self.ranges)
                + _TAIL)

    def table(self) -> str:
        """A fixed-width table of the ranges, for people."""
        rows = [("RANGE", "SHARDS", "MASTER", "STANDBY", "STATE")]
        for r in self.ranges:
            rows.append((f"{r.first}-{r.last}", str(r.size), r.master, r.standby or "-", r.state))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                         for row in rows)


FROZEN_BY = "frozen_by"      # the operation that froze a range
FROZEN_FROM = "frozen_from"  # the state it had before
_LEGACY_OWNER = "split"      # maps written before ``frozen_by`` named a split's freeze so


def freeze_owner(r: ShardRange) -> str | None:
    """The operation that froze *r* (None when nobody owns its freeze)."""
    owner = r.extra.get(FROZEN_BY) or r.extra.get(_LEGACY_OWNER)
    return str(owner) if owner else None


def _thawed(r: ShardRange) -> ShardRange:
    extra = {k: v for k, v in r.extra.items() if k not in (FROZEN_BY, FROZEN_FROM, _LEGACY_OWNER)}
    state = str(r.extra.get(FROZEN_FROM, "open")) if r.state == "frozen" else r.state
    return replace(r, state=state, extra=extra)


def from_obj(data: Any, known_hosts: Iterable[str] | None = None) -> ShardMap:
    """Build a map from its parsed JSON (the object form or a bare list of ranges)."""
    if isinstance(data, list):
        return ShardMap.from_ranges(data, known_hosts=known_hosts)
    if isinstance(data, dict):
        if "ranges" not in data:
            raise MapError("the map object has no 'ranges' list")
        if not isinstance(data["ranges"], list):
            raise MapError("'ranges' must be a list")
        unknown = set(data) - {"ranges", "mod_shard_count"}
        if unknown:
            raise MapError(f"unknown map keys: {', '.join(sorted(unknown))}")
        return ShardMap.from_ranges(data["ranges"],
                                    data.get("mod_shard_count", DEFAULT_MOD_SHARD_COUNT),
                                    known_hosts)
    raise MapError(f"a map must be a JSON object or list, got {type(data).__name__}")


def loads(text: str | bytes, known_hosts: Iterable[str] | None = None) -> ShardMap:
    """Parse and validate a map's JSON; raises :class:`MapError`.

    Bytes in exactly the stored form (:meth:`ShardMap.to_bytes`) take a shorter road
    to the same map (:func:`_loads_stored`); anything else, and anything that road
    declines, is parsed whole.
    """
    if isinstance(text, bytes) and known_hosts is None:
        m = _loads_stored(text)
        if m is not None:
            return m
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MapError(f"the map is not valid JSON: {exc}") from None
    return from_obj(data, known_hosts)


# -- the stored form, read line by line ---------------------------------------
# A router parses every version of the map, and a new version differs from the one
# before in the few ranges an operation touched. The checks of one entry (its
# shape, bounds, addresses, state: ShardRange.from_dict and _check_range) depend on
# its line alone, so a line already parsed and checked needs neither again: _PARSED
# keeps the range each such line holds. The checks across ranges (order, overlaps,
# mod_shard_count, not empty: ShardMap._assemble) run on every map. A line is kept
# only if it is exactly how its range writes itself (ShardRange._line); a JSON
# string holds no raw newline, so the document is the header, those lines and the
# tail, and the map read this way is the one json.loads + from_obj builds from it.
# Anything else (another layout, a bad line, a bad map) is declined, and loads()
# parses the document whole: the same checks, the same messages, as before.

_INDENT = b"  "
_HEAD = re.compile(rb'\{"mod_shard_count": ([1-9][0-9]{0,5}), "ranges": \[\n')
_HEAD_FORMAT = b'{"mod_shard_count": %d, "ranges": [\n'
_TAIL = b"\n]}\n"
_FIRST = operator.attrgetter("first")
_LAST = operator.attrgetter("last")
_PARSED: dict[bytes, ShardRange] = {}
_PARSED_MAX = 8192  # lines kept beyond the last map's: then only the last map's are kept


def _parse_line(line: bytes) -> ShardRange | None:
    """The checked range on one line of the stored form; None if the line is not
    exactly how that range writes itself. Raises :class:`MapError` (a bad entry)."""
    try:
        d = json.loads(line)
    except ValueError:
        return None
    r = ShardRange.from_dict(d)
    _check_range(r, "range", None)
    return r if r._line == line else None


def _loads_stored(data: bytes) -> ShardMap | None:
    """The map in *data* if *data* is exactly in the stored form, else None.

    Never raises for a bad map: it declines (None), and :func:`loads` parses the
    document whole, which names the problem the way it always has.
    """
    head = _HEAD.match(data)
    if head is None or not data.endswith(_TAIL):
        return None
    lines = data[head.end():len(data) - len(_TAIL)].split(b",\n")
    parsed = _PARSED
    found = list(map(parsed.get, lines))  # None: a line not seen before
    try:
        if any(map(operator.is_, found, repeat(None))):
            for i, line in enumerate(lines):
                if found[i] is None:
                    r = _parse_line(line)
                    if r is None:
                        return None
                    found[i] = parsed[line] = r
        in_order = cast(list[ShardRange], found)
        m = ShardMap._assemble(list(in_order), int(head[1]))
    except MapError:
        return None
    if len(parsed) > _PARSED_MAX + len(lines):
        # unbounded otherwise (every version adds its changed lines); two threads
        # racing here at worst parse a line again
        parsed.clear()
        parsed.update(zip(lines, in_order, strict=True))
    if m.ranges == tuple(in_order):
        # in order, the document is byte for byte what m.to_bytes() would join again (the
        # router's cache file writes it): keep it as the cached value of ShardMap._stored
        m.__dict__["_stored"] = data
    return m


def diff(before: ShardMap | None, after: ShardMap | None) -> list[str]:
    """A readable list of changes between two maps: ``- old``, ``+ new``, ``~ changed``."""
    b = {r.bounds: r for r in (before.ranges if before else ())}
    a = {r.bounds: r for r in (after.ranges if after else ())}
    lines: list[str] = []
    for bounds in sorted(set(a) | set(b)):
        old, new = b.get(bounds), a.get(bounds)
        if old is None and new is not None:
            lines.append(f"+ {new.describe()}")
        elif new is None and old is not None:
            lines.append(f"- {old.describe()}")
        elif old != new and old is not None and new is not None:
            changes = [f"{k}: {getattr(old, k)} -> {getattr(new, k)}"
                       for k in ("master", "standby", "state", "extra")
                       if getattr(old, k) != getattr(new, k)]
            lines.append(f"~ [{bounds[0]}, {bounds[1]}] " + "; ".join(changes))
    if before and after and before.mod_shard_count != after.mod_shard_count:
        lines.append(f"~ mod_shard_count: {before.mod_shard_count} -> {after.mod_shard_count}")
    return lines


CHANGE_STATES = ("present", "exact", "absent")


def plan_change(current: ShardMap | None, state: str, entries: Iterable[Mapping[str, Any]], *,
                known_hosts: Iterable[str] | None = None,
                mod_shard_count: int | None = None) -> ShardMap:
    """The map after registering *entries* with *state*; validated, nothing written.

    * ``present`` merges: an entry whose bounds equal an existing range updates
      only the fields it gives (``{"range": [0, 511], "state": "closed"}``
      closes a range); other entries are added and need a master.
    * ``exact`` replaces the whole map with *entries*.
    * ``absent`` removes ranges with exactly these bounds (absent ones are
      skipped; one that only partly overlaps a range is an error).

    ``mod_shard_count`` is fixed once a map exists: a different value is an error.
    """
    if state not in CHANGE_STATES:
        raise MapError(f"state {state!r} is not one of {', '.join(CHANGE_STATES)}")
    items: list[dict[str, Any]] = [dict(e) for e in entries]
    for i, e in enumerate(items):
        r = e.get("range")
        if (not isinstance(r, list | tuple) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise MapError(f"ranges[{i}]: 'range' must be [first, last] integers, got {r!r}")
        e["range"] = [r[0], r[1]]
    count = current.mod_shard_count if current else (mod_shard_count or DEFAULT_MOD_SHARD_COUNT)
    if current and mod_shard_count is not None and mod_shard_count != current.mod_shard_count:
        raise MapError(f"mod_shard_count is fixed at {current.mod_shard_count} for this map; "
                       f"refusing to change it to {mod_shard_count}")
    if state == "exact":
        return ShardMap.from_ranges(items, count, known_hosts)
    existing = {r.bounds: r for r in (current.ranges if current else ())}
    if state == "absent":
        drop = set()
        for e in items:
            b = (e["range"][0], e["range"][1])
            if b in existing:
                drop.add(b)
                continue
            clash = [r for r in existing.values() if r.first <= b[1] and b[0] <= r.last]
            if clash:
                raise MapError(f"range [{b[0]}, {b[1]}] only partly overlaps "
                               f"[{clash[0].first}, {clash[0].last}]; remove exact ranges")
        if current is None:
            raise MapError("there is no map to remove ranges from")
        return ShardMap.from_ranges([r for b, r in existing.items() if b not in drop], count,
                                    known_hosts)
    merged = {b: r.to_dict() for b, r in existing.items()}
    for e in items:
        b = (e["range"][0], e["range"][1])
        merged[b] = {**merged.get(b, {}), **e}
    return ShardMap.from_ranges(merged.values(), count, known_hosts)


def even_split(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    """Split shards ``first..last`` into *parts* contiguous ranges as even as possible
    (the first ranges get the remainder): 0..4095 over 2 pairs -> 0..2047, 2048..4095."""
    if not isinstance(parts, int) or parts < 1:
        raise MapError(f"cannot split a range into {parts!r} parts")
    total = last - first + 1
    if total < parts:
        raise MapError(f"{total} shards cannot be spread over {parts} pairs")
    out, start = [], first
    for i in range(parts):
        size = total // parts + (1 if i < total % parts else 0)
        out.append((start, start + size - 1))
        start += size
    return out
