"""The library's exception tree: every error it raises derives from ShardfleetError."""

from __future__ import annotations


def mysql_code(exc: BaseException) -> int:
    """The MySQL error number behind *exc*, 0 if none: the first error of the driver
    (PyMySQL) in *exc*'s chain of causes, so an error the library re-raised as its own
    (a DatabaseError ``from`` the driver's) still tells its number."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__module__.startswith("pymysql") and seen.args \
                and isinstance(seen.args[0], int):
            return int(seen.args[0])
        seen = seen.__cause__ or seen.__context__
    return 0


class ShardfleetError(Exception):
    """Base class of every error the library raises on purpose."""


class InvalidInputError(ShardfleetError, ValueError):
    """Raised for input a person typed that the library refuses before doing anything (a
    bad ID, a bad name, a map file that is not a valid map): the command's usage error."""


class InvalidIDError(InvalidInputError):
    """Raised by :mod:`shardfleet.ids` when an ID, or one of its parts, is out of its field."""


class SchemaError(ShardfleetError):
    """Raised when the schema file does not parse or names an unknown type or table."""


class MapError(ShardfleetError):
    """Raised when a shard map is invalid: overlap, out of bounds, missing master, bad JSON."""


class ShardNotMappedError(ShardfleetError):
    """Raised when a shard is not covered by any range of the map."""


class MapConflictError(ShardfleetError):
    """Raised when a compare-and-set write of the map loses against a concurrent writer."""


class FenceMoved(MapConflictError):
    """Raised by a fenced write (:meth:`shardfleet.mapstore.ZooKeeperMapStore.write_raw` with
    ``checks``) when a fence znode moved: another run took the servers' locks since this
    one took its fencing token, so this one must not act again."""


class MapStoreUnavailable(ShardfleetError):
    """Raised when the map's store (ZooKeeper) cannot be reached and no cached map exists."""


class MapWriteUnknown(MapStoreUnavailable):
    """Raised by :func:`shardfleet.mapstore.update` when a map write was sent, its reply was
    lost, and the store could not be read again in time to tell whether it was applied.
    The caller must assume either outcome (keep any fence; rerun the operation, which
    decides by what the map says)."""


class ShardFrozenError(ShardfleetError):
    """Raised when a write to a frozen shard waited its bounded time and the shard stayed frozen."""


class NoOpenShardError(ShardfleetError):
    """Raised when an object is created without ``near`` and the map has no open range."""


class ObjectNotFound(ShardfleetError, KeyError):
    """Raised when an object ID does not exist (or was deleted) in its shard."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else "object not found"


class DatabaseError(ShardfleetError):
    """Raised when a shard's MySQL server refuses or fails a statement the library sent."""
