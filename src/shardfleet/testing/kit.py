"""The test kit the integration, e2e and fault tests and the benchmarks share.

* :class:`Writer` — a bounded writer through the routing library (several threads,
  creates and read-modify-write updates, through one store or several) whose
  :class:`WriterLog` holds every acknowledged write (``acked``: the last acknowledged
  version per object) and every errored one (``uncertain``: an update that failed may
  or may not have happened; ``errors``: creates that failed may have left a row), and
  the history of every operation, invoked and completed ``ok`` or ``info``
  (:mod:`shardfleet.testing.history`, for the fault campaign's checker);
* :func:`check_writes` — the checker over that log and the servers: nothing
  acknowledged lost or stale, no row nobody acknowledged beyond the errored creates,
  no write accepted by a server the map no longer names;
* :func:`pair_up` / :func:`wait_pair_synced` — wiring two MariaDB servers
  master-master with GTID as the ``mysql`` role does, and waiting for a position;
* :class:`SplitFleet` — a source server and a target pair with a fresh map, for the
  split's tests and ``bench/split_cutover.py``; :func:`physical_copy` — the copy a
  physical clone names, made as ``split.yml`` has ``shard_copy`` make it.
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql

from shardfleet import ids, physical, provision
from shardfleet.mapstore import NO_NODE, ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.schema import default_schema, shard_database
from shardfleet.shardmap import ShardMap
from shardfleet.split import Credentials, Split, SplitSpec
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer
from shardfleet.testing.history import History

APP_USER, APP_PASSWORD = "sf_app", "sf-app-test"
REPL_USER, REPL_PASSWORD = "sf_repl", "sf-repl-test"
SOURCE_RANGE = (0, 31)
PIN = 1


def _sql(server: MariaDBServer, statement: str, params: Any = None) -> list[Any]:
    return server.sql(statement, params)


def make_server(base: Path, server_id: int, side: str = "a",
                extra: list[str] | None = None) -> MariaDBServer:
    """A MariaDB server for one side of a pair, with the application and replication users;
    *extra*: more server options (semi-sync, read_only at boot, ...)."""
    s = MariaDBServer(base, server_id=server_id, extra=[
        "--innodb-file-per-table=0", "--auto-increment-increment=2",
        f"--auto-increment-offset={1 if side == 'a' else 2}", *(extra or [])]).start()
    for user, pw in ((APP_USER, APP_PASSWORD), (REPL_USER, REPL_PASSWORD)):
        _sql(s, f"CREATE USER IF NOT EXISTS '{user}'@'%%' IDENTIFIED BY %s", (pw,))
    _sql(s, f"GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO '{REPL_USER}'@'%'")
    return s


def start_all(starters: list[Callable[[], MariaDBServer]],
              setup: Callable[..., Any] | None = None) -> list[MariaDBServer]:
    """Start a server per *starter*, then run *setup(*servers)*; when any of it fails, the
    servers already started are stopped and removed (a fixture's failed setup never
    reaches its teardown)."""
    servers: list[MariaDBServer] = []
    try:
        for start in starters:
            servers.append(start())
        if setup is not None:
            setup(*servers)
    except BaseException:
        for s in servers:
            s.stop(remove=True)
        raise
    return servers


def pair_up(a: MariaDBServer, b: MariaDBServer, connect_retry: int | None = None) -> None:
    """Wire a and b master-master with GTID, like the mysql role does (*connect_retry*:
    seconds between a replica's reconnection attempts; the server's default when None)."""
    retry = "" if connect_retry is None else f", MASTER_CONNECT_RETRY={int(connect_retry)}"
    for me, peer in ((a, b), (b, a)):
        pos = _sql(peer, "SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
        _sql(me, "SET GLOBAL gtid_slave_pos = %s", (pos,))
        _sql(me, "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=%s, MASTER_USER=%s, "
                 f"MASTER_PASSWORD=%s, MASTER_USE_GTID=slave_pos{retry}",
             (peer.port, REPL_USER, REPL_PASSWORD))
        _sql(me, "START SLAVE")


@dataclass
class SplitFleet:
    """Source server + target pair, reset to a fresh state for each test."""

    source: MariaDBServer
    target: MariaDBServer
    standby: MariaDBServer
    zk_address: str
    cluster: str = ""
    store: ZooKeeperMapStore | None = None
    # the source's standby (replicating from the source), named in the map when given
    source_standby: MariaDBServer | None = None

    @property
    def creds(self) -> Credentials:
        return Credentials("root", MariaDBServer.root_password, REPL_USER, REPL_PASSWORD,
                           APP_USER, "%")

    def reset(self, *, source: bool = True) -> None:
        """Empty target pair, the source's shards present and empty (kept as they are
        when not *source*: a benchmark's data), a fresh map in ZooKeeper."""
        t = self.target.connect(client_flag=provision.multi_statement_flags())
        try:
            with t.cursor() as cur:
                cur.execute("SHOW ALL SLAVES STATUS")
                names = [r[0] for r in cur.fetchall() if r[0]]
                for n in names:
                    cur.execute(f"STOP SLAVE '{n}'")
                    cur.execute(f"RESET SLAVE '{n}' ALL")
                dbs = sorted(provision.existing_databases(cur))
            if dbs:
                provision.apply_drop(t, dbs, app_user=APP_USER)
        finally:
            t.close()
        for s in (self.target, self.standby):
            _sql(s, "SET GLOBAL read_only = ON")
        if source:
            self._reset_source()
        wait_pair_synced(self.target, self.standby)
        if self.source_standby is not None:
            wait_pair_synced(self.source, self.source_standby)
        self.cluster = "split" + uuid.uuid4().hex[:8]
        if self.store is not None:
            self.store.close()
        self.store = ZooKeeperMapStore(self.zk_address, self.cluster)
        self.store.write(ShardMap.from_ranges([
            {"range": list(SOURCE_RANGE), "master": self.source.address,
             "standby": self.source_standby.address if self.source_standby else None,
             "state": "open"},
            {"range": [32, 47], "master": "10.255.255.1:3306", "standby": None,
             "state": "open"},
        ], mod_shard_count=32), NO_NODE)

    def _reset_source(self) -> None:
        """The source's shards present and empty."""
        shards = list(range(SOURCE_RANGE[0], SOURCE_RANGE[1] + 1))
        s = self.source.connect(client_flag=provision.multi_statement_flags())
        try:
            # The source's shards are emptied, not dropped and created again: 448 tables'
            # DDL took 3-6 s of every fault campaign run. A split's cleanup may have
            # dropped some (created again here) and its fence taken the application
            # user's privileges on others (granted again: ensure_shards plans both).
            with s.cursor() as cur:
                have = provision.existing_databases(cur)
                keep = {shard_database(i) for i in shards}
                provision.apply_drop(s, sorted(have - keep), app_user=APP_USER)
                cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
                            "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")
                tables = sorted((str(db), str(t)) for db, t in cur.fetchall() if db in keep)
                for i in range(0, len(tables), 200):
                    provision.run_many(cur, [f"DELETE FROM `{db}`.`{t}`"
                                             for db, t in tables[i:i + 200]])
            provision.ensure_shards(s, shards, default_schema(), app_user=APP_USER)
        finally:
            s.close()

    def split(self, moving: tuple[int, int] | None = None, target: str | None = None,
              **kw: Any) -> Split:
        assert self.store is not None
        spec = SplitSpec(self.source.address, target or self.target.address,
                         self.standby.address, moving)
        return Split(self.store, spec, self.creds, **kw)

    def map(self) -> ShardMap:
        assert self.store is not None
        m = self.store.read().map
        assert m is not None
        return m

    def router(self, tmp: Path, frozen_wait: float = 8.0) -> Router:
        return Router(ZooKeeperMapStore(self.zk_address, self.cluster),
                      cache_file=tmp / f"map-{uuid.uuid4().hex[:6]}.json", user=APP_USER,
                      password=APP_PASSWORD, frozen_wait=frozen_wait)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def physical_copy(servers: dict[str, MariaDBServer], copy: dict[str, Any], *,
                  secret: str = "split-secret", watch: Any = None,
                  parallel: int = 2) -> tuple[str, dict[str, Any]]:
    """What split.yml has shard_copy do on the nodes (*servers* by address): one
    mariadb-backup of ``copy["source"]`` streamed to a receiver on each of ``copy["targets"]``, each
    prepared and installed in place of its node's data directory (the node restarted on
    it). *watch(receivers, secret)*, when given, runs beside it (the playbook's watch of
    the copy's progress). Returns the copy's position (the same on both) and the
    sender's figures."""
    by = servers
    src = by[copy["source"]]
    got: dict[str, Any] = {}
    receivers = {}
    for address in copy["targets"]:
        receivers[address] = physical.Receiver(secret, bind="127.0.0.1")

    def receive(address: str) -> None:
        node = by[address]
        incoming = str(Path(str(node.datadir) + ".incoming"))
        try:
            rx = receivers[address]
            rx.receive(incoming, timeout=7200)
            rx.set_phase("preparing")
            physical.prepare(incoming)
            pos = physical.position(incoming)
            rx.set_phase("installing")
            physical.install(incoming, str(node.datadir), stop=node.stop, start=node.start)
            rx.set_phase("installed", position=pos)
            got[address] = pos
        except Exception as exc:  # noqa: BLE001 - handed to the test
            receivers[address].set_phase("failed")
            got[address] = exc

    threads = [threading.Thread(target=receive, args=(a,)) for a in copy["targets"]]
    if watch is not None:
        threads.append(threading.Thread(target=watch, args=(
            [f"127.0.0.1:{rx.port}" for rx in receivers.values()], secret)))
    for t in threads:
        t.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cnf = physical.client_defaults(tmp, "root", MariaDBServer.root_password)
            argv = physical.backup_argv(defaults_file=cnf, datadir=str(src.datadir),
                                        socket_path=str(src.socket), parallel=parallel)
            sent = physical.send([f"127.0.0.1:{rx.port}" for rx in receivers.values()],
                                 secret, argv, connect_timeout=10, reply_timeout=7200)
    finally:
        for t in threads[:len(copy["targets"])]:
            t.join(7200)
        time.sleep(1.5)  # a status request after the install sees "installed"
        for rx in receivers.values():
            rx.close()
        for t in threads[len(copy["targets"]):]:
            t.join(60)
    positions = {v for k, v in got.items() if k in copy["targets"]}
    assert len(positions) == 1 and all(isinstance(p, str) for p in positions), got
    return positions.pop(), {"bytes": sent.bytes, "seconds": round(sent.seconds, 3)}


def wait_pair_synced(a: MariaDBServer, b: MariaDBServer, timeout: float = 30.0) -> None:
    pos = _sql(a, "SELECT @@GLOBAL.gtid_binlog_pos")[0][0]
    r = _sql(b, "SELECT MASTER_GTID_WAIT(%s, %s)", (pos, timeout))[0][0]
    assert r == 0, f"standby {b.address} did not apply {pos} within {timeout}s"


# -- the bounded writer ------------------------------------------------------------
@dataclass
class WriterLog:
    acked: dict[int, int] = field(default_factory=dict)  # id -> last acknowledged version
    uncertain: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    errors: list[tuple[int, str]] = field(default_factory=list)  # (shard, error)
    latencies: list[tuple[float, float, int]] = field(default_factory=list)  # start, secs, shard
    created: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # shard -> n
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # in every body it writes
    history: History = field(default_factory=History)  # every invocation and completion

    def longest(self, shards: set[int] | None = None, since: float = 0.0) -> float:
        xs = [d for t, d, s in self.latencies if t >= since and (shards is None or s in shards)]
        return max(xs, default=0.0)


class Writer:
    """Threads creating and updating pins across *shards* through the routing library, for at
    most *seconds* and *max_ops* operations each (*pause* seconds apart), logging every
    acknowledged write.

    *shards* None: creates go to any open shard (the store picks). *updates*: the share
    of operations that update an object this thread created (read-modify-write), the
    rest create. ``ack_times`` and the helpers below measure stalls (a promotion's).
    *stores*: thread *n* writes through ``stores[n % len(stores)]`` (several routers)
    instead of *store*. Every create's body carries its history index (``op``).
    *joining*: another writer whose log and history this one writes into (its threads
    numbered after that writer's), e.g. a router added halfway through a run."""

    def __init__(self, store: Store, shards: list[int] | None, *, threads: int = 3,
                 seconds: float = 60.0, max_ops: int = 20_000, seed: int = 7,
                 pause: float = 0.0, updates: float = 0.5,
                 stores: Sequence[Store] | None = None,
                 joining: Writer | None = None) -> None:
        self.store, self.shards = store, shards
        self.stores = list(stores) if stores else [store]
        self.threads, self.seconds, self.max_ops = threads, seconds, max_ops
        self.pause = pause  # seconds each thread sleeps between operations
        self.updates = updates
        self.ack_times: list[float] = joining.ack_times if joining else []
        self.log: WriterLog = joining.log if joining else WriterLog()
        self._stop = threading.Event()
        self._lock: threading.Lock = joining._lock if joining else threading.Lock()
        self._first: int = (joining._first + joining.threads) if joining else 0
        self._workers: list[threading.Thread] = []
        self._rng = random.Random(seed)
        self.ops = 0

    def start(self) -> Writer:
        for i in range(self._first, self._first + self.threads):
            t = threading.Thread(target=self._run, args=(i,), name=f"writer-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> WriterLog:
        self._stop.set()
        for t in self._workers:
            t.join(30)
        return self.log

    # -- what the promotion tests read ------------------------------------------------
    @property
    def acked(self) -> list[int]:
        """Every acknowledged object ID, in the order they were first acknowledged."""
        with self._lock:
            return list(self.log.acked)

    @property
    def errors(self) -> list[str]:
        with self._lock:
            return [e for _, e in self.log.errors]

    def wait_acks(self, n: int, timeout: float = 30.0, *, total: bool = False) -> bool:
        """Wait (bounded) for *n* more acknowledged writes (*total*: *n* since the writer
        started, for a writer of a few writes that may all be done before the call).
        False at once when every thread has ended (its time or operation bound)."""
        deadline = time.monotonic() + timeout
        start = 0 if total else len(self.ack_times)
        while len(self.ack_times) < start + n:
            if time.monotonic() > deadline or not self.running():
                return len(self.ack_times) >= start + n
            time.sleep(0.01)
        return True

    def running(self) -> bool:
        return any(t.is_alive() for t in self._workers)

    def status(self) -> str:
        """What a failed wait needs to say: how many threads run, the writes acknowledged
        and failed, the last errors, how long since the last acknowledgement and the
        latest latencies, and where each running thread is (its innermost frames)."""
        now = time.monotonic()
        with self._lock:
            acks, errors = len(self.ack_times), list(self.log.errors)
            last = self.ack_times[-1] if self.ack_times else None
            recent = [round(d, 3) for _, d, _ in self.log.latencies[-5:]]
        alive = [t for t in self._workers if t.is_alive()]
        since = f"{now - last:.1f} s ago" if last is not None else "never"
        ended = "" if alive else (f" (ended: its {self.seconds:g} s or {self.max_ops} "
                                  "operations per thread ran out)")
        lines = [f"writer: {len(alive)}/{len(self._workers)} threads running{ended}, {acks} acks "
                 f"(last {since}, latest latencies {recent}), {len(errors)} errors "
                 f"{[e for _, e in errors[-3:]]}"]
        frames = sys._current_frames()  # noqa: SLF001 - a diagnostic of the test kit
        for t in alive:
            frame = frames.get(t.ident or 0)
            if frame is not None:
                where = traceback.format_stack(frame)[-4:]
                lines.append(f"{t.name} at:\n" + "".join(where).rstrip())
        return "\n".join(lines)

    def longest_stall(self, since: float = 0.0) -> float:
        """The longest gap between two acknowledged writes after *since*."""
        with self._lock:
            ts = sorted(t for t in self.ack_times if t >= since)
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)

    def first_ack_after(self, t: float) -> float | None:
        with self._lock:
            return min((x for x in self.ack_times if x > t), default=None)

    def _run(self, n: int) -> None:
        rng = random.Random(n)
        store = self.stores[(n - self._first) % len(self.stores)]
        history = self.log.history
        mine: list[int] = []
        deadline = time.monotonic() + self.seconds
        for _ in range(self.max_ops):
            if self._stop.wait(self.pause) or time.monotonic() > deadline:
                return
            shard = rng.choice(self.shards) if self.shards else -1
            start = time.monotonic()
            if mine and rng.random() < self.updates:
                oid = rng.choice(mine)
                shard = ids.shard_of(oid)
                with self._lock:
                    v = self.log.acked[oid] + 1
                    self.log.uncertain[oid].add(v)
                value = {"id": oid, "v": v}
                k = history.invoke(n, "update", value)
                try:
                    store.update(oid, {"v": v})
                except Exception as exc:  # noqa: BLE001 - logged, checked by the test
                    history.info(k, n, "update", value, repr(exc))
                    with self._lock:
                        self.log.errors.append((shard, repr(exc)))
                    self._stop.wait(0.02)
                    continue
                history.ok(k, n, "update", value)
                with self._lock:
                    self.log.acked[oid] = max(self.log.acked[oid], v)
                    self.log.uncertain[oid].discard(v)
            else:
                k = history.invoke(n, "create", {"shard": shard})
                try:
                    oid = store.create(PIN, {"v": 0, "w": n, "tag": self.log.tag, "op": k},
                                       near=ids.compose(shard, PIN, 1) if shard >= 0 else None)
                except Exception as exc:  # noqa: BLE001
                    history.info(k, n, "create", {"shard": shard}, repr(exc))
                    with self._lock:
                        self.log.errors.append((shard, repr(exc)))
                    self._stop.wait(0.02)
                    continue
                history.ok(k, n, "create", {"shard": shard, "id": oid})
                shard = ids.shard_of(oid)
                with self._lock:
                    self.log.acked[oid] = 0
                    self.log.created[shard] += 1
                mine.append(oid)
            with self._lock:
                now = time.monotonic()
                self.log.latencies.append((start, now - start, shard))
                self.ack_times.append(now)
                self.ops += 1


def rows(server: MariaDBServer, shards: list[int], tag: str | None = None) -> dict[int, int]:
    """{object id: body version} of every pin on *server* in *shards* (only those a writer
    tagged *tag* when given: other pins may share the shards)."""
    out: dict[int, int] = {}
    where = "" if tag is None else " WHERE JSON_VALUE(body, '$.tag') = %s"
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            for s in shards:
                try:
                    cur.execute(f"SELECT local_id, JSON_VALUE(body, '$.v') "
                                f"FROM `{shard_database(s)}`.`pins`{where}",
                                None if tag is None else (tag,))
                except pymysql.err.ProgrammingError:
                    continue  # no such database
                for local, v in cur.fetchall():
                    out[ids.compose(s, PIN, int(local))] = int(v)
    finally:
        conn.close()
    return out


def verify(fleet: SplitFleet, log: WriterLog, moving: tuple[int, int], *,
           source_copy: bool = True) -> None:
    """:func:`check_writes` over the test fleet's source range."""
    check_writes(fleet.map(), {fleet.source.address: fleet.source,
                               fleet.target.address: fleet.target},
                 list(range(SOURCE_RANGE[0], SOURCE_RANGE[1] + 1)), log, moving,
                 fleet.source.address, fleet.target.address, source_copy=source_copy)


def check_writes(shard_map: ShardMap, servers: dict[str, Any], shards: list[int],
                 log: WriterLog, moving: tuple[int, int], source: str, target: str, *,
                 source_copy: bool = True) -> None:
    """Every acknowledged write in *shards* is on the master the map names with its latest
    value; no row nobody acknowledged beyond the failed creates; the old master holds
    nothing the target lacks for the moved shards. Only the writer's own rows count
    (its tag). *servers* maps an address to an object
    with ``connect()`` (an admin connection)."""
    moved = [s for s in shards if moving[0] <= s <= moving[1]]
    by_master: dict[str, list[int]] = defaultdict(list)
    for s in shards:
        by_master[shard_map.range_for(s).master].append(s)
    assert set(by_master[target]) == set(moved), dict(by_master)
    live: dict[int, int] = {}
    for master, on_master in by_master.items():
        live.update(rows(servers[master], on_master, log.tag))
    lost = [i for i in log.acked if i not in live]
    assert not lost, f"{len(lost)} acknowledged object(s) missing, e.g. {lost[:5]}"
    stale = [(i, v, live[i]) for i, v in log.acked.items()
             if live[i] != v and live[i] not in log.uncertain.get(i, set())]
    assert not stale, f"{len(stale)} object(s) without their last acknowledged value: {stale[:5]}"
    extra = [i for i in live if i not in log.acked]
    unacked_creates = len(log.errors)
    assert len(extra) <= unacked_creates, f"{len(extra)} rows no writer acknowledged: {extra[:5]}"
    if source_copy:
        old = rows(servers[source], moved, log.tag)
        ahead = [(i, v, live.get(i)) for i, v in old.items() if live.get(i) is None
                 or live[i] < v]
        assert not ahead, f"the old master accepted writes for moved shards: {ahead[:5]}"
