# Filters the shards role and the playbooks use; the arithmetic lives in the shardfleet
# library. The address rule of a fleet host (its shardfleet_address, else the local
# fleet's shardfleet_container_ip, else its inventory name) lives here, once.
#
# The library comes from the collection's own copy (src/, the same version as the
# modules and the bundle the shards role ships to the hosts: docs/collection.md), so an
# installed collection needs nothing pip-installed on the controller for this filter.

from __future__ import annotations

import sys
from pathlib import Path

from ansible.errors import AnsibleFilterError

_SRC = Path(__file__).resolve().parents[2] / "src"
if (_SRC / "shardfleet" / "__init__.py").is_file() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

try:
    from shardfleet.errors import ShardfleetError
    from shardfleet.shardmap import even_split
except ImportError:  # pragma: no cover
    even_split = None


def shard_split(pairs, first=0, last=4095):
    """``{pair: [first, last]}`` for the sorted pair names, spread evenly."""
    if even_split is None:
        raise AnsibleFilterError(f"the shardfleet library is neither in {_SRC} nor installed "
                                 "on the controller")
    names = sorted(set(pairs))
    try:
        return {p: list(r) for p, r in zip(names, even_split(int(first), int(last), len(names)),
                                           strict=True)}
    except ShardfleetError as exc:
        raise AnsibleFilterError(str(exc)) from None


def _hostvar(hostvars, host, name, default=None):
    hv = hostvars[host]
    try:
        value = hv[name]
    except (KeyError, TypeError):
        return default
    return default if value in (None, "") else value


def fleet_address(host, hostvars):
    """A fleet host's address as the map and the other hosts know it."""
    return str(_hostvar(hostvars, host, "shardfleet_address")
               or _hostvar(hostvars, host, "shardfleet_container_ip") or host)


def mysql_nodes(hosts, hostvars, pair=None):
    """``host:port`` of each MySQL host (of *pair* only, when given), as the map names it."""
    return [f"{fleet_address(h, hostvars)}:{int(_hostvar(hostvars, h, 'mysql_port', 3306))}"
            for h in hosts
            if pair is None or _hostvar(hostvars, h, "shardfleet_pair") == pair]


def mysql_labels(hosts, hostvars):
    """``{host:port: {"host": inventory name, "pair": pair name}}`` of the MySQL hosts."""
    return {node: {"host": h, "pair": str(_hostvar(hostvars, h, "shardfleet_pair", ""))}
            for h in hosts for node in mysql_nodes([h], hostvars)}


def zookeeper_hosts(hosts, hostvars, port=2181):
    """``address:port`` of each ZooKeeper host (its ``zookeeper_client_port``, else
    *port*): the ensemble a client connects to."""
    return [f"{fleet_address(h, hostvars)}:"
            f"{int(_hostvar(hostvars, h, 'zookeeper_client_port', port))}" for h in hosts]


def mysql_ca_cert(host, hostvars):
    """The CA file a shardfleet module running on *host* verifies the MySQL servers with,
    or "" when the fleet has no TLS (``mysql_tls_enabled``, else ``shardfleet_tls_enabled``,
    false): on a MySQL host the copy the mysql role installed (``mysql_tls_dir``/ca.pem),
    elsewhere (the control node) ``shardfleet_tls_ca_cert``."""
    enabled = _hostvar(hostvars, host, "mysql_tls_enabled",
                       _hostvar(hostvars, host, "shardfleet_tls_enabled", False))
    if str(enabled).lower() not in ("true", "yes", "on", "1"):
        return ""
    if _hostvar(hostvars, host, "shardfleet_pair"):
        return f"{_hostvar(hostvars, host, 'mysql_tls_dir', '/etc/mysql/tls')}/ca.pem"
    return str(_hostvar(hostvars, host, "shardfleet_tls_ca_cert", ""))


def monitoring_target(host, hostvars, port):
    """A Prometheus static_configs entry for *host*'s exporter on *port*: its fleet
    address, labelled with its inventory name (``instance``) and, for a MySQL host, its
    pair."""
    labels = {"instance": host}
    pair = _hostvar(hostvars, host, "shardfleet_pair")
    if pair:
        labels["pair"] = str(pair)
    return {"targets": [f"{fleet_address(host, hostvars)}:{int(port)}"], "labels": labels}


class FilterModule:
    def filters(self):
        return {"shard_split": shard_split, "fleet_address": fleet_address,
                "mysql_nodes": mysql_nodes, "mysql_labels": mysql_labels,
                "zookeeper_hosts": zookeeper_hosts, "mysql_ca_cert": mysql_ca_cert,
                "monitoring_target": monitoring_target}
