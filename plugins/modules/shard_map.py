#!/usr/bin/python
# Register shard ranges in the map kept in ZooKeeper.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_map
short_description: Register, replace, remove and open/close/freeze shard ranges in the ZooKeeper map
description:
  - Edits the shard map at C(<zookeeper_root>/<cluster>/map) with a
    compare-and-set on the znode version.
  - The whole resulting map is validated (bounds 0-65535, no overlap, a master on
    every range, servers among I(known_hosts)) before anything is written; on any
    error nothing is written.
  - I(state=present) merges I(ranges) into the map (an entry whose bounds equal an
    existing range updates only the fields it gives, so an entry with only C(range)
    and C(state=closed) closes a range); C(exact) replaces the whole map; C(absent)
    removes ranges with exactly these bounds.
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.zookeeper
options:
  ranges:
    description:
      - Range entries in the map's own shape. Each has C(range) ([first, last]) and,
        for a new range, C(master) (C(host:port)); optional C(standby) and C(state)
        (C(open), C(closed) or C(frozen)).
    type: list
    elements: dict
    required: true
  state:
    description: How I(ranges) change the map.
    type: str
    choices: [present, exact, absent]
    default: present
  known_hosts:
    description: When given, every master and standby must be one of these C(host:port).
    type: list
    elements: str
  mod_shard_count:
    description:
      - The initial shard count mod-shard keys hash over. Set once when the map is
        created (default 4096) and fixed forever; a different value is refused.
    type: int
attributes:
  check_mode:
    support: full
    description: Validates and shows the new map; writes nothing.
  diff_mode:
    support: full
    description: A readable before/after of the map (one line per range).
  idempotent:
    support: full
    description: Writing the map it already holds is no change.
"""

EXAMPLES = r"""
- name: Register two pairs' ranges
  shardfleet.fleet.shard_map:
    zookeeper_hosts: "{{ groups['zookeeper'] | map('regex_replace', '$', ':2181') | list }}"
    zookeeper_user: "{{ zookeeper_admin_user }}"
    zookeeper_password: "{{ zookeeper_admin_password }}"
    ranges:
      - {range: [0, 2047], master: "mysql001a:3306", standby: "mysql001b:3306", state: open}
      - {range: [2048, 4095], master: "mysql002a:3306", standby: "mysql002b:3306", state: open}

- name: Close a range to new objects
  shardfleet.fleet.shard_map:
    zookeeper_hosts: [zk1:2181]
    ranges: [{range: [0, 2047], state: closed}]
"""

RETURN = r"""
map:
  description: The map after the change (in check mode, the map that would be written).
  returned: always
  type: dict
version:
  description: The znode version after the change (-1 when there is no map).
  returned: always
  type: int
changes:
  description: Readable list of range changes (C(+) added, C(-) removed, C(~) changed).
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    require_library,
    zookeeper_argument_spec,
    zookeeper_store,
)


def run(module):
    from shardfleet import mapstore, shardmap

    p = module.params
    store = zookeeper_store(module)
    with library_errors(module, "shard map", None):
        try:
            done = mapstore.change_ranges(store, p["state"], p["ranges"],
                                          known_hosts=p["known_hosts"],
                                          mod_shard_count=p["mod_shard_count"],
                                          check=module.check_mode)
        finally:
            store.close(timeout=2)
    result = dict(changed=done.changed, map=done.after.to_dict(), version=done.version,
                  changes=shardmap.diff(done.before, done.after))
    if module._diff:
        result["diff"] = dict(before=(done.before.table() + "\n") if done.before else "",
                              after=done.after.table() + "\n")
    module.exit_json(**result)


def main():
    spec = zookeeper_argument_spec()
    spec.update(
        ranges=dict(type="list", elements="dict", required=True),
        state=dict(type="str", default="present", choices=["present", "exact", "absent"]),
        known_hosts=dict(type="list", elements="str"),
        mod_shard_count=dict(type="int"),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
