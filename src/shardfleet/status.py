"""The fleet's state in one report: used by the ``shard_info`` module and
``shardfleet status`` (same facts; the command renders them as a table)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardfleet import replication, topology
from shardfleet.errors import ShardfleetError
from shardfleet.mapstore import MapStore
from shardfleet.shardmap import freeze_owner
from shardfleet.tls import TLS


def collect(store: MapStore, user: str, password: str, *, extra_servers: list[str] | None = None,
            sizes: bool = True, zookeeper_hosts: list[str] | None = None,
            timeout: float = 5.0, labels: dict[str, dict[str, str]] | None = None,
            tls: TLS | None = None) -> dict[str, Any]:
    """The map (the source of truth) and what every server says, side by side.

    *extra_servers* are reported besides the map's (an inventory's nodes the map does
    not name yet); *labels* give a server (``host:port``) the names people know it by
    (``{"host": inventory name, "pair": pair name}``). The report carries
    ``problems``: where the servers and the map disagree (:func:`problems`). *tls*: the
    client TLS options of every MySQL connection (:mod:`shardfleet.tls`)."""
    v = store.read()
    m = v.map
    servers: list[str] = sorted(set((m.servers() if m else set()) | set(extra_servers or [])))
    with ThreadPoolExecutor(max_workers=8) as pool:
        states = dict(zip(servers, pool.map(
            lambda s: topology.server_state(s, user, password, timeout=timeout,
                                            with_sizes=sizes, tls=tls).to_dict(),
            servers), strict=True))
        zk_nodes = [h.strip() for hs in (zookeeper_hosts or []) for h in hs.split(",")
                    if h.strip()]
        zk = list(pool.map(topology.zookeeper_mode, zk_nodes))
    names = labels or {}
    for st in states.values():
        for ch in st.get("replicas") or []:
            ch["peer"] = _channel_peer(ch, states, names)
            ch["trx_behind"] = trx_behind(states.get(ch["peer"] or ""), st)
    pairs: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in (m.ranges if m else ()):
        key = (r.master, r.standby)
        entry = pairs.setdefault(key, {"master": r.master, "standby": r.standby, "ranges": []})
        rng: dict[str, Any] = {"range": [r.first, r.last], "state": r.state}
        if r.extra.get("rebuild"):
            rng["rebuild"] = r.extra["rebuild"]
        if r.state == "frozen":
            rng["frozen_by"] = freeze_owner(r)
        entry["ranges"].append(rng)
    pair_list = []
    by_first = sorted(pairs.items(), key=lambda kv: kv[1]["ranges"][0]["range"])
    for (master, standby), entry in by_first:
        entry["master_state"] = states.get(master)
        entry["standby_state"] = states.get(standby) if standby else None
        pair_names = {names.get(s, {}).get("pair") for s in (master, standby) if s}
        entry["name"] = pair_names.pop() if len(pair_names) == 1 else None
        pair_list.append(entry)
    named = (m.servers() if m else set())
    unmapped = [s for s in servers if s not in named]
    running, done = _operations(store)
    ops_list = [{"name": op.name, "kind": op.kind, "step": op.step,
                 "servers": list(op.servers), "updated_at": op.updated_at}
                for op in running]
    report = {"map": m.to_dict() if m else None, "version": v.version, "pairs": pair_list,
              "servers": states, "unmapped": unmapped, "labels": names, "zookeeper": zk,
              "operations": ops_list, "finished_operations": done}
    report["problems"] = problems(report)
    return report


def _channel_peer(ch: dict[str, Any], states: dict[str, dict[str, Any]],
                  names: dict[str, dict[str, str]]) -> str | None:
    """The server (as the map names it) a replication channel reads from. A channel names
    its source as the role configured it (a host name, an address); the source's server
    id (once connected) names it exactly, else the inventory name or the address."""
    sid = ch.get("source_server_id") or 0
    if sid:
        same = [s for s, st in states.items() if st.get("server_id") == sid]
        if len(same) == 1:
            return same[0]
    if ch["source"] in states:
        return str(ch["source"])
    host, _, port = str(ch["source"]).rpartition(":")
    named = [s for s, n in names.items() if n.get("host") == host and s.endswith(f":{port}")]
    return named[0] if len(named) == 1 else None


def _operations(store: MapStore) -> tuple[list[Any], list[dict[str, Any]]]:
    """The journals' operations, unfinished and finished (a store without journals has
    none)."""
    if getattr(store, "client", None) is None:
        return [], []
    from shardfleet import ops
    return ops.operations(store)  # type: ignore[arg-type]


def trx_behind(source: dict[str, Any] | None, replica: dict[str, Any] | None) -> int | None:
    """How many transactions of *source*'s binlog *replica* has not applied, by GTID
    (summed over the source's domains); None when either position is unknown."""
    if not source or not replica or not source.get("gtid_binlog_pos"):
        return None
    try:
        have = replication.parse_gtids(replica.get("gtid_binlog_pos") or "")
        for d, (srv, n) in replication.parse_gtids(replica.get("gtid_slave_pos") or "").items():
            if n > have.get(d, (0, -1))[1]:
                have[d] = (srv, n)
        want = replication.parse_gtids(source["gtid_binlog_pos"])
    except ShardfleetError:
        return None
    return sum(max(0, n - have.get(d, (0, 0))[1]) for d, (_, n) in want.items())


# How far behind a standby may fall (transactions, by GTID) before it is worth a warning.
LAG_WARN_TRX = 1000

CRITICAL, WARNING = "critical", "warning"


def problems(report: dict[str, Any]) -> list[dict[str, str]]:
    """Where the servers and the map disagree, or the fleet is not as the design wants it:
    ``[{"severity": "critical"|"warning", "text": ...}]``, critical first.

    Critical: a pair with two writable nodes; the map's master read-only or unreachable
    or failing to answer; a node of a pair that does not replicate from the other (both
    ways), unless the map marks it for rebuild; a channel whose IO or SQL thread stopped.
    Warning: a node marked for rebuild (it does not replicate until rebuild-standby.yml
    runs); a frozen range; an operation in flight; a semi-synchronous master that fell
    back to asynchronous; a standby far behind; a ZooKeeper node not serving; a server
    of the inventory the map does not name that is writable or unreachable."""
    out: list[dict[str, str]] = []

    def add(sev: str, text: str) -> None:
        out.append({"severity": sev, "text": text})

    names = report.get("labels") or {}

    def who(server: str | None) -> str:
        host = names.get(server or "", {}).get("host")
        return f"{server} ({host})" if host else str(server)

    for pair in report.get("pairs") or []:
        master, standby = pair["master"], pair["standby"]
        ms, ss = pair.get("master_state") or {}, pair.get("standby_state") or {}
        ranges = ",".join(f"{r['range'][0]}-{r['range'][1]}" for r in pair["ranges"])
        label = f"{pair.get('name') or 'pair'} (ranges {ranges})"
        marked = {r["rebuild"] for r in pair["ranges"] if r.get("rebuild")}
        for r in pair["ranges"]:
            if r["state"] == "frozen":
                add(WARNING, f"{label}: range {r['range'][0]}-{r['range'][1]} is frozen"
                    f"{' by ' + str(r['frozen_by']) if r.get('frozen_by') else ' by hand'}: "
                    "writes to it are held")
        for role, server, st in (("master", master, ms), ("standby", standby, ss)):
            if server is None:
                continue
            if server in marked:
                add(WARNING, f"{label}: {role} {who(server)} is marked for rebuild "
                    "(run rebuild-standby.yml)")
                continue
            if not st.get("reachable"):
                add(CRITICAL, f"{label}: {role} {who(server)} (per the map) is unreachable"
                    f"{': ' + str(st.get('error')) if st.get('error') else ''}")
                continue
            if st.get("error"):
                add(CRITICAL, f"{label}: {role} {who(server)} did not answer: {st['error']}")
                continue
            peer = standby if role == "master" else master
            chans = st.get("replicas") or []
            for ch in chans:
                if ch["io_running"] != "Yes" or ch["sql_running"] != "Yes":
                    name = ch["connection"] or "default"
                    add(CRITICAL, f"{label}: {who(server)} channel {name} from {ch['source']}"
                        f" has IO={ch['io_running'] or '-'} SQL={ch['sql_running'] or '-'}"
                        f"{': ' + ch['last_error'] if ch.get('last_error') else ''}")
            if peer and peer not in marked and not any(ch.get("peer") == peer for ch in chans):
                add(CRITICAL, f"{label}: {role} {who(server)} does not replicate from "
                    f"{who(peer)} (a pair replicates both ways)")
            for ch in chans:
                lag = ch.get("trx_behind")
                if role == "standby" and ch.get("peer") == master and lag and lag > LAG_WARN_TRX:
                    add(WARNING, f"{label}: standby {who(server)} is {lag} transactions "
                        f"behind {who(master)}")
        if ms.get("reachable") and not ms.get("error"):
            if ms.get("read_only") and master not in marked:
                add(CRITICAL, f"{label}: master {who(master)} (per the map) is read-only: "
                    "writes to its ranges fail")
            if ms.get("semisync_master") and str(ms.get("semisync_status")).upper() == "OFF":
                add(WARNING, f"{label}: master {who(master)} has semi-synchronous "
                    "replication on but fell back to asynchronous")
        if (standby and ss.get("reachable") and not ss.get("error")
                and ss.get("read_only") is False):
            both = "two writable nodes: " if ms.get("read_only") is False else ""
            add(CRITICAL, f"{label}: {both}standby {who(standby)} (per the map) is writable")
    for server in report.get("unmapped") or []:
        st = (report.get("servers") or {}).get(server) or {}
        if not st.get("reachable"):
            add(WARNING, f"{who(server)} (named by no range) is unreachable")
        elif st.get("read_only") is False:
            add(WARNING, f"{who(server)} (named by no range) is writable")
    for op in report.get("operations") or []:
        add(WARNING, f"operation in flight: {op['kind']} {op['name']} at step {op['step']} "
            f"on {', '.join(op['servers'])} (`shardfleet ops show {op['name']}`)")
    for z in report.get("zookeeper") or []:
        if z.get("mode") not in ("leader", "follower", "standalone", "observer"):
            add(WARNING, f"ZooKeeper {z['server']} is {z.get('mode')}"
                f"{': ' + str(z['error']) if z.get('error') else ''}")
    out.sort(key=lambda p: p["severity"] != CRITICAL)
    return out


def _channel(ch: dict[str, Any], names: dict[str, dict[str, str]]) -> str:
    """One replication channel: ``'name' <- source: IO/SQL, lag``."""
    peer = ch.get("peer")
    host = names.get(peer or "", {}).get("host")
    if peer and peer != ch["source"]:  # the channel's own name for it, then the map's
        host = f"{peer}{', ' + host if host else ''}"
    lag = ch.get("trx_behind")
    secs = ch.get("seconds_behind")
    behind = (f"{lag} trx behind" if lag is not None else "lag unknown") + (
        f", {secs} s" if secs not in (None, 0) else "")
    err = f" ERROR {ch['last_error']}" if ch.get("last_error") else ""
    return (f"{ch['connection'] or 'default'} <- {ch['source']}"
            f"{' (' + host + ')' if host else ''}: "
            f"{ch['io_running'] or '-'}/{ch['sql_running'] or '-'}, {behind}{err}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _server_line(role: str, server: str, st: dict[str, Any] | None,
                 names: dict[str, dict[str, str]]) -> list[str]:
    """A server's row (what the map calls it, then what the server says) and one line per
    replication channel."""
    s = st or {}
    host = names.get(server, {}).get("host", "-")
    head = f"  {role:<8} {host:<16} {server:<22}"
    if not s.get("reachable"):
        return [f"{head} DOWN {s.get('error') or ''}".rstrip()]
    if s.get("error"):
        return [f"{head} ERROR {s['error']}"]
    ro = "ON" if s.get("read_only") else "off"
    semi = ("master " if s.get("semisync_master") else "") + (
        "replica " if s.get("semisync_replica") else "")
    semi = f"{semi.strip().replace(' ', '+')}:{s.get('semisync_status') or '-'}" \
        if semi else "off"
    lines = [f"{head} read_only={ro:<3} semisync={semi:<10} shards={s.get('shards', '-')} "
             f"{_size(int(s.get('shard_bytes') or 0))}"]
    chans = s.get("replicas") or []
    lines += [f"             channel {_channel(ch, names)}" for ch in chans] or \
        ["             channel none"]
    return lines


def render(report: dict[str, Any]) -> str:
    """The fleet as the map sees it, for people (the on-call engineer at 3 a.m.): per
    pair its ranges and state, then the map's master and standby with what each server
    says (read_only, semi-sync, every replication channel with its IO/SQL threads and its
    lag by GTID); servers the map does not name; operations in flight; ZooKeeper; and
    last, every problem (:func:`problems`)."""
    names = report.get("labels") or {}
    pairs = report.get("pairs") or []
    if report.get("map") is None:
        lines = ["no shard map in ZooKeeper (the shards play registers it)"]
    else:
        nranges = sum(len(p["ranges"]) for p in pairs)
        lines = [f"map version {report['version']}: {nranges} range(s) on {len(pairs)} pair(s)"]
    for pair in pairs:
        ranges = ", ".join(
            f"{r['range'][0]}-{r['range'][1]} {r['state']}"
            + (f" (frozen by {r['frozen_by']})" if r.get("frozen_by") else "")
            + (f" (rebuild {r['rebuild']})" if r.get("rebuild") else "")
            for r in pair["ranges"])
        lines.append("")
        lines.append(f"PAIR {pair.get('name') or '?'}: {ranges}")
        lines += _server_line("master", pair["master"], pair.get("master_state"), names)
        if pair.get("standby"):
            lines += _server_line("standby", pair["standby"], pair.get("standby_state"), names)
        else:
            lines.append("  standby  none")
    unmapped = report.get("unmapped") or []
    if unmapped:
        lines.append("")
        lines.append("NOT IN THE MAP")
        for server in unmapped:  # the role column names the inventory's pair, if any
            lines += _server_line(names.get(server, {}).get("pair") or "-", server,
                                  (report.get("servers") or {}).get(server), names)
    ops_list = report.get("operations") or []
    lines.append("")
    lines.append("operations in flight: " + (", ".join(
        f"{o['kind']} {o['name']} (step {o['step']})" for o in ops_list) or "none"))
    if report.get("zookeeper"):
        lines.append("zookeeper: " + ", ".join(f"{z['server']}={z['mode']}"
                                              for z in report["zookeeper"]))
    found = report.get("problems")
    if found is None:
        found = problems(report)
    lines.append("")
    if found:
        lines.append(f"PROBLEMS ({len(found)}):")
        lines += [f"  {p['severity'].upper():<8} {p['text']}" for p in found]
    else:
        lines.append("PROBLEMS: none (the servers agree with the map)")
    return "\n".join(lines)
