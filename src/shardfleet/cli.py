"""The ``shardfleet`` command.

Errors are one line on stderr: exit code 2 for a usage error (bad arguments, a bad ID or
name, a map file that is not a valid map), 1 for a runtime error (ZooKeeper or a server
unreachable, a file unreadable, a shard no range holds). ``status --check`` exits as a
Nagios check instead (0 ok, 1 warning, 2 critical). Credentials never go on the command
line: ``SHARDFLEET_ZK_USER`` / ``SHARDFLEET_ZK_PASSWORD`` for ZooKeeper,
``SHARDFLEET_MYSQL_USER`` / ``SHARDFLEET_MYSQL_PASSWORD`` (or ``--password-file``) for
MySQL. The commands that log in to the fleet's MySQL servers take the client TLS options
(``--ca-cert``, ``--client-cert``, ``--client-key``, ``--check-hostname``; environment
``SHARDFLEET_MYSQL_CA_CERT`` ... as :func:`_tls_args` says); TLS is off unless given."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardfleet import __version__, ids, shardmap
from shardfleet.errors import InvalidInputError, SchemaError, ShardfleetError
from shardfleet.schema import Schema, load_schema

EXIT_USAGE = 2
EXIT_RUNTIME = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2, no usage dump
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"shardfleet: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _schema(args: argparse.Namespace) -> Schema:
    return load_schema(args.schema)


def _decoded(schema: Schema, text: str) -> dict[str, Any]:
    """An ID typed by a person, decoded; an unknown type is refused (the ID cannot be one
    the fleet made)."""
    value = ids.parse(text)
    oid = ids.decompose(value)
    try:
        type_name = schema.object_type(oid.type).name
    except SchemaError:
        known = ", ".join(f"{t.name} ({t.type})" for t in schema.objects)
        raise InvalidInputError(f"ID {value} has type {oid.type}, which the schema does not "
                                f"know (known: {known})") from None
    return {"id": value, "shard": oid.shard, "type": oid.type, "type_name": type_name,
            "local_id": oid.local}


def cmd_id_decode(args: argparse.Namespace) -> int:
    schema = _schema(args)
    out = [_decoded(schema, text) for text in args.ids]
    if args.json:
        print(json.dumps(out))  # a list for one ID as for many
    else:
        for o in out:
            print(f"{o['id']}: shard {o['shard']}, type {o['type_name']} ({o['type']}), "
                  f"local ID {o['local_id']}")
    return 0


def cmd_id_encode(args: argparse.Namespace) -> int:
    schema = _schema(args)
    t = args.type
    type_num = schema.object_type(int(t) if t.isdigit() else t).type
    print(ids.compose(args.shard, type_num, args.local))
    return 0


class _Unreadable(ShardfleetError):
    """A file the command was given cannot be read (a runtime error)."""


def _read_map_file(path: str) -> shardmap.ShardMap:
    try:
        text = Path(path).read_bytes() if path != "-" else sys.stdin.buffer.read()
    except OSError as exc:
        raise _Unreadable(f"cannot read {path}: {exc.strerror}") from None
    try:
        return shardmap.loads(text)
    except shardmap.MapError as exc:
        raise InvalidInputError(f"{path}: {exc}") from None


def _map_from(args: argparse.Namespace, where: str) -> tuple[shardmap.ShardMap, str]:
    """The map *where* names: ``zk`` (ZooKeeper, per --zk/--cluster), else a file (``-``:
    stdin); and a description of where it came from."""
    if where != "zk":
        return _read_map_file(where), where
    m, version, path = _zk_map(args)
    return m, f"ZooKeeper {args.zk} {path} (version {version})"


def _zk_map(args: argparse.Namespace) -> tuple[shardmap.ShardMap, int, str]:
    """The map in ZooKeeper (per --zk/--cluster/--root), its version and its znode's path;
    no map there is an error."""
    store = _zk_store(args)
    try:
        v = store.read()
    finally:
        store.close(timeout=2)
    if v.map is None:
        raise ShardfleetError(f"no map at {store.path} on {args.zk}")
    return v.map, v.version, store.path


def _zk_store(args: argparse.Namespace) -> Any:
    from shardfleet.mapstore import ZooKeeperMapStore

    auth = None
    if os.environ.get("SHARDFLEET_ZK_USER"):
        auth = (os.environ["SHARDFLEET_ZK_USER"], os.environ.get("SHARDFLEET_ZK_PASSWORD", ""))
    return ZooKeeperMapStore(args.zk, args.cluster, root=args.root, auth=auth,
                             timeout=args.timeout)


def cmd_map_show(args: argparse.Namespace) -> int:
    version: int | None = None
    if args.file:
        m = _read_map_file(args.file)
    else:
        m, version, _ = _zk_map(args)
    if args.json:
        print(m.dumps())
    else:
        if version is not None:
            print(f"map version {version}, mod shard count {m.mod_shard_count}")
        print(m.table())
    return 0


def _holes(m: shardmap.ShardMap, first: int, last: int) -> list[tuple[int, int]]:
    """Runs of shards in first..last that no range holds."""
    out, at = [], first
    for r in m.ranges:
        if r.last < at:
            continue
        if r.first > last:
            break
        if r.first > at:
            out.append((at, r.first - 1))
        at = max(at, r.last + 1)
    if at <= last:
        out.append((at, last))
    return out


def _runs(holes: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in holes)


def cmd_map_validate(args: argparse.Namespace) -> int:
    known = args.known_host or None
    m = _read_map_file(args.file)
    if known:
        try:
            shardmap.ShardMap.from_ranges(m.ranges, m.mod_shard_count, known)
        except shardmap.MapError as exc:
            raise InvalidInputError(f"{args.file}: {exc}") from None
    # every shard below the mod shard count holds mod-sharded keys: a hole there loses them
    inside = _holes(m, 0, m.mod_shard_count - 1)
    if inside:
        raise InvalidInputError(
            f"{args.file}: shards {_runs(inside)} are in no range, but every shard below the "
            f"mod shard count ({m.mod_shard_count}) must be: mod-sharded keys go there")
    top = max(r.last for r in m.ranges)
    outside = _holes(m, m.mod_shard_count, top)
    if outside:
        print(f"warning: shards {_runs(outside)} are in no range (IDs on them cannot be "
              "routed)", file=sys.stderr)
    covered = sum(r.size for r in m.ranges)
    print(f"{args.file}: valid, {len(m.ranges)} ranges, {covered} shards, "
          f"{len(m.servers())} servers")
    return 0


def cmd_map_diff(args: argparse.Namespace) -> int:
    """Like diff(1): 0 when the maps are the same, 1 when they differ."""
    a, where_a = _map_from(args, args.a)
    b, where_b = _map_from(args, args.b)
    changes = shardmap.diff(a, b)
    if not changes:
        print(f"same map: {where_a} and {where_b}")
        return 0
    print(f"--- {where_a}\n+++ {where_b}")
    for line in changes:
        print(line)
    return 1


def cmd_locate(args: argparse.Namespace) -> int:
    """Shard -> range -> pair: where an object or a shard lives, from the map."""
    what = args.what.strip()
    if not what.isascii() or not what.isdigit():
        raise InvalidInputError(f"{what!r} is neither an object ID nor a shard number "
                                "(ASCII digits only)")
    decoded = None
    if args.shard or int(what) <= ids.MAX_SHARD:
        shard = int(what)
        if shard > ids.MAX_SHARD:
            raise InvalidInputError(f"shard {shard} is beyond the largest, {ids.MAX_SHARD}")
    else:
        decoded = _decoded(_schema(args), what)
        shard = decoded["shard"]
    m, where = _map_from(args, args.file or "zk")
    r = m.find(shard)
    out: dict[str, Any] = {"shard": shard, "database": f"db{shard:05d}", "object": decoded,
                           "map": where, "range": None}
    if r is not None:
        out["range"] = {"range": [r.first, r.last], "state": r.state, "master": r.master,
                        "standby": r.standby, **{k: v for k, v in r.extra.items()}}
    if args.json:
        print(json.dumps(out))
    else:
        head = (f"ID {decoded['id']} ({decoded['type_name']}, local ID {decoded['local_id']}) "
                f"is on shard {shard}" if decoded else f"shard {shard}")
        if r is None:
            print(f"{head} (database {out['database']}): in no range of {where}")
        else:
            extra = "".join(f", {k} {v}" for k, v in sorted(r.extra.items()))
            print(f"{head} (database {out['database']}): range {r.first}-{r.last} "
                  f"{r.state}{extra}; master {r.master}, standby {r.standby or 'none'} "
                  f"({where})")
    if r is None:
        raise ShardfleetError(f"shard {shard} is in no range of {where}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    password = _mysql_password(args)
    tls = _tls(args)
    if args.count < 0 or (args.count and args.watch is None):
        raise InvalidInputError("--count takes a number of reports (0 or more), with --watch")
    if args.watch is None:
        return _status_once(args, password, tls, watching=False)
    # --watch: a report every WATCH seconds until Ctrl-C (or --count reports); a round
    # with ZooKeeper unreachable is a report too, and the next round tries again
    tty = sys.stdout.isatty()
    rounds, rc = 0, 0
    try:
        while True:
            started = time.monotonic()
            if tty:
                print("\033[H\033[2J", end="")  # the terminal's clear, as watch(1) does
            if not args.json:  # --json: one JSON document a round, nothing between them
                print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} every {args.watch:g}s "
                      f"(Ctrl-C stops)")
            rc = _status_once(args, password, tls, watching=True)
            sys.stdout.flush()
            rounds += 1
            if args.count and rounds >= args.count:
                return rc
            time.sleep(max(0.0, args.watch - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return rc  # the last report's answer


def _status_once(args: argparse.Namespace, password: str, tls: Any, *, watching: bool) -> int:
    from shardfleet import status

    store = _zk_store(args)
    try:
        if not store.connected:
            if args.check or watching:  # a check's (or a round's) answer, not a failure
                text = f"ZooKeeper at {args.zk} is unreachable: the map cannot be read"
                print(json.dumps({"problems": [{"severity": "critical", "text": text}]},
                                 indent=2) if args.json else f"CRITICAL {text}")
                return 2
            raise ShardfleetError(f"ZooKeeper at {args.zk} is unreachable")
        report = status.collect(store, args.user, password, sizes=not args.no_sizes,
                                zookeeper_hosts=[args.zk], tls=tls)
    finally:
        store.close(timeout=2)
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    if args.check or watching:
        sev = {p["severity"] for p in report["problems"]}
        return 2 if status.CRITICAL in sev else 1 if status.WARNING in sev else 0
    return 0


def _mysql_password(args: argparse.Namespace) -> str:
    password = os.environ.get("SHARDFLEET_MYSQL_PASSWORD", "")
    if getattr(args, "password_file", None):
        try:
            password = Path(args.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise _Unreadable(f"cannot read {args.password_file}: {exc.strerror}") from None
    return password


def cmd_exporter(args: argparse.Namespace) -> int:
    """Serve the fleet's metrics (shardfleet.metrics) until interrupted."""
    from shardfleet import metrics, status

    password = _mysql_password(args)
    tls = _tls(args)
    host, _, port = args.listen.rpartition(":")
    store = _zk_store(args)
    servers = [s for s in (args.server or []) if s]
    exporter = metrics.FleetExporter(
        lambda: status.collect(store, args.user, password, extra_servers=servers,
                               sizes=False, zookeeper_hosts=[args.zk], timeout=args.timeout,
                               tls=tls),
        store.changed_at, interval=args.interval,
        memcached=[m.strip() for ms in (args.memcached or []) for m in ms.split(",")
                   if m.strip()])
    try:
        httpd = metrics.serve(exporter, host or "127.0.0.1", int(port))
    except OSError as exc:
        store.close(timeout=2)
        raise _Unreadable(f"cannot listen on {args.listen}: {exc.strerror}") from None
    print(f"shardfleet exporter on http://{args.listen}/metrics (ZooKeeper {args.zk})",
          flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        store.close(timeout=2)
    return 0


_TLS_ENV = {"ca_cert": "SHARDFLEET_MYSQL_CA_CERT", "client_cert": "SHARDFLEET_MYSQL_CLIENT_CERT",
            "client_key": "SHARDFLEET_MYSQL_CLIENT_KEY",
            "check_hostname": "SHARDFLEET_MYSQL_CHECK_HOSTNAME"}


def _tls_args(p: argparse.ArgumentParser) -> None:
    """The MySQL client TLS options (community.mysql's names; shardfleet.tls), each with
    its environment variable as the default."""
    g = p.add_argument_group("MySQL TLS (off unless one is given; a production fleet gives "
                             "--ca-cert and keeps the name checked)")
    g.add_argument("--ca-cert", default=os.environ.get(_TLS_ENV["ca_cert"]) or None,
                   metavar="FILE", help="CA certificate(s) that verify the servers' "
                   f"(env {_TLS_ENV['ca_cert']})")
    g.add_argument("--client-cert", default=os.environ.get(_TLS_ENV["client_cert"]) or None,
                   metavar="FILE", help="client certificate, for a user created REQUIRE "
                   f"X509 (env {_TLS_ENV['client_cert']})")
    g.add_argument("--client-key", default=os.environ.get(_TLS_ENV["client_key"]) or None,
                   metavar="FILE", help=f"its key (env {_TLS_ENV['client_key']})")
    g.add_argument("--check-hostname", action=argparse.BooleanOptionalAction, default=None,
                   help="verify that the server's certificate names the address connected "
                   "to (default: on when --ca-cert is given; env "
                   f"{_TLS_ENV['check_hostname']}=true|false)")


def _tls(args: argparse.Namespace) -> Any:
    """The TLS options of *args* (checked: a missing or bad file is a usage error)."""
    from shardfleet.tls import TLS

    check = args.check_hostname
    env = os.environ.get(_TLS_ENV["check_hostname"], "").strip().lower()
    if check is None and env:
        if env not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise InvalidInputError(f"{_TLS_ENV['check_hostname']}={env!r}: say true or false")
        check = env in ("1", "true", "yes", "on")
    tls = TLS(ca_cert=args.ca_cert, client_cert=args.client_cert, client_key=args.client_key,
              check_hostname=check)
    if tls.enabled:
        tls.context  # noqa: B018 - refuses an unreadable or bad certificate file now
    return tls


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return seconds


def _zk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zk", default=os.environ.get("SHARDFLEET_ZK", "127.0.0.1:2181"),
                   help="ZooKeeper hosts (env SHARDFLEET_ZK; SHARDFLEET_ZK_USER and "
                   "SHARDFLEET_ZK_PASSWORD for digest auth)")
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
                    password=os.environ.get("SHARDFLEET_APP_PASSWORD", ""), tls=_tls(args))
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
        rows.append((name, str(d.get("kind") or d.get("mode") or "?"), _step_text(d),
                     "yes" if name in flight else "no", f"{age:.0f} s ago"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _step_text(d: dict[str, Any]) -> str:
    """A journal's last step, with the clone's progress while a split clones."""
    step, p = str(d.get("step")), d.get("clone_progress")
    if step != "started" or not isinstance(p, dict):
        return step
    eta = p.get("eta_seconds")
    if "bytes_done" in p or p.get("phase") == "copying":  # a physical clone's copy
        return (f"{step} (physical copy {p.get('copy_id')}: {p.get('phase')}, "
                f"{_mib(p.get('bytes_done'))} of ~{_mib(p.get('bytes_estimated'))} MiB, "
                f"{_mib(p.get('bytes_per_second'))} MiB/s, ETA "
                f"{'?' if eta is None else eta} s)")
    return (f"{step} (clone: {p.get('databases_done')}/{p.get('databases')} databases, "
            f"{p.get('rows_done')} of ~{p.get('rows_estimated')} rows, "
            f"{p.get('rows_per_second')} rows/s, ETA {'?' if eta is None else eta} s)")


def _mib(n: Any) -> str:
    return "?" if n is None else f"{int(n) / 2**20:.0f}"


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
    dif = ms.add_parser("diff", help="what changed between two maps (files, - for stdin, or "
                        "zk for ZooKeeper's); exit 0 when the same, 1 when they differ")
    _zk_args(dif)
    dif.add_argument("a", metavar="A")
    dif.add_argument("b", metavar="B")
    dif.set_defaults(func=cmd_map_diff)

    loc = sub.add_parser("locate", help="where an object ID or a shard lives: shard, range, "
                         "state, master and standby (from ZooKeeper, or --file)",
                         description="A number up to 65535 is a shard (an object ID is "
                         "always larger); --shard says so explicitly.")
    _zk_args(loc)
    loc.add_argument("what", metavar="ID|SHARD")
    loc.add_argument("--shard", action="store_true", help="WHAT is a shard number")
    loc.add_argument("--file", help="read a map file instead of ZooKeeper")
    loc.add_argument("--json", action="store_true")
    loc.set_defaults(func=cmd_locate)

    st = sub.add_parser("status", help="pairs, ranges, replication, read_only, semi-sync, "
                        "shards and ZooKeeper modes")
    _zk_args(st)
    st.add_argument("--user", default=os.environ.get("SHARDFLEET_MYSQL_USER", "shardfleet_admin"),
                    help="MySQL admin user (env SHARDFLEET_MYSQL_USER)")
    st.add_argument("--password-file", help="file holding the MySQL password "
                    "(or env SHARDFLEET_MYSQL_PASSWORD; never on the command line)")
    _tls_args(st)
    st.add_argument("--no-sizes", action="store_true", help="skip summing shard sizes")
    st.add_argument("--json", action="store_true")
    st.add_argument("--check", action="store_true", help="exit as a Nagios check: 0 when "
                    "the servers agree with the map, 1 on warnings, 2 on a critical problem")
    st.add_argument("--watch", type=_positive_seconds, metavar="SECONDS",
                    help="print the report again every SECONDS until Ctrl-C (the exit "
                    "code, as --check's, is the last report's)")
    st.add_argument("--count", type=int, default=0, metavar="N",
                    help="with --watch: stop after N reports")
    st.set_defaults(func=cmd_status)

    ex = sub.add_parser("exporter", help="serve the fleet's Prometheus metrics (map, ranges, "
                        "operations, each server's role, replication, lag, semi-sync)")
    _zk_args(ex)
    ex.add_argument("--listen", default="127.0.0.1:9150", metavar="HOST:PORT",
                    help="where to serve /metrics (127.0.0.1:9150)")
    ex.add_argument("--user", default=os.environ.get("SHARDFLEET_MYSQL_USER", "shardfleet_monitor"),
                    help="MySQL monitor user (env SHARDFLEET_MYSQL_USER)")
    ex.add_argument("--password-file", help="file holding its password "
                    "(or env SHARDFLEET_MYSQL_PASSWORD)")
    _tls_args(ex)
    ex.add_argument("--server", action="append", metavar="HOST:PORT",
                    help="a server to report besides the map's (repeatable)")
    ex.add_argument("--memcached", action="append", metavar="HOST:PORT[,...]",
                    default=[os.environ["SHARDFLEET_MEMCACHED"]]
                    if os.environ.get("SHARDFLEET_MEMCACHED") else None,
                    help="memcached servers to serve `stats` of (repeatable or comma-separated; "
                    "env SHARDFLEET_MEMCACHED)")
    ex.add_argument("--interval", type=float, default=10.0,
                    help="ask the servers at most this often (seconds; scrapes in between "
                    "get the last answer)")
    ex.set_defaults(func=cmd_exporter)

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
    _tls_args(mg)  # the fleet's servers (the legacy server's connection stays plain)
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
    # the command speaks in one line per error: kazoo's connection chatter and the
    # library's warnings go nowhere unless SHARDFLEET_DEBUG is set
    if not os.environ.get("SHARDFLEET_DEBUG"):
        for name in ("", "kazoo"):
            logging.getLogger(name).addHandler(logging.NullHandler())
    else:
        logging.basicConfig(level=logging.DEBUG)
    try:
        args = parser.parse_args(argv)
        return int(args.func(args))
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    except (InvalidInputError, SchemaError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except ShardfleetError as exc:
        return _fail(str(exc), EXIT_RUNTIME)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_RUNTIME)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
