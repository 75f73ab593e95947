"""The fleet's hosts against what holds the fleet's data: which of them may be removed,
and which names and addresses a new host may not take.

A host holds data the fleet cannot lose when

* the map names its address as the master or standby of a range (that range's data;
  the map keeps routing to it);
* it is a ZooKeeper server (the ensemble holds the map itself): the ZooKeeper hosts the
  caller connects to, and the members of the ensemble's own configuration;
* it is a server of an operation in flight (:func:`shardfleet.ops.in_flight`): a split's
  target pair holds a copy the map does not name yet, a promotion's or a rebuild's
  servers are mid-change.

Everything that removes hosts asks :func:`plan_removal` first:

``remove``    hosts the caller means to remove (or recreate: the same loss): one that
              holds data is refused, saying what it holds, unless the caller says the
              data may go (``data_may_go``);
``unlisted``  hosts found running that the caller's inventory does not list: one that
              holds data is kept and reported (someone added it for a split and the map
              moved ranges onto it), the others may go.

Without a map (ZooKeeper cannot be read, or no map at the path read: a wrong cluster
name reads none) nothing tells which hosts hold ranges: every host to remove is refused
(unless ``data_may_go``) and every unlisted one kept, saying why.

Everything that creates hosts from nothing (fleet-add) asks :func:`check_addition`: a
new, empty server at a name or address the map still names (one removed with
``data_may_go``) would take that range's traffic.

A host is named by its name and its addresses (IPs); a server ``host:port`` matches a
host when ``host`` is one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shardfleet.errors import ShardfleetError
from shardfleet.shardmap import ShardMap


class RemovalRefused(ShardfleetError):
    """Raised when hosts to remove hold the fleet's data; nothing was removed."""


class AdditionRefused(ShardfleetError):
    """Raised when a host to create would take a name or address the map still names;
    nothing was changed."""


class Operation(Protocol):
    """What this module reads of an operation in flight (``shardfleet.ops.InFlight``)."""

    servers: tuple[str, ...]

    def describe(self) -> str: ...


@dataclass
class RemovalPlan:
    """What may be removed, what is kept and why (``kept``: host -> what it holds),
    and what was refused (``refused``, empty unless the data may go)."""

    removable: list[str] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, list[str]] = field(default_factory=dict)
    allowed: dict[str, list[str]] = field(default_factory=dict)  # named, removed anyway

    def to_dict(self) -> dict[str, object]:
        return {"removable": self.removable, "kept": self.kept, "refused": self.refused,
                "allowed": self.allowed}


def host_of(server: str) -> str:
    """The host part of ``host:port``, ``[v6]:port``, a bare host or a bare IPv6
    address (a ZooKeeper connect string's ``/chroot`` dropped)."""
    s = server.strip().split("/", 1)[0]
    if s.startswith("["):
        return s[1:].partition("]")[0]
    if s.count(":") == 1:
        return s.partition(":")[0]
    return s


def roles_in_map(m: ShardMap | None) -> dict[str, list[str]]:
    """Each host (the host part of a map server) -> what it is, one entry per range:
    ``master of [0, 511] (open)``."""
    out: dict[str, list[str]] = {}
    for r in (m.ranges if m is not None else ()):
        for role, server in (("master", r.master), ("standby", r.standby)):
            if server:
                out.setdefault(host_of(server), []).append(
                    f"{role} of [{r.first}, {r.last}] ({r.state})")
    return out


def zookeeper_members(config: str | bytes | None) -> list[str]:
    """The servers (``host:quorum-port``) of a ZooKeeper ensemble's dynamic configuration
    (the ``/zookeeper/config`` znode: ``server.N=host:2888:3888[:role][;client]``)."""
    text = config.decode() if isinstance(config, bytes) else (config or "")
    out = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip().startswith("server.") and value.strip():
            addr = value.split(";", 1)[0].strip()
            if addr.startswith("["):
                host, _, rest = addr.partition("]")
                out.append(f"{host}]:{rest.lstrip(':').split(':', 1)[0]}")
            else:
                out.append(":".join(addr.split(":")[:2]))
    return out


def holders(m: ShardMap | None, *, zookeeper: Iterable[str] = (),
            in_flight: Iterable[Operation] = ()) -> dict[str, list[str]]:
    """Each host that holds the fleet's data -> what it holds: its ranges in *m*, the
    ZooKeeper server it is (*zookeeper*: ``host:port`` each), the operations in flight
    it is a server of."""
    out = roles_in_map(m)
    for server in dict.fromkeys(zookeeper):
        if server.strip():
            out.setdefault(host_of(server), []).append(
                f"ZooKeeper server {server.strip()} (holds the shard map)")
    for op in in_flight:
        for server in dict.fromkeys(op.servers):
            out.setdefault(host_of(server), []).append(f"a server of {op.describe()}")
    return out


def _named(held: Mapping[str, list[str]], names: Iterable[str]) -> list[str]:
    return [what for n in dict.fromkeys(names) if n for what in held.get(n, [])]


def plan_removal(m: ShardMap | None, remove: Mapping[str, Iterable[str]],
                 unlisted: Mapping[str, Iterable[str]] | None = None, *,
                 data_may_go: bool = False, zookeeper: Iterable[str] = (),
                 in_flight: Iterable[Operation] = (),
                 no_map: str = "there is no shard map") -> RemovalPlan:
    """The plan for removing *remove* and the *unlisted* hosts (each: host name ->
    its addresses). Raises :class:`RemovalRefused` naming every host of *remove* that
    holds data (see :func:`holders`) and what it holds, unless *data_may_go*; nothing is
    decided to be removed then. With no map (*m* None; *no_map* says why) every host of
    *remove* is refused and every unlisted one kept."""
    held = holders(m, zookeeper=zookeeper, in_flight=in_flight)
    unknown = [f"not checked: {no_map}"] if m is None else []
    plan = RemovalPlan()
    for name, addrs in (unlisted or {}).items():
        named = _named(held, [name, *addrs]) + unknown
        if named:
            plan.kept[name] = named
        else:
            plan.removable.append(name)
    for name, addrs in remove.items():
        named = _named(held, [name, *addrs])
        if (named or unknown) and not data_may_go:
            if named:
                plan.refused[name] = named
        else:
            if named or unknown:
                plan.allowed[name] = named + unknown
            plan.removable.append(name)
    if m is None and not data_may_go and remove:
        held_too = "".join(f"; {h} is {', '.join(w)}" for h, w in plan.refused.items())
        raise RemovalRefused(
            f"refusing to remove {', '.join(remove)}: {no_map}, so whether the map names "
            f"them cannot be told{held_too}; nothing was removed. Start ZooKeeper, or check "
            "that shards_cluster names the fleet's map, and rerun; or, if the data may go, "
            "rerun with -e fleet_data_may_go=true")
    if plan.refused:
        lines = "; ".join(f"{h} is {', '.join(w)}" for h, w in plan.refused.items())
        raise RemovalRefused(
            f"refusing to remove {len(plan.refused)} host(s) that hold the fleet's data "
            f"(the shard map, ZooKeeper or an operation in flight names them): {lines}. "
            "Their data would be lost while the map routes to them (or the operation in "
            "flight needs them); nothing was removed. Move the ranges off "
            "first (split.yml, promote.yml), finish or abort the operation, or, if the "
            "data may go, rerun with -e fleet_data_may_go=true")
    return plan


def check_addition(m: ShardMap | None, add: Mapping[str, Iterable[str]], *,
                   zookeeper: Iterable[str] = (), in_flight: Iterable[Operation] = (),
                   no_map: str = "there is no shard map") -> dict[str, list[str]]:
    """Refuse (:class:`AdditionRefused`) to create any host of *add* (host name -> its
    addresses, those known yet) whose name or address holds data (:func:`holders`): the
    map still names it (a server removed with ``data_may_go``), an operation in flight
    or ZooKeeper uses it. Without a map (*m* None) that cannot be told: refused too.
    Returns every host that holds data -> what (the addresses a new host must not get)."""
    if m is None:
        raise AdditionRefused(
            f"{no_map}, so whether it names {', '.join(add) or 'the new hosts'} cannot be "
            "told; nothing changed. Check that shards_cluster names the fleet's map (and "
            "that ZooKeeper answers), then rerun")
    held = holders(m, zookeeper=zookeeper, in_flight=in_flight)
    clash = {}
    for name, addrs in add.items():
        a = [x for x in dict.fromkeys(addrs) if x]
        named = _named(held, [name, *a])
        if named:
            clash[f"{name} ({', '.join(a)})" if a else name] = named
    if clash:
        lines = "; ".join(f"{h} is {', '.join(w)}" for h, w in clash.items())
        raise AdditionRefused(
            f"refusing to create {len(clash)} host(s) at a name or address the fleet still "
            f"uses: {lines}. A new, empty server there would take that traffic (a server "
            "removed with fleet_data_may_go stays in the map until its ranges move); "
            "nothing changed. Move the ranges to a live server first (promote.yml, "
            "rebuild-standby.yml, split.yml) or add another pair")
    return held
