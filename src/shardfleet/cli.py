"""The ``shardfleet`` command. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardfleet import __version__, ids, shardmap
from shardfleet.errors import ShardfleetError
from shardfleet.schema import Schema, load_schema

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2, no usage dump
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(message: str) -> int:
    print(f"shardfleet: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _schema(args: argparse.Namespace) -> Schema:
    return load_schema(args.schema)


def cmd_id_decode(args: argparse.Namespace) -> int:
    schema = _schema(args)
    out = []
    for text in args.ids:
        value = ids.parse(text)
        oid = ids.decompose(value)
        try:
            type_name: str | None = schema.object_type(oid.type).name
        except ShardfleetError:
            type_name = None
        out.append({"id": value, "shard": oid.shard, "type": oid.type, "type_name": type_name,
                    "local_id": oid.local})
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0]))
    else:
        for o in out:
            print(f"{o['id']}: shard {o['shard']}, type {o['type_name'] or '?'} ({o['type']}), "
                  f"local ID {o['local_id']}")
    return 0


def cmd_id_encode(args: argparse.Namespace) -> int:
    schema = _schema(args)
    t = args.type
    type_num = schema.object_type(int(t) if t.isdigit() else t).type
    print(ids.compose(args.shard, type_num, args.local))
    return 0


def _read_map_file(path: str) -> shardmap.ShardMap:
    try:
        text = Path(path).read_bytes() if path != "-" else sys.stdin.buffer.read()
    except OSError as exc:
        raise ShardfleetError(f"cannot read {path}: {exc.strerror}") from None
    return shardmap.loads(text)


def _zk_store(args: argparse.Namespace) -> Any:
    from shardfleet.mapstore import ZooKeeperMapStore

    auth = None
    if os.environ.get("SHARDFLEET_ZK_USER"):
        auth = (os.environ["SHARDFLEET_ZK_USER"], os.environ.get("SHARDFLEET_ZK_PASSWORD", ""))
    return ZooKeeperMapStore(args.zk, args.cluster, root=args.root, auth=auth,
                             timeout=args.timeout)


def cmd_map_show(args: argparse.Namespace) -> int:
    if args.file:
        m, version = _read_map_file(args.file), None
    else:
        store = _zk_store(args)
        try:
            v = store.read()
        finally:
            store.close()
        if v.map is None:
            raise ShardfleetError(f"no map at {store.path} on {args.zk}")
        m, version = v.map, v.version
    if args.json:
        print(m.dumps())
    else:
        if version is not None:
            print(f"map version {version}, mod shard count {m.mod_shard_count}")
        print(m.table())
    return 0


def cmd_map_validate(args: argparse.Namespace) -> int:
    known = args.known_host or None
    m = _read_map_file(args.file)
    if known:
        shardmap.ShardMap.from_ranges(m.ranges, m.mod_shard_count, known)
    covered = sum(r.size for r in m.ranges)
    print(f"{args.file}: valid, {len(m.ranges)} ranges, {covered} shards, "
          f"{len(m.servers())} servers")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shardfleet import status

    password = os.environ.get("SHARDFLEET_MYSQL_PASSWORD", "")
    if args.password_file:
        try:
            password = Path(args.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ShardfleetError(f"cannot read {args.password_file}: {exc.strerror}") from None
    store = _zk_store(args)
    try:
        if not store.connected:
            if args.check:  # a check's answer, not a tool's failure
                print(f"CRITICAL ZooKeeper at {args.zk} is unreachable: the map cannot be read")
                return 2
            raise ShardfleetError(f"ZooKeeper at {args.zk} is unreachable")
        report = status.collect(store, args.user, password, sizes=not args.no_sizes,
                                zookeeper_hosts=[args.zk])
    finally:
        store.close(timeout=2)
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    if args.check:
        sev = {p["severity"] for p in report["problems"]}
        return 2 if status.CRITICAL in sev else 1 if status.WARNING in sev else 0
    return 0


def _zk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zk", default=os.environ.get("SHARDFLEET_ZK", "127.0.0.1:2181"),
                   help="ZooKeeper hosts (env SHARDFLEET_ZK)")
    p.add_argument("--root", default=os.environ.get("SHARDFLEET_ZK_ROOT", "/shardfleet"))
    p.add_argument("--cluster", default=os.environ.get("SHARDFLEET_CLUSTER", "default"))
    p.add_argument("--timeout", type=float, default=5.0)


def cmd_migrate(args: argparse.Namespace) -> int:
    """Copy the legacy database into the fleet until the drift is zero, then verify."""
    import random

    import pymysql

    from shardfleet.migrate import Migration, MigrationError
    from shardfleet.router import Router, split_hostport
    from shardfleet.store import Store

    host, port = split_hostport(args.legacy)

    def connect_legacy() -> Any:
        try:
            return pymysql.connect(host=host, port=port, user=args.legacy_user,
                                   password=os.environ.get("SHARDFLEET_LEGACY_PASSWORD", ""),
                                   charset="utf8mb4", autocommit=True, connect_timeout=10)
        except pymysql.err.MySQLError as exc:
            raise MigrationError(f"legacy server {args.legacy}: {exc}") from None

    caches: dict[str, Any] = {}
    if args.memcached:
        from shardfleet.cache import ObjectCache

        caches["object_cache"] = ObjectCache(args.memcached)
    if args.redis:
        from shardfleet.cache import MappingCache

        caches["mapping_cache"] = MappingCache(args.redis)
    router = Router(_zk_store(args), user=os.environ.get("SHARDFLEET_APP_USER", "shardfleet_app"),
                    password=os.environ.get("SHARDFLEET_APP_PASSWORD", ""))
    store = Store(router, _schema(args), **caches)
    show = {"auto": None, "always": True, "never": False}[args.progress]
    try:
        mig = Migration(store, connect_legacy, args.legacy_db, state_db=args.state_db,
                        source=args.source, batch=args.batch, max_passes=args.max_passes,
                        rng=random.Random(args.seed) if args.seed is not None else None,
                        progress=show is not False, tty=show)
        if args.dry_run:
            for line in mig.plan():
                print(line)
            mig.close()
            return 0
        result = mig.run(verify=not args.no_verify)
        print(f"migrated: {len(result.passes)} passes, drift 0"
              + (", verified" if result.checks else ", not verified (--no-verify)"))
        return 0
    except pymysql.err.MySQLError as exc:
        raise MigrationError(f"migration: {exc}") from None
    finally:
        store.close()
        router.close()


def cmd_ops_list(args: argparse.Namespace) -> int:
    from shardfleet import ops

    store = _zk_store(args)
    try:
        found = ops.journals(store) if args.all else {
            op.name: op.data for op in ops.in_flight(store)}
        flight = {op.name for op in ops.in_flight(store)}
    finally:
        store.close(timeout=2)
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    if not found:
        print("no operation in flight" if not args.all else "no journal")
        return 0
    rows = [("NAME", "KIND", "STEP", "IN FLIGHT", "UPDATED")]
    import time

    for name, d in found.items():
        age = time.time() - float(d.get("updated_at") or d.get("started_at") or 0)
        rows.append((name, str(d.get("kind") or d.get("mode") or "?"), str(d.get("step")),
                     "yes" if name in flight else "no", f"{age:.0f} s ago"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_ops_show(args: argparse.Namespace) -> int:
    from shardfleet import ops

    store = _zk_store(args)
    try:
        found = ops.journals(store)
    finally:
        store.close(timeout=2)
    if args.name not in found:
        raise ShardfleetError(f"no journal {args.name!r}; known: {', '.join(found) or 'none'}")
    print(json.dumps(found[args.name], indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shardfleet", description=__doc__)
    p.add_argument("--version", action="version", version=f"shardfleet {__version__}")
    p.add_argument("--schema", help="schema file (default: the library's own)")
    sub = p.add_subparsers(dest="group", required=True, parser_class=_Parser)

    g = sub.add_parser("id", help="decode and encode 64-bit object IDs")
    gs = g.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    d = gs.add_parser("decode", help="shard, type and local ID of IDs")
    d.add_argument("ids", nargs="+", metavar="ID")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=cmd_id_decode)
    e = gs.add_parser("encode", help="compose an ID from its parts")
    e.add_argument("--shard", type=int, required=True)
    e.add_argument("--type", required=True, help="type name (pin) or number (1)")
    e.add_argument("--local", type=int, required=True, help="local ID (>= 1)")
    e.set_defaults(func=cmd_id_encode)

    m = sub.add_parser("map", help="show and validate shard maps")
    ms = m.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    show = ms.add_parser("show", help="the map as a table (from ZooKeeper or a file)")
    _zk_args(show)
    show.add_argument("--file", help="read a map file instead of ZooKeeper")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_map_show)
    val = ms.add_parser("validate", help="validate a map file (- for stdin)")
    val.add_argument("file")
    val.add_argument("--known-host", action="append", metavar="HOST:PORT",
                     help="refuse servers not listed (repeatable)")
    val.set_defaults(func=cmd_map_validate)

    st = sub.add_parser("status", help="pairs, ranges, replication, read_only, semi-sync, "
                        "shards and ZooKeeper modes")
    _zk_args(st)
    st.add_argument("--user", default=os.environ.get("SHARDFLEET_MYSQL_USER", "shardfleet_admin"),
                    help="MySQL admin user (env SHARDFLEET_MYSQL_USER)")
    st.add_argument("--password-file", help="file holding the MySQL password "
                    "(or env SHARDFLEET_MYSQL_PASSWORD; never on the command line)")
    st.add_argument("--no-sizes", action="store_true", help="skip summing shard sizes")
    st.add_argument("--json", action="store_true")
    st.add_argument("--check", action="store_true", help="exit as a Nagios check: 0 when "
                    "the servers agree with the map, 1 on warnings, 2 on a critical problem")
    st.set_defaults(func=cmd_status)

    op = sub.add_parser("ops", help="operations in flight (split, promotion, rebuild) and "
                        "their journals")
    ops_sub = op.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    ol = ops_sub.add_parser("list", help="unfinished operations (--all: every journal)")
    _zk_args(ol)
    ol.add_argument("--all", action="store_true", help="finished journals too")
    ol.add_argument("--json", action="store_true")
    ol.set_defaults(func=cmd_ops_list)
    osh = ops_sub.add_parser("show", help="one operation's journal as JSON")
    _zk_args(osh)
    osh.add_argument("name", help="the journal name (split-16-31, promote-pair001, ...)")
    osh.set_defaults(func=cmd_ops_show)

    mg = sub.add_parser(
        "migrate", help="copy a legacy database into the fleet until the drift is zero",
        description="Copy a legacy single database (users, boards, pins, likes, follows) into "
        "the fleet, repeat passes until one finds nothing new, then verify counts and "
        "checksums per type. Passwords come from the environment: "
        "SHARDFLEET_LEGACY_PASSWORD, SHARDFLEET_APP_USER / SHARDFLEET_APP_PASSWORD.")
    mg.add_argument("--legacy", default=os.environ.get("SHARDFLEET_LEGACY", "127.0.0.1:3306"),
                    metavar="HOST:PORT", help="the legacy server (env SHARDFLEET_LEGACY)")
    mg.add_argument("--legacy-db", default="legacy", help="the legacy database (legacy)")
    mg.add_argument("--legacy-user", default=os.environ.get("SHARDFLEET_LEGACY_USER", "root"))
    mg.add_argument("--state-db", default="shardfleet_migration",
                    help="the migration's own database on the legacy server")
    mg.add_argument("--source", help="legacy_src tag in copied bodies (default: --legacy-db)")
    _zk_args(mg)
    mg.add_argument("--memcached", action="append", metavar="HOST:PORT",
                    help="object cache servers to keep right while copying (repeatable)")
    mg.add_argument("--redis", metavar="URL", help="mapping cache to keep right while copying")
    mg.add_argument("--max-passes", type=int, default=20)
    mg.add_argument("--batch", type=int, default=1000, help="rows per chunk (1000)")
    mg.add_argument("--seed", type=int, help="placement seed (reproducible runs)")
    mg.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                    help="auto: a bar on a terminal, plain lines otherwise")
    mg.add_argument("--no-verify", action="store_true", help="skip the final verification")
    mg.add_argument("--dry-run", action="store_true", help="show the plan, copy nothing")
    mg.set_defaults(func=cmd_migrate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args))
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    except ShardfleetError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
