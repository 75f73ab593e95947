"""The fleet's state in one report: used by the ``shard_info`` module and
``shardfleet status`` (same facts; the command renders them as a table)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardfleet import topology
from shardfleet.mapstore import MapStore


def collect(store: MapStore, user: str, password: str, *, extra_servers: list[str] | None = None,
            sizes: bool = True, zookeeper_hosts: list[str] | None = None,
            timeout: float = 5.0) -> dict[str, Any]:
    v = store.read()
    m = v.map
    servers: list[str] = sorted(set((m.servers() if m else set()) | set(extra_servers or [])))
    with ThreadPoolExecutor(max_workers=8) as pool:
        states = dict(zip(servers, pool.map(
            lambda s: topology.server_state(s, user, password, timeout=timeout,
                                            with_sizes=sizes).to_dict(), servers), strict=True))
        zk_nodes = [h.strip() for hs in (zookeeper_hosts or []) for h in hs.split(",")
                    if h.strip()]
        zk = list(pool.map(topology.zookeeper_mode, zk_nodes))
    pairs: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in (m.ranges if m else ()):
        key = (r.master, r.standby)
        entry = pairs.setdefault(key, {"master": r.master, "standby": r.standby, "ranges": []})
        entry["ranges"].append({"range": [r.first, r.last], "state": r.state})
    pair_list = []
    by_first = sorted(pairs.items(), key=lambda kv: kv[1]["ranges"][0]["range"])
    for (master, standby), entry in by_first:
        entry["master_state"] = states.get(master)
        entry["standby_state"] = states.get(standby) if standby else None
        pair_list.append(entry)
    return {"map": m.to_dict() if m else None, "version": v.version, "pairs": pair_list,
            "servers": states, "zookeeper": zk}


def _repl(state: dict[str, Any] | None, peer: str | None) -> str:
    if not state or not state.get("reachable"):
        return "DOWN"
    if state.get("error"):
        return "error"
    chans = state.get("replicas") or []
    if not chans:
        return "no replica"
    parts = []
    for c in chans:
        ok = c["io_running"] == "Yes" and c["sql_running"] == "Yes"
        lag = c["seconds_behind"]
        parts.append(("ok" if ok else f"IO={c['io_running']} SQL={c['sql_running']}")
                     + (f" lag={lag}s" if lag not in (None, 0) else ""))
    return ", ".join(parts)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render(report: dict[str, Any]) -> str:
    """A fixed-width table for people (the on-call engineer at 3 a.m.)."""
    lines = [f"map version {report['version']}"]
    rows = [("RANGES", "STATE", "ROLE", "SERVER", "RO", "SEMISYNC", "REPLICATION", "SHARDS",
             "SIZE")]
    for pair in report["pairs"]:
        ranges = ",".join(f"{r['range'][0]}-{r['range'][1]}" for r in pair["ranges"])
        st = ",".join(sorted({r["state"] for r in pair["ranges"]}))
        for role, server, state in (("master", pair["master"], pair["master_state"]),
                                    ("standby", pair["standby"], pair["standby_state"])):
            if server is None:
                continue
            s = state or {}
            ro = "-" if s.get("read_only") is None else ("ON" if s["read_only"] else "off")
            semi = s.get("semisync_status") or "-"
            rows.append((ranges if role == "master" else "", st if role == "master" else "",
                         role, server, ro, semi, _repl(state, None),
                         str(s.get("shards", "-")), _size(int(s.get("shard_bytes") or 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if report.get("zookeeper"):
        lines.append("")
        lines.append("zookeeper: " + ", ".join(f"{z['server']}={z['mode']}"
                                              for z in report["zookeeper"]))
    return "\n".join(lines)
