"""Copy a legacy single database into the fleet, and repeat the copy until the drift is zero.

The post's advice for leaving the old database: script the copy, then run it
again and again, because data will be missed, until a pass finds nothing new.

How a pass knows what is new or changed: the migration keeps a **state
database** of its own on the legacy server (``shardfleet_migration`` by default,
never a shard) with one row per copied legacy row::

    migrated(kind, k1, k2, new_id, hash, links)

``hash`` is MD5 of the legacy row's content as it was copied; ``links`` the
mapping rows written for it. A pass asks the legacy server, in one joined query
per table, for the rows whose current MD5 differs from the recorded one (new
rows have none), copies them, and records the MD5 *of what it copied* — so a row
changed by the application while the pass ran is found again by the next pass.
Rows recorded but gone from the legacy table are deleted from the fleet. The
drift of a pass is the number of rows it copied, deleted or had to defer (a
child whose parent is not copied yet); the migration stops when a pass has a
drift of zero, then verifies counts and content checksums per type.

Placement follows the design: each user goes to a random shard of an open
range; its boards and pins to the user's shard (``near``); relations become
mapping rows on the from-object's shard (``user_has_boards``,
``board_has_pins``, ``user_likes_pins`` + ``pin_liked_by_user``,
``user_follows_users``). Every copied object carries ``legacy_src`` and
``legacy_id`` in its JSON body, and the state table maps legacy ID -> new ID,
so a rerun updates instead of duplicating. Objects never move: a legacy pin
whose owner changes keeps its shard.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import pymysql

from shardfleet import ids
from shardfleet.errors import InvalidInputError, NoOpenShardError, ObjectNotFound, ShardfleetError
from shardfleet.migrate.legacy import ident
from shardfleet.migrate.progress import Progress
from shardfleet.schema import shard_database
from shardfleet.store import Store

log = logging.getLogger(__name__)


class MigrationError(ShardfleetError):
    """Raised when a migration cannot start (lock, names), does not converge within its
    pass limit, or its verification finds a mismatch."""


class BadName(MigrationError, InvalidInputError):
    """A database name from the command line that is not a plain identifier."""


@dataclass(frozen=True)
class Kind:
    """One legacy table and what it becomes in the fleet."""

    name: str
    table: str
    keys: tuple[str, ...]
    columns: tuple[str, ...]  # content: hashed, and copied into the body
    object_type: str | None  # None: a relation, only mapping rows
    parents: tuple[tuple[str, str], ...] = ()  # (column, kind) translated to new IDs


KINDS: tuple[Kind, ...] = (
    Kind("user", "users", ("id",),
         ("username", "email", "full_name", "about", "created_at"), "user"),
    Kind("board", "boards", ("id",),
         ("user_id", "name", "description", "category", "created_at"), "board",
         (("user_id", "user"),)),
    Kind("pin", "pins", ("id",),
         ("user_id", "board_id", "image_url", "link", "description", "created_at"), "pin",
         (("user_id", "user"), ("board_id", "board"))),
    Kind("like", "likes", ("user_id", "pin_id"), ("created_at",), None,
         (("user_id", "user"), ("pin_id", "pin"))),
    Kind("follow", "follows", ("follower_id", "followee_id"), ("created_at",), None,
         (("follower_id", "user"), ("followee_id", "user"))),
)
MAPPINGS = ("user_has_boards", "board_has_pins", "user_likes_pins", "pin_liked_by_user",
            "user_follows_users")

# Seconds open() waits for the migration lock: long enough for the server to notice that
# the run before (ended or killed an instant ago) closed its connection, short enough that
# a migration started beside a running one is refused at once to a person.
LOCK_WAIT = 5

STATE_DDL = (
    """CREATE TABLE IF NOT EXISTS `{db}`.migrated (
  kind VARCHAR(16) NOT NULL,
  k1 BIGINT UNSIGNED NOT NULL,
  k2 BIGINT UNSIGNED NOT NULL DEFAULT 0,
  new_id BIGINT UNSIGNED NULL,
  hash CHAR(32) NOT NULL,
  links LONGTEXT NULL,
  copied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  PRIMARY KEY (kind, k1, k2),
  KEY new_id (new_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    """CREATE TABLE IF NOT EXISTS `{db}`.passes (
  pass INT UNSIGNED NOT NULL AUTO_INCREMENT,
  started_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  drift INT UNSIGNED NOT NULL,
  report LONGTEXT NOT NULL,
  PRIMARY KEY (pass)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
)

Link = tuple[str, int, int, int]  # (mapping, from_id, to_id, sequence)


def _jsonable(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.isoformat(sep=" ", timespec="microseconds")
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def _micros(v: Any) -> int:
    """A DATETIME as microseconds since the epoch (UTC): the mapping sequence."""
    if not isinstance(v, datetime):
        return 0
    return calendar.timegm(v.utctimetuple()) * 1_000_000 + v.microsecond


def digest(value: Any) -> int:
    """64 bits of MD5 of a canonical JSON form (order-independent sums of these are checksums)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return int.from_bytes(hashlib.md5(text.encode(), usedforsecurity=False).digest()[:8], "big")


@dataclass
class StepReport:
    new: int = 0
    updated: int = 0
    deleted: int = 0
    deferred: int = 0

    @property
    def drift(self) -> int:
        return self.new + self.updated + self.deleted + self.deferred


@dataclass
class PassReport:
    number: int
    steps: dict[str, StepReport] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def drift(self) -> int:
        return sum(s.drift for s in self.steps.values())

    def line(self) -> str:
        parts = [f"{k} +{s.new} ~{s.updated} -{s.deleted}" + (f" ({s.deferred} deferred)"
                                                              if s.deferred else "")
                 for k, s in self.steps.items()]
        return f"pass {self.number}: drift {self.drift} in {self.seconds:.1f}s  " + ", ".join(parts)


@dataclass
class TypeCheck:
    """Verification of one object type or mapping: counts and content checksums."""

    name: str
    legacy_count: int
    fleet_count: int
    legacy_sum: int
    fleet_sum: int
    missing: list[Any] = field(default_factory=list)  # in legacy, not (or different) in fleet
    extra: list[Any] = field(default_factory=list)  # in fleet, not in legacy

    @property
    def ok(self) -> bool:
        return (self.legacy_count == self.fleet_count and self.legacy_sum == self.fleet_sum
                and not self.missing and not self.extra)

    def line(self) -> str:
        s = (f"{self.name}: legacy {self.legacy_count}, fleet {self.fleet_count}, checksum "
             f"{self.legacy_sum:016x} / {self.fleet_sum:016x} "
             f"{'ok' if self.ok else 'MISMATCH'}")
        if self.missing:
            s += f"; missing or different: {self.missing[:5]}"
        if self.extra:
            s += f"; extra in fleet: {self.extra[:5]}"
        return s


@dataclass
class MigrationResult:
    passes: list[PassReport]
    checks: list[TypeCheck]

    @property
    def verified(self) -> bool:
        return all(c.ok for c in self.checks)


def _replace_with(body: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda _old: body


def _ck(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF


class Migration:
    """One legacy database -> the fleet behind *store*.

    * ``connect_legacy`` — a callable returning a new PyMySQL connection (autocommit)
      to the legacy server; the state database is created there.
    * ``legacy_db`` — the legacy database name; ``state_db`` (default
      ``shardfleet_migration``) the migration's own; ``source`` (default the
      legacy database name) the ``legacy_src`` tag in copied bodies.
    * ``batch`` (1000) rows per chunk; ``max_passes`` (20); ``rng`` for placement.
    * ``progress`` — show progress (a bar on a TTY, plain lines otherwise) on
      ``stream`` (stderr); ``out`` receives the pass and verification lines.
    """

    def __init__(self, store: Store, connect_legacy: Callable[[], Any], legacy_db: str, *,
                 state_db: str = "shardfleet_migration", source: str | None = None,
                 batch: int = 1000, max_passes: int = 20, rng: random.Random | None = None,
                 progress: bool = True, stream: Any = None, tty: bool | None = None,
                 out: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.connect_legacy = connect_legacy
        self.legacy_db = ident(legacy_db)
        self.state_db = ident(state_db)
        if self.state_db == self.legacy_db:
            raise MigrationError("the state database must not be the legacy database")
        self.source = source or legacy_db
        self.batch = batch
        self.max_passes = max_passes
        self.rng = rng or random.Random()
        self.progress, self.stream, self.tty = progress, stream, tty
        self.out = out or (lambda line: print(line, flush=True))
        self.idmap: dict[str, dict[int, int]] = {k.name: {} for k in KINDS if k.object_type}
        self._conn: Any = None

    # -- connections and state -------------------------------------------------
    def _state(self) -> Any:
        if self._conn is None or not self._conn.open:
            self._conn = self.connect_legacy()
        return self._conn

    def _q(self, sql: str, params: Any = None) -> list[Any]:
        with self._state().cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def open(self) -> None:
        """Create the state database and take the migration lock (one migration at a time)."""
        self._q(f"CREATE DATABASE IF NOT EXISTS `{self.state_db}` CHARACTER SET utf8mb4")
        for ddl in STATE_DDL:
            self._q(ddl.format(db=self.state_db))
        # a few seconds' wait: a run that ended (or was killed) an instant ago holds the lock
        # until the server has seen its connection close; one still running holds it on
        got = self._q("SELECT GET_LOCK(%s, %s)", (self._lock_name, LOCK_WAIT))
        if not got or got[0][0] != 1:
            raise MigrationError(f"another migration holds the lock on {self.state_db}")
        self._load_idmap()

    @property
    def _lock_name(self) -> str:
        return f"shardfleet_migrate.{self.state_db}"

    def close(self) -> None:
        """Release the lock (at once, not when the server sees the connection close) and
        close the state connection."""
        if self._conn is not None and self._conn.open:
            try:
                self._q("SELECT RELEASE_LOCK(%s)", (self._lock_name,))
            except pymysql.MySQLError:
                pass  # a connection already lost: the server frees its locks itself
            self._conn.close()
        self._conn = None

    def _load_idmap(self) -> None:
        for kind in self.idmap:
            self.idmap[kind] = {int(k): int(n) for k, n in self._q(
                f"SELECT k1, new_id FROM `{self.state_db}`.migrated WHERE kind=%s "
                "AND new_id IS NOT NULL", (kind,))}

    # -- SQL pieces ----------------------------------------------------------
    def _hash_sql(self, k: Kind) -> str:
        return "MD5(JSON_ARRAY(" + ", ".join(f"l.`{c}`" for c in (*k.keys, *k.columns)) + "))"

    def _join_sql(self, k: Kind) -> str:
        k2 = f"l.`{k.keys[1]}`" if len(k.keys) > 1 else "0"
        return (f"FROM `{self.legacy_db}`.`{k.table}` l LEFT JOIN `{self.state_db}`.migrated s "
                f"ON s.kind=%s AND s.k1=l.`{k.keys[0]}` AND s.k2={k2}")

    def _deleted_sql(self, k: Kind) -> str:
        on = f"l.`{k.keys[0]}`=s.k1" + (f" AND l.`{k.keys[1]}`=s.k2" if len(k.keys) > 1 else "")
        return (f"SELECT s.k1, s.k2, s.new_id, s.links FROM `{self.state_db}`.migrated s "
                f"LEFT JOIN `{self.legacy_db}`.`{k.table}` l ON {on} "
                f"WHERE s.kind=%s AND l.`{k.keys[0]}` IS NULL")

    def changed_counts(self, k: Kind) -> tuple[int, int, int]:
        """(new, changed, deleted) rows of one kind right now."""
        h = self._hash_sql(k)
        row = self._q(f"SELECT COUNT(*), COALESCE(SUM(s.k1 IS NULL), 0) {self._join_sql(k)} "
                      f"WHERE s.hash IS NULL OR s.hash <> {h}", (k.name,))[0]
        gone = self._q(f"SELECT COUNT(*) FROM ({self._deleted_sql(k)}) d", (k.name,))[0][0]
        return int(row[1]), int(row[0]) - int(row[1]), int(gone)

    # -- the plan --------------------------------------------------------------
    def plan(self) -> list[str]:
        """What a run would do now, as lines (``--dry-run``); changes nothing in the fleet."""
        m = self.store.router.map
        opened = m.open_ranges()
        lines = [f"legacy database {self.legacy_db} -> fleet map version "
                 f"{self.store.router.version} ({len(m.ranges)} ranges, "
                 f"{sum(r.size for r in opened)} shards open for new users)",
                 f"state database {self.state_db} (legacy ID -> new ID, content MD5 per row); "
                 f"source tag {self.source!r}",
                 "placement: users on a random open shard; boards and pins on their user's "
                 "shard; relations as mapping rows on the from-object's shard"]
        if not opened:
            lines.append("WARNING: the map has no open range: new users cannot be placed")
        started = bool(self._q("SELECT 1 FROM information_schema.TABLES WHERE "
                               "TABLE_SCHEMA=%s AND TABLE_NAME='migrated'", (self.state_db,)))
        if not started:
            lines.append(f"state database {self.state_db} does not exist yet: a first run "
                         "copies everything")
        for k in KINDS:
            total = self._q(f"SELECT COUNT(*) FROM `{self.legacy_db}`.`{k.table}`")[0][0]
            new, changed, gone = self.changed_counts(k) if started else (total, 0, 0)
            target = (f"{k.object_type} objects" if k.object_type else "mapping rows") + (
                f" + {', '.join(self._mapping_names(k))}" if self._mapping_names(k) else "")
            lines.append(f"  {k.table}: {total} rows -> {target}: copy {new} new, "
                         f"update {changed}, delete {gone}")
        lines.append(f"then: repeat passes until one finds nothing (at most {self.max_passes}),"
                     " then verify counts and checksums per type")
        return lines

    @staticmethod
    def _mapping_names(k: Kind) -> list[str]:
        return {"board": ["user_has_boards"], "pin": ["board_has_pins"],
                "like": ["user_likes_pins", "pin_liked_by_user"],
                "follow": ["user_follows_users"]}.get(k.name, [])

    # -- transforms ------------------------------------------------------------
    def _parents(self, k: Kind, row: dict[str, Any]) -> dict[str, int] | None:
        out = {}
        for col, parent in k.parents:
            nid = self.idmap[parent].get(int(row[col]))
            if nid is None:
                return None
            out[col] = nid
        return out

    def body(self, k: Kind, row: dict[str, Any], parents: dict[str, int]) -> dict[str, Any]:
        b = {c: parents.get(c, _jsonable(row[c])) for c in k.columns}
        b["legacy_src"] = self.source
        b["legacy_id"] = int(row[k.keys[0]])
        return b

    @staticmethod
    def links(k: Kind, row: dict[str, Any], new_id: int | None, p: dict[str, int]) -> list[Link]:
        seq = _micros(row.get("created_at"))
        if k.name == "board":
            return [("user_has_boards", p["user_id"], new_id or 0, seq)]
        if k.name == "pin":
            return [("board_has_pins", p["board_id"], new_id or 0, seq)]
        if k.name == "like":
            return [("user_likes_pins", p["user_id"], p["pin_id"], seq),
                    ("pin_liked_by_user", p["pin_id"], p["user_id"], seq)]
        if k.name == "follow":
            return [("user_follows_users", p["follower_id"], p["followee_id"], seq)]
        return []

    def _shard_for(self, k: Kind, p: dict[str, int]) -> int:
        if "user_id" in p:
            return ids.shard_of(p["user_id"])
        opened = self.store.router.map.open_ranges()
        if not opened:
            raise NoOpenShardError("the map has no open range to place a migrated user in")
        n = self.rng.randrange(sum(r.size for r in opened))
        for r in opened:
            if n < r.size:
                return r.first + n
            n -= r.size
        raise AssertionError("unreachable")

    # -- fleet writes -------------------------------------------------------------
    def _insert_objects(self, shard: int, object_type: str,
                        bodies: list[dict[str, Any]]) -> dict[int, int]:
        """Insert bodies into one shard's table in one statement; ``{legacy_id: new ID}``."""
        ot = self.store.schema.object_type(object_type)
        table = f"`{shard_database(shard)}`.`{ot.table}`"
        values = ",".join(["(%s)"] * len(bodies))
        data = [json.dumps(b, separators=(",", ":"), ensure_ascii=False) for b in bodies]
        want = {b["legacy_id"] for b in bodies}

        def run(conn: Any) -> dict[int, int]:
            conn.begin()
            try:
                with conn.cursor() as cur:
                    cur.execute(f"INSERT INTO {table} (body) VALUES {values}", data)
                    first = int(cur.lastrowid)
                    # every row of this statement has local_id >= the first one it got
                    cur.execute(f"SELECT local_id, JSON_VALUE(body, '$.legacy_id') FROM {table} "
                                "WHERE local_id >= %s AND JSON_VALUE(body, '$.legacy_src') = %s",
                                (first, self.source))
                    got = {int(lid): int(local) for local, lid in cur.fetchall()
                           if lid is not None and int(lid) in want}
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            return got

        got = self.store._on_master(shard, run, write=True)
        if len(got) != len(want):
            raise MigrationError(f"shard {shard} {ot.table}: inserted {len(want)} rows, "
                                 f"found {len(got)} back")
        return {lid: ids.compose(shard, ot.type, local) for lid, local in got.items()}

    def _write_links(self, adds: Iterable[Link], removes: Iterable[tuple[str, int, int]]) -> None:
        add_g: dict[tuple[int, str], list[Link]] = defaultdict(list)
        rem_g: dict[tuple[int, str], list[tuple[str, int, int]]] = defaultdict(list)
        for a in adds:
            add_g[(ids.shard_of(a[1]), a[0])].append(a)
        for r in removes:
            rem_g[(ids.shard_of(r[1]), r[0])].append(r)
        touched: set[tuple[str, int]] = set()
        for (shard, name), rows in add_g.items():
            table = f"`{shard_database(shard)}`.`{self.store.schema.mapping(name).table}`"
            sql = (f"INSERT INTO {table} (from_id, to_id, sequence) VALUES "
                   + ",".join(["(%s, %s, %s)"] * len(rows))
                   + " ON DUPLICATE KEY UPDATE sequence=VALUES(sequence)")
            params = [v for _, f, t, s in rows for v in (f, t, s)]
            self._exec(shard, sql, params)
            touched.update((name, f) for _, f, _, _ in rows)
        for (shard, name), rrows in rem_g.items():
            table = f"`{shard_database(shard)}`.`{self.store.schema.mapping(name).table}`"
            sql = (f"DELETE FROM {table} WHERE (from_id, to_id) IN ("
                   + ",".join(["(%s, %s)"] * len(rrows)) + ")")
            self._exec(shard, sql, [v for _, f, t in rrows for v in (f, t)])
            touched.update((name, f) for _, f, _ in rrows)
        mc = self.store.mapping_cache
        if mc is not None:
            for name, f in touched:
                mc.invalidate(name, f)

    def _exec(self, shard: int, sql: str, params: Sequence[Any]) -> None:
        def run(conn: Any) -> None:
            with conn.cursor() as cur:
                cur.execute(sql, params)

        self.store._on_master(shard, run, write=True)

    def _record(self, kind: str, rows: list[tuple[int, int, int | None, str, list[Link]]]) -> None:
        if not rows:
            return
        sql = (f"INSERT INTO `{self.state_db}`.migrated (kind, k1, k2, new_id, hash, links) "
               "VALUES " + ",".join(["(%s, %s, %s, %s, %s, %s)"] * len(rows))
               + " ON DUPLICATE KEY UPDATE new_id=VALUES(new_id), hash=VALUES(hash), "
               "links=VALUES(links)")
        params: list[Any] = []
        for k1, k2, new_id, h, links in rows:
            params += [kind, k1, k2, new_id, h, json.dumps(links)]
        self._q(sql, params)

    # -- one pass ----------------------------------------------------------------
    def _copy_chunk(self, k: Kind, chunk: list[dict[str, Any]], rep: StepReport) -> None:
        inserts: dict[int, list[tuple[dict[str, Any], dict[str, int]]]] = defaultdict(list)
        done: list[tuple[dict[str, Any], dict[str, int], int | None]] = []
        for row in chunk:
            p = self._parents(k, row)
            if p is None:
                rep.deferred += 1  # its parent is not copied yet: the next pass takes it
                continue
            if k.object_type and row["_new_id"] is None:
                inserts[self._shard_for(k, p)].append((row, p))
                rep.new += 1
                continue
            if k.object_type:
                existing = int(row["_new_id"])
                body = self.body(k, row, p)
                try:
                    self.store.update(existing, _replace_with(body))
                except ObjectNotFound:  # deleted in the fleet behind our back: copy again
                    inserts[self._shard_for(k, p)].append((row, p))
                    rep.new += 1
                    continue
                done.append((row, p, existing))
            else:
                done.append((row, p, None))
            if row["_old_links"] is None:
                rep.new += 1
            else:
                rep.updated += 1
        assert k.object_type or not inserts
        for shard, items in inserts.items():
            made = self._insert_objects(shard, k.object_type or "",
                                        [self.body(k, row, p) for row, p in items])
            for row, p in items:
                done.append((row, p, made[int(row[k.keys[0]])]))
        adds: list[Link] = []
        removes: list[tuple[str, int, int]] = []
        state: list[tuple[int, int, int | None, str, list[Link]]] = []
        for row, p, placed in done:
            new_links = self.links(k, row, placed, p)
            old = {(m, f, t): s for m, f, t, s in json.loads(row["_old_links"] or "[]")}
            new = {(m, f, t): s for m, f, t, s in new_links}
            adds += [(m, f, t, s) for (m, f, t), s in new.items() if old.get((m, f, t)) != s]
            removes += [key for key in old if key not in new]
            k1 = int(row[k.keys[0]])
            k2 = int(row[k.keys[1]]) if len(k.keys) > 1 else 0
            state.append((k1, k2, placed, row["_hash"], new_links))
            if placed is not None and k.object_type:
                self.idmap[k.name][k1] = placed
        self._write_links(adds, removes)
        self._record(k.name, state)

    def _delete_gone(self, k: Kind, rep: StepReport) -> None:
        gone = self._q(self._deleted_sql(k), (k.name,))
        removes: list[tuple[str, int, int]] = []
        for _k1, _k2, _new_id, links in gone:
            removes += [(m, f, t) for m, f, t, _ in json.loads(links or "[]")]
        self._write_links([], removes)
        for k1, k2, new_id, _ in gone:
            if new_id is not None:
                self.store.delete(int(new_id), hard=True)
                self.idmap.get(k.name, {}).pop(int(k1), None)
            self._q(f"DELETE FROM `{self.state_db}`.migrated WHERE kind=%s AND k1=%s AND k2=%s",
                    (k.name, k1, k2))
        rep.deleted += len(gone)

    def run_pass(self, number: int) -> PassReport:
        report = PassReport(number)
        t0 = time.monotonic()
        for k in KINDS:
            rep = report.steps[k.name] = StepReport()
            new, changed, _ = self.changed_counts(k)
            prog = Progress(f"pass {number} {k.table}", new + changed, stream=self.stream,
                            tty=self.tty, enabled=self.progress)
            h = self._hash_sql(k)
            cols = ", ".join(f"l.`{c}`" for c in dict.fromkeys((*k.keys, *k.columns)))
            sql = (f"SELECT {cols}, {h} AS _hash, s.new_id AS _new_id, s.links AS _old_links "
                   f"{self._join_sql(k)} WHERE s.hash IS NULL OR s.hash <> {h}")
            stream = self.connect_legacy()  # an unbuffered read beside the state writes
            try:
                with stream.cursor(pymysql.cursors.SSDictCursor) as cur:
                    cur.execute(sql, (k.name,))
                    while True:
                        chunk = cur.fetchmany(self.batch)
                        if not chunk:
                            break
                        self._copy_chunk(k, chunk, rep)
                        prog.update(len(chunk))
            finally:
                stream.close()
            prog.finish()
            self._delete_gone(k, rep)
        report.seconds = time.monotonic() - t0
        self._q(f"INSERT INTO `{self.state_db}`.passes (drift, report) VALUES (%s, %s)",
                (report.drift, json.dumps({k: vars(s) for k, s in report.steps.items()})))
        return report

    def run(self, *, verify: bool = True,
            after_pass: Callable[[PassReport], None] | None = None) -> MigrationResult:
        """Passes until one has zero drift, then (by default) verification.

        Raises :class:`MigrationError` when the drift is not zero after
        ``max_passes`` passes, or when verification finds a mismatch (the result
        is logged and printed first).
        """
        self.open()
        passes: list[PassReport] = []
        try:
            for n in range(1, self.max_passes + 1):
                rep = self.run_pass(n)
                passes.append(rep)
                self.out(rep.line())
                if after_pass is not None:
                    after_pass(rep)
                if rep.drift == 0:
                    break
            else:
                raise MigrationError(f"drift still {passes[-1].drift} after {self.max_passes} "
                                     "passes; is the legacy database still being written?")
            checks = self.verify() if verify else []
        finally:
            self.close()
        result = MigrationResult(passes, checks)
        for c in checks:
            self.out(c.line())
        if verify and not result.verified:
            bad = [c.name for c in checks if not c.ok]
            raise MigrationError(f"verification found mismatches in {', '.join(bad)}")
        return result

    # -- verification --------------------------------------------------------------
    def _all_shards(self) -> list[int]:
        return [s for r in self.store.router.map.ranges for s in range(r.first, r.last + 1)]

    def _scan(self, shard: int, sql: str, params: Sequence[Any]) -> list[Any]:
        def run(conn: Any) -> list[Any]:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall())

        return self.store._on_master(shard, run, write=False)

    def verify(self) -> list[TypeCheck]:
        """Counts and content checksums per object type and per mapping, legacy vs fleet.

        The legacy side is each row as it would be copied now; the fleet side is
        every object in the shards tagged with this source (duplicates count), and
        every mapping row between migrated objects. Call :meth:`open` first.
        """
        checks: list[TypeCheck] = []
        shards = self._all_shards()
        expect_links: dict[str, dict[tuple[int, int], int]] = {m: {} for m in MAPPINGS}
        for k in KINDS:
            cols = ", ".join(f"l.`{c}`" for c in dict.fromkeys((*k.keys, *k.columns)))
            conn = self.connect_legacy()
            try:
                with conn.cursor(pymysql.cursors.DictCursor) as cur:
                    cur.execute(f"SELECT {cols} FROM `{self.legacy_db}`.`{k.table}` l")
                    rows = list(cur.fetchall())
            finally:
                conn.close()
            want: dict[int, int] = {}
            unplaced: list[Any] = []
            for row in rows:
                p = self._parents(k, row)
                k1 = int(row[k.keys[0]])
                new_id = self.idmap[k.name].get(k1) if k.object_type else None
                if p is None or (k.object_type and new_id is None):
                    unplaced.append(k1)
                    continue
                for m, f, t, s in self.links(k, row, new_id, p):
                    expect_links[m][(f, t)] = s
                if k.object_type:
                    want[k1] = digest(self.body(k, row, p))
            if not k.object_type:
                continue
            table = self.store.schema.object_type(k.object_type).table
            have: dict[int, int] = {}
            dupes: list[int] = []
            count = 0
            for shard in shards:
                for (body,) in self._scan(
                        shard, f"SELECT body FROM `{shard_database(shard)}`.`{table}` "
                        "WHERE JSON_VALUE(body, '$.legacy_src') = %s", (self.source,)):
                    b = json.loads(body)
                    count += 1
                    lid = int(b.get("legacy_id", 0))
                    if lid in have:
                        dupes.append(lid)
                    have[lid] = digest(b)
            checks.append(TypeCheck(
                k.object_type, len(rows), count,
                _ck(sum(want.values())), _ck(sum(have.values()) + sum(
                    digest(d) for d in dupes)),
                missing=sorted(unplaced + [i for i, d in want.items() if have.get(i) != d]),
                extra=sorted(set(dupes) | {i for i in have if i not in want})))
        migrated = {n for m in self.idmap.values() for n in m.values()}
        for name in MAPPINGS:
            table = self.store.schema.mapping(name).table
            have_l: dict[tuple[int, int], int] = {}
            for shard in shards:
                for f, t, s in self._scan(
                        shard, f"SELECT from_id, to_id, sequence FROM "
                        f"`{shard_database(shard)}`.`{table}`", ()):
                    if int(f) in migrated and int(t) in migrated:
                        have_l[(int(f), int(t))] = int(s)
            want_l = expect_links[name]
            checks.append(TypeCheck(
                name, len(want_l), len(have_l),
                _ck(sum(digest([f, t, s]) for (f, t), s in want_l.items())),
                _ck(sum(digest([f, t, s]) for (f, t), s in have_l.items())),
                missing=sorted(x for x, s in want_l.items() if have_l.get(x) != s),
                extra=sorted(x for x in have_l if x not in want_l)))
        return checks
