"""One operation in its own process, for the fault campaign to SIGKILL at any instant.

    python tests/faults/op.py '<json>'

The JSON names the operation and its arguments:

* ``split``: ``Split.run("all")``, what playbooks/split.yml runs;
* ``promote``: ``promote.promote`` (planned or emergency), what playbooks/promote.yml runs;
* ``rebuild``: ``promote.rebuild_standby``, what playbooks/rebuild-standby.yml runs:
  a logical copy, or with ``"copy": "physical"`` the playbook's three parts
  (:func:`rebuild_physical`: the library fences the node and names the copy, the copy is
  streamed, prepared and installed with the node stopped and started again, the library
  re-attaches it at the copy's position); ``servers`` are the pair's
  ``MariaDBServer.handle()``s, so this process can stop and start the node;
* ``open_range``: what playbooks/open-range.yml runs: the range's shard databases on the
  pair's master (``provision.ensure_shards``), the master writable, the range registered
  open (``mapstore.change_ranges``, the ``shard_map`` module's call);
* ``backup``: what backup.yml runs for a pair (:func:`backup_node`): the map read from
  ZooKeeper (the control node's read: its rebuild marks refuse a marked standby), then
  ``shardfleet.backup.backup`` of ``server`` (a ``MariaDBServer.handle()``) into moto's
  S3 (``s3``: url, bucket, cluster, pair) under the campaign's ``backup_id``;
* ``restore``: ``shardfleet.backup.restore`` of the pair's newest complete backup into a
  scratch server (``server``), verified (the manifest's checksums).

``die_after``: the name of a ``Split`` method after which the process SIGKILLs itself
(a named schedule). ``redirect``: ``{"host:port": "host:port"}``, the process's MySQL
connections to the first go to the second (a proxy the nemesis can partition: the
control node cut off from one server while the routers still reach it). The process
prints ``SESSION <id> <password>`` (hex) and ``READY`` once its ZooKeeper session is up
(the nemesis times its fault from there; ``session_expiry`` ends that session),
``FINISHED <monotonic> <session id>`` when the operation returned or raised (before its
store is closed), then ``RESULT ok <summary>`` or ``RESULT error <type>: <message>``
(exit 3).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def die_after(cls: type, name: str) -> None:
    """SIGKILL this process right after ``cls.name`` returns the first time (a named
    schedule: the instant a seed found, replayed exactly)."""
    real = getattr(cls, name)

    def dying(self: object, *a: object, **kw: object) -> object:
        out = real(self, *a, **kw)
        print(f"DYING after {name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(cls, name, dying)


def redirect(routes: dict[str, str]) -> None:
    """Every library connection (``topology.connect``) to a key of *routes* goes to its
    value instead."""
    from shardfleet import topology

    real = topology.connect

    def connect(server: str, *a: Any, **kw: Any) -> Any:
        return real(routes.get(server, server), *a, **kw)

    topology.connect = connect  # type: ignore[assignment]


def open_range(store: Any, spec: dict[str, Any]) -> str:
    from shardfleet import mapstore, provision, replication, topology
    from shardfleet.schema import default_schema

    first, last = spec["range"]
    conn = topology.connect(spec["master"], "root", spec["password"], timeout=2.0,
                            read_timeout=30.0, client_flag=provision.multi_statement_flags())
    try:
        plan, _ = provision.ensure_shards(conn, list(range(first, last + 1)), default_schema(),
                                          app_user=spec["app_user"])
        replication.set_read_only(conn, False)
    finally:
        conn.close()
    done = mapstore.change_ranges(store, "present", [
        {"range": [first, last], "master": spec["master"], "standby": spec["standby"],
         "state": "open"}])
    return (f"shards created={len(plan.databases)} tables={len(plan.tables)}; "
            f"map changed={done.changed} version={done.version}")


def stream_copy(source: Any, dest: str, *, timeout: float = 120.0) -> None:
    """mariadb-backup of *source* streamed to a receiver extracting into *dest* (what
    shard_copy mode=send and mode=receive do on the two hosts)."""
    import tempfile
    import threading

    from shardfleet import physical

    secret = os.urandom(16).hex()
    rx = physical.Receiver(secret, bind="127.0.0.1")
    got: dict[str, Any] = {}

    def receive() -> None:
        try:
            got["r"] = rx.receive(dest, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - raised below
            got["r"] = exc

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        with tempfile.TemporaryDirectory(prefix="sf-copy-") as tmp:
            cnf = physical.client_defaults(tmp, "root", source.root_password)
            argv = physical.backup_argv(defaults_file=cnf, datadir=str(source.datadir),
                                        socket_path=str(source.socket), parallel=2)
            physical.send(f"127.0.0.1:{rx.port}", secret, argv, connect_timeout=10,
                          reply_timeout=timeout)
    finally:
        t.join(timeout + 30)
        rx.close()
    if isinstance(got.get("r"), Exception):
        raise got["r"]


def die_in_install(n: int) -> None:
    """SIGKILL this process after the *n*-th entry ``physical.install`` moved (a named
    schedule: the node stopped, its data directory half swapped)."""
    from shardfleet import physical

    real = physical.shutil.move
    moved = [0]

    def move(src: str, dst: str) -> Any:
        out = real(src, dst)
        moved[0] += 1
        if moved[0] == n:
            print(f"DYING after moving {moved[0]} entries into place", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    physical.shutil.move = move  # type: ignore[assignment]


def rebuild_physical(store: Any, pair: str, nodes: list[str], opts: dict[str, Any],
                     servers: list[dict[str, Any]]) -> str:
    """playbooks/rebuild-standby.yml with a physical copy, in one process: the library's
    first call (fence, name the copy), the copy node to node (receive, prepare, install:
    the node stopped, its data directory swapped, started), the second call with the
    copy's position. Returns a summary; raises what the library raises."""
    import shutil

    from shardfleet import physical, promote
    from shardfleet.testing import MariaDBServer

    handles = {f"127.0.0.1:{h['port']}": MariaDBServer.attach(h) for h in servers}
    first = promote.rebuild_standby(store, pair, nodes,
                                    opts=promote.Options(**{**opts, "copy": "physical"}))
    if not first.copy:
        return f"changed={first.changed} steps={','.join(first.steps)} (no copy)"
    src, dst = handles[first.copy["source"]], handles[first.copy["target"]]
    incoming = str(dst.datadir) + ".incoming"
    with physical.copy_lock(str(dst.datadir)) as mark:  # shard_copy mode=receive holds it
        mark("receiving")  # so (its sender is this process: it never waits for one)
        shutil.rmtree(incoming, ignore_errors=True)  # a copy that never completed
        stream_copy(src, incoming)
        physical.prepare(incoming)
        pos = physical.position(incoming)
        physical.install(incoming, str(dst.datadir), stop=dst.stop, start=dst.start)
    second = promote.rebuild_standby(store, pair, nodes, opts=promote.Options(
        **{**opts, "copy": "physical", "copy_position": pos,
           "copy_id": first.copy.get("copy_id", "")}))
    return (f"copied {first.copy['source']} -> {first.copy['target']} at {pos}; "
            f"changed={second.changed} steps={','.join(second.steps)}")


def s3_of(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The S3 client and the pair's backup location the spec names (moto's server)."""
    from shardfleet import backup

    s3 = backup.s3_client(endpoint_url=spec["s3"]["url"], region="us-east-1",
                          access_key="testing", secret_key="testing")
    loc = backup.Location(spec["s3"]["bucket"], spec["s3"]["cluster"], spec["s3"]["pair"])
    return s3, loc


def backup_node(store: Any, spec: dict[str, Any]) -> str:
    """backup.yml for one pair: the map as the control node reads it, then the backup of
    the node (passing the map store too when the library's backup takes one: a backup on
    the operation runner locks the node it copies)."""
    import inspect
    import tempfile

    from shardfleet import backup, physical
    from shardfleet.testing import MariaDBServer

    s3, loc = s3_of(spec)
    node = MariaDBServer.attach(spec["server"])
    kw: dict[str, Any] = {"shard_map": store.read().map, "part_size": 5 << 20,
                          "backup_id": spec["backup_id"]}
    params = inspect.signature(backup.backup).parameters
    if "store" in params:
        kw["store"] = store
    if spec.get("unlocked"):  # the checker's own test: no lock, no map (its marks)
        kw.pop("store", None)
        kw["shard_map"] = None
    if "lock_timeout" in params and spec.get("lock_timeout") is not None:
        kw["lock_timeout"] = float(spec["lock_timeout"])
    with tempfile.TemporaryDirectory(prefix="sf-backup-") as tmp:
        cnf = physical.client_defaults(tmp, "root", MariaDBServer.root_password)
        argv = physical.backup_argv(defaults_file=cnf, datadir=str(node.datadir),
                                    socket_path=str(node.socket), parallel=2)
        m = backup.backup(s3, loc, argv, connect=node.connect, node=node.address, **kw)
    return (f"backup {m['backup_id']} of {m['node']} at {m['position']['gtid']} "
            f"checksums_at_position={m['checksums_at_position']}")


def restore_newest(store: Any, spec: dict[str, Any]) -> str:
    """The pair's newest complete backup restored into the scratch server, verified."""
    import inspect

    from shardfleet import backup
    from shardfleet.testing import MariaDBServer

    s3, loc = s3_of(spec)
    node = MariaDBServer.attach(spec["server"])
    kw: dict[str, Any] = {}
    if "store" in inspect.signature(backup.restore).parameters:
        kw = {"store": store, "node": node.address}  # on the runner: the target's lock
        if spec.get("lock_timeout") is not None:
            kw["lock_timeout"] = float(spec["lock_timeout"])
    r = backup.restore(s3, loc, datadir=str(node.datadir), stop=node.stop, start=node.start,
                       connect=node.connect, verify=True, **kw)
    return (f"restored {r.backup_id} at {r.position} verified={r.checksums_verified} "
            f"note={r.note!r}")


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("redirect"):
        redirect(spec["redirect"])
    from shardfleet import promote
    from shardfleet.mapstore import ZooKeeperMapStore
    from shardfleet.split import Credentials, Split, SplitSpec

    store = ZooKeeperMapStore(spec["zk"], spec["cluster"], timeout=float(spec.get("zk_timeout",
                                                                                  5.0)))
    store.read()  # the session is up
    # the session's id and password, for the nemesis's session_expiry (a second client
    # started with them, then closed, ends it: the locks this run takes go with it)
    sid, password = store.client.client_id
    print(f"SESSION {sid:x} {password.hex()}", flush=True)
    print("READY", time.monotonic(), flush=True)
    try:
        if spec["op"] == "split":
            if spec.get("die_after"):
                die_after(Split, spec["die_after"])
            creds = Credentials(*spec["creds"])
            with Split(store, SplitSpec(spec["source"], spec["target"], spec["standby"]),
                       creds, lock_timeout=float(spec.get("lock_timeout", 20.0))) as sp:
                res = sp.run("all")
            summary = ", ".join(f"{r.step}{'*' if r.changed else ''}" for r in res)
        elif spec["op"] == "promote":
            opts = promote.Options(**spec["opts"])
            r = promote.promote(store, spec["pair"], spec["nodes"], mode=spec["mode"],
                                expect_master=spec.get("expect_master"), opts=opts)
            summary = f"changed={r.changed} resumed={r.resumed} steps={','.join(r.steps)}"
        elif spec["op"] == "rebuild" and spec.get("copy") == "physical":
            if spec.get("die_in_install"):
                die_in_install(int(spec["die_in_install"]))
            summary = rebuild_physical(store, spec["pair"], spec["nodes"], spec["opts"],
                                       spec["servers"])
        elif spec["op"] == "rebuild":
            r = promote.rebuild_standby(store, spec["pair"], spec["nodes"],
                                        opts=promote.Options(**spec["opts"]))
            summary = f"changed={r.changed} steps={','.join(r.steps)}"
        elif spec["op"] == "open_range":
            summary = open_range(store, spec)
        elif spec["op"] == "backup":
            summary = backup_node(store, spec)
        elif spec["op"] == "restore":
            summary = restore_newest(store, spec)
        else:
            raise ValueError(f"unknown operation {spec['op']!r}")
    except Exception as exc:  # noqa: BLE001 - reported to the campaign, which judges it
        print(f"RESULT error {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
        return 3
    finally:
        # when the operation's work ended, and in which ZooKeeper session (another than
        # SESSION's: the first expired and the client made a new one)
        now = store.session()
        print(f"FINISHED {time.monotonic()} {now and format(now, 'x')}", flush=True)
        store.close()
    print(f"RESULT ok {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
