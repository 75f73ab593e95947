"""The schema of every shard, loaded from one YAML file (``schema.yml``).

From the file come both the type registry (name <-> 10-bit type number <-> table)
and the DDL of every table. Identifiers put into SQL come only from here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from shardfleet import ids
from shardfleet.errors import SchemaError

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
TABLE_OPTIONS = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_unicode_ci"


@dataclass(frozen=True)
class ObjectType:
    name: str
    type: int
    table: str


@dataclass(frozen=True)
class Mapping:
    name: str
    from_type: str
    to_type: str

    @property
    def table(self) -> str:
        return self.name


@dataclass(frozen=True)
class Lookup:
    name: str
    value: str  # "id" or "json"

    @property
    def table(self) -> str:
        return self.name


@dataclass(frozen=True)
class Schema:
    objects: tuple[ObjectType, ...]
    mappings: tuple[Mapping, ...]
    lookups: tuple[Lookup, ...]
    source: str = "<schema>"
    _by_name: dict[str, ObjectType] = field(default_factory=dict, compare=False, repr=False)
    _by_type: dict[int, ObjectType] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({o.name: o for o in self.objects})
        self._by_type.update({o.type: o for o in self.objects})

    # -- registry -------------------------------------------------------
    def object_type(self, key: str | int) -> ObjectType:
        """The object type by name (``"pin"``) or number (``1``)."""
        found = self._by_type.get(key) if isinstance(key, int) else self._by_name.get(key)
        if found is None:
            raise SchemaError(f"unknown object type {key!r} (schema {self.source})")
        return found

    def mapping(self, name: str) -> Mapping:
        for m in self.mappings:
            if m.name == name:
                return m
        raise SchemaError(f"unknown mapping table {name!r} (schema {self.source})")

    def lookup(self, name: str) -> Lookup:
        for lk in self.lookups:
            if lk.name == name:
                return lk
        raise SchemaError(f"unknown lookup table {name!r} (schema {self.source})")

    @property
    def tables(self) -> list[str]:
        return (
            [o.table for o in self.objects]
            + [m.table for m in self.mappings]
            + [lk.table for lk in self.lookups]
        )

    # -- DDL -------------------------------------------------------------
    def ddl(self) -> dict[str, str]:
        """``{table: CREATE TABLE statement}`` for every table of a shard, in schema order."""
        out: dict[str, str] = {}
        for o in self.objects:
            out[o.table] = object_table_ddl(o.table)
        for m in self.mappings:
            out[m.table] = mapping_table_ddl(m.table)
        for lk in self.lookups:
            out[lk.table] = lookup_table_ddl(lk.table, lk.value)
        return out

    def columns(self) -> dict[str, list[tuple[str, str]]]:
        """``{table: [(column, type), ...]}``: what a live table is compared against."""
        out: dict[str, list[tuple[str, str]]] = {}
        for o in self.objects:
            out[o.table] = list(OBJECT_COLUMNS)
        for m in self.mappings:
            out[m.table] = list(MAPPING_COLUMNS)
        for lk in self.lookups:
            out[lk.table] = [("lookup_key", "varbinary(255)"), _lookup_value_column(lk.value),
                             ("updated_at", "timestamp")]
        return out


# Column shapes, written once. Types are as information_schema.COLUMNS.COLUMN_TYPE
# reports them on MariaDB (JSON is an alias of LONGTEXT there).
OBJECT_COLUMNS = (
    ("local_id", "bigint(20) unsigned"),
    ("body", "longtext"),
    ("created_at", "timestamp"),
    ("updated_at", "timestamp"),
)
MAPPING_COLUMNS = (
    ("from_id", "bigint(20) unsigned"),
    ("to_id", "bigint(20) unsigned"),
    ("sequence", "bigint(20)"),
)


def _lookup_value_column(kind: str) -> tuple[str, str]:
    return ("value_id", "bigint(20) unsigned") if kind == "id" else ("body", "longtext")


def object_table_ddl(table: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS `{table}` (\n"
        "  local_id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,\n"
        "  body JSON NOT NULL,\n"
        "  created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,\n"
        "  updated_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,\n"
        "  PRIMARY KEY (local_id)\n"
        f") {TABLE_OPTIONS}"
    )


def mapping_table_ddl(table: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS `{table}` (\n"
        "  from_id BIGINT UNSIGNED NOT NULL,\n"
        "  to_id BIGINT UNSIGNED NOT NULL,\n"
        "  sequence BIGINT NOT NULL,\n"
        "  PRIMARY KEY (from_id, to_id),\n"
        "  KEY from_sequence (from_id, sequence)\n"
        f") {TABLE_OPTIONS}"
    )


def lookup_table_ddl(table: str, kind: str) -> str:
    value = "value_id BIGINT UNSIGNED NOT NULL" if kind == "id" else "body JSON NOT NULL"
    return (
        f"CREATE TABLE IF NOT EXISTS `{table}` (\n"
        "  lookup_key VARBINARY(255) NOT NULL,\n"
        f"  {value},\n"
        "  updated_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,\n"
        "  PRIMARY KEY (lookup_key)\n"
        f") {TABLE_OPTIONS}"
    )


def _ident(kind: str, value: Any) -> str:
    if not isinstance(value, str) or not _IDENT.match(value):
        raise SchemaError(f"{kind} {value!r} is not a valid name (^[a-z][a-z0-9_]{{0,63}}$)")
    return value


def parse_schema(data: Any, source: str = "<schema>") -> Schema:
    """Validate a parsed schema document and build a :class:`Schema`."""
    if not isinstance(data, dict):
        raise SchemaError(f"{source}: the schema must be a mapping with objects/mappings/lookups")
    objects: list[ObjectType] = []
    seen_tables: set[str] = set()

    def claim(table: str) -> None:
        if table in seen_tables:
            raise SchemaError(f"{source}: table {table!r} is defined twice")
        seen_tables.add(table)

    for i, o in enumerate(data.get("objects") or []):
        if not isinstance(o, dict):
            raise SchemaError(f"{source}: objects[{i}] must be a mapping")
        name = _ident("object name", o.get("name"))
        t = o.get("type")
        if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= ids.MAX_TYPE:
            raise SchemaError(f"{source}: object {name!r} type {t!r} is not in 1..{ids.MAX_TYPE}")
        table = _ident("table", o.get("table", name + "s"))
        if any(x.name == name or x.type == t for x in objects):
            raise SchemaError(f"{source}: object {name!r} or type {t} is defined twice")
        claim(table)
        objects.append(ObjectType(name, t, table))
    if not objects:
        raise SchemaError(f"{source}: the schema defines no object types")
    names = {o.name for o in objects}
    mappings: list[Mapping] = []
    for i, m in enumerate(data.get("mappings") or []):
        if not isinstance(m, dict):
            raise SchemaError(f"{source}: mappings[{i}] must be a mapping")
        name = _ident("mapping name", m.get("name"))
        if name.count("_") < 2:
            raise SchemaError(f"{source}: mapping {name!r} is not named noun_verb_noun")
        for end in ("from", "to"):
            if m.get(end) not in names:
                raise SchemaError(
                    f"{source}: mapping {name!r} {end} {m.get(end)!r} is not an object type")
        claim(name)
        mappings.append(Mapping(name, m["from"], m["to"]))
    lookups: list[Lookup] = []
    for i, lk in enumerate(data.get("lookups") or []):
        if not isinstance(lk, dict):
            raise SchemaError(f"{source}: lookups[{i}] must be a mapping")
        name = _ident("lookup name", lk.get("name"))
        value = lk.get("value", "id")
        if value not in ("id", "json"):
            raise SchemaError(f"{source}: lookup {name!r} value must be 'id' or 'json'")
        claim(name)
        lookups.append(Lookup(name, value))
    return Schema(tuple(objects), tuple(mappings), tuple(lookups), source=source)


def load_schema(path: str | Path | None = None) -> Schema:
    """Load the schema from *path*, or the library's own ``schema.yml`` when None."""
    if path is None:
        return default_schema()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read schema file {p}: {exc.strerror}") from None
    return _parse_text(text, str(p))


def _parse_text(text: str, source: str) -> Schema:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SchemaError(f"schema file {source} does not parse: {exc}") from None
    return parse_schema(data, source)


@lru_cache(maxsize=1)
def default_schema() -> Schema:
    """The schema shipped in the package (``shardfleet/schema.yml``)."""
    text = resources.files("shardfleet").joinpath("schema.yml").read_text(encoding="utf-8")
    return _parse_text(text, "shardfleet/schema.yml")


# Every shard database's name matches this (MySQL REGEXP syntax): ``db`` and five digits.
SHARD_DATABASE_REGEXP = "^db[0-9]{5}$"


def shard_databases_on(conn: Any) -> list[str]:
    """The shard databases a server holds, sorted."""
    with conn.cursor() as c:
        c.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA "
                  "WHERE SCHEMA_NAME REGEXP %s ORDER BY 1", (SHARD_DATABASE_REGEXP,))
        return [str(r[0]) for r in c.fetchall()]


def shard_database(shard: int) -> str:
    """The database name of a shard: ``db00000`` .. ``db65535``."""
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard <= ids.MAX_SHARD:
        raise SchemaError(f"shard {shard!r} is out of range 0..{ids.MAX_SHARD}")
    return f"db{shard:05d}"
