"""Shard databases on one server: plan what is missing, then create it in batches.

Used by the ``shard_databases`` module and the tests. A plan reads the server's
current state in a few queries (not one per shard); applying it sends one
multi-statement round trip per batch of shards over a single connection.
Tables whose live definition differs from the schema are reported, never altered.

The definition check is the plan's one costly part, so a clean one is recorded on the
server and, by default, repeated only when the schema changed (:data:`CHECKS_DB`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardfleet.errors import DatabaseError, SchemaError, mysql_code
from shardfleet.schema import Schema, shard_database

log = logging.getLogger(__name__)

APP_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"


@dataclass
class ShardPlan:
    """What :func:`apply_plan` would do to reach the schema on one server."""

    shards: list[int]
    databases: list[str] = field(default_factory=list)  # to create
    tables: list[tuple[str, str]] = field(default_factory=list)  # (db, table) to create
    grants: list[str] = field(default_factory=list)  # databases to grant the app user on
    drifted: list[dict[str, Any]] = field(default_factory=list)  # tables unlike the schema
    definitions_checked: bool = False  # the columns of the existing tables were compared

    @property
    def changed(self) -> bool:
        return bool(self.databases or self.tables or self.grants)


def shard_list(first_last: Sequence[int] | None = None, shards: Iterable[int] | None = None
               ) -> list[int]:
    """Shards from ``[first, last]`` or an explicit list, validated and sorted."""
    if (first_last is None) == (shards is None):
        raise SchemaError("give either a range [first, last] or a list of shards")
    if first_last is not None:
        if len(first_last) != 2:
            raise SchemaError(f"range must be [first, last], got {list(first_last)!r}")
        first, last = first_last
        if not (isinstance(first, int) and isinstance(last, int)) or first > last:
            raise SchemaError(f"range [{first}, {last}] is not first <= last integers")
        out = list(range(first, last + 1))
    else:
        out = sorted(set(shards or []))
    for s in out:
        shard_database(s)  # bounds check
    return out


def _account(user: str, host: str) -> str:
    return f"'{_quote(user)}'@'{_quote(host)}'"


def _quote(s: str) -> str:
    if not isinstance(s, str) or not s or "'" in s or "\\" in s or len(s) > 80:
        raise SchemaError(f"invalid account name part {s!r}")
    return s


def existing_databases(cur: Any) -> set[str]:
    cur.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA "
                "WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$'")
    return {r[0] for r in cur.fetchall()}


# The definition check opens every table's definition: 9.9 s for 2,048 shards (28,672
# tables) on the local fleet at load 5, against 0.6 s for the rest of the plan, and the
# same answer on every converged rerun. A clean check is recorded on the server, in a
# database of the project's own that replicates (and is copied physically) with the
# shards: check_definitions="changed" repeats it only for a shard set with no record, or
# one made against another schema. A table altered by hand since is seen with "always".
CHECKS_DB = "shardfleet_provision"
DEFINITION_CHECKS = ("changed", "always", "never")


def definitions_fingerprint(schema: Schema) -> str:
    """The schema's tables and columns, as the definition check compares them."""
    cols = {t: [[c, _norm(x)] for c, x in v] for t, v in schema.columns().items()}
    return hashlib.sha256(json.dumps(cols, sort_keys=True).encode()).hexdigest()


def _shards_key(shards: Sequence[int]) -> str:
    return hashlib.sha256(",".join(str(s) for s in shards).encode()).hexdigest()[:32]


def _recorded_check(cur: Any, shards: Sequence[int]) -> str | None:
    try:
        cur.execute(f"SELECT schema_fingerprint FROM `{CHECKS_DB}`.definition_checks "
                    "WHERE shards_key=%s", (_shards_key(shards),))
    except Exception as exc:
        if mysql_code(exc) in (1049, 1146):  # no record kept on this server yet
            return None
        raise
    row = cur.fetchone()
    return str(row[0]) if row else None


def _check_mode(check_definitions: bool | str) -> str:
    if check_definitions is True:
        return "always"
    if check_definitions is False:
        return "never"
    if check_definitions not in DEFINITION_CHECKS:
        raise SchemaError(f"check_definitions must be one of {', '.join(DEFINITION_CHECKS)}, "
                          f"got {check_definitions!r}")
    return str(check_definitions)


def plan_shards(conn: Any, shards: Sequence[int], schema: Schema, *,
                app_user: str | None = None, app_host: str = "%",
                check_definitions: bool | str = True) -> ShardPlan:
    """Compare the server with the schema for *shards*; changes nothing.

    *check_definitions*: ``"always"`` (or True) compares every existing table's columns
    with the schema; ``"changed"`` only when no clean check of these shards against this
    schema is recorded on the server (:func:`record_definitions_check`); ``"never"`` (or
    False) not at all."""
    mode = _check_mode(check_definitions)
    plan = ShardPlan(list(shards))
    wanted = {shard_database(s): s for s in shards}
    ddl = schema.ddl()
    with conn.cursor() as cur:
        have_dbs = existing_databases(cur)
        cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                    "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")
        have_tables: dict[str, set[str]] = {}
        for db, t in cur.fetchall():
            have_tables.setdefault(db, set()).add(t)
        granted: set[str] = set()
        if app_user:
            cur.execute("SELECT Db FROM mysql.db WHERE User=%s AND Host=%s AND Select_priv='Y' "
                        "AND Insert_priv='Y' AND Update_priv='Y' AND Delete_priv='Y'",
                        (app_user, app_host))
            granted = {r[0] for r in cur.fetchall()}
        for db in wanted:
            if db not in have_dbs:
                plan.databases.append(db)
            tables = have_tables.get(db, set())
            plan.tables.extend((db, t) for t in ddl if t not in tables)
            if app_user and db not in granted:
                plan.grants.append(db)
        if mode == "always" or (mode == "changed" and _recorded_check(cur, plan.shards)
                                != definitions_fingerprint(schema)):
            plan.drifted = _drift(cur, schema, [db for db in wanted if db in have_dbs])
            plan.definitions_checked = True
    return plan


def record_definitions_check(conn: Any, plan: ShardPlan, schema: Schema) -> bool:
    """Record that *plan*'s shards match *schema* once it is applied: a check found no
    drift, and what it did not see it created from the schema. Returns whether a record
    was written (nothing when the plan did not check, or found drift: that warning then
    stays until the tables are fixed)."""
    if not plan.definitions_checked or plan.drifted or not plan.shards:
        return False
    fingerprint = definitions_fingerprint(schema)
    with conn.cursor() as cur:
        if _recorded_check(cur, plan.shards) == fingerprint:
            return False
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{CHECKS_DB}` CHARACTER SET utf8mb4")
        cur.execute(f"CREATE TABLE IF NOT EXISTS `{CHECKS_DB}`.definition_checks ("
                    "shards_key CHAR(32) NOT NULL PRIMARY KEY, "
                    "first_shard INT UNSIGNED NOT NULL, last_shard INT UNSIGNED NOT NULL, "
                    "shard_count INT UNSIGNED NOT NULL, schema_fingerprint CHAR(64) NOT NULL, "
                    "checked_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP"
                    ") ENGINE=InnoDB")
        cur.execute(f"INSERT INTO `{CHECKS_DB}`.definition_checks (shards_key, first_shard, "
                    "last_shard, shard_count, schema_fingerprint) VALUES (%s, %s, %s, %s, %s) "
                    "ON DUPLICATE KEY UPDATE schema_fingerprint=VALUES(schema_fingerprint), "
                    "checked_at=CURRENT_TIMESTAMP",
                    (_shards_key(plan.shards), min(plan.shards), max(plan.shards),
                     len(plan.shards), fingerprint))
    conn.commit()
    return True


# Shards per information_schema.COLUMNS query of the drift check. The server opens every
# table's definition to answer it: 500 shards (7,000 tables) took 11.7 s cold on a loaded
# 2-core machine, past 30 s under more load (the statement's read timeout): a rerun of
# site.yml failed with 2013. 100 keep each statement a few seconds, the total the same.
DRIFT_CHUNK = 100


def _drift(cur: Any, schema: Schema, dbs: list[str]) -> list[dict[str, Any]]:
    """Tables whose columns differ from the schema (one query per DRIFT_CHUNK shards)."""
    expect = schema.columns()
    out: list[dict[str, Any]] = []
    for i in range(0, len(dbs), DRIFT_CHUNK):
        chunk = dbs[i:i + DRIFT_CHUNK]
        marks = ",".join(["%s"] * len(chunk))
        cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME, COLUMN_TYPE "
                    f"FROM information_schema.COLUMNS WHERE TABLE_SCHEMA IN ({marks}) "
                    "ORDER BY TABLE_SCHEMA, TABLE_NAME, ORDINAL_POSITION", chunk)
        live: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for db, t, col, ctype in cur.fetchall():
            live.setdefault((db, t), []).append((col, ctype.lower()))
        for (db, t), cols in sorted(live.items()):
            want = expect.get(t)
            if want is None:
                continue  # not a schema table: not ours to judge
            if [(c, _norm(x)) for c, x in cols] != [(c, _norm(x)) for c, x in want]:
                out.append({"database": db, "table": t, "expected": want, "actual": cols})
    return out


def _norm(column_type: str) -> str:
    # MySQL 8 drops integer display widths ("bigint unsigned"); MariaDB keeps them.
    return re.sub(r"\(\d+\)", "", column_type)


def apply_plan(conn: Any, plan: ShardPlan, schema: Schema, *, app_user: str | None = None,
               app_host: str = "%", batch: int = 64) -> dict[str, int]:
    """Create what *plan* lists, *batch* shards per round trip. Returns counts done."""
    ddl = schema.ddl()
    per_db: dict[str, list[str]] = {}
    for db in plan.databases:
        per_db.setdefault(db, []).append(
            f"CREATE DATABASE IF NOT EXISTS `{db}` CHARACTER SET utf8mb4 "
            "COLLATE utf8mb4_unicode_ci")
    for db, t in plan.tables:
        per_db.setdefault(db, []).append(ddl[t].replace(f"`{t}`", f"`{db}`.`{t}`", 1))
    if plan.grants:
        account = _account(app_user or "", app_host)
        for db in plan.grants:
            per_db.setdefault(db, []).append(f"GRANT {APP_PRIVILEGES} ON `{db}`.* TO {account}")
    dbs = sorted(per_db)
    done = {"databases_created": 0, "tables_created": 0, "grants_added": 0}
    with conn.cursor() as cur:
        for i in range(0, len(dbs), batch):
            chunk = dbs[i:i + batch]
            statements = [s for db in chunk for s in per_db[db]]
            try:
                run_many(cur, statements)
            except Exception as exc:
                raise DatabaseError(f"creating shards {chunk[0]}..{chunk[-1]}: {exc}") from exc
    done["databases_created"] = len(plan.databases)
    done["tables_created"] = len(plan.tables)
    done["grants_added"] = len(plan.grants)
    return done


def run_many(cur: Any, statements: Sequence[str]) -> None:
    """Send *statements* in one round trip (the connection needs MULTI_STATEMENTS)."""
    if not statements:
        return
    cur.execute(";\n".join(statements))
    while cur.nextset():
        pass


def multi_statement_flags() -> int:
    from pymysql.constants import CLIENT

    return int(CLIENT.MULTI_STATEMENTS)


def ensure_shards(conn: Any, shards: Sequence[int], schema: Schema, *,
                  app_user: str | None = None, app_host: str = "%") -> tuple[ShardPlan,
                                                                             dict[str, int]]:
    """Plan and apply in one call (the connection needs MULTI_STATEMENTS)."""
    plan = plan_shards(conn, shards, schema, app_user=app_user, app_host=app_host)
    return plan, apply_plan(conn, plan, schema, app_user=app_user, app_host=app_host)


def shards_with_rows(conn: Any, dbs: Sequence[str], schema: Schema, chunk: int = 40
                     ) -> list[str]:
    """The databases among *dbs* in which any schema table holds at least one row."""
    if not dbs:
        return []
    with conn.cursor() as cur:
        cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                    "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")
        tables: dict[str, list[str]] = {}
        for db, t in cur.fetchall():
            tables.setdefault(db, []).append(t)
        out: list[str] = []
        todo = [db for db in dbs if tables.get(db)]
        for i in range(0, len(todo), chunk):
            part = todo[i:i + chunk]
            selects = [f"(SELECT '{db}' FROM `{db}`.`{t}` LIMIT 1)"
                       for db in part for t in tables[db]]
            cur.execute(" UNION ".join(selects))
            out.extend(r[0] for r in cur.fetchall())
    return sorted(set(out))


def plan_drop(conn: Any, shards: Sequence[int], schema: Schema) -> tuple[list[str], list[str]]:
    """(databases that exist and would be dropped, those among them holding rows)."""
    wanted = {shard_database(s) for s in shards}
    with conn.cursor() as cur:
        present = sorted(existing_databases(cur) & wanted)
    return present, shards_with_rows(conn, present, schema)


def apply_drop(conn: Any, dbs: Sequence[str], *, app_user: str | None = None,
               app_host: str = "%", batch: int = 64) -> int:
    """Drop *dbs* (and the application user's grants on them); returns how many."""
    statements: list[str] = []
    if app_user:
        with conn.cursor() as cur:
            cur.execute("SELECT Db FROM mysql.db WHERE User=%s AND Host=%s", (app_user, app_host))
            granted = {r[0] for r in cur.fetchall()}
    else:
        granted = set()
    account = _account(app_user, app_host) if app_user else ""
    with conn.cursor() as cur:
        for i in range(0, len(dbs), batch):
            statements = []
            for db in dbs[i:i + batch]:
                shard_database(int(db[2:]))  # only ever a shard database
                if db in granted:
                    statements.append(f"REVOKE ALL PRIVILEGES ON `{db}`.* FROM {account}")
                statements.append(f"DROP DATABASE IF EXISTS `{db}`")
            run_many(cur, statements)
    return len(dbs)
