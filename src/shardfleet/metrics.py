"""Prometheus metrics: the routers' own (an application registers them) and the fleet's
(the ``shardfleet exporter`` service reads ZooKeeper and the servers).

Both are plain functions from state to samples (:func:`router_samples`,
:func:`fleet_samples`); ``prometheus_client`` is imported only by the adapters that
serve them (:func:`register_router`, :func:`serve_fleet`), so an application that does
not use Prometheus needs nothing more. Exposing a router's metrics from an application
that already runs ``prometheus_client``::

    from shardfleet import metrics
    metrics.register_router(router, store)      # on prometheus_client's default REGISTRY

and without ``prometheus_client``: :func:`render` gives the text exposition format to
serve from any HTTP handler, ``metrics.render(metrics.router_samples(router, store))``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# name -> (type, help). One place names every metric the library exports.
METRICS: dict[str, tuple[str, str]] = {
    # -- a router (in the application)
    "shardfleet_router_map_version": ("gauge", "Version of the shard map the router holds"),
    "shardfleet_router_map_age_seconds": (
        "gauge", "Seconds since the router last took a new map"),
    "shardfleet_router_map_changes_total": ("counter", "Maps the router swapped in"),
    "shardfleet_router_refreshes_total": (
        "counter", "Reads of the map on demand (after a refused statement or a lost master)"),
    "shardfleet_router_refresh_failures_total": (
        "counter", "Reads of the map on demand that ZooKeeper did not answer"),
    "shardfleet_router_reroutes_total": (
        "counter", "Statements retried after a refusal (fenced, read-only) or a lost master"),
    "shardfleet_router_frozen_waits_total": (
        "counter", "Writes that found their range frozen and waited for the map"),
    "shardfleet_router_frozen_wait_seconds_total": (
        "counter", "Seconds writes waited on frozen ranges, summed"),
    "shardfleet_router_frozen_errors_total": (
        "counter", "ShardFrozenError raised: a write's range stayed frozen past frozen_wait"),
    "shardfleet_router_ended_in_flight_total": (
        "counter", "Statements ended because the map moved their master off their range "
        "(reported to the caller as may-have-happened, never retried)"),
    "shardfleet_router_pool_idle_connections": (
        "gauge", "Idle pooled connections per MySQL server"),
    "shardfleet_cache_requests_total": (
        "counter", "Cache lookups by cache and result (hit, miss)"),
    "shardfleet_cache_errors_total": ("counter", "Cache calls that failed (treated as misses)"),
    "shardfleet_cache_fills_total": ("counter", "Entries written to a cache after a miss"),
    # -- the fleet (the exporter)
    "shardfleet_up": ("gauge", "1 when the exporter read the map from ZooKeeper"),
    "shardfleet_map_version": ("gauge", "Version of the map znode"),
    "shardfleet_map_age_seconds": ("gauge", "Seconds since the map last changed"),
    "shardfleet_ranges": ("gauge", "Ranges of the map by state"),
    "shardfleet_range_frozen_seconds": (
        "gauge", "Seconds a range has been frozen (as seen by this exporter)"),
    "shardfleet_operations_in_flight": ("gauge", "Unfinished operations (journals) by kind"),
    "shardfleet_operation_journal_age_seconds": (
        "gauge", "Seconds since an unfinished operation's journal last moved"),
    "shardfleet_operation_last_finished_timestamp_seconds": (
        "gauge", "When the latest finished operation of a kind last moved its journal "
        "(Unix time; it rises when one finishes)"),
    "shardfleet_operations_finished": (
        "gauge", "Finished operations whose journals ZooKeeper still holds, by kind"),
    "shardfleet_server_up": ("gauge", "1 when the server answered the monitor user"),
    "shardfleet_server_writable": ("gauge", "1 when the server has read_only OFF"),
    "shardfleet_server_map_role": (
        "gauge", "1 for the role (master, standby) the map gives the server"),
    "shardfleet_pair_writable_nodes": ("gauge", "Writable nodes of a pair (1 is right)"),
    "shardfleet_pair_master_writable": ("gauge", "1 when the map's master is writable"),
    "shardfleet_replication_running": (
        "gauge", "1 when both threads of a replication channel run"),
    "shardfleet_replication_lag_transactions": (
        "gauge", "Transactions of the source's binlog a channel has not applied (by GTID)"),
    "shardfleet_replication_lag_seconds": ("gauge", "Seconds_Behind_Master of a channel"),
    "shardfleet_semisync_master_on": (
        "gauge", "1 when a server's semi-synchronous master is enabled and active"),
    "shardfleet_semisync_master_enabled": (
        "gauge", "1 when a server's semi-synchronous master is enabled (active or not)"),
    "shardfleet_rebuild_mark_seconds": (
        "gauge", "Seconds the map has marked a node for rebuild (at least: since the map "
        "last changed when this exporter first saw the mark)"),
    "shardfleet_zookeeper_serving": (
        "gauge", "1 when a ZooKeeper node serves (leader, follower, observer, standalone)"),
    "shardfleet_zookeeper_leader": (
        "gauge", "1 when a ZooKeeper node is the ensemble's leader (or standalone)"),
    "shardfleet_problems": ("gauge", "Problems status.problems found, by severity"),
    # -- memcached (no Debian exporter package: the exporter asks `stats`)
    "shardfleet_memcached_up": ("gauge", "1 when a memcached server answered stats"),
    "shardfleet_memcached_items": ("gauge", "Items a memcached server holds"),
    "shardfleet_memcached_bytes": ("gauge", "Bytes a memcached server's items use"),
    "shardfleet_memcached_limit_bytes": ("gauge", "Memory a memcached server may use (-m)"),
    "shardfleet_memcached_connections": ("gauge", "Open connections of a memcached server"),
    "shardfleet_memcached_gets_total": ("counter", "Gets a memcached server answered, by "
                                        "result (hit, miss)"),
    "shardfleet_memcached_evictions_total": (
        "counter", "Items a memcached server evicted to make room"),
}


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def _s(name: str, value: float, **labels: Any) -> Sample:
    assert name in METRICS, name
    return Sample(name, float(value), tuple(sorted((k, str(v)) for k, v in labels.items())))


def router_samples(router: Any, store: Any = None, *, now: float | None = None
                   ) -> list[Sample]:
    """A router's counters and gauges, and those of *store*'s caches (a
    :class:`~shardfleet.store.Store` over it), at this instant."""
    now = time.time() if now is None else now
    st = router.stats
    out = [
        _s("shardfleet_router_map_version", router.version),
        _s("shardfleet_router_map_age_seconds",
           max(0.0, now - st.map_changed_at) if st.map_changed_at else 0.0),
        _s("shardfleet_router_map_changes_total", st.map_changes),
        _s("shardfleet_router_refreshes_total", st.refreshes),
        _s("shardfleet_router_refresh_failures_total", st.refresh_failures),
        _s("shardfleet_router_reroutes_total", st.reroutes),
        _s("shardfleet_router_frozen_waits_total", st.frozen_waits),
        _s("shardfleet_router_frozen_wait_seconds_total", st.frozen_wait_seconds),
        _s("shardfleet_router_frozen_errors_total", st.frozen_errors),
        _s("shardfleet_router_ended_in_flight_total", st.ended_in_flight),
    ]
    out += [_s("shardfleet_router_pool_idle_connections", n, server=server)
            for server, n in sorted(router.pools().items())]
    for name, cache in (("object", getattr(store, "object_cache", None)),
                        ("mapping", getattr(store, "mapping_cache", None))):
        if cache is None:
            continue
        out += [_s("shardfleet_cache_requests_total", cache.stats.hits, cache=name,
                   result="hit"),
                _s("shardfleet_cache_requests_total", cache.stats.misses, cache=name,
                   result="miss"),
                _s("shardfleet_cache_errors_total", cache.health.errors, cache=name),
                _s("shardfleet_cache_fills_total", cache.stats.fills, cache=name)]
    return out


@dataclass
class FrozenClock:
    """When this exporter first saw each range frozen (the map does not say)."""

    since: dict[tuple[int, int], float] = field(default_factory=dict)

    def seen(self, frozen: Iterable[tuple[int, int]], now: float) -> dict[tuple[int, int], float]:
        keep = set(frozen)
        self.since = {b: self.since.get(b, now) for b in keep}
        return {b: now - t for b, t in self.since.items()}


@dataclass
class MarkClock:
    """Since when each node has been marked for rebuild. The map does not date the mark;
    a mark this exporter sees for the first time is in the map it read, so it was written
    at or before the map's last change: that time (when known) is a lower bound that
    survives an exporter restart, where "now" would start a day-long clock again."""

    since: dict[str, float] = field(default_factory=dict)

    def seen(self, marked: Iterable[str], now: float, first: float | None = None
             ) -> dict[str, float]:
        start = min(now, first) if first else now
        self.since = {n: self.since.get(n, start) for n in set(marked)}
        return {n: now - t for n, t in self.since.items()}


def fleet_samples(report: dict[str, Any] | None, *, map_mtime: float | None = None,
                  clock: FrozenClock | None = None, marks: MarkClock | None = None,
                  now: float | None = None) -> list[Sample]:
    """The fleet's state as metrics, from a :func:`shardfleet.status.collect` report
    (None: ZooKeeper could not be read, ``shardfleet_up`` 0)."""
    now = time.time() if now is None else now
    if report is None:
        return [_s("shardfleet_up", 0)]
    out = [_s("shardfleet_up", 1), _s("shardfleet_map_version", report.get("version", -1))]
    if map_mtime:
        out.append(_s("shardfleet_map_age_seconds", max(0.0, now - map_mtime)))
    ranges = [r for p in report.get("pairs") or [] for r in p["ranges"]]
    for state in ("open", "frozen", "closed"):
        out.append(_s("shardfleet_ranges", sum(r["state"] == state for r in ranges),
                      state=state))
    frozen = [tuple(r["range"]) for r in ranges if r["state"] == "frozen"]
    for (a, b), secs in sorted((clock or FrozenClock()).seen(frozen, now).items()):
        out.append(_s("shardfleet_range_frozen_seconds", secs, range=f"{a}-{b}"))
    kinds: dict[str, int] = {}
    for op in report.get("operations") or []:
        kinds[op["kind"]] = kinds.get(op["kind"], 0) + 1
        if op.get("updated_at"):
            out.append(_s("shardfleet_operation_journal_age_seconds",
                          max(0.0, now - float(op["updated_at"])), operation=op["name"]))
    out += [_s("shardfleet_operations_in_flight", n, kind=k) for k, n in sorted(kinds.items())]
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for op in report.get("finished_operations") or []:
        count[op["kind"]] = count.get(op["kind"], 0) + 1
        last[op["kind"]] = max(last.get(op["kind"], 0.0), float(op.get("updated_at") or 0))
    for k in sorted(count):
        out += [_s("shardfleet_operations_finished", count[k], kind=k),
                _s("shardfleet_operation_last_finished_timestamp_seconds", last[k], kind=k)]
    servers = report.get("servers") or {}
    names = report.get("labels") or {}
    roles: dict[str, str] = {}
    marked: dict[str, str] = {}  # node marked for rebuild -> its pair
    for pair in report.get("pairs") or []:
        label = pair.get("name") or f"{pair['master']}"
        nodes = [s for s in (pair["master"], pair["standby"]) if s]
        roles[pair["master"]] = "master"
        if pair["standby"]:
            roles[pair["standby"]] = "standby"
        writable = sum(1 for s in nodes if (servers.get(s) or {}).get("read_only") is False)
        ms = servers.get(pair["master"]) or {}
        out += [_s("shardfleet_pair_writable_nodes", writable, pair=label),
                _s("shardfleet_pair_master_writable", 1 if ms.get("read_only") is False else 0,
                   pair=label)]
        marked.update({str(r["rebuild"]): label for r in pair["ranges"] if r.get("rebuild")})
    for node, secs in sorted((marks or MarkClock()).seen(marked, now, map_mtime).items()):
        out.append(_s("shardfleet_rebuild_mark_seconds", secs, pair=marked[node], server=node))
    for server, st in sorted(servers.items()):
        host = names.get(server, {}).get("host", "")
        up = bool(st.get("reachable")) and not st.get("error")
        out.append(_s("shardfleet_server_up", 1 if up else 0, server=server, host=host))
        if not up:
            continue
        out.append(_s("shardfleet_server_writable", 0 if st.get("read_only") else 1,
                      server=server, host=host))
        if server in roles:
            out.append(_s("shardfleet_server_map_role", 1, server=server, role=roles[server]))
        out.append(_s("shardfleet_semisync_master_on",
                      1 if st.get("semisync_master") and
                      str(st.get("semisync_status")).upper() == "ON" else 0, server=server))
        out.append(_s("shardfleet_semisync_master_enabled",
                      1 if st.get("semisync_master") else 0, server=server))
        for ch in st.get("replicas") or []:
            lab = {"server": server, "channel": ch["connection"] or "default",
                   "source": ch.get("peer") or ch["source"]}
            ok = ch["io_running"] == "Yes" and ch["sql_running"] == "Yes"
            out.append(_s("shardfleet_replication_running", 1 if ok else 0, **lab))
            if ch.get("trx_behind") is not None:
                out.append(_s("shardfleet_replication_lag_transactions", ch["trx_behind"],
                              **lab))
            if ch.get("seconds_behind") is not None:
                out.append(_s("shardfleet_replication_lag_seconds", ch["seconds_behind"],
                              **lab))
    for z in report.get("zookeeper") or []:
        mode = z.get("mode")
        out += [_s("shardfleet_zookeeper_serving",
                   1 if mode in ("leader", "follower", "observer", "standalone") else 0,
                   node=z["server"]),
                _s("shardfleet_zookeeper_leader", 1 if mode in ("leader", "standalone") else 0,
                   node=z["server"])]
    sev = {"critical": 0, "warning": 0}
    for p in report.get("problems") or []:
        sev[p["severity"]] = sev.get(p["severity"], 0) + 1
    out += [_s("shardfleet_problems", n, severity=k) for k, n in sorted(sev.items())]
    return out


def memcached_samples(stats: Iterable[dict[str, Any]]) -> list[Sample]:
    """Metrics of memcached servers from :func:`shardfleet.topology.memcached_stats`."""
    out: list[Sample] = []
    names = {"curr_items": "shardfleet_memcached_items", "bytes": "shardfleet_memcached_bytes",
             "limit_maxbytes": "shardfleet_memcached_limit_bytes",
             "curr_connections": "shardfleet_memcached_connections",
             "evictions": "shardfleet_memcached_evictions_total"}
    for st in stats:
        server = st["server"]
        up = "error" not in st
        out.append(_s("shardfleet_memcached_up", 1 if up else 0, server=server))
        if not up:
            continue
        out += [_s(name, st[k], server=server) for k, name in names.items() if k in st]
        out += [_s("shardfleet_memcached_gets_total", st[k], server=server, result=r)
                for k, r in (("get_hits", "hit"), ("get_misses", "miss")) if k in st]
    return out


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: Iterable[Sample]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of *samples*."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    lines = []
    for name, group in by_name.items():
        kind, text = METRICS[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for s in group:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
            lines.append(f"{name}{{{labels}}} {s.value!r}" if labels else f"{name} {s.value!r}")
    return "\n".join(lines) + "\n"


class _Collector:
    """A prometheus_client collector over a function returning samples."""

    def __init__(self, samples: Callable[[], list[Sample]]) -> None:
        self._samples = samples

    def describe(self) -> list[Any]:
        return []  # unchecked collector: the names depend on the state

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        by_name: dict[str, list[Sample]] = {}
        for s in self._samples():
            by_name.setdefault(s.name, []).append(s)
        for name, group in by_name.items():
            kind, text = METRICS[name]
            keys = [k for k, _ in group[0].labels]
            if kind == "counter":
                fam: Any = CounterMetricFamily(name.removesuffix("_total"), text, labels=keys)
            else:
                fam = GaugeMetricFamily(name, text, labels=keys)
            for s in group:
                fam.add_metric([v for _, v in s.labels], s.value)
            yield fam


def register_router(router: Any, store: Any = None, registry: Any = None) -> Any:
    """Register a router's (and *store*'s caches') metrics on a prometheus_client registry
    (default: its global REGISTRY); returns the collector (``registry.unregister`` it)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811
    collector = _Collector(lambda: router_samples(router, store))
    registry.register(collector)
    return collector


class FleetExporter:
    """The fleet's metrics, collected at most every *interval* seconds (a scrape in
    between gets the last collection: the servers are asked once per interval however
    many Prometheus servers scrape)."""

    def __init__(self, collect: Callable[[], dict[str, Any] | None],
                 changed_at: Callable[[], float | None] | None = None, *,
                 interval: float = 10.0, memcached: Iterable[str] = ()) -> None:
        self._collect = collect
        self.memcached = list(memcached)
        self._changed_at = changed_at
        self.interval = interval
        self.clock = FrozenClock()
        self.marks = MarkClock()
        self._last: tuple[float, str] | None = None
        self._lock = threading.Lock()

    def text(self) -> str:
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.interval:
                self._last = (now, render(self._samples()))
            return self._last[1]

    def _samples(self) -> list[Sample]:
        from shardfleet import topology
        from shardfleet.errors import ShardfleetError

        caches = memcached_samples(topology.memcached_stats(m) for m in self.memcached)
        try:
            report = self._collect()
            mtime = self._changed_at() if self._changed_at else None
        except ShardfleetError:
            return fleet_samples(None) + caches
        return fleet_samples(report, map_mtime=mtime, clock=self.clock,
                             marks=self.marks) + caches


def serve(exporter: FleetExporter, host: str, port: int) -> Any:
    """An HTTP server answering ``GET /metrics`` with *exporter*'s text (and 404
    elsewhere); the caller runs ``serve_forever()`` and ``shutdown()``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics")
                return
            body = exporter.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # quiet: one line per scrape is noise
            return

    return ThreadingHTTPServer((host, port), Handler)
