#!/usr/bin/python
# Which hosts may be removed: none the shard map names, unless the data may go.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_hosts
short_description: Refuse to remove hosts the shard map names as a master or standby
description:
  - Reads the shard map and decides which of the hosts about to be removed may go.
    A host the map names as the master or standby of a range holds its data;
    removing it loses that data while the map keeps routing to it.
  - Hosts in I(remove) (to be removed or recreated) that the map names make the
    module fail, naming their ranges, unless I(data_may_go); nothing is removed then.
  - Hosts in I(unlisted) (found, but not in the inventory) that the map names are
    kept and reported in C(kept); the others are returned as removable.
  - With nothing to decide it does not contact ZooKeeper. When ZooKeeper cannot be
    read, the I(unlisted) hosts are all kept, and hosts in I(remove) make it fail
    unless I(data_may_go).
  - The decision is the library's (C(shardfleet.hosts.plan_removal)).
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.zookeeper
options:
  remove:
    description: Host name -> its addresses (IPs, names) for each host to be removed.
    type: dict
    default: {}
  unlisted:
    description: Host name -> its addresses for each host found that the inventory does not list.
    type: dict
    default: {}
  data_may_go:
    description: Remove hosts the map names anyway (their data is lost; said in C(allowed)).
    type: bool
    default: false
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
- name: Which containers may go
  shardfleet.fleet.shard_hosts:
    zookeeper_hosts: [10.242.0.31:2181, 10.242.0.32:2181, 10.242.0.33:2181]
    zookeeper_user: "{{ zookeeper_admin_user }}"
    zookeeper_password: "{{ zookeeper_admin_password }}"
    remove: {sf-mysql003a: [10.242.0.61]}
    unlisted: {sf-mysql004a: [10.242.0.63]}
  register: guard
"""

RETURN = r"""
removable:
  description: The hosts that may be removed.
  returned: success
  type: list
  elements: str
kept:
  description:
    - Unlisted hosts the map names, with their ranges (all unlisted ones when the map
      cannot be read); not to be removed.
  returned: success
  type: dict
allowed:
  description: Hosts to remove that the map names, removed because I(data_may_go).
  returned: success
  type: dict
map_version:
  description: The map's znode version read (null without a map or without ZooKeeper).
  returned: success
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    open_zookeeper_store,
    require_library,
    zookeeper_argument_spec,
    zookeeper_hosts,
)


def _read_map(module):
    """(the map or None, its version, None) or (None, None, why it could not be read)."""
    p = module.params
    hosts = zookeeper_hosts(module)
    store = None
    try:
        store = open_zookeeper_store(module)
        if not store.connected:
            return None, None, (f"ZooKeeper at {hosts} gave no session within "
                                f"{p['zookeeper_timeout']}s")
        cur = store.read()
        return cur.map, cur.version if cur.map is not None else None, None
    except Exception as exc:  # noqa: BLE001 - any failure to read is "cannot tell"
        return None, None, f"the map at {hosts} could not be read: {' '.join(str(exc).split())}"
    finally:
        if store is not None:
            store.close(timeout=2)


def run(module):
    from shardfleet import hosts

    p = module.params
    remove = {k: [str(a) for a in (v or [])] for k, v in p["remove"].items()}
    unlisted = {k: [str(a) for a in (v or [])] for k, v in p["unlisted"].items()}
    if not remove and not unlisted:
        module.exit_json(changed=False, removable=[], kept={}, allowed={}, map_version=None)
    m, version, why = _read_map(module)
    warnings = []
    if why is not None:
        if remove and not p["data_may_go"]:
            module.fail_json(
                msg=f"cannot read the shard map ({why}), so cannot tell whether it names "
                    f"{', '.join(remove)}; nothing was removed. Start the ZooKeeper hosts and "
                    "rerun, or, if the data may go, rerun with -e fleet_data_may_go=true")
        warnings.append(f"the shard map could not be read ({why}): "
                        + (f"kept every host the inventory does not list ({', '.join(unlisted)})"
                           if unlisted else "removing as asked (data_may_go)"))
        plan = hosts.RemovalPlan(removable=list(remove), kept={
            h: ["not checked: the map could not be read"] for h in unlisted})
    else:
        with library_errors(module, "shard hosts"):
            plan = hosts.plan_removal(m, remove, unlisted, data_may_go=p["data_may_go"])
    for h, what in plan.kept.items():
        warnings.append(f"kept {h} (not in the inventory): {', '.join(what)}")
    for h, what in plan.allowed.items():
        warnings.append(f"removing {h} although the map names it (data_may_go): "
                        f"{', '.join(what)}")
    for w in warnings:
        module.warn(w)
    out = {k: v for k, v in plan.to_dict().items() if k != "refused"}
    module.exit_json(changed=False, map_version=version, **out)


def main():
    spec = zookeeper_argument_spec()
    spec.update(
        remove=dict(type="dict", default={}),
        unlisted=dict(type="dict", default={}),
        data_may_go=dict(type="bool", default=False),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
