"""Caches in front of the shards: objects in memcache, mapping pages in Redis.

Each half of the application-layer join has its own cache, as the design splits
them:

* :class:`ObjectCache` — object bodies (the raw JSON text of the row) in
  memcached, through pymemcache's ``HashClient`` over the memcached group.
  Read-through: one multi-get (every server's request sent before any reply is
  read), the database only for the misses, then a fill.
* :class:`MappingCache` — the newest ``capacity`` entries of one mapping list
  (``board_has_pins`` of one board) as a Redis sorted set, with a marker that
  says whether the set holds the whole list. ``add``/``remove`` keep it right
  after the commit.

Both are optional: :class:`~shardfleet.store.Store` works with neither.

Failure policy (both caches): a cache that cannot be reached, times out or
answers nonsense is a **miss**, logged (a warning when it starts failing, debug
lines while it stays down, info when it answers again), never an error for the
caller. A write whose invalidation could not reach the cache succeeds; the
stale entry is then bounded by the entry's TTL (see ``docs/caching.md``).

Consistency, and the race this module closes (the classic one: a reader misses,
reads the old row, a writer commits and invalidates, the reader then fills the
old row back in):

* objects: an invalidation does not delete the key, it writes a short-lived
  **tombstone** (``tombstone_ttl`` seconds), and fills use memcache ``add``,
  which does nothing while any value, tombstone included, is there. A fill that
  read the database before the commit therefore cannot land after the
  invalidation unless it arrives more than ``tombstone_ttl`` seconds late.
* mapping lists: every change bumps a per-list **generation** counter in Redis in
  the same Lua script that edits the set; a reader notes the generation in the
  same atomic read (a Lua script) that found the miss, and its fill (a Lua script) writes only if
  the generation is unchanged. No timing window.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TOMBSTONE = b"\x00tomb"  # never valid JSON, so never mistaken for a body
MAX_EXACT_SCORE = 2**53  # Redis scores are doubles: larger sequences bypass the cache


class _Health:
    """Failure bookkeeping and logging of one cache: warn once, then quiet until it recovers."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False
        self.errors = 0
        self._lock = threading.Lock()

    def failed(self, action: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            first = not self.failing
            self.failing = True
        if first:
            log.warning("%s: %s failed (%s: %s); treating it as a miss",
                        self.what, action, type(exc).__name__, exc)
        else:
            log.debug("%s: %s failed again (%s)", self.what, action, exc)

    def ok(self) -> None:
        if self.failing:
            self.failing = False
            log.info("%s answers again", self.what)


@dataclass
class CacheStats:
    """Counters of one cache (approximate under threads: plain integer adds)."""

    hits: int = 0
    misses: int = 0
    fills: int = 0
    invalidations: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def reset(self) -> None:
        self.hits = self.misses = self.fills = self.invalidations = 0


class FastRendezvousHash:
    """Rendezvous (highest random weight) hashing with MD5 from C.

    pymemcache's default ``RendezvousHash`` computes murmur3 in pure Python, once
    per key per server: about 1 ms for a 50-key multi-get on two servers, more
    than the round trips. MD5 gives the same properties (a key moves only when
    its server leaves) at a few microseconds per key.
    """

    MEMO_MAX = 65536  # remembered placements (key -> node); about 10 MB when full

    def __init__(self, nodes: Iterable[str] | None = None, seed: int = 0) -> None:
        self.nodes: list[str] = []
        self._salts: dict[str, bytes] = {}
        self._ring: tuple[tuple[str, bytes], ...] = ()
        self._memo: dict[str | bytes, str | None] = {}
        for n in nodes or ():
            self.add_node(n)

    def _changed(self) -> None:
        # ring before memo: a reader that sees the new memo computes on the new ring; one
        # that still holds the old memo writes into a dict nobody reads any more
        self._ring = tuple((n, self._salts[n]) for n in self.nodes)
        self._memo = {}

    def add_node(self, node: str) -> None:
        if node not in self._salts:
            self.nodes.append(node)
            self._salts[node] = f"{node}-".encode()
            self._changed()

    def remove_node(self, node: str) -> None:
        if node in self._salts:
            self.nodes.remove(node)
            del self._salts[node]
            self._changed()

    def get_node(self, key: str | bytes) -> str | None:
        """The node of *key*: remembered (a page's keys recur), else the highest MD5 score.
        The memory is dropped whenever a node comes or goes, and when it is full."""
        memo = self._memo
        best = memo.get(key)
        if best is not None:
            return best
        raw = key.encode() if isinstance(key, str) else key
        best_score = b""
        for node, salt in self._ring:
            score = hashlib.md5(salt + raw, usedforsecurity=False).digest()
            if score > best_score:
                best, best_score = node, score
        if len(memo) >= self.MEMO_MAX:
            self._memo = memo = {}
        memo[key] = best
        return best


def _hash_client_class() -> Any:
    from pymemcache.client.hash import HashClient

    class _LoggingHashClient(HashClient):
        """HashClient whose per-server failures are logged and become the default value.

        pymemcache's ``ignore_exc=True`` would swallow errors silently;
        ``ignore_exc=False`` makes a multi-get lose the other servers' hits when one
        server fails. Overriding ``_safely_run_func`` (pymemcache 4.x) keeps the
        ring's retry / mark-dead / re-add logic and turns each failure into a logged
        miss for that server only.
        """

        health: _Health

        def _safely_run_func(self, client: Any, func: Any, default_val: Any,
                             *args: Any, **kwargs: Any) -> Any:
            try:
                result = super()._safely_run_func(client, func, default_val, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the cache's failure policy
                self.health.failed(f"memcached {client.server}", exc)
                return default_val
            return result

        def get_many(self, keys: Sequence[str], gets: bool = False,
                     *args: Any, **kwargs: Any) -> dict[Any, Any]:
            """A multi-get with every server's request in flight at once.

            One ``get k1 k2 ...`` per server is sent before any reply is read, so the
            servers work at the same time (pymemcache's ``HashClient.get_many`` asks
            them one after the other); the replies are then read in turn. Each phase
            of each server goes through ``_safely_run_func``, so the ring's
            retry / mark-dead policy and the failure logging stay as for any other
            command, and a failing server is a miss for its keys only. Keys are not
            re-checked (they are made by :meth:`ObjectCache.key`: ASCII, no spaces,
            short). Values come back as the raw bytes stored (the object cache stores
            bytes only, so no serde applies).
            """
            if gets or args or kwargs:
                return dict(super().get_many(keys, gets, *args, **kwargs))
            if self._dead_clients:
                self._retry_dead()
            batches: dict[str, list[str]] = {}
            get_node = self.hasher.get_node
            for key in keys:
                node = get_node(key)
                if node is not None:
                    batches.setdefault(node, []).append(key)
            sent: list[_MultiGet] = []
            out: dict[Any, Any] = {}
            try:
                for node, batch in batches.items():
                    mg = _MultiGet(self.clients[node], batch)
                    if self._safely_run_func(mg.client, mg.send, False):
                        sent.append(mg)
                for mg in sent:
                    out.update(self._safely_run_func(mg.client, mg.read, {}))
            finally:
                for mg in sent:
                    mg.release()
            return out

        def add_many(self, values: dict[str, bytes], expire: int) -> None:
            """``add`` of many keys, one pipelined write per server, without replies
            (``noreply``: a fill is best effort). pymemcache has ``set_many`` but no
            ``add_many``; the commands are written here, as for the multi-get (keys
            from :meth:`ObjectCache.key`, values bytes stored with flags 0, as
            pymemcache stores bytes)."""
            if self._dead_clients:
                self._retry_dead()
            batches: dict[str, list[bytes]] = {}
            get_node = self.hasher.get_node
            tail = b" 0 %d " % expire
            for key, value in values.items():
                node = get_node(key)
                if node is not None:
                    batches.setdefault(node, []).append(
                        b"add " + key.encode() + tail + b"%d noreply\r\n" % len(value)
                        + value + b"\r\n")
            for node, parts in batches.items():
                client = self.clients[node]
                self._safely_run_func(client, _send_noreply, None, client, b"".join(parts))

    return _LoggingHashClient


class _MultiGet:
    """One server's part of a parallel multi-get: :meth:`send` the request on a pooled
    connection, :meth:`read` the reply later, :meth:`release` the connection (back to
    the pool after a full reply, destroyed otherwise: a reply left unread would be
    read by the next command).

    Relies on pymemcache 4.x as pinned by ``tests/unit/test_cache_contract.py`` and
    ``tests/integration/test_cache.py::test_pymemcache_socket_contract``: a
    ``PooledClient`` has ``client_pool`` (``get``/``release``/``destroy``) of
    ``Client`` objects whose ``sock`` is the connected socket (None until a command
    connects it, and again after ``close()``; its timeout is the client's).
    """

    __slots__ = ("client", "keys", "conn", "done")

    def __init__(self, client: Any, keys: list[str]) -> None:
        self.client = client
        self.keys = keys
        self.conn: Any = None
        self.done = False

    def send(self) -> bool:
        conn = _checkout(self.client)
        try:
            conn.sock.sendall(("get " + " ".join(self.keys) + "\r\n").encode())
        except BaseException:
            _checkin(self.client, conn, ok=False)
            raise
        self.conn = conn
        return True

    def read(self) -> dict[str, bytes]:
        out = _read_values(self.conn.sock)
        self.done = True
        return out

    def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            _checkin(self.client, conn, ok=self.done)


class MemcacheReplyError(Exception):
    """A memcached reply to a multi-get that is not ``VALUE``/``END`` (the server said
    ``ERROR``, ``CLIENT_ERROR`` or ``SERVER_ERROR``, or sent something else)."""


def _read_values(sock: Any) -> dict[str, bytes]:
    """Read one ``get`` reply (``VALUE <key> <flags> <bytes>\\r\\n<data>\\r\\n``... ``END``)
    from *sock*; ``{key: data}``. A closed connection raises ``ConnectionError`` (an
    ``OSError``, so the ring counts it as a server failure, like a timeout)."""
    buf = b""
    pos = 0
    out: dict[str, bytes] = {}
    recv = sock.recv
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            chunk = recv(262144)
            if not chunk:
                raise ConnectionError("memcached closed the connection mid-reply")
            buf = buf[pos:] + chunk
            pos = 0
            continue
        if buf.startswith(b"VALUE ", pos):
            parts = buf[pos + 6:eol].split()
            start = eol + 2
            end = start + int(parts[2])
            while len(buf) < end + 2:
                chunk = recv(max(262144, end + 2 - len(buf)))
                if not chunk:
                    raise ConnectionError("memcached closed the connection mid-reply")
                buf += chunk
            out[parts[0].decode()] = buf[start:end]
            pos = end + 2
        elif buf.startswith(b"END\r\n", pos):
            if eol + 2 != len(buf):
                raise MemcacheReplyError("memcached sent bytes after END")
            return out
        else:
            raise MemcacheReplyError(f"memcached answered {buf[pos:eol][:64]!r}")


def _checkout(client: Any) -> Any:
    """A connected pymemcache ``Client`` of *client* (from its pool when it has one)."""
    pool = getattr(client, "client_pool", None)
    conn = pool.get() if pool is not None else client
    try:
        if conn.sock is None:
            conn.version()  # a public command connects it (a new connection only)
    except BaseException:
        _checkin(client, conn, ok=False)
        raise
    return conn


def _checkin(client: Any, conn: Any, ok: bool) -> None:
    """Back to the pool after a complete exchange; closed (destroyed) otherwise."""
    pool = getattr(client, "client_pool", None)
    if pool is None:
        if not ok:
            conn.close()
    elif ok:
        pool.release(conn)
    else:
        pool.destroy(conn)  # closes it (the pool's after_remove)


def _send_noreply(client: Any, payload: bytes) -> None:
    conn = _checkout(client)
    try:
        conn.sock.sendall(payload)
    except BaseException:
        _checkin(client, conn, ok=False)
        raise
    _checkin(client, conn, ok=True)


def _server_tuple(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    return host.strip("[]"), int(port)


class ObjectCache:
    """Object bodies in memcached (pymemcache ``HashClient`` over *servers*).

    Keyword arguments (documented defaults):

    * ``ttl`` (21600 s) — lifetime of a cached body; bounds any stale entry.
    * ``tombstone_ttl`` (5 s) — lifetime of the tombstone an invalidation writes;
      a read-fill that arrives later than this after an invalidation can still
      put back the old body (until ``ttl``).
    * ``connect_timeout`` / ``timeout`` (0.25 s) — per-operation socket limits.
    * ``retry_attempts`` (2), ``retry_timeout`` (1 s), ``dead_timeout`` (30 s) —
      HashClient's ring policy: a failing server is skipped for ``retry_timeout``,
      removed from the ring after ``retry_attempts`` failures (its keys move to
      the others) and tried again after ``dead_timeout``.
    * ``prefix`` (``sf1:o:``) — key prefix; change it to drop every entry at once.
    * ``client`` — a ready HashClient-like object instead of *servers* (tests).
    """

    def __init__(self, servers: Sequence[str] = (), *, ttl: int = 21600,
                 tombstone_ttl: int = 5, connect_timeout: float = 0.25, timeout: float = 0.25,
                 retry_attempts: int = 2, retry_timeout: float = 1.0, dead_timeout: float = 30.0,
                 prefix: str = "sf1:o:", max_pool_size: int = 16, client: Any = None) -> None:
        self.ttl = int(ttl)
        self.tombstone_ttl = int(tombstone_ttl)
        if not (prefix.isascii() and prefix.isprintable() and " " not in prefix
                and len(prefix) <= 200):
            # keys go on the wire unchecked (the multi-get and the fills write them)
            raise ValueError(f"object cache prefix {prefix!r} must be printable ASCII "
                             "without spaces, at most 200 characters")
        self.prefix = prefix
        self.health = _Health("object cache")
        self.stats = CacheStats()
        if client is None:
            if not servers:
                raise ValueError("ObjectCache needs memcached servers (host:port) or a client")
            cls = _hash_client_class()
            client = cls([_server_tuple(s) for s in servers], connect_timeout=connect_timeout,
                         timeout=timeout, retry_attempts=retry_attempts,
                         retry_timeout=retry_timeout, dead_timeout=dead_timeout,
                         use_pooling=True, max_pool_size=max_pool_size, ignore_exc=False,
                         no_delay=True, hasher=FastRendezvousHash)
            client.health = self.health
        self.client = client

    def key(self, object_id: int) -> str:
        return f"{self.prefix}{object_id}"

    def _call(self, action: str, fn: Any, *args: Any, default: Any = None, **kw: Any) -> Any:
        try:
            out = fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - a dead cache is a miss, never an error
            self.health.failed(action, exc)
            return default
        return out

    # -- reads -------------------------------------------------------------
    def get(self, object_id: int) -> bytes | None:
        """The cached raw body, or None (miss, tombstone, or cache unavailable)."""
        raw = self._call("get", self.client.get, self.key(object_id))
        if raw is None or raw[:1] == b"\x00":
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return bytes(raw)

    def get_many(self, object_ids: Iterable[int]) -> dict[int, bytes]:
        """``{id: raw body}`` for the IDs found; one ``get`` per memcached server, all of
        them sent before any reply is read (the servers answer at the same time)."""
        keys = {self.key(i): i for i in object_ids}
        got = self._call("get_many", self.client.get_many, list(keys), default={}) or {}
        out: dict[int, bytes] = {}
        for k, raw in got.items():
            if raw is not None and raw[:1] != b"\x00":
                ks = k.decode() if isinstance(k, bytes) else k
                oid = keys.get(ks)
                if oid is not None:
                    out[oid] = bytes(raw)
        self.stats.hits += len(out)
        self.stats.misses += len(keys) - len(out)
        return out

    # -- fills -------------------------------------------------------------
    def fill(self, object_id: int, raw: str | bytes) -> None:
        """Cache a body read from the database, unless any value (or tombstone) is there.

        Uses ``add`` without waiting for the reply: a fill is best effort.
        """
        data = raw.encode() if isinstance(raw, str) else raw
        self._call("add", self.client.add, self.key(object_id), data, expire=self.ttl,
                   noreply=True)
        self.stats.fills += 1

    def fill_many(self, bodies: Mapping[int, str | bytes]) -> None:
        """:meth:`fill` of many bodies: one pipelined ``add`` per server when the client can."""
        add_many = getattr(self.client, "add_many", None)
        if add_many is None:
            for object_id, raw in bodies.items():
                self.fill(object_id, raw)
            return
        values = {self.key(i): (r.encode() if isinstance(r, str) else r)
                  for i, r in bodies.items()}
        self._call("add_many", add_many, values, self.ttl)
        self.stats.fills += len(values)

    # -- invalidation --------------------------------------------------------
    def invalidate(self, object_id: int) -> bool:
        """After a commit: replace the entry with a tombstone. False if the cache was away."""
        self.stats.invalidations += 1
        ok = self._call("invalidate", self.client.set, self.key(object_id), TOMBSTONE,
                        expire=self.tombstone_ttl, noreply=False, default=False)
        if not ok:
            log.warning("object cache: could not invalidate %s; a stale entry may live "
                        "until its TTL (%ss)", object_id, self.ttl)
        return bool(ok)

    def close(self) -> None:
        self._call("close", self.client.close)


# --------------------------------------------------------------------------
# Mapping pages in Redis
# --------------------------------------------------------------------------

# KEYS: zset, meta, gen. ARGV: member, score, capacity, gen_ttl.
# Keeps the set a prefix (the newest entries) of the list after an add.
_ADD_LUA = """
redis.call('INCR', KEYS[3]); redis.call('EXPIRE', KEYS[3], ARGV[4])
local meta = redis.call('GET', KEYS[2])
if not meta then redis.call('DEL', KEYS[1]); return 0 end
local score = tonumber(ARGV[2])
if meta == 'P' then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #oldest == 0 then redis.call('DEL', KEYS[1], KEYS[2]); return 0 end
  local os = tonumber(oldest[2])
  if score < os or (score == os and ARGV[1] < oldest[1]) then
    redis.call('ZREM', KEYS[1], ARGV[1]); return 1
  end
end
redis.call('ZADD', KEYS[1], score, ARGV[1])
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
local n = redis.call('ZCARD', KEYS[1])
local cap = tonumber(ARGV[3])
if n > cap then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - cap - 1)
  redis.call('SET', KEYS[2], 'P', 'KEEPTTL')
end
return 1
"""

# KEYS: zset, meta, gen. ARGV: member, gen_ttl.
_REMOVE_LUA = """
redis.call('INCR', KEYS[3]); redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# KEYS: zset, meta, gen. ARGV: gen_ttl.
_INVALIDATE_LUA = """
redis.call('INCR', KEYS[3]); redis.call('EXPIRE', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

# KEYS: zset, meta, gen. ARGV: expected gen ('' = none), 'C' or 'P', ttl,
# "score member score member ..." (one string: packing 2 x N arguments costs redis-py
# more than the round trip). Writes only if no change committed since the reader looked
# (the generation is unchanged). ZADD in chunks: one Lua unpack of more than ~8,000
# values fails ("too many results to unpack").
_FILL_LUA = """
local g = redis.call('GET', KEYS[3]) or ''
if g ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local batch, n = {}, 0
for score, member in string.gmatch(ARGV[4], '(%S+) (%S+)') do
  batch[n + 1] = score; batch[n + 2] = member; n = n + 2
  if n >= 1000 then redis.call('ZADD', KEYS[1], unpack(batch, 1, n)); n = 0 end
end
if n > 0 then redis.call('ZADD', KEYS[1], unpack(batch, 1, n)) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""

# KEYS: zset, meta, gen. ARGV: how many, [max score]. One atomic read; the entries come
# back as one "member score member score ..." string: a reply of 2 x N bulk strings
# costs redis-py's pure-Python parser more than the round trip.
_READ_LUA = """
local rows
if ARGV[2] then
  rows = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[2], '-inf', 'WITHSCORES', 'LIMIT', 0,
                    tonumber(ARGV[1]))
else
  rows = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
end
return {redis.call('GET', KEYS[2]) or false, redis.call('GET', KEYS[3]) or false,
        table.concat(rows, ' ')}
"""

UNAVAILABLE: Any = object()  # a lookup token: the cache could not be asked, do not fill


@dataclass
class CachedPage:
    """Entries served from Redis: (to_id, sequence) newest first, and whether more follow."""

    rows: list[tuple[int, int]]
    more: bool


def _member(to_id: int) -> str:
    # zero-padded so Redis' tie order (member, descending) is the database's (to_id DESC)
    return f"{to_id:020d}"


def redis_options(socket_timeout: float = 0.25) -> dict[str, Any]:
    """redis-py options for a cache client: short timeouts and no client-side retries.

    redis-py retries failed commands with backoff by default; for a cache that
    only multiplies the cost of a dead server, so the failure policy here is a
    single attempt, then a miss.
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0)}


class PendingFill:
    """A :meth:`MappingCache.fill_begin` whose reply is still on its connection."""

    __slots__ = ("cache", "conn", "keys", "args")

    def __init__(self, cache: MappingCache, conn: Any, keys: list[str], args: list[Any]
                 ) -> None:
        self.cache, self.conn, self.keys, self.args = cache, conn, keys, args

    def wait(self) -> bool:
        """Read the fill's reply and give the connection back; True if the list was
        cached. Never raises: a failure is logged and Redis skipped for a while, as for
        :meth:`MappingCache.fill`. A script Redis no longer holds (``NOSCRIPT``, after a
        restart or ``SCRIPT FLUSH``) is run again the ordinary way, which loads it."""
        from redis.exceptions import NoScriptError

        mc, conn = self.cache, self.conn
        if conn is None:
            return False
        self.conn = None
        pool = mc.client.connection_pool
        try:
            out = conn.read_response()
        except NoScriptError:
            pool.release(conn)
            return mc.fill_args(self.keys, self.args)
        except Exception as exc:  # noqa: BLE001 - a dead cache is a miss, never an error
            conn.disconnect()
            pool.release(conn)
            mc._failed("fill", exc)
            return False
        pool.release(conn)
        mc.health.ok()
        mc.stats.fills += 1
        return bool(out)


class MappingCache:
    """The newest entries of mapping lists in Redis (redis-py).

    Per ``(mapping, from_id)`` three keys share one hash tag (so a Redis Cluster
    keeps them in one slot): a sorted set ``member=to_id, score=sequence`` of the
    newest ``capacity`` entries, a marker (``C``: the set is the whole list,
    ``P``: the newest ``capacity`` of a longer list) and a generation counter.

    Keyword arguments (documented defaults):

    * ``capacity`` (200) — entries kept per list; pages beyond it read the database.
    * ``ttl`` (3600 s) — lifetime of a cached list; the generation lives twice as long.
    * ``socket_timeout`` (0.25 s) — per-command limit.
    * ``retry_after`` (2 s) — after a failure, calls skip Redis (misses, and
      skipped invalidations, logged) for this long instead of paying a timeout
      each time.
    * ``prefix`` (``sf1:m:``).

    *client* is a ``redis.Redis`` or a URL (``redis://:password@host:port/0``).
    """

    def __init__(self, client: Any, *, capacity: int = 200, ttl: int = 3600,
                 socket_timeout: float = 0.25, retry_after: float = 2.0,
                 prefix: str = "sf1:m:") -> None:
        import redis

        if isinstance(client, str):
            client = redis.Redis.from_url(client, **redis_options(socket_timeout))
        if not 1 <= capacity <= 5000:
            raise ValueError("capacity must be in 1..5000")
        self.client = client
        self.capacity = capacity
        self.ttl = int(ttl)
        self.retry_after = retry_after
        self.prefix = prefix
        self.health = _Health("mapping cache")
        self.stats = CacheStats()
        self._down_until = 0.0
        self._add = client.register_script(_ADD_LUA)
        self._remove = client.register_script(_REMOVE_LUA)
        self._invalidate = client.register_script(_INVALIDATE_LUA)
        self._fill = client.register_script(_FILL_LUA)
        self._read = client.register_script(_READ_LUA)

    def keys(self, name: str, from_id: int) -> list[str]:
        tag = f"{self.prefix}{{{name}:{from_id}}}"
        return [tag + ":z", tag + ":m", tag + ":g"]

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, action: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_after
        self.health.failed(action, exc)

    def _run(self, action: str, fn: Any, *args: Any, **kw: Any) -> Any:
        if not self._available():
            return UNAVAILABLE
        try:
            out = fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - a dead cache is a miss, never an error
            self._failed(action, exc)
            return UNAVAILABLE
        self.health.ok()
        return out

    # -- reads -------------------------------------------------------------
    def lookup(self, name: str, from_id: int, limit: int,
               cursor: tuple[int, int] | None = None) -> tuple[CachedPage | None, Any]:
        """A page from the cache, or ``(None, token)`` on a miss.

        *token* is the list's generation as seen by this lookup (read atomically
        with the entries, in one Lua script); pass it to :meth:`fill`. It is
        :data:`UNAVAILABLE` when Redis could not be asked.
        """
        extra = 8  # entries tied with the cursor's sequence that the filter may drop
        args = [limit + 1] if cursor is None else [limit + 1 + extra, cursor[0]]
        res = self._run("lookup", self._read, keys=self.keys(name, from_id), args=args)
        if res is UNAVAILABLE:
            self.stats.misses += 1
            return None, UNAVAILABLE
        meta, gen, packed = res
        parts = packed.split() if packed else []
        entries = [(parts[i], float(parts[i + 1])) for i in range(0, len(parts), 2)]
        token = gen.decode() if gen is not None else ""
        if meta is None:
            self.stats.misses += 1
            return None, token
        rows = [(int(m), int(s)) for m, s in entries]
        fetched = len(rows)
        if cursor is not None:
            seq, to = cursor
            rows = [(t, s) for t, s in rows if s < seq or (s == seq and t < to)]
        if len(rows) > limit:
            self.stats.hits += 1
            return CachedPage(rows[:limit], True), token
        asked = limit + 1 if cursor is None else limit + 1 + extra
        if meta == b"C" and fetched < asked:
            self.stats.hits += 1
            return CachedPage(rows, False), token
        self.stats.misses += 1
        return None, token

    def fill(self, name: str, from_id: int, rows: Sequence[tuple[int, int]], complete: bool,
             token: Any) -> bool:
        """Cache the newest entries read from the database, if nothing changed meanwhile.

        *rows* are ``(to_id, sequence)`` newest first, at most ``capacity``;
        *complete* says they are the whole list.
        """
        if token is UNAVAILABLE or any(abs(s) >= MAX_EXACT_SCORE for _, s in rows):
            return False
        packed = " ".join(f"{seq} {to_id:020d}" for to_id, seq in rows[: self.capacity])
        args: list[Any] = [token, "C" if complete else "P", self.ttl, packed]
        return self.fill_args(self.keys(name, from_id), args)

    def fill_args(self, keys: list[str], args: list[Any]) -> bool:
        """The fill script on prepared keys and arguments (see :meth:`fill`)."""
        out = self._run("fill", self._fill, keys=keys, args=args)
        if out is UNAVAILABLE:
            return False
        self.stats.fills += 1
        return bool(out)

    def fill_begin(self, name: str, from_id: int, rows: Sequence[tuple[int, int]],
                   complete: bool, token: Any) -> PendingFill | None:
        """:meth:`fill`, sent now and answered later: the script's ``EVALSHA`` is written
        on a connection taken from the client's pool and its reply is left on the
        socket until :meth:`PendingFill.wait`. A cold page sends it before the objects
        half (memcached, then MySQL) and reads it after, so Redis runs the fill while
        the page waits on the other servers instead of costing a round trip of its
        own. Uses redis-py's public ``ConnectionPool.get_connection`` / ``release`` and
        ``Connection.send_command`` / ``read_response`` (pinned by
        tests/integration/test_cache.py). None: nothing was sent (nothing to do, or
        Redis is away); the same refusals as :meth:`fill` apply.
        """
        if token is UNAVAILABLE or any(abs(s) >= MAX_EXACT_SCORE for _, s in rows):
            return None
        if not self._available():
            return None
        packed = " ".join(f"{seq} {to_id:020d}" for to_id, seq in rows[: self.capacity])
        args: list[Any] = [token, "C" if complete else "P", self.ttl, packed]
        keys = self.keys(name, from_id)
        pool = self.client.connection_pool
        conn = None
        try:
            conn = pool.get_connection()
            conn.send_command("EVALSHA", self._fill.sha, len(keys), *keys, *args)
        except Exception as exc:  # noqa: BLE001 - a dead cache is a miss, never an error
            if conn is not None:
                conn.disconnect()
                pool.release(conn)
            self._failed("fill", exc)
            return None
        return PendingFill(self, conn, keys, args)

    # -- after commits -------------------------------------------------------
    def added(self, name: str, from_id: int, to_id: int, sequence: int) -> bool:
        """After ``from_id -> to_id`` was added (or re-sequenced) and committed."""
        if abs(sequence) >= MAX_EXACT_SCORE:
            return self.invalidate(name, from_id)
        out = self._run("add", self._add, keys=self.keys(name, from_id),
                        args=[_member(to_id), sequence, self.capacity, self.ttl * 2])
        return self._after_write(out, name, from_id)

    def removed(self, name: str, from_id: int, to_id: int) -> bool:
        """After ``from_id -> to_id`` was removed and committed."""
        out = self._run("remove", self._remove, keys=self.keys(name, from_id),
                        args=[_member(to_id), self.ttl * 2])
        return self._after_write(out, name, from_id)

    def invalidate(self, name: str, from_id: int) -> bool:
        """Drop the cached list (and bump its generation so in-flight fills are refused)."""
        self.stats.invalidations += 1
        out = self._run("invalidate", self._invalidate, keys=self.keys(name, from_id),
                        args=[self.ttl * 2])
        return self._after_write(out, name, from_id)

    def _after_write(self, out: Any, name: str, from_id: int) -> bool:
        if out is UNAVAILABLE:
            log.warning("mapping cache: could not update %s of %s after a commit; a stale "
                        "list may live until its TTL (%ss)", name, from_id, self.ttl)
            return False
        return True

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead cache
            pass
