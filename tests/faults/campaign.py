"""The campaign's machinery, shared by every operation family (``test_*.py`` here).

A *run* is one operation (a split, a planned or emergency promotion and its rebuild, an
open-range) started in its own process (``op.py``) under the kit's writer (three
threads through two routers, one history), one fault at an instant drawn from the
run's seed, the documented recovery alone, then the checker. The faults:

* ``kill``         SIGKILL of the operation's process;
* ``lost_reply``   the operation's ZooKeeper client talks through a proxy that forwards
                   the next request of at least N bytes, lets ZooKeeper apply it and cuts
                   the connection before the reply;
* ``second_op``    the same operation started again beside the first: refused, or
                   continuing it, never interleaving;
* ``partition``    the operation's MySQL connections to the pair's master go through a
                   proxy that stops forwarding for a while (the control node cut off from
                   the master; the routers and the standby still reach it), then heals;
* ``too_many``     the master answers every new connection with 1040 for a while (its
                   connections really held: the routers get 1040 too);
* ``stale_router`` a router started from the cache file another router wrote before the
                   operation, with ZooKeeper unreachable from it, writes beside the others;
* ``restart_new``  (emergency) the new master SIGKILLed and started again, with the old
                   master back;
* ``zk_leader``    the ZooKeeper ensemble's leader SIGKILLed (a new one is elected), and
                   started again a while later;
* ``session_expiry`` the operation's ZooKeeper session expired while it runs (a second
                   client started with its session id and password, which ``op.py``
                   prints, then closed: the server ends the session and deletes its lock
                   znodes; the process's client gets a new session): the run must stop
                   before its next action (LockLost) or finish, and the rerun finish it.

The backup runs (``backup_rebuild``, ``backup_split``: :mod:`tests.faults.backups`) start a
backup of a pair's standby and a restore of the pair's newest complete backup into a
scratch server beside a rebuild of that standby or a split onto that pair, at instants of
their own, and have faults of their own: ``kill`` and ``session_expiry`` of the operation,

* ``kill_backup``  SIGKILL of the backup's process (and its mariadb-backup) 0.1-1.5 s
                   (drawn) after it started: its rerun must complete;
* ``beside``       none but the mix: the backup and the restore beside the operation;
* ``expire_backup`` the backup's ZooKeeper session expired while it runs: it stops (LockLost)
                   or finishes, and a stopped one's rerun completes;
* ``kill_restore`` SIGKILL of the restore's process: its rerun finishes it.

Faults after the instant the operation already finished still happen (but for
``kill``, ``lost_reply``, ``second_op`` and ``session_expiry``, which need it running): a
partition or a restart of a fleet that just changed is what on-call meets too.

The seeds: ``SHARDFLEET_FAULT_SEED`` (the base; random and printed when unset) and
``SHARDFLEET_FAULT_RUNS`` (runs in all, shared among the families by :data:`WEIGHTS`;
with a seed and no count, one run of each family: a replay). A run's fault is
``faults[seed % len(faults)]`` of its family; every other draw comes from its seed.
A seed drawn before a family's list grew replays with the list of its time (the named
schedules keep theirs).

Beside the checker, every run samples its pairs all along (:class:`checks.WritableSampler`,
started with the writer): never two writable nodes in one pair at any sampled instant.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql
import pytest

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.store import Store
from shardfleet.testing import MariaDBServer
from shardfleet.testing.faults import ReplyLosingProxy
from shardfleet.testing.kit import APP_PASSWORD, APP_USER, Writer, WriterLog
from shardfleet.testing.nemesis import (
    ENV_RUNS,
    ENV_SEED,
    OpProcess,
    Schedule,
    SessionGone,
    expire_session,
    failure_dir,
    keep_logs,
)
from shardfleet.testing.origins import MapTimeline, check_origins, rotate

from .checks import WritableSampler

OP_SCRIPT = Path(__file__).with_name("op.py")
# ZooKeeper as a router cut off from it sees it: nothing listens on port 1
UNREACHABLE_ZK = "127.0.0.1:1"

# The share of the campaign's runs each family gets, and the runs in all by default.
# Measured on a quiet 2-core machine (see docs/faults.md): a planned promotion run ~1.5 s,
# an open-range ~2 s, an emergency with its rebuild ~5 s, a split ~4 s (9 s when killed:
# the rerun waits for the dead process's ZooKeeper session to expire); a backup run
# (tests/faults/backups.py) about 2.5 planned runs: on a machine loaded by other test runs
# (load average 8-22) a backup_rebuild run took 21 s and a backup_split 18 s on average,
# against 8.5 s for a planned promotion and 15 s for an emergency (a backup of the standby
# takes 1-5 s, a restore 1-2 s; a killed backup's rerun waits for its lock).
WEIGHTS = {"planned": 0.34, "open_range": 0.18, "emergency": 0.18, "split": 0.23,
           "backup_rebuild": 0.04, "backup_split": 0.03}
DEFAULT_RUNS = 200


def seeds(family: str) -> list[int]:
    """This family's seeds: consecutive from the campaign's base."""
    seed_env = os.environ.get(ENV_SEED, "").strip()
    runs_env = os.environ.get(ENV_RUNS, "").strip()
    base = int(seed_env) if seed_env else _random_base()
    if runs_env:
        n = max(1, round(int(runs_env) * WEIGHTS[family]))
    else:
        n = 1 if seed_env else max(1, round(DEFAULT_RUNS * WEIGHTS[family]))
    return [base + i for i in range(n)]


_BASE: list[int] = []


def _random_base() -> int:
    if not _BASE:
        # pytest-xdist's workers must collect the same runs: one base for the whole test
        # run (its uid), random otherwise
        uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        _BASE.append(int(uid, 16) % 10**6 + 1 if uid else
                     random.SystemRandom().randrange(1, 10**6))
        print(f"fault campaign: base seed {_BASE[0]} ({ENV_SEED}={_BASE[0]} replays it)")
    return _BASE[0]


@dataclass
class Run:
    """One run: its seed's random source, the nemesis's schedule, what went wrong."""

    test: str
    seed: int
    faults: tuple[str, ...]
    rng: random.Random = field(init=False)
    schedule: Schedule = field(init=False)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.schedule = Schedule(self.seed, self.test)

    @property
    def fault(self) -> str:
        return self.faults[self.seed % len(self.faults)]

    def draw(self, window: float) -> dict[str, Any]:
        """The fault's parameters, drawn in a fixed order (a replay draws the same)."""
        return {"fault": self.fault, "at": round(self.rng.uniform(0.0, window), 3),
                "min_bytes": self.rng.choice((48, 96, 200, 400)),
                "apply_wait": self.rng.choice((0.05, 0.3)),
                "lock_timeout": self.rng.choice((0.5, 5.0)),
                "lasting": self.rng.choice((0.5, 1.0, 2.5))}

    def fail_if_problems(self, log: WriterLog | None, servers: dict[str, Any],
                         op_logs: list[Path]) -> None:
        if not self.problems:
            print(f"\n{self.schedule.describe()}\n  ok; history "
                  + (f"{log.history.counts()}" if log else ""))
            return
        d = failure_dir(self.test, self.seed)
        (d / "schedule.txt").write_text(self.schedule.describe() + "\n\nproblems:\n"
                                        + "\n".join(self.problems) + "\n")
        if log is not None:
            log.history.dump(d / "history.jsonl", self.schedule.t0)
        for p in op_logs:
            if p.exists():
                shutil.copy(p, d / p.name)
        keep_logs(d, servers)
        pytest.fail(f"{len(self.problems)} problem(s):\n  " + "\n  ".join(self.problems)
                    + f"\n{self.schedule.describe()}\nhistory, schedule and server logs: {d}",
                    pytrace=False)


def zk_servers(ensemble: Any) -> dict[str, Any]:
    """The ensemble's members by name, for the logs a failing run keeps."""
    return {f"zk{i + 1}": m for i, m in enumerate(ensemble.members)}


def oneline(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def router(zk: str, cluster: str, cache: Path, frozen_wait: float = 8.0,
           timeout: float = 5.0) -> Router:
    return Router(ZooKeeperMapStore(zk, cluster, timeout=timeout), cache_file=cache,
                  user=APP_USER, password=APP_PASSWORD, frozen_wait=frozen_wait,
                  connect_timeout=2, read_timeout=10)


class Scene:
    """The writer of one run (three threads through two routers, one history), the routers
    a fault adds (:meth:`stale_router`), the map's timeline with the binary logs the
    run starts from, for the check of who accepted each write (:meth:`origin_problems`),
    and the sampler of *pairs* (never two writable nodes in one, from :meth:`start` to
    :meth:`stop`, which adds what it saw to the run's problems)."""

    def __init__(self, run: Run, zk: str, cluster: str, shards: list[int], tmp: Path,
                 servers: list[MariaDBServer], frozen_wait: float = 8.0, *,
                 pairs: Sequence[tuple[MariaDBServer, MariaDBServer]] = ()) -> None:
        self.run, self.tmp, self.servers, self.zk = run, tmp, servers, zk
        self.sampler = WritableSampler(list(pairs), t0=run.schedule.t0)
        self.skip = {s.address: rotate(s) for s in servers}
        self.timeline = MapTimeline.for_cluster(zk, cluster).start()
        self.routers = [router(zk, cluster, tmp / f"map{i}.json", frozen_wait)
                        for i in range(2)]
        self.stores = [Store(r) for r in self.routers]
        self.writer = Writer(self.stores[0], shards, threads=3, seconds=150, max_ops=6000,
                             pause=0.003, updates=0.4, seed=run.seed, stores=self.stores)
        self.extra: list[tuple[Router, Store, Writer]] = []
        self.cluster, self.shards = cluster, shards
        self.stale_cache = tmp / "stale-map.json"

    def start(self) -> None:
        self.sampler.start()
        self.writer.start()
        if not self.writer.wait_acks(20, 30):
            self.run.problems.append(f"the writer made no progress before the fault: "
                                     f"{self.writer.errors[-3:]}")

    def keep_cache(self) -> None:
        """Keep the first router's cache file as it is now (before the operation)."""
        shutil.copy(self.tmp / "map0.json", self.stale_cache)

    def stale_router(self) -> None:
        """A router started from the kept cache file with ZooKeeper unreachable from it, and
        a writer thread through it, in the same history."""
        r = router(UNREACHABLE_ZK, self.cluster, self.stale_cache, timeout=1.0)
        s = Store(r)
        w = Writer(s, self.shards, threads=1, seconds=150, max_ops=3000, pause=0.003,
                   updates=0.4, seed=self.run.seed, joining=self.writer)
        w.start()
        self.extra.append((r, s, w))
        self.run.schedule.note("stale router started", source=r.source,
                               version=r.version if hasattr(r, "version") else None)

    def wait_resumed(self) -> None:
        if not self.writer.wait_acks(20, 30):
            self.run.problems.append(f"writes did not resume after the recovery: "
                                     f"{self.writer.errors[-3:]}")

    def origin_problems(self, log: WriterLog) -> list[str]:
        """Writes accepted by a server the map had stopped naming (their own binary logs
        against the map's timeline; :mod:`shardfleet.testing.origins`)."""
        return check_origins(self.timeline, log.history, self.servers, log.tag,
                             skip=self.skip)

    def stop(self) -> WriterLog:
        sampled = self.sampler.stop()
        self.run.schedule.note("writable sampler stopped", **self.sampler.summary)
        self.run.problems += sampled
        for _, _, w in self.extra:
            w.stop()
        log = self.writer.stop()
        self.timeline.stop()
        for r, s, _ in self.extra:
            s.close()
            r.close()
        for s in self.stores:
            s.close()
        for r in self.routers:
            r.close()
        return log


def hold_connections(server: MariaDBServer) -> list[Any]:
    """Fill *server*'s connections (max_connections 1, and root's one extra): every new
    connection gets 1040 until :func:`release_connections`."""
    held = [server.connect()]
    with held[0].cursor() as c:
        c.execute("SET GLOBAL max_connections = 1")
    for _ in range(20):
        try:
            held.append(server.connect())
        except pymysql.err.OperationalError as exc:
            if exc.args[0] != 1040:
                raise
            return held
    return held


def release_connections(held: list[Any]) -> None:
    with held[0].cursor() as c:
        c.execute("SET GLOBAL max_connections = 500")
    for conn in held:
        conn.close()


@dataclass
class Faults:
    """What a family gives the nemesis to act on (None: that fault does not apply)."""

    zk_proxy: ReplyLosingProxy | None = None
    sql_proxy: ReplyLosingProxy | None = None      # the op's way to the master
    busy: MariaDBServer | None = None              # the master for too_many
    second: Callable[[], tuple[str, bool]] | None = None
    restart: Callable[[], None] | None = None      # restart_new
    zk: Any = None                                 # the ensemble, for zk_leader


NEEDS_RUNNING = ("kill", "lost_reply", "second_op", "session_expiry")


def expire_op_session(run: Run, proc: OpProcess, plan: dict[str, Any], scene: Scene) -> None:
    """The ``session_expiry`` fault: the running operation's ZooKeeper session ended."""
    if proc.session is None:
        run.problems.append(f"the operation's process named no ZooKeeper session: "
                            f"{proc.lines[-5:]}")
        return
    sid = f"{proc.session[0]:#x}"
    sent = round(time.monotonic() - run.schedule.t0, 3)  # the note's time is the end
    try:
        expire_session(scene.zk, proc.session)
        run.schedule.note("ZooKeeper session expired", at=plan["at"], session=sid,
                          since=sent, op_running=proc.running)
    except SessionGone as exc:
        # the process closed its session: it was ending (its result says how)
        run.schedule.note("the operation's session was already closed", at=plan["at"],
                          session=sid, error=oneline(exc), op_running=proc.running)
    except Exception as exc:  # noqa: BLE001 - the trick failed, or its client did
        # on a loaded machine the trick's client can time out after the server moved
        # the session to it (seeds 182299, 182303: KazooTimeoutError, and the operation
        # then lost its locks): once more, and "gone" now means it did end
        try:
            expire_session(scene.zk, proc.session)
            run.schedule.note("ZooKeeper session expired (second try)", at=plan["at"],
                              session=sid, first_error=oneline(exc),
                              op_running=proc.running)
        except SessionGone:
            run.schedule.note("ZooKeeper session ended (the first try's client timed "
                              "out after taking it over)", at=plan["at"], session=sid,
                              first_error=oneline(exc), op_running=proc.running)
        except Exception as again:  # noqa: BLE001 - the trick failed twice
            run.schedule.note("ZooKeeper session not expired", at=plan["at"],
                              session=sid, error=oneline(again),
                              first_error=oneline(exc), op_running=proc.running)
            if proc.running:
                run.problems.append(f"could not expire the running operation's session "
                                    f"{sid}: {oneline(again)}")


def inject(run: Run, proc: OpProcess, plan: dict[str, Any], scene: Scene,
           f: Faults) -> None:
    """Wait for the operation's process to be ready, then *plan['at']* seconds, then the
    fault (for those that need the operation running: unless it has ended by then)."""
    if not proc.wait_ready(60):
        run.problems.append(f"the operation's process never became ready: {proc.lines[-5:]}")
        return
    run.schedule.note("operation ready")
    fault = plan["fault"]
    if fault == "die_after":
        run.schedule.note("the process SIGKILLs itself after a named call", call=plan["call"])
        return
    end = proc.ready_at + plan["at"]
    while time.monotonic() < end and proc.running:
        time.sleep(0.002)
    if not proc.running and fault in NEEDS_RUNNING:
        run.schedule.note("operation ended before the fault's instant", result=proc.result)
        return
    if fault == "kill":
        run.schedule.note("SIGKILL", at=plan["at"], killed=proc.kill())
    elif fault == "session_expiry":
        expire_op_session(run, proc, plan, scene)
    elif fault == "lost_reply":
        assert f.zk_proxy is not None
        f.zk_proxy.lose_reply_to_next(min_bytes=plan["min_bytes"],
                                      apply_wait=plan["apply_wait"])
        run.schedule.note("armed: lose the reply to the next request", at=plan["at"],
                          min_bytes=plan["min_bytes"], apply_wait=plan["apply_wait"])
    elif fault == "second_op":
        assert f.second is not None
        run.schedule.note("second operation started", at=plan["at"])
        outcome, ok = f.second()
        run.schedule.note("second operation ended", outcome=outcome,
                          first_still_running=proc.running)
        if not ok:
            run.problems.append(f"the second operation neither was refused nor continued the "
                                f"first: {outcome}")
    elif fault == "partition":
        assert f.sql_proxy is not None
        f.sql_proxy.partition(True)
        run.schedule.note("partition: control node | master", at=plan["at"],
                          lasting=plan["lasting"], op_running=proc.running)
        time.sleep(plan["lasting"])
        f.sql_proxy.partition(False)
        run.schedule.note("partition healed", op_running=proc.running)
    elif fault == "too_many":
        assert f.busy is not None
        held = hold_connections(f.busy)
        run.schedule.note("master answers 1040", at=plan["at"], lasting=plan["lasting"],
                          held=len(held), op_running=proc.running)
        try:
            time.sleep(plan["lasting"])
        finally:
            release_connections(held)
        run.schedule.note("master takes connections again", op_running=proc.running)
    elif fault == "zk_leader":
        assert f.zk is not None
        leader = f.zk.leader()
        f.zk.kill(leader)
        run.schedule.note("ZooKeeper leader SIGKILLed", at=plan["at"], member=leader + 1,
                          lasting=plan["lasting"], op_running=proc.running)
        time.sleep(plan["lasting"])
        f.zk.start_member(leader)
        run.schedule.note("ZooKeeper member back", member=leader + 1, op_running=proc.running)
    elif fault == "stale_router":
        scene.stale_router()
    elif fault == "restart_new":
        assert f.restart is not None
        run.schedule.note("restart: the new master SIGKILLed, the old one back",
                          at=plan["at"], op_running=proc.running)
        f.restart()
        run.schedule.note("restarted", op_running=proc.running)
    else:
        raise AssertionError(f"unknown fault {fault!r}")


def end_operation(run: Run, proc: OpProcess, proxy: ReplyLosingProxy | None) -> None:
    rc = proc.wait(180)
    if proc.finished_at is not None:
        # when its work ended (before it closed its store), and in which session: another
        # than the one it started with means it saw its first session expire
        first = proc.session[0] if proc.session else None
        run.schedule.note("operation's work ended", at_t=round(proc.finished_at
                                                               - run.schedule.t0, 3),
                          same_session=proc.finished_session == first,
                          session=proc.finished_session and f"{proc.finished_session:#x}")
    run.schedule.note("operation process ended", rc=rc, result=proc.result or proc.lines[-3:])
    if proxy is not None and proxy.lost.is_set():
        run.schedule.note("proxy", lost_a_reply=True)


@contextmanager
def proxies(plan: dict[str, Any], zk_port: int, master: MariaDBServer | None
            ) -> Iterator[tuple[ReplyLosingProxy | None, ReplyLosingProxy | None]]:
    """The ZooKeeper proxy a lost reply needs, the MySQL proxy a partition needs."""
    zk = ReplyLosingProxy("127.0.0.1", zk_port) if plan["fault"] == "lost_reply" else None
    sql = ReplyLosingProxy("127.0.0.1", master.port) \
        if plan["fault"] == "partition" and master is not None else None
    try:
        yield zk, sql
    finally:
        for p in (zk, sql):
            if p is not None:
                p.close()


def op_spec(base: dict[str, Any], zk: str, zk_proxy: ReplyLosingProxy | None,
            sql_proxy: ReplyLosingProxy | None, master: MariaDBServer | None) -> dict[str, Any]:
    spec = dict(base, zk=zk_proxy.address if zk_proxy else zk)
    if sql_proxy is not None and master is not None:
        spec["redirect"] = {master.address: sql_proxy.address}
    return spec


__all__ = ["DEFAULT_RUNS", "Faults", "OP_SCRIPT", "Run", "Scene", "WEIGHTS", "end_operation",
           "hold_connections", "inject", "keep_logs", "oneline", "op_spec", "proxies",
           "release_connections", "router", "seeds", "zk_servers"]
