"""Where the shard map lives: a backend interface, ZooKeeper and in-memory implementations.

Every write is a compare-and-set on the stored version and validates the map
before anything is sent. Watches follow kazoo ``DataWatch`` semantics: the
callback runs once at once with the current map, then again on each new
version, and the watch survives session loss (kazoo re-arms it).

Layout in ZooKeeper, under a configurable root (default ``/shardfleet``)::

    /shardfleet/<cluster>/map                 the map's JSON (one znode per cluster)
    /shardfleet/<cluster>/ops/journal/<name>  an operation's journal (JSON)
    /shardfleet/<cluster>/ops/locks/<name>    kazoo Lock: one operation at a time per server
    /shardfleet/<cluster>/ops/fence/<name>    fencing token: bumped by each lock holder

The paths are built here only (:meth:`ZooKeeperMapStore.ops_node`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from shardfleet import shardmap
from shardfleet.errors import (
    FenceMoved,
    MapConflictError,
    MapError,
    MapStoreUnavailable,
    MapWriteUnknown,
)
from shardfleet.shardmap import ShardMap

log = logging.getLogger(__name__)

NO_NODE = -1  # expected version meaning "the map does not exist yet"
MapCallback = Callable[[ShardMap | None, int], None]


@dataclass(frozen=True)
class Versioned:
    """A map with the store version it was read at (``NO_NODE`` when absent)."""

    map: ShardMap | None
    version: int


class MapStore(Protocol):
    """The backend interface of the shard map."""

    def read(self) -> Versioned:
        """The current map and version; raises MapStoreUnavailable, MapError."""

    def write(self, new: ShardMap, expected_version: int) -> int:
        """Store *new* if the stored version is still *expected_version*; return the new version.

        Raises MapConflictError if another writer got there first.
        """

    def watch(self, callback: MapCallback) -> None:
        """Call *callback(map, version)* now and on every change."""

    def close(self) -> None: ...


class MemoryMapStore:
    """An in-process store with the same semantics, for unit tests."""

    def __init__(self, initial: ShardMap | None = None) -> None:
        self._lock = threading.Lock()
        self._data: bytes | None = initial.to_bytes() if initial else None
        self._version = 0 if initial else NO_NODE
        self._watchers: list[MapCallback] = []
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise MapStoreUnavailable("memory map store is marked unavailable")

    def read(self) -> Versioned:
        self._check()
        with self._lock:
            data, version = self._data, self._version
        return Versioned(shardmap.loads(data) if data is not None else None, version)

    def write(self, new: ShardMap, expected_version: int) -> int:
        self._check()
        data = shardmap.loads(new.to_bytes()).to_bytes()  # validate the serialised form
        with self._lock:
            if expected_version != self._version:
                raise MapConflictError(
                    f"map version is {self._version}, expected {expected_version}")
            self._data = data
            self._version += 1
            version, watchers = self._version, list(self._watchers)
        for cb in watchers:
            cb(new, version)
        return version

    def watch(self, callback: MapCallback) -> None:
        with self._lock:
            self._watchers.append(callback)
        if self.available:  # like ZooKeeper's: an absent store delivers later, not an error
            v = self.read()
            callback(v.map, v.version)

    def close(self) -> None:
        self._watchers.clear()


class ZooKeeperMapStore:
    """The shard map in ZooKeeper (kazoo).

    *hosts* is a kazoo host string (``"127.0.0.1:2181,10.0.0.2:2181"``). *auth* is
    ``("user", "password")`` for the digest scheme; when given, znodes this store
    creates get an ACL that lets that user do everything and *read_acl_world*
    lets anyone read. The client keeps reconnecting in the background after a
    failed start, so a watch set while ZooKeeper is away fires once it is back.
    """

    def __init__(self, hosts: str, cluster: str = "default", *, root: str = "/shardfleet",
                 auth: tuple[str, str] | None = None, timeout: float = 5.0,
                 read_acl_world: bool = True) -> None:
        from kazoo.client import KazooClient
        from kazoo.retry import KazooRetry

        if not cluster or "/" in cluster:
            raise MapError(f"cluster name {cluster!r} must be non-empty and have no '/'")
        self.root = "/" + root.strip("/")
        self.cluster = cluster
        self.path = f"{self.root}/{cluster}/map"
        self.ops_path = f"{self.root}/{cluster}/ops"
        self.where = hosts  # the connect string as given, for messages
        self.timeout = timeout
        self._auth = auth
        self._read_acl_world = read_acl_world
        auth_data = [("digest", f"{auth[0]}:{auth[1]}")] if auth else None
        try:
            self.client = KazooClient(
                hosts=hosts, timeout=max(timeout, 4.0), auth_data=auth_data,
                connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
                command_retry=KazooRetry(max_tries=2, max_delay=1.0),
            )
        except ValueError as exc:
            raise MapError(f"invalid ZooKeeper hosts {hosts!r}: {exc}") from None
        self._start()
        # kazoo's own exit hook joins its worker threads, which wait forever on a
        # watch retrying against an absent ensemble; stopping the client first
        # (exit hooks run last-registered first) fails those waits and lets the
        # process exit.
        atexit.register(self.close)

    def _start(self) -> None:
        event = self.client.start_async()
        event.wait(self.timeout)
        if not self.client.connected:
            log.warning("ZooKeeper at %s did not answer within %.1fs; retrying in background",
                        self.where, self.timeout)

    @property
    def connected(self) -> bool:
        return bool(self.client.connected)

    OPS_KINDS = ("journal", "locks", "fence")

    def ops_node(self, kind: str, name: str = "") -> str:
        """The znode of an operation's *kind* (``journal``, ``locks``, ``fence``) named
        *name* (the folder when empty): every path under ``ops/`` is built here."""
        if kind not in self.OPS_KINDS:
            raise MapError(f"unknown operation znode kind {kind!r}")
        if "/" in name:
            raise MapError(f"operation znode name {name!r} must have no '/'")
        return f"{self.ops_path}/{kind}/{name}" if name else f"{self.ops_path}/{kind}"

    def session(self) -> int | None:
        """The id of the client's current ZooKeeper session (None before the first): it
        changes when a session expires and the client starts a new one."""
        cid = self.client.client_id
        return int(cid[0]) if cid else None

    def acl(self) -> list[Any] | None:
        """The ACL for znodes this store creates (None: ZooKeeper's open default)."""
        if not self._auth:
            return None
        from kazoo.security import ACL, Id, Permissions, make_digest_acl

        acl = [make_digest_acl(self._auth[0], self._auth[1], all=True)]
        if self._read_acl_world:
            acl.append(ACL(Permissions.READ, Id("world", "anyone")))
        return acl

    def _wait(self, request: Callable[[], Any], what: str, *, read: bool = False) -> Any:
        """Send *request* (a kazoo ``*_async`` call) once a session is up, and wait for its
        reply; all the waits share one bound, ``timeout``.

        A store that is between sessions (a slow first connect, a leader election, a busy
        machine) waits for the next one instead of failing at once. The request is sent
        only when connected, so "unreachable" means it was never sent; "did not answer"
        or a lost connection after sending means it may have been applied. A *read*
        changes nothing: one whose connection drops (a heartbeat missed on a loaded
        machine, ZooKeeper still up, the session alive) is sent again once connected,
        within the same bound. An expired session is never papered over: what the old
        session held (an ephemeral node) is gone, and the caller must know.
        """
        from kazoo.exceptions import ConnectionLoss

        deadline = time.monotonic() + self.timeout
        while True:
            while not self.client.connected:
                if time.monotonic() >= deadline or self.client.state == "CLOSED":
                    raise MapStoreUnavailable(
                        f"ZooKeeper at {self.where} is unreachable ({what}; no session "
                        f"within {self.timeout}s)")
                time.sleep(0.05)
            try:
                return request().get(timeout=max(0.5, deadline - time.monotonic()))
            except self.client.handler.timeout_exception:
                raise MapStoreUnavailable(
                    f"ZooKeeper at {self.where} did not answer within {self.timeout}s "
                    f"({what})") from None
            except ConnectionLoss:
                if not read or time.monotonic() >= deadline or self.client.state == "CLOSED":
                    raise
                log.warning("ZooKeeper connection lost (%s); sending it again once connected",
                            what)
                time.sleep(0.05)  # the client may not have seen the loss yet

    def sync(self) -> None:
        """Make the next read see every write the ensemble committed before this call
        (ZooKeeper ``sync``: a read after a lost reply must not come from a lagging
        follower)."""
        try:
            self._wait(lambda: self.client.sync_async(self.path), f"sync {self.path}",
                       read=True)
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost (sync): {exc}") from None

    def _errors(self) -> tuple[type[BaseException], ...]:
        from kazoo.exceptions import ConnectionLoss, SessionExpiredError

        return (ConnectionLoss, SessionExpiredError)

    def read_raw(self, path: str) -> tuple[bytes | None, int]:
        """Read any znode: (data, version), (None, NO_NODE) when absent."""
        from kazoo.exceptions import NoAuthError, NoNodeError

        try:
            data, stat = self._wait(lambda: self.client.get_async(path), f"read {path}",
                                    read=True)
        except NoNodeError:
            return None, NO_NODE
        except NoAuthError:
            raise MapStoreUnavailable(f"ZooKeeper refused to read {path}: not authorised") from None
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost reading {path}: {exc}") from None
        return data, stat.version

    def changed_at(self, path: str | None = None) -> float | None:
        """When a znode (default: the map) was last written, as time.time(); None when it
        is absent."""
        where = path or self.path
        try:
            stat = self._wait(lambda: self.client.exists_async(where), f"stat {where}",
                              read=True)
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost reading {where}: {exc}") from None
        return stat.mtime / 1000.0 if stat is not None else None

    def children(self, path: str) -> list[str]:
        """The children of any znode ([] when it is absent), bounded by ``timeout`` like
        every other read: a client between sessions does not wait forever."""
        from kazoo.exceptions import NoAuthError, NoNodeError

        try:
            return list(self._wait(lambda: self.client.get_children_async(path),
                                   f"list {path}", read=True))
        except NoNodeError:
            return []
        except NoAuthError:
            raise MapStoreUnavailable(f"ZooKeeper refused to list {path}: not authorised") from None
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost listing {path}: {exc}") from None

    def write_raw(self, path: str, data: bytes, expected_version: int, *,
                  checks: tuple[tuple[str, int], ...] = ()) -> int:
        """Compare-and-set any znode (create when *expected_version* is NO_NODE).

        *checks*: (path, version) pairs that must still hold, in the same ZooKeeper
        transaction as the write (a fencing token): when one moved nothing is written
        and :class:`FenceMoved` is raised."""
        from kazoo.exceptions import BadVersionError, NoAuthError, NodeExistsError, NoNodeError

        if checks:
            return self._write_fenced(path, data, expected_version, checks)
        try:
            if expected_version == NO_NODE:
                self._ensure_parent(path)
                self._wait(lambda: self.client.create_async(path, data, acl=self.acl()),
                           f"create {path}")
                return 0
            stat = self._wait(lambda: self.client.set_async(path, data, version=expected_version),
                              f"write {path}")
            return int(stat.version)
        except (BadVersionError, NodeExistsError, NoNodeError):
            cur = self.read_raw(path)[1]
            raise MapConflictError(f"{path} is at version {cur}, expected {expected_version}: "
                                   "another writer changed it; read it again") from None
        except NoAuthError:
            raise MapStoreUnavailable(
                f"ZooKeeper refused to write {path}: not authorised (check the credential)"
            ) from None
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost writing {path}: {exc}") from None

    def _write_fenced(self, path: str, data: bytes, expected_version: int,
                      checks: tuple[tuple[str, int], ...]) -> int:
        """:meth:`write_raw` with its *checks*, as one transaction."""
        from kazoo.exceptions import NoAuthError, RolledBackError

        if expected_version == NO_NODE:
            self._ensure_parent(path)

        def request() -> Any:
            t = self.client.transaction()
            for p, v in checks:
                t.check(p, v)
            if expected_version == NO_NODE:
                t.create(path, data, acl=self.acl())
            else:
                t.set_data(path, data, version=expected_version)
            return t.commit_async()

        try:
            results = self._wait(request, f"write {path} (fenced)")
        except self._errors() as exc:
            raise MapStoreUnavailable(f"ZooKeeper connection lost writing {path}: {exc}") from None
        *checked, written = results
        moved = [p for (p, _), r in zip(checks, checked, strict=True)
                 if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if moved:
            raise FenceMoved(f"{', '.join(moved)} moved: another run took these servers' "
                             f"locks; {path} not written")
        if isinstance(written, NoAuthError):
            raise MapStoreUnavailable(f"ZooKeeper refused to write {path}: not authorised")
        if isinstance(written, Exception):
            cur = self.read_raw(path)[1]
            raise MapConflictError(f"{path} is at version {cur}, expected {expected_version}: "
                                   "another writer changed it; read it again")
        return 0 if expected_version == NO_NODE else int(written.version)

    def delete_raw(self, path: str, expected_version: int = -1) -> None:
        from kazoo.exceptions import BadVersionError, NoNodeError

        try:
            self._wait(lambda: self.client.delete_async(path, version=expected_version),
                       f"delete {path}")
        except NoNodeError:
            return
        except BadVersionError:
            raise MapConflictError(f"{path} changed while deleting it") from None

    def _ensure_parent(self, path: str) -> None:
        from kazoo.exceptions import NodeExistsError

        parent = path.rsplit("/", 1)[0]
        parts = [p for p in parent.split("/") if p]
        cur = ""
        for p in parts:
            cur += "/" + p
            if self._wait(partial(self.client.exists_async, cur), f"exists {cur}",
                          read=True) is None:
                try:
                    self._wait(partial(self.client.create_async, cur, b"", acl=self.acl()),
                               f"create {cur}")
                except NodeExistsError:
                    pass

    # -- MapStore --------------------------------------------------------
    def read(self) -> Versioned:
        data, version = self.read_raw(self.path)
        if data is None:
            return Versioned(None, NO_NODE)
        return Versioned(shardmap.loads(data), version)

    def write(self, new: ShardMap, expected_version: int) -> int:
        data = new.to_bytes()
        shardmap.loads(data)  # validate exactly what will be stored
        return self.write_raw(self.path, data, expected_version)

    def watch(self, callback: MapCallback) -> None:
        """Watch the map znode; *callback(map or None, version)* runs on each version.

        The kazoo DataWatch is set up once ZooKeeper answers (at once if it does
        now), in a background thread so that a caller is never blocked by an
        absent ensemble. An invalid map is logged and skipped.
        """
        from kazoo.recipe.watchers import DataWatch

        def on_data(data: bytes | None, stat: Any, *event: Any) -> None:
            if data is None or stat is None:
                callback(None, NO_NODE)
                return
            try:
                m = shardmap.loads(data)
            except MapError as exc:
                log.error("ignoring invalid map version %s at %s: %s", stat.version,
                          self.path, exc)
                return
            callback(m, stat.version)

        def establish() -> None:
            DataWatch(self.client, self.path, on_data)

        threading.Thread(target=establish, name="shardfleet-map-watch", daemon=True).start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the client. Bounded: a watch still retrying against an absent
        ensemble must not hold the caller (kazoo's threads are daemons)."""
        def stop() -> None:
            try:
                self.client.stop()
                self.client.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("error closing ZooKeeper client", exc_info=True)

        atexit.unregister(self.close)
        t = threading.Thread(target=stop, name="shardfleet-zk-close", daemon=True)
        t.start()
        t.join(timeout)


@dataclass(frozen=True)
class Updated:
    """What :func:`update` left: the map and version it ends on, and whether it changed it
    (``changed`` is also True when a lost reply's write was found applied)."""

    map: ShardMap
    version: int
    changed: bool


Edit = Callable[[ShardMap], "ShardMap | None"]


def update(store: MapStore, edit: Edit, *, attempts: int = 20,
           settle_timeout: float | None = None) -> Updated:
    """The one read-modify-CAS loop every map change goes through.

    *edit* is a pure, idempotent function of the current map (the vocabulary in
    :class:`~shardfleet.shardmap.ShardMap`: ``freeze``, ``thaw``, ``flip``): it returns
    the new map, or the same map / None when nothing needs to change ("no change
    needed" is a result, not an error). A lost compare-and-set re-reads and re-applies
    the edit. A write whose reply is lost (connection loss, timeout) may or may not
    have been applied: the loop re-reads after a ``sync`` and decides by content: if
    the edit has nothing left to do the write landed (or another writer did the same),
    otherwise it tries again. If the store cannot be read again within
    *settle_timeout* (default: three times the store's timeout) it raises
    :class:`MapWriteUnknown`. An edit that raises (MapError) stops the loop with
    nothing written by this attempt.
    """
    settle = settle_timeout if settle_timeout is not None else 3 * float(
        getattr(store, "timeout", 5.0))
    for _ in range(attempts):
        cur = store.read()
        if cur.map is None:
            raise MapError("there is no shard map in the store")
        new = edit(cur.map)
        if new is None or new == cur.map:
            return Updated(cur.map, cur.version, False)
        try:
            return Updated(new, store.write(new, cur.version), True)
        except MapConflictError:
            continue
        except MapStoreUnavailable as exc:
            log.warning("map write at version %s: reply lost (%s); reading the map again",
                        cur.version, exc)
            after = _read_settled(store, settle, exc)
            if after.map is not None and after.version != cur.version:
                again = edit(after.map)
                if again is None or again == after.map:
                    return Updated(after.map, after.version, True)
    raise MapConflictError(f"the map kept changing under this edit ({attempts} "
                           "compare-and-set attempts lost)")


def _read_settled(store: MapStore, timeout: float, cause: Exception) -> Versioned:
    """Read the map after a ``sync``, retrying until *timeout*; MapWriteUnknown after."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sync = getattr(store, "sync", None)
            if sync is not None:
                sync()
            return store.read()
        except MapStoreUnavailable as exc:
            if time.monotonic() >= deadline:
                raise MapWriteUnknown(
                    f"a map write was sent but its reply was lost ({cause}), and the map "
                    f"could not be read again within {timeout:.0f}s ({exc}): it may or may "
                    "not have been applied") from None
            time.sleep(0.2)


@dataclass(frozen=True)
class Changed:
    """What :func:`change_ranges` did: the map before and after, the version it ends on
    (``NO_NODE`` when there is no map), and whether the stored map changed."""

    before: ShardMap | None
    after: ShardMap
    version: int
    changed: bool


def change_ranges(store: MapStore, state: str, entries: list[dict[str, Any]], *,
                  known_hosts: list[str] | None = None, mod_shard_count: int | None = None,
                  check: bool = False) -> Changed:
    """Register, replace or remove ranges (:func:`shardmap.plan_change`) through the one
    read-modify-CAS loop (:func:`update`): what ``shard_map`` and ``open-range.yml`` do.

    A write whose reply is lost is decided by content, so a rerun, or the loop itself,
    never applies the change twice and never reports a change it lost. A plan that
    fails validation (an overlap, a hole) raises :class:`MapError` before anything is
    written. *check*: plan only. With no map yet, the first map is created (a lost
    race to create it is retried as an update of the map that won).
    """
    def edit(m: ShardMap | None) -> ShardMap:
        return shardmap.plan_change(m, state, entries, known_hosts=known_hosts,
                                    mod_shard_count=mod_shard_count)

    cur = store.read()
    planned = edit(cur.map)
    if check or planned == cur.map:
        return Changed(cur.map, planned, cur.version, cur.map is None or planned != cur.map)
    if cur.map is None:
        try:
            return Changed(None, planned, store.write(planned, NO_NODE), True)
        except MapConflictError:
            cur = store.read()  # someone created it first: edit theirs
        except MapStoreUnavailable as exc:
            after = _read_settled(store, 3 * float(getattr(store, "timeout", 5.0)), exc)
            if after.map is not None and edit(after.map) == after.map:
                return Changed(None, after.map, after.version, True)
            cur = after
    before = cur.map
    done = update(store, edit)
    return Changed(before, done.map, done.version, done.changed)
