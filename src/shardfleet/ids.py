"""The 64-bit object ID: the one place that knows its layout.

::

     63 62 61                    46 45            36 35                           0
    +-----+------------------------+----------------+------------------------------+
    | 0 0 |   shard (16 bits)      | type (10 bits) |      local ID (36 bits)      |
    +-----+------------------------+----------------+------------------------------+

    id = (shard << 46) | (type << 36) | local

The two high bits are reserved and must be zero. The local ID is the row's
``AUTO_INCREMENT`` value in its shard's object table and is never 0. Every width,
shift and mask below is derived from the three field widths.
"""

from __future__ import annotations

from typing import NamedTuple

from shardfleet.errors import InvalidIDError

RESERVED_BITS = 2
SHARD_BITS = 16
TYPE_BITS = 10
LOCAL_BITS = 36
ID_BITS = RESERVED_BITS + SHARD_BITS + TYPE_BITS + LOCAL_BITS  # 64

LOCAL_SHIFT = 0
TYPE_SHIFT = LOCAL_BITS
SHARD_SHIFT = LOCAL_BITS + TYPE_BITS
RESERVED_SHIFT = SHARD_SHIFT + SHARD_BITS

MAX_SHARD = (1 << SHARD_BITS) - 1
MAX_TYPE = (1 << TYPE_BITS) - 1
MAX_LOCAL = (1 << LOCAL_BITS) - 1
MAX_ID = (1 << ID_BITS) - 1

SHARD_MASK = MAX_SHARD << SHARD_SHIFT
TYPE_MASK = MAX_TYPE << TYPE_SHIFT
LOCAL_MASK = MAX_LOCAL << LOCAL_SHIFT
RESERVED_MASK = ((1 << RESERVED_BITS) - 1) << RESERVED_SHIFT


class ObjectID(NamedTuple):
    """The parts of an ID, as :func:`decompose` returns them."""

    shard: int
    type: int
    local: int


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; True is never a meaningful shard or ID.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidIDError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _check_field(name: str, value: object, low: int, high: int) -> int:
    v = _check_int(name, value)
    if not low <= v <= high:
        raise InvalidIDError(f"{name} {v} is out of range {low}..{high}")
    return v


def compose(shard: int, type: int, local: int) -> int:  # noqa: A002 - the post's word
    """Pack *shard*, *type* and *local* into a 64-bit ID.

    Raises :class:`InvalidIDError` naming the part that does not fit its field
    (or is not an int). A local ID of 0 is refused: AUTO_INCREMENT never gives it.
    """
    s = _check_field("shard", shard, 0, MAX_SHARD)
    t = _check_field("type", type, 0, MAX_TYPE)
    lo = _check_field("local ID", local, 1, MAX_LOCAL)
    return (s << SHARD_SHIFT) | (t << TYPE_SHIFT) | (lo << LOCAL_SHIFT)


def decompose(object_id: int) -> ObjectID:
    """Split a 64-bit ID into its parts.

    Raises :class:`InvalidIDError` for a non-int, a negative value, a value of
    2**64 or more, a set reserved bit, or a local ID of 0.
    """
    v = _check_int("ID", object_id)
    if v < 0:
        raise InvalidIDError(f"ID {v} is negative")
    if v > MAX_ID:
        raise InvalidIDError(f"ID {v} does not fit in {ID_BITS} bits")
    if v & RESERVED_MASK:
        raise InvalidIDError(f"ID {v} has its reserved high bits set")
    local = (v & LOCAL_MASK) >> LOCAL_SHIFT
    if local == 0:
        raise InvalidIDError(f"ID {v} has local ID 0")
    return ObjectID((v & SHARD_MASK) >> SHARD_SHIFT, (v & TYPE_MASK) >> TYPE_SHIFT, local)


def base(shard: int, type: int) -> int:  # noqa: A002 - the post's word
    """The ID of *shard* and *type* with local ID 0, so that ``base + local`` is the ID of
    each local ID (what a query adds to ``local_id`` to return whole IDs)."""
    s = _check_field("shard", shard, 0, MAX_SHARD)
    t = _check_field("type", type, 0, MAX_TYPE)
    return (s << SHARD_SHIFT) | (t << TYPE_SHIFT)


def shard_of(object_id: int) -> int:
    """The shard an ID lives on (validates the whole ID)."""
    return decompose(object_id).shard


def parse(text: str) -> int:
    """Parse an ID typed by a person: plain ASCII decimal digits only (no sign, no
    ``_``, no other script's digits: ``int()`` would read ``'１２３'`` as 123), then
    validate it (:func:`decompose`)."""
    s = str(text).strip()
    if not s or not s.isascii() or not s.isdigit():
        raise InvalidIDError(f"ID {text!r} is not a plain decimal number (ASCII digits only)")
    if len(s) > len(str(MAX_ID)):
        raise InvalidIDError(f"ID {text!r} does not fit in {ID_BITS} bits")
    value = int(s, 10)
    decompose(value)
    return value
