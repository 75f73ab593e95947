"""The store API: objects, mappings, application-layer joins and mod-shard lookups.

Everything goes to the master of the shard an ID names. SQL values are always
bound parameters; identifiers (database and table names) come only from the
schema file and from validated shard numbers.

Caches are optional keyword arguments (:mod:`shardfleet.cache`): objects read
through memcache, mapping pages through Redis; writes update or invalidate them
after the commit. A cache that fails is a miss, never an error.

Failure policy for routing: a write to a ``frozen`` shard waits (bounded) for
the map to move on, then raises :class:`ShardFrozenError`; a statement refused
by MySQL because the shard was fenced (access denied) or the server is
read-only refreshes the map and is retried once. A write whose master cannot
be reached (no connection made, so nothing sent) waits, bounded the same way,
for the map to name another master and is retried once there; a connection lost
after a write's statement was sent surfaces as :class:`DatabaseError`, since
the write may have been applied (see ``Store._on_master``). That includes a
statement the router ends because a new map moved its server off the shard
(:meth:`Router._end_moved`: a hung master would otherwise hold it for the read
timeout); a read ended so is read again where the map now says.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pymysql

from shardfleet import ids
from shardfleet.errors import (
    DatabaseError,
    NoOpenShardError,
    ObjectNotFound,
    SchemaError,
    ShardfleetError,
    mysql_code,
)
from shardfleet.router import Router
from shardfleet.schema import Schema, default_schema, shard_database
from shardfleet.shardmap import ShardMap

if TYPE_CHECKING:
    from shardfleet.cache import MappingCache, ObjectCache, PendingFill

log = logging.getLogger(__name__)
T = TypeVar("T")

# MySQL errors that mean "this server no longer serves this shard for you":
# 1142 table access denied, 1044 database access denied (a fenced shard),
# 1290 / 1836 the server runs --read-only (a demoted master).
REROUTE_ERRNOS = frozenset({1142, 1044, 1290, 1836})
# Connection-level errors: the pooled connection is dead; reads retry once.
CONNECTION_ERRNOS = frozenset({2003, 2006, 2013, 2014, 2055})

Body = dict[str, Any]
Updater = Callable[[Body], Body] | dict[str, Any]
JoinPage = tuple[list[tuple[int, Body]], str | None]  # (id, body) in page order, next cursor
Rows = list[tuple[int, int]]  # (to_id, sequence), newest first


def _rollback(conn: pymysql.connections.Connection) -> None:
    """Roll back after a failure, without hiding it: a connection that was lost is rolled
    back by the server, and a rollback attempted on it would raise its own error
    (``InterfaceError(0, '')``) in place of the one that says what happened."""
    if not conn.open:
        return
    try:
        conn.rollback()
    except pymysql.err.MySQLError:
        log.debug("rollback failed on a broken connection", exc_info=True)


_SHARD_MASK, _SHARD_SHIFT = ids.SHARD_MASK, ids.SHARD_SHIFT
_TYPE_MASK, _TYPE_SHIFT = ids.TYPE_MASK, ids.TYPE_SHIFT
_LOCAL_MASK, _LOCAL_SHIFT = ids.LOCAL_MASK, ids.LOCAL_SHIFT


def _well_formed(object_id: object) -> bool:
    """What :func:`ids.decompose` accepts, for a plain int, without building its parts."""
    return (type(object_id) is int and 0 < object_id <= ids.MAX_ID
            and not object_id & ids.RESERVED_MASK and bool(object_id & _LOCAL_MASK))


def _dumps(body: Body) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


@dataclass
class ManyResult:
    """What :meth:`Store.get_many` returns: found objects in the caller's order, and the rest."""

    items: list[tuple[int, Body]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    def bodies(self) -> list[Body]:
        return [b for _, b in self.items]


@dataclass
class MappingPage:
    """A page of a mapping, newest first. ``cursor`` is None on the last page."""

    ids: list[int]
    sequences: list[int]
    cursor: str | None


class Store:
    """Objects and mappings on the fleet, through a :class:`Router`.

    ``schema`` defaults to the library's ``schema.yml``. ``object_cache``
    (a :class:`~shardfleet.cache.ObjectCache`, default None) and
    ``mapping_cache`` (a :class:`~shardfleet.cache.MappingCache`, default None)
    put memcache in front of object reads and Redis in front of mapping pages.
    """

    def __init__(self, router: Router, schema: Schema | None = None, *,
                 rng: random.Random | None = None,
                 object_cache: ObjectCache | None = None,
                 mapping_cache: MappingCache | None = None) -> None:
        self.router = router
        self.object_cache = object_cache
        self.mapping_cache = mapping_cache
        self.schema = schema or default_schema()
        self._rng = rng or random.Random()
        # (shard, type) -> SELECT text; at most shards x types entries each
        self._get_sql: dict[tuple[int, int], str] = {}
        self._many_head: dict[tuple[int, int], str] = {}

    def close(self) -> None:
        """Nothing to release (connections belong to the router); kept for symmetry."""

    # -- plumbing --------------------------------------------------------
    def _on_master(self, shard: int, fn: Callable[[pymysql.connections.Connection], T], *,
                   write: bool) -> T:
        """Run *fn(conn)* on the master of *shard*, with the reroute/retry policy.

        What may be repeated depends on whether the statement could have been
        applied:

        * No connection was made (refused, unreachable, silent until the connect
          timeout, or a pooled connection the server had closed): nothing was
          sent, so the statement may go wherever the map says next. A write
          waits (bounded by the router's ``frozen_wait``) for the map to name
          another master for the shard and is retried once there; during an
          emergency promotion the old master is dead until the flip, and the
          write lands on the new master as soon as the map moves. A read
          refreshes the map and is retried once at once. A connect given up
          because the map moved on meanwhile goes to the new master and costs
          no retry.
        * The server refused the statement (fenced shard, read-only): it was not
          applied; the map is refreshed and the statement retried once.
        * The connection failed after the statement was sent (2006/2013
          mid-statement), or the router ended the statement because the map moved
          the shard off that server: a write may have been applied, and repeating an
          insert would apply it twice, so the error surfaces. A read is retried once.
        """
        retried = False
        for _ in range(8):  # bounded: only a map moving on while connecting loops freely
            r = self.router.writable_range(shard) if write else self.router.range_for(shard)
            try:
                conn = self.router.acquire(r.master, shard)
            except pymysql.err.MySQLError as exc:
                errno = mysql_code(exc)
                if retried or errno not in CONNECTION_ERRNOS:
                    raise DatabaseError(f"shard {shard} on {r.master}: {exc}") from exc
                retried = True
                if not write:
                    log.info("shard %s: no connection to %s (%s); refreshing the map and "
                             "retrying once", shard, r.master, errno)
                    self.router.stats.reroutes += 1
                    self.router.refresh()
                    continue
                log.warning("shard %s: no connection to its master %s (%s); waiting up to "
                            "%.1fs for the map to name another master", shard, r.master, errno,
                            self.router.frozen_wait)
                self.router.stats.reroutes += 1
                if not self.router.wait_for_new_master(shard, r.master):
                    raise DatabaseError(
                        f"shard {shard} on {r.master}: {exc}; the map named no other master "
                        f"within {self.router.frozen_wait}s") from exc
                continue
            if conn is None:
                log.info("shard %s moved off %s while connecting; rerouting", shard, r.master)
                continue
            pool = self.router.pool(r.master)
            try:
                result = fn(conn)
            except pymysql.err.MySQLError as exc:
                pool.discard(conn)
                errno = mysql_code(exc)
                retry = errno in REROUTE_ERRNOS or (not write and errno in CONNECTION_ERRNOS)
                if retry and not retried:
                    retried = True
                    log.info("shard %s on %s refused (%s); refreshing the map and retrying once",
                             shard, r.master, errno)
                    self.router.stats.reroutes += 1
                    self.router.refresh()
                    continue
                raise DatabaseError(f"shard {shard} on {r.master}: {exc}") from exc
            except BaseException:
                pool.discard(conn)
                raise
            pool.put(conn)
            return result
        raise DatabaseError(f"shard {shard}: the map kept moving while connecting to its master")

    def _object_table(self, object_id: int) -> tuple[ids.ObjectID, str]:
        oid = ids.decompose(object_id)
        table = self.schema.object_type(oid.type).table
        return oid, f"`{shard_database(oid.shard)}`.`{table}`"

    def _pick_shard(self) -> int:
        opened = self.router.map.open_ranges()
        if not opened:  # an open range frozen by a promotion or split: writable_range waits
            opened = [r for r in self.router.map.ranges
                      if r.state == "frozen" and r.extra.get("frozen_from") == "open"]
        if not opened:
            raise NoOpenShardError("the map has no open range to place a new object in")
        total = sum(r.size for r in opened)
        n = self._rng.randrange(total)
        for r in opened:
            if n < r.size:
                return r.first + n
            n -= r.size
        raise AssertionError("unreachable")


    def _group(self, object_ids: Sequence[int], m: ShardMap | None = None
               ) -> dict[str, dict[tuple[int, int], list[int]]]:
        """``{master: {(shard, type): [local, ...]}}`` under the map *m* (None: the router's).

        A well-formed ID is split with the layout's masks from :mod:`shardfleet.ids`
        inline (``ids.decompose`` per ID, with its checks, cost a quarter of the
        Python time of a 50-ID fetch); anything else goes through ``ids.decompose``,
        which raises naming what is wrong."""
        by_server: dict[str, dict[tuple[int, int], list[int]]] = {}
        if m is None:
            m = self.router.map
        groups: dict[tuple[int, int], list[int]] = {}  # (shard, type) -> the server's list
        for object_id in object_ids:
            if _well_formed(object_id):
                key = ((object_id & _SHARD_MASK) >> _SHARD_SHIFT,
                       (object_id & _TYPE_MASK) >> _TYPE_SHIFT)
                local = (object_id & _LOCAL_MASK) >> _LOCAL_SHIFT
            else:
                shard, type_, local = ids.decompose(object_id)
                key = (shard, type_)
            locals_ = groups.get(key)
            if locals_ is None:
                self.schema.object_type(key[1])
                server = by_server.setdefault(m.range_for(key[0]).master, {})
                locals_ = groups[key] = server.setdefault(key, [])
            locals_.append(local)
        return by_server

    def _many_sql(self, groups: dict[tuple[int, int], list[int]]) -> str:
        """The UNION ALL of one SELECT per (shard, type) of ``(ID, body)``. Every value is an
        int that the ID layout produced, written as a literal (nothing to escape;
        escaping ~60 parameters cost a fifth of a 50-ID fetch). The text up to the
        ``IN`` list is built once per (shard, type)."""
        heads = self._many_head
        parts = []
        for key, locals_ in groups.items():
            head = heads.get(key)
            if head is None:
                shard, type_ = key
                table = self.schema.object_type(type_).table
                # the server returns whole IDs: base + local_id
                head = heads[key] = (f"SELECT {ids.base(shard, type_):d} + local_id, body FROM "
                                     f"`{shard_database(shard)}`.`{table}` WHERE local_id IN (")
            parts.append(head + ",".join(map(str, locals_)) + ")")
        return " UNION ALL ".join(parts)

    def _fetch_many(self, jobs: list[tuple[str, dict[tuple[int, int], list[int]]]],
                    m: ShardMap) -> list[Any] | None:
        """One statement per server, pipelined: every server's query is sent before any
        result is read, so the servers work at the same time without threads (a thread
        hand-off costs more than it saves on a GIL-bound parse). Uses PyMySQL's
        send/read halves of ``Connection.query``; a failure discards every connection
        of the batch (their protocol state is unknown). None, with nothing sent, when
        the router's map is no longer *m* (the one *jobs* were grouped by) once the
        connections are handed out: a map that moves a server off a shard later ends
        the statement in flight there (:meth:`Router._end_moved`)."""
        from pymysql.constants import COMMAND

        taken: list[tuple[Any, Any]] = []
        try:
            for server, _ in jobs:
                pool = self.router.pool(server)
                taken.append((pool, pool.get()))
            if self.router.map is not m:
                for pool, conn in taken:
                    pool.put(conn)  # unused: nothing was sent on it
                return None
            for (_, conn), (_, groups) in zip(taken, jobs, strict=True):
                conn._execute_command(COMMAND.COM_QUERY,
                                      self._many_sql(groups).encode("ascii"))
            rows: list[Any] = []
            for _, conn in taken:
                conn._affected_rows = conn._read_query_result()
                rows.extend(conn._result.rows or ())
        except BaseException:
            for pool, conn in taken:
                pool.discard(conn)
            raise
        for pool, conn in taken:
            pool.put(conn)
        return rows

    # -- objects ---------------------------------------------------------
    def create(self, type: str | int, body: Body, near: int | None = None) -> int:  # noqa: A002
        """Insert a new object and return its ID.

        The shard is *near*'s shard (locality: a pin on its board's shard), else a
        random shard of an ``open`` range.
        """
        if not isinstance(body, dict):
            raise SchemaError(f"an object body must be a dict, got {body.__class__.__name__}")
        ot = self.schema.object_type(type)
        shard = ids.shard_of(near) if near is not None else self._pick_shard()
        sql = f"INSERT INTO `{shard_database(shard)}`.`{ot.table}` (body) VALUES (%s)"
        data = _dumps(body)

        def run(conn: pymysql.connections.Connection) -> int:
            conn.begin()
            try:
                with conn.cursor() as cur:
                    cur.execute(sql, (data,))
                    local = int(cur.lastrowid)
                if local > ids.MAX_LOCAL:
                    raise ids.InvalidIDError(
                        f"shard {shard} table {ot.table} has used up its 36-bit local IDs")
                conn.commit()
                return local
            except BaseException:
                _rollback(conn)
                raise

        local = self._on_master(shard, run, write=True)
        return ids.compose(shard, ot.type, local)

    def get(self, object_id: int, *, include_inactive: bool = False) -> Body:
        """The object's body; :class:`ObjectNotFound` if absent or soft-deleted."""
        if self.object_cache is not None:
            return self._get_cached(object_id, include_inactive)
        if _well_formed(object_id):  # the layout's masks inline (decompose: ~1.4 us)
            shard = (object_id & _SHARD_MASK) >> _SHARD_SHIFT
            sql = self._get_sql.get((shard, (object_id & _TYPE_MASK) >> _TYPE_SHIFT))
            local = (object_id & _LOCAL_MASK) >> _LOCAL_SHIFT
        else:
            sql = None
        if sql is None:  # first read of this (shard, type), or an ID decompose refuses
            oid = ids.decompose(object_id)
            shard, sql, local = oid.shard, self._body_sql(oid), oid.local
        row = self._read_one(shard, sql, (local,))
        if row is None:
            raise ObjectNotFound(f"object {object_id} not found")
        body = json.loads(row[0])
        if not include_inactive and body.get("active") is False:
            raise ObjectNotFound(f"object {object_id} was deleted")
        return body

    def _get_cached(self, object_id: int, include_inactive: bool) -> Body:
        """:meth:`get` through the object cache: memcache, else the row, then a fill."""
        oc = self.object_cache
        assert oc is not None
        oid = ids.decompose(object_id)
        raw: Any = oc.get(object_id)
        if raw is None:
            row = self._read_one(oid.shard, self._body_sql(oid), (oid.local,))
            if row is None:
                raise ObjectNotFound(f"object {object_id} not found")
            raw = row[0]
            oc.fill(object_id, raw)
        body = json.loads(raw)
        if not include_inactive and body.get("active") is False:
            raise ObjectNotFound(f"object {object_id} was deleted")
        return body

    def _body_sql(self, oid: ids.ObjectID) -> str:
        """``SELECT body`` of one object's table, built once per (shard, type)."""
        key = (oid.shard, oid.type)
        sql = self._get_sql.get(key)
        if sql is None:
            table = f"`{shard_database(oid.shard)}`.`{self.schema.object_type(oid.type).table}`"
            sql = self._get_sql[key] = f"SELECT body FROM {table} WHERE local_id=%s"
        return sql

    def _read_one(self, shard: int, sql: str, params: tuple[Any, ...]) -> Any:
        """The hot path of a single-row read on a pooled connection; no idle connection, or
        any error, falls back to :meth:`_on_master` (which connects under its rules)."""
        router = self.router
        m = router.map
        pool = router.pool(m.range_for(shard).master)
        conn = pool.take_idle(shard)  # unchecked: a dead connection fails here, read again below
        if conn is not None and router.map is not m:
            pool.put(conn)  # the map moved while it was handed out: route again, below
        elif conn is not None:
            try:
                cur = conn.cursor()
                cur.execute(sql, params)
                row = cur.fetchone()
            except pymysql.err.MySQLError:
                pool.discard(conn)
            else:
                pool.put(conn)
                return row

        def run(conn: pymysql.connections.Connection) -> Any:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchone()

        return self._on_master(shard, run, write=False)

    def get_many(self, object_ids: Sequence[int], *, include_inactive: bool = False
                 ) -> ManyResult:
        """Fetch many objects: one SELECT per (shard, type), one round trip per server.

        Each server gets one statement (the UNION ALL of its shards' SELECTs);
        servers are queried concurrently. Results come in the caller's order;
        absent or soft-deleted IDs are listed in ``missing``. With an object cache,
        one multi-get to memcache comes first and only the misses reach MySQL.
        """
        found: dict[int, Body] = {}
        oc = self.object_cache
        if oc is None:
            for object_id, raw in self._fetch_raw(object_ids).items():
                found[object_id] = json.loads(raw)
        else:
            for i in object_ids:
                if not _well_formed(i):
                    ids.decompose(i)  # a bad ID is the caller's error, cache or not
            cached = oc.get_many(object_ids)
            misses = [i for i in dict.fromkeys(object_ids) if i not in cached]
            fetched = self._fetch_raw(misses) if misses else {}
            if fetched:
                oc.fill_many(fetched)
            for object_id, raw_bytes in cached.items():
                found[object_id] = json.loads(raw_bytes)
            for object_id, raw_text in fetched.items():
                found[object_id] = json.loads(raw_text)
        out = ManyResult()
        for object_id in object_ids:
            body = found.get(object_id)
            if body is None or (not include_inactive and body.get("active") is False):
                out.missing.append(object_id)
            else:
                out.items.append((object_id, body))
        return out

    def _fetch_raw(self, object_ids: Sequence[int]) -> dict[int, str]:
        """``{id: raw JSON body}`` of the rows found, one statement per server, pipelined."""
        retried = False
        for _ in range(8):  # bounded: only a map moving on while connecting loops freely
            m = self.router.map
            jobs = list(self._group(object_ids, m).items())
            if not jobs:
                return {}
            try:
                rows = self._fetch_many(jobs, m)
            except pymysql.err.MySQLError as exc:
                errno = mysql_code(exc)
                if retried or errno not in REROUTE_ERRNOS | CONNECTION_ERRNOS:
                    raise DatabaseError(f"get_many: {exc}") from exc
                retried = True
                log.info("get_many refused (%s); refreshing the map and retrying once", errno)
                self.router.stats.reroutes += 1
                self.router.refresh()
                continue
            if rows is not None:
                return dict(rows)  # each row is (ID, body)
        raise DatabaseError("get_many: the map kept moving while connecting to the masters")

    def update(self, object_id: int, changes: Updater) -> Body:
        """Read-modify-write the JSON body in one transaction (``SELECT … FOR UPDATE``).

        *changes* is a dict merged into the body (shallow) or a function
        ``body -> new body``. Returns the new body.
        """
        oid, table = self._object_table(object_id)
        select = f"SELECT body FROM {table} WHERE local_id=%s FOR UPDATE"
        update = f"UPDATE {table} SET body=%s WHERE local_id=%s"

        def run(conn: pymysql.connections.Connection) -> Body:
            conn.begin()
            try:
                with conn.cursor() as cur:
                    cur.execute(select, (oid.local,))
                    row = cur.fetchone()
                    if row is None:
                        raise ObjectNotFound(f"object {object_id} not found")
                    body = json.loads(row[0])
                    new = changes(dict(body)) if callable(changes) else {**body, **changes}
                    if not isinstance(new, dict):
                        raise SchemaError("an update must produce a dict body")
                    cur.execute(update, (_dumps(new), oid.local))
                conn.commit()
                return new
            except BaseException:
                _rollback(conn)
                raise

        try:
            return self._on_master(oid.shard, run, write=True)
        finally:
            # after the commit (or a failure that may have committed): never before
            if self.object_cache is not None:
                self.object_cache.invalidate(object_id)

    def delete(self, object_id: int, *, hard: bool = False) -> bool:
        """Soft-delete (``"active": false``) or, with ``hard=True``, remove the row.

        Returns False when the object did not exist.
        """
        if not hard:
            try:
                self.update(object_id, {"active": False})
                return True
            except ObjectNotFound:
                return False
        oid, table = self._object_table(object_id)
        sql = f"DELETE FROM {table} WHERE local_id=%s"

        def run(conn: pymysql.connections.Connection) -> bool:
            with conn.cursor() as cur:
                return bool(cur.execute(sql, (oid.local,)))

        try:
            return self._on_master(oid.shard, run, write=True)
        finally:
            if self.object_cache is not None:
                self.object_cache.invalidate(object_id)

    # -- mappings --------------------------------------------------------
    def _mapping(self, name: str, from_id: int, to_id: int | None = None) -> tuple[int, str]:
        m = self.schema.mapping(name)
        f = ids.decompose(from_id)
        want_from = self.schema.object_type(m.from_type).type
        if f.type != want_from:
            raise SchemaError(f"{name} maps from {m.from_type} (type {want_from}); "
                              f"ID {from_id} is type {f.type}")
        if to_id is not None:
            t = ids.decompose(to_id)
            want_to = self.schema.object_type(m.to_type).type
            if t.type != want_to:
                raise SchemaError(f"{name} maps to {m.to_type} (type {want_to}); "
                                  f"ID {to_id} is type {t.type}")
        return f.shard, f"`{shard_database(f.shard)}`.`{m.table}`"

    def add(self, name: str, from_id: int, to_id: int, sequence: int | None = None) -> int:
        """Add (or re-sequence) ``from_id -> to_id``; returns the sequence used.

        The default sequence is the current time in microseconds.
        """
        shard, table = self._mapping(name, from_id, to_id)
        seq = time.time_ns() // 1000 if sequence is None else int(sequence)
        sql = (f"INSERT INTO {table} (from_id, to_id, sequence) VALUES (%s, %s, %s) "
               "ON DUPLICATE KEY UPDATE sequence=VALUES(sequence)")

        def run(conn: pymysql.connections.Connection) -> None:
            with conn.cursor() as cur:
                cur.execute(sql, (from_id, to_id, seq))

        mc = self.mapping_cache
        if mc is None:
            self._on_master(shard, run, write=True)
            return seq
        try:
            self._on_master(shard, run, write=True)
        except BaseException:
            mc.invalidate(name, from_id)  # the statement may have committed
            raise
        mc.added(name, from_id, to_id, seq)
        return seq

    def remove(self, name: str, from_id: int, to_id: int) -> bool:
        shard, table = self._mapping(name, from_id, to_id)
        sql = f"DELETE FROM {table} WHERE from_id=%s AND to_id=%s"

        def run(conn: pymysql.connections.Connection) -> bool:
            with conn.cursor() as cur:
                return bool(cur.execute(sql, (from_id, to_id)))

        mc = self.mapping_cache
        if mc is None:
            return self._on_master(shard, run, write=True)
        try:
            done = self._on_master(shard, run, write=True)
        except BaseException:
            mc.invalidate(name, from_id)
            raise
        mc.removed(name, from_id, to_id)
        return done

    def count(self, name: str, from_id: int) -> int:
        shard, table = self._mapping(name, from_id)
        sql = f"SELECT COUNT(*) FROM {table} WHERE from_id=%s"

        def run(conn: pymysql.connections.Connection) -> int:
            with conn.cursor() as cur:
                cur.execute(sql, (from_id,))
                return int(cur.fetchone()[0])

        return self._on_master(shard, run, write=False)

    def list(self, name: str, from_id: int, limit: int = 50, cursor: str | None = None
             ) -> MappingPage:
        """A page of ``from_id``'s mapping, newest (highest sequence) first.

        With a mapping cache, a page inside the cached newest entries comes from
        Redis; a first page that misses reads the newest ``capacity`` entries once
        and fills the cache with them.
        """
        return self._list(name, from_id, limit, cursor, defer_fill=False)[0]

    def _list(self, name: str, from_id: int, limit: int, cursor: str | None, *,
              defer_fill: bool) -> tuple[MappingPage, PendingFill | None]:
        """:meth:`list`; with *defer_fill*, a cache fill is sent but its reply left to the
        caller (``pending.wait()``), so the caller's next round trips hide it."""
        if not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise ShardfleetError(f"limit {limit!r} must be an int in 1..10000")
        shard, table = self._mapping(name, from_id)
        after = _parse_cursor(cursor) if cursor is not None else None
        mc = self.mapping_cache
        pending = None
        if mc is None:
            rows = self._list_db(shard, table, from_id, limit + 1, after)
        else:
            hit, token = mc.lookup(name, from_id, limit, after)
            if hit is not None:
                return _page(hit.rows, hit.more), None
            if after is None and limit <= mc.capacity:
                newest = self._list_db(shard, table, from_id, mc.capacity + 1, None)
                complete = len(newest) <= mc.capacity
                if defer_fill:
                    pending = mc.fill_begin(name, from_id, newest[:mc.capacity], complete, token)
                else:
                    mc.fill(name, from_id, newest[:mc.capacity], complete, token)
                rows = newest[:limit + 1]
            else:
                rows = self._list_db(shard, table, from_id, limit + 1, after)
        return _page(rows[:limit], len(rows) > limit), pending

    def _list_db(self, shard: int, table: str, from_id: int, n: int,
                 after: tuple[int, int] | None) -> Rows:
        """Up to *n* ``(to_id, sequence)`` of a mapping, newest first, after a cursor."""
        params: list[Any] = [from_id]
        where = "from_id=%s"
        if after is not None:
            seq, to = after
            where += " AND (sequence < %s OR (sequence = %s AND to_id < %s))"
            params += [seq, seq, to]
        sql = (f"SELECT to_id, sequence FROM {table} WHERE {where} "
               "ORDER BY sequence DESC, to_id DESC LIMIT %s")
        params.append(n)

        def run(conn: pymysql.connections.Connection) -> list[Any]:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall())

        return [(int(t), int(s)) for t, s in self._on_master(shard, run, write=False)]

    def join(self, name: str, from_id: int, limit: int = 50, cursor: str | None = None
             ) -> JoinPage:
        """The application-layer join: a mapping page, then its objects in page order."""
        page, pending = self._list(name, from_id, limit, cursor, defer_fill=True)
        if pending is None:
            if not page.ids:
                return [], page.cursor
            return self.get_many(page.ids).items, page.cursor
        # a cold page: Redis runs the mapping fill while the objects are fetched
        try:
            items = self.get_many(page.ids).items if page.ids else []
        finally:
            pending.wait()
        return items, page.cursor

    # -- mod shard -------------------------------------------------------
    def _lookup(self, name: str, key: str | bytes) -> tuple[int, str, str, bytes]:
        lk = self.schema.lookup(name)
        raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
        if not raw or len(raw) > 255:
            raise SchemaError(f"lookup key must be 1..255 bytes, got {len(raw)}")
        shard = self.router.map.mod_shard(raw)
        column = "value_id" if lk.value == "id" else "body"
        return shard, f"`{shard_database(shard)}`.`{lk.table}`", column, raw

    def put(self, name: str, key: str | bytes, value: Any) -> None:
        """Store *value* (an ID, or JSON for ``value: json`` tables) under a mod-shard key."""
        shard, table, column, raw = self._lookup(name, key)
        if column == "value_id":
            ids.decompose(value)
            v: Any = value
        else:
            v = _dumps(value)
        sql = (f"INSERT INTO {table} (lookup_key, {column}) VALUES (%s, %s) "
               f"ON DUPLICATE KEY UPDATE {column}=VALUES({column})")

        def run(conn: pymysql.connections.Connection) -> None:
            with conn.cursor() as cur:
                cur.execute(sql, (raw, v))

        self._on_master(shard, run, write=True)

    def lookup(self, name: str, key: str | bytes) -> Any:
        """The value stored under *key*, or None."""
        shard, table, column, raw = self._lookup(name, key)
        sql = f"SELECT {column} FROM {table} WHERE lookup_key=%s"

        def run(conn: pymysql.connections.Connection) -> Any:
            with conn.cursor() as cur:
                cur.execute(sql, (raw,))
                return cur.fetchone()

        row = self._on_master(shard, run, write=False)
        if row is None:
            return None
        return int(row[0]) if column == "value_id" else json.loads(row[0])

    def unput(self, name: str, key: str | bytes) -> bool:
        shard, table, _, raw = self._lookup(name, key)
        sql = f"DELETE FROM {table} WHERE lookup_key=%s"

        def run(conn: pymysql.connections.Connection) -> bool:
            with conn.cursor() as cur:
                return bool(cur.execute(sql, (raw,)))

        return self._on_master(shard, run, write=True)


def _page(rows: Sequence[tuple[int, int]], more: bool) -> MappingPage:
    nxt = f"{rows[-1][1]}.{rows[-1][0]}" if more and rows else None
    return MappingPage([t for t, _ in rows], [s for _, s in rows], nxt)


def _parse_cursor(cursor: str) -> tuple[int, int]:
    try:
        seq, to = cursor.split(".")
        return int(seq), int(to)
    except (ValueError, AttributeError):
        raise ShardfleetError(f"invalid cursor {cursor!r}") from None

