#!/usr/bin/python
# Read-only facts about the fleet: the map, every pair, the ZooKeeper ensemble.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_info
short_description: The shard map, every pair's replication and shards, and ZooKeeper modes
description:
  - Reads the map and its version from ZooKeeper; for every server the map names
    (and any in I(servers)), its replication channels (IO/SQL threads, lag, GTID
    positions), C(read_only), semi-synchronous status, the number of shard
    databases present and their total size; and each ZooKeeper node's mode.
  - Changes nothing. An unreachable MySQL server is reported, not a failure.
  - Returns I(problems), where the servers and the map disagree (two writable nodes in
    a pair, the map's master read-only, a node not replicating from its peer, a stopped
    channel, a frozen range, an operation in flight), and I(table), the report as
    C(shardfleet status) prints it.
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.zookeeper
  - shardfleet.fleet.mysql.tls
options:
  login_user:
    description: MySQL user able to read replication status (the admin user).
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password; never logged.
    type: str
    default: ''
  servers:
    description: Extra MySQL C(host:port) to report on besides those in the map.
    type: list
    elements: str
    default: []
  sizes:
    description: Sum the shards' data and index sizes (reads InnoDB's tablespace list).
    type: bool
    default: true
  labels:
    description:
      - Names people know a server by, keyed by C(host:port) as the map names it, each a
        dict with C(host) (the inventory name) and C(pair) (the pair's name). Used in
        I(problems) and I(table); the map stays the source of truth.
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    description: The module only reads.
  diff_mode:
    support: none
  idempotent:
    support: full
    description: Never changes anything.
"""

EXAMPLES = r"""
- name: What the fleet looks like
  shardfleet.fleet.shard_info:
    zookeeper_hosts: [zk1:2181, zk2:2181, zk3:2181]
    login_user: "{{ mysql_admin_user }}"
    login_password: "{{ mysql_admin_password }}"
  register: fleet
"""

RETURN = r"""
map:
  description: The current map (null when none is registered).
  returned: always
  type: dict
version:
  description: The map znode's version (-1 when absent).
  returned: always
  type: int
pairs:
  description: One entry per map range's pair, with C(master) and C(standby) server states.
  returned: always
  type: list
  elements: dict
servers:
  description: Every server's state by C(host:port).
  returned: always
  type: dict
zookeeper:
  description: Each ZooKeeper node's mode (leader, follower, standalone, unreachable).
  returned: always
  type: list
  elements: dict
unmapped:
  description: Servers of I(servers) that no range of the map names.
  returned: always
  type: list
  elements: str
operations:
  description: Operations in flight (unfinished journals) with their step and servers.
  returned: always
  type: list
  elements: dict
problems:
  description: Disagreements, critical first, each with C(severity) and C(text).
  returned: always
  type: list
  elements: dict
table:
  description: The report as a fixed-width table for people.
  returned: always
  type: str
labels:
  description: The I(labels) given.
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    mysql_tls,
    mysql_tls_argument_spec,
    require_library,
    zookeeper_argument_spec,
    zookeeper_store,
)


def run(module):
    from shardfleet import status

    p = module.params
    store = zookeeper_store(module)
    with library_errors(module, "shard info", None):
        try:
            report = status.collect(store, p["login_user"], p["login_password"],
                                    extra_servers=p["servers"], sizes=p["sizes"],
                                    zookeeper_hosts=p["zookeeper_hosts"],
                                    labels=p["labels"], tls=mysql_tls(module))
        finally:
            store.close(timeout=2)
    module.exit_json(changed=False, table=status.render(report), **report)


def main():
    spec = zookeeper_argument_spec()
    spec.update(mysql_tls_argument_spec())
    spec.update(
        login_user=dict(type="str", default="shardfleet_admin"),
        login_password=dict(type="str", default="", no_log=True),
        servers=dict(type="list", elements="str", default=[]),
        sizes=dict(type="bool", default=True),
        labels=dict(type="dict", default={}),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
