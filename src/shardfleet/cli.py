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
            raise ShardfleetError(f"ZooKeeper at {args.zk} is unreachable")
        report = status.collect(store, args.user, password, sizes=not args.no_sizes,
                                zookeeper_hosts=[args.zk])
    finally:
        store.close(timeout=2)
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    return 0


def _zk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zk", default=os.environ.get("SHARDFLEET_ZK", "127.0.0.1:2181"),
                   help="ZooKeeper hosts (env SHARDFLEET_ZK)")
    p.add_argument("--root", default=os.environ.get("SHARDFLEET_ZK_ROOT", "/shardfleet"))
    p.add_argument("--cluster", default=os.environ.get("SHARDFLEET_CLUSTER", "default"))
    p.add_argument("--timeout", type=float, default=5.0)


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
    st.set_defaults(func=cmd_status)
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
