"""The fleet's hosts against the map: which of them may be removed.

A host whose address the map names as the master or standby of a range holds that
range's data; removing it (deleting a container, terminating an instance) loses the
data while the map keeps routing to it. Everything that removes hosts asks
:func:`plan_removal` first:

``remove``    hosts the caller means to remove (or recreate: the same loss): one the
              map names is refused, naming its ranges, unless the caller says the data
              may go (``data_may_go``);
``unlisted``  hosts found running that the caller's inventory does not list: one the
              map names is kept and reported (someone added it for a split and the map
              moved ranges onto it), the others may go.

A host is named by its name and its addresses (IPs); a map server ``host:port``
matches a host when ``host`` is one of them. With no map there is nothing to keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shardfleet.errors import ShardfleetError
from shardfleet.shardmap import ShardMap


class RemovalRefused(ShardfleetError):
    """Raised when hosts to remove hold ranges of the map; nothing was removed."""


@dataclass
class RemovalPlan:
    """What may be removed, what is kept and why (``kept``: host -> its roles in the map),
    and what was refused (``refused``, empty unless the data may go)."""

    removable: list[str] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, list[str]] = field(default_factory=dict)
    allowed: dict[str, list[str]] = field(default_factory=dict)  # named, removed anyway

    def to_dict(self) -> dict[str, object]:
        return {"removable": self.removable, "kept": self.kept, "refused": self.refused,
                "allowed": self.allowed}


def roles_in_map(m: ShardMap | None) -> dict[str, list[str]]:
    """Each host (the host part of a map server) -> what it is, one entry per range:
    ``master of [0, 511] (open)``."""
    out: dict[str, list[str]] = {}
    for r in (m.ranges if m is not None else ()):
        for role, server in (("master", r.master), ("standby", r.standby)):
            if server:
                host = server.rpartition(":")[0].strip("[]")
                out.setdefault(host, []).append(f"{role} of [{r.first}, {r.last}] ({r.state})")
    return out


def _named(roles: Mapping[str, list[str]], names: Iterable[str]) -> list[str]:
    return [what for n in dict.fromkeys(names) if n for what in roles.get(n, [])]


def plan_removal(m: ShardMap | None, remove: Mapping[str, Iterable[str]],
                 unlisted: Mapping[str, Iterable[str]] | None = None, *,
                 data_may_go: bool = False) -> RemovalPlan:
    """The plan for removing *remove* and the *unlisted* hosts (each: host name ->
    its addresses). Raises :class:`RemovalRefused` naming every host of *remove* the
    map names and its ranges, unless *data_may_go*; nothing is decided to be removed
    then."""
    roles = roles_in_map(m)
    plan = RemovalPlan()
    for name, addrs in (unlisted or {}).items():
        named = _named(roles, [name, *addrs])
        if named:
            plan.kept[name] = named
        else:
            plan.removable.append(name)
    for name, addrs in remove.items():
        named = _named(roles, [name, *addrs])
        if named and not data_may_go:
            plan.refused[name] = named
        else:
            if named:
                plan.allowed[name] = named
            plan.removable.append(name)
    if plan.refused:
        lines = "; ".join(f"{h} is {', '.join(w)}" for h, w in plan.refused.items())
        raise RemovalRefused(
            f"refusing to remove {len(plan.refused)} host(s) the shard map names: {lines}. "
            "Their data would be lost while the map routes to them; nothing was removed. "
            "Move the ranges off first (split.yml, promote.yml), or, if the data may go, "
            "rerun with -e fleet_data_may_go=true")
    return plan
