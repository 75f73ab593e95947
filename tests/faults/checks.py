"""The checker the campaign runs after every run: the writer's history against the servers
(:func:`shardfleet.testing.history.check_history`, plus the kit's
:func:`~shardfleet.testing.kit.check_writes` for a split), and the fleet's health: every
pair replicating both ways, no range frozen, no operation in flight, the fleet writable
through a router; and, sampled all through the run (:class:`WritableSampler`), never two
writable nodes in one pair. Each check returns problems (strings) instead of raising, so
one run reports everything that is wrong with it."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from shardfleet import ids, ops, topology
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer
from shardfleet.testing.kit import APP_PASSWORD, APP_USER

FROZEN_KEYS = ("frozen_from", "frozen_by")


def map_problems(m: ShardMap | None) -> list[str]:
    if m is None:
        return ["the map is gone"]
    out = []
    for r in m.ranges:
        if r.state == "frozen" or any(k in r.extra for k in FROZEN_KEYS):
            out.append(f"range left frozen: {r.describe()} {dict(r.extra)}")
    return out


def in_flight_problems(store: ZooKeeperMapStore) -> list[str]:
    return [f"operation left in flight: {op.describe()}" for op in ops.in_flight(store)]


def _replica_rows(server: MariaDBServer) -> list[dict[str, Any]]:
    conn = server.connect()
    try:
        with conn.cursor() as c:
            c.execute("SHOW ALL SLAVES STATUS")
            cols = [d[0] for d in c.description]
            return [dict(zip(cols, r, strict=True)) for r in c.fetchall()]
    finally:
        conn.close()


def both_ways(a: MariaDBServer, b: MariaDBServer, timeout: float = 30.0) -> list[str]:
    """Each node replicates from the other (its default channel runs) and a row written on
    each node reaches the other, within *timeout* (bounded; tolerant of a busy machine)."""
    out = []
    for s in (a, b):
        deadline = time.monotonic() + timeout
        while True:
            rows = [r for r in _replica_rows(s) if not r.get("Connection_name")]
            ok = len(rows) == 1 and (rows[0]["Slave_IO_Running"],
                                     rows[0]["Slave_SQL_Running"]) == ("Yes", "Yes")
            if ok:
                break
            if time.monotonic() > deadline:
                out.append(f"{s.address} does not replicate from its peer: "
                           + (", ".join(f"IO {r['Slave_IO_Running']} SQL "
                                        f"{r['Slave_SQL_Running']} {r['Last_Error'] or ''}"
                                        f"{r['Last_IO_Error'] or ''}" for r in rows)
                              or "no channel"))
                break
            time.sleep(0.2)
    if out:
        return out
    a.sql("CREATE DATABASE IF NOT EXISTS sf_faults")
    a.sql("CREATE TABLE IF NOT EXISTS sf_faults.marks (mark VARCHAR(40) PRIMARY KEY)")
    r = b.sql("SELECT MASTER_GTID_WAIT(%s, %s)",
              (a.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0], timeout))[0][0]
    if r != 0:
        return [f"{b.address} did not apply {a.address}'s position within {timeout}s"]
    for src, dst in ((a, b), (b, a)):
        # the row itself is awaited: a wait for src's whole binlog position also waits for
        # src's copy of dst's own domain, which dst never applies (its own server id)
        mark = uuid.uuid4().hex
        src.sql("INSERT INTO sf_faults.marks VALUES (%s)", (mark,))
        deadline = time.monotonic() + timeout
        while not dst.sql("SELECT COUNT(*) FROM sf_faults.marks WHERE mark = %s", (mark,))[0][0]:
            if time.monotonic() > deadline:
                conn = dst.connect()
                try:
                    rows = topology.dict_rows(conn, "SHOW ALL SLAVES STATUS")
                finally:
                    conn.close()
                out.append(f"a row written on {src.address} did not reach {dst.address} "
                           f"within {timeout}s; its channels: " + "; ".join(
                               f"{r['Connection_name'] or 'default'} IO {r['Slave_IO_Running']}"
                               f" SQL {r['Slave_SQL_Running']} at {r['Gtid_IO_Pos']} "
                               f"{r['Last_Error'] or ''}{r['Last_IO_Error'] or ''}"
                               for r in rows))
                break
            time.sleep(0.1)
    return out


def writable_problems(zk: str, cluster: str, tmp: Path, shards: list[int],
                      timeout: float = 20.0) -> list[str]:
    """A fresh router creates (and reads back) an object on each of *shards*, each within
    *timeout* (the router's own waits included)."""
    router = Router(ZooKeeperMapStore(zk, cluster), cache_file=tmp / f"w-{uuid.uuid4().hex[:6]}",
                    user=APP_USER, password=APP_PASSWORD, frozen_wait=5.0, connect_timeout=2,
                    read_timeout=10)
    store = Store(router)
    out = []
    try:
        for shard in shards:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    oid = store.create("pin", {"after": shard}, near=ids.compose(shard, 1, 1))
                    if store.get(oid) != {"after": shard}:
                        out.append(f"shard {shard}: object {oid} read back differently")
                    break
                except Exception as exc:  # noqa: BLE001 - reported as a problem
                    if time.monotonic() > deadline:
                        out.append(f"shard {shard} is not writable through a router: "
                                   f"{type(exc).__name__}: {exc}")
                        break
                    time.sleep(0.5)
    finally:
        store.close()
        router.close()
    return out


def read_only(server: MariaDBServer) -> bool:
    return bool(server.sql("SELECT @@GLOBAL.read_only")[0][0])


class WritableSampler:
    """Never two writable nodes in one pair, at any sampled instant: a bounded background
    thread reads ``@@GLOBAL.read_only`` of both nodes of each pair every *every* seconds
    (its own root connections, short timeouts; a node that does not answer, killed,
    restarting or refusing connections, counts as not writable: nobody can write to it).

    Two servers are not read at one instant, and a correct planned promotion makes the
    old master read-only before it makes the new one writable: a tick that read the old
    master (still writable) and then the new one (already writable) would see two
    writable nodes that never were. So a tick reads A, then B, then A again, and a
    violation is A writable at both of its reads with B writable between them (each node
    of the pair is "A" on alternate ticks). :meth:`stop` returns the violations (the
    pair and the instants, relative to *t0*) and :attr:`summary` what was sampled."""

    def __init__(self, pairs: list[tuple[MariaDBServer, MariaDBServer]], *,
                 t0: float | None = None, every: float = 0.05, connect_timeout: float = 0.5,
                 read_timeout: float = 1.0, max_seconds: float = 600.0) -> None:
        self.pairs = [tuple(p) for p in pairs]
        self.t0 = time.monotonic() if t0 is None else t0
        self.every, self.max_seconds = every, max_seconds
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._conns: dict[str, Any] = {}
        self._retry_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.unanswered: dict[str, int] = {}
        self.violations: list[str] = []
        self.errors: list[str] = []

    def start(self) -> WritableSampler:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="sf-writable-sampler")
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10 + 3 * (self.connect_timeout + self.read_timeout))
        for conn in self._conns.values():
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
        self._conns.clear()
        out = list(self.violations[:5])
        if len(self.violations) > 5:
            out.append(f"... and {len(self.violations) - 5} more samples with two writable "
                       f"nodes in one pair")
        return out + self.errors

    @property
    def summary(self) -> dict[str, Any]:
        return {"ticks": self.ticks, "violations": len(self.violations),
                "unanswered": dict(self.unanswered)}

    def writable(self, server: MariaDBServer) -> bool:
        """True when *server* answered read_only=OFF now; False for ON or no answer."""
        key = server.address
        conn = self._conns.get(key)
        if conn is None:
            if time.monotonic() < self._retry_at.get(key, 0.0):
                self.unanswered[key] = self.unanswered.get(key, 0) + 1
                return False
            try:
                conn = server.connect(connect_timeout=self.connect_timeout,
                                      read_timeout=self.read_timeout,
                                      write_timeout=self.read_timeout)
                self._conns[key] = conn
            except Exception:  # noqa: BLE001 - a node that does not answer is not writable
                self._retry_at[key] = time.monotonic() + 0.1
                self.unanswered[key] = self.unanswered.get(key, 0) + 1
                return False
        try:
            with conn.cursor() as c:
                c.execute("SELECT @@GLOBAL.read_only")
                return not c.fetchone()[0]
        except Exception:  # noqa: BLE001 - the node died or restarted: reconnect next time
            self._conns.pop(key, None)
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.unanswered[key] = self.unanswered.get(key, 0) + 1
            return False

    def tick(self) -> None:
        for a, b in self.pairs:
            if self.ticks % 2:
                a, b = b, a
            t1 = time.monotonic()
            a1 = self.writable(a)
            if not a1:
                continue  # A read-only: no violation this tick whatever B says
            t2 = time.monotonic()
            b_w = self.writable(b)
            if not b_w:
                continue
            t3 = time.monotonic()
            if self.writable(a):
                t4 = time.monotonic()
                self.violations.append(
                    f"two writable nodes in the pair ({a.address}, {b.address}) at "
                    f"{t2 - self.t0:.3f}s: {a.address} answered read_only=OFF to a read "
                    f"sent at {t1 - self.t0:.3f}s and to one answered at "
                    f"{t4 - self.t0:.3f}s, {b.address} read_only=OFF to a read between them "
                    f"({t2 - self.t0:.3f}-{t3 - self.t0:.3f}s)")
        self.ticks += 1

    def _loop(self) -> None:
        end = time.monotonic() + self.max_seconds
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                started = time.monotonic()
                self.tick()
                self._stop.wait(max(0.0, self.every - (time.monotonic() - started)))
        except Exception as exc:  # noqa: BLE001 - a sampler that died checks nothing
            self.errors.append(f"the writable sampler stopped: {type(exc).__name__}: {exc}")
