#!/usr/bin/python
# Which hosts may be removed: none that holds the fleet's data (the map's servers,
# ZooKeeper, an operation in flight), unless the data may go; which a new host may not reuse.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_hosts
short_description: Refuse to remove hosts that hold the fleet's data, or to reuse their names
description:
  - Reads the shard map, the operations in flight and the ZooKeeper ensemble, and
    decides which of the hosts about to be removed may go. A host holds the fleet's
    data when the map names it as the master or standby of a range (removing it loses
    that data while the map keeps routing to it), when it is a ZooKeeper server (the
    ensemble holds the map, so the I(zookeeper_hosts) and the members of the ensemble's
    C(/zookeeper/config)), or when it is a server of an operation in flight (a split's
    target pair, a promotion's or a rebuild's servers).
  - Hosts in I(remove) (to be removed or recreated) that hold data make the module
    fail, saying what they hold, unless I(data_may_go); nothing is removed then.
  - Hosts in I(unlisted) (found, but not in the inventory) that hold data are kept and
    reported in C(kept); the others are returned as removable.
  - Without a map nothing tells which hosts hold ranges. When ZooKeeper cannot be read,
    or there is no map at the path read (a wrong I(cluster)), the I(unlisted) hosts are
    all kept, and hosts in I(remove) make it fail unless I(data_may_go), saying why.
  - Hosts in I(add) (about to be created, empty) make it fail when their name or an
    address the map, an operation in flight or ZooKeeper still names (a server removed
    with I(data_may_go) stays in the map); also without a map. C(named) then lists every
    such host part, so that new hosts get other addresses.
  - With nothing to decide it does not contact ZooKeeper.
  - The decisions are the library's (C(shardfleet.hosts.plan_removal),
    C(shardfleet.hosts.check_addition)).
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
    description:
      - Remove hosts that hold data anyway (their data is lost; said in C(allowed)).
      - Does not apply to I(add).
    type: bool
    default: false
  add:
    description:
      - Host name -> its addresses (those known yet) for each host about to be created
        from nothing; refused when the map, an operation in flight or ZooKeeper names one.
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
    - Unlisted hosts that hold data, with what they hold (all unlisted ones when there
      is no map to read); not to be removed.
  returned: success
  type: dict
allowed:
  description: Hosts to remove that hold data (or were not checked), removed because I(data_may_go).
  returned: success
  type: dict
named:
  description:
    - With I(add), every host part (name or IP) that holds data, with what it holds,
      the addresses a new host must not get. Empty without I(add).
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


def _read(module):
    """What the guard reads from ZooKeeper: (the map or None, its version, the operations
    in flight, the ensemble's members, None), or why the map is not there: (None, None,
    [], [], why)."""
    from shardfleet import hosts, ops

    p = module.params
    where = zookeeper_hosts(module)
    store = None
    try:
        store = open_zookeeper_store(module)
        if not store.connected:
            return None, None, [], [], (f"cannot read the shard map (ZooKeeper at {where} "
                                        f"gave no session within {p['zookeeper_timeout']}s)")
        cur = store.read()
        if cur.map is None:
            return None, None, [], [], (
                f"there is no shard map at {store.path} (ZooKeeper at {where}: is "
                f"{p['cluster']!r} the fleet's cluster, shards_cluster?)")
        running = ops.in_flight(store)
        try:  # the ensemble's own view of its members (empty for a standalone server)
            members = hosts.zookeeper_members(store.read_raw("/zookeeper/config")[0])
        except Exception:  # noqa: BLE001 - the connect string's hosts are kept anyway
            members = []
        return cur.map, cur.version, running, members, None
    except Exception as exc:  # noqa: BLE001 - any failure to read is "cannot tell"
        return None, None, [], [], (f"cannot read the shard map at {where}: "
                                    f"{' '.join(str(exc).split())}")
    finally:
        if store is not None:
            store.close(timeout=2)


def _addresses(option):
    return {k: [str(a) for a in (v or [])] for k, v in option.items()}


def run(module):
    from shardfleet import hosts

    p = module.params
    remove, unlisted, add = (_addresses(p[k]) for k in ("remove", "unlisted", "add"))
    if not remove and not unlisted and not add:
        module.exit_json(changed=False, removable=[], kept={}, allowed={}, named={},
                         map_version=None)
    m, version, running, members, why = _read(module)
    zookeeper = [*p["zookeeper_hosts"], *members]
    guard = dict(zookeeper=[h for z in zookeeper for h in z.split(",") if h.strip()],
                 in_flight=running, no_map=why or "there is no shard map")
    named = {}
    if add:
        with library_errors(module, "shard hosts"):
            named = hosts.check_addition(m, add, **guard)
    with library_errors(module, "shard hosts"):
        plan = hosts.plan_removal(m, remove, unlisted, data_may_go=p["data_may_go"], **guard)
    for h, what in plan.kept.items():
        module.warn(f"kept {h} (not in the inventory): {', '.join(what)}")
    for h, what in plan.allowed.items():
        module.warn(f"removing {h} although it holds the fleet's data (data_may_go): "
                    f"{', '.join(what)}")
    out = {k: v for k, v in plan.to_dict().items() if k != "refused"}
    module.exit_json(changed=False, map_version=version, named=named, **out)


def main():
    spec = zookeeper_argument_spec()
    spec.update(
        remove=dict(type="dict", default={}),
        unlisted=dict(type="dict", default={}),
        data_may_go=dict(type="bool", default=False),
        add=dict(type="dict", default={}),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
