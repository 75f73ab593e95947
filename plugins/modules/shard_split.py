#!/usr/bin/python
# Split a pair's shard range onto a new pair, one resumable step at a time.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_split
short_description: Move part of a pair's shard range onto a new pair, live and resumably
description:
  - Runs one step of a split (or all of them) with the shardfleet library; each step is
    idempotent and its progress is kept in a journal in ZooKeeper beside the map
    (C(<zookeeper_root>/<cluster>/ops/journal/split-<first>-<last>)), so rerunning after
    any failure continues where it stopped.
  - C(check) refuses, changing nothing, unless the source master owns the moving range,
    the target pair is new and empty (or holds this split's own earlier attempt) and both
    servers log GTID binlogs in ROW format.
  - C(clone) copies the moving shard databases from one consistent snapshot of the source
    (no lock; writes go on) onto the target's master, noting the snapshot's GTID position.
  - C(replicate) makes the target's master replicate the moving databases from the source
    over a named connection (C(split_<first>_<last>)) until caught up, compared by GTID.
  - C(cutover) freezes the range in the map, fences it on the source (the application user
    loses INSERT, UPDATE, DELETE there), waits for the target to apply the source's position
    read after the fence, and flips the map. On timeout it undoes the fence and the freeze.
  - C(cleanup) drops the moved databases from the source; C(abort) (before the cutover)
    removes the split's replication, freeze, fence and the target's copies.
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.zookeeper
  - shardfleet.fleet.mysql.tls
options:
  source:
    description: The source pair's master, C(host:port) as the map names it.
    type: str
    required: true
  target:
    description: The target pair's master, C(host:port).
    type: str
    required: true
  target_standby:
    description: The target pair's standby, C(host:port); the map names it after the flip.
    type: str
  range:
    description:
      - First and last shard to move. Default the upper half of the source's range
        (or the range of this source and target's split in progress).
    type: list
    elements: int
  name:
    description: Journal name; default C(split-<first>-<last>).
    type: str
  step:
    description: The step to run; C(all) runs check, clone, replicate and cutover.
    type: str
    choices: [check, clone, replicate, cutover, cleanup, abort, all]
    default: all
  cleanup:
    description: With I(step=all), also run C(cleanup) after the cutover.
    type: bool
    default: false
  login_user:
    description: Admin user on both pairs (the C(mysql) role's C(mysql_admin_user)).
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password (from Ansible Vault).
    type: str
    default: ''
  replication_user:
    description: The user the target's master replicates from the source with.
    type: str
    default: shardfleet_repl
  replication_password:
    description: Its password (from Ansible Vault).
    type: str
    default: ''
  app_user:
    description: The application user that is fenced on the source and granted on the target.
    type: str
    default: shardfleet_app
  app_host:
    description: Host part of the application user's account.
    type: str
    default: "%"
  catchup_timeout:
    description: Seconds the replicate step waits for the target to catch up.
    type: float
    default: 600
  cutover_timeout:
    description: Seconds the cutover waits for the target to apply the fenced position.
    type: float
    default: 5
  drain_timeout:
    description: Seconds the cutover waits for writes already past the fence to finish.
    type: float
    default: 2
  connect_timeout:
    description: Seconds to wait for a MySQL connection.
    type: float
    default: 10
  clone_parallel:
    description:
      - Connections the clone copies over, all in one snapshot of the source (more than
        one briefly hold the source's commits while their snapshots start).
      - Measured on loopback with 2 cores, more connections gained nothing (the copy is
        bound by the control node's CPU); they help where each connection waits on the
        network. See docs/runbooks/split.md.
    type: int
    default: 1
  clone:
    description:
      - How the clone copies. C(logical) copies the moving shards' rows from one
        consistent snapshot through this host (resumable database by database).
      - C(physical) (the Jetpants way, for volume) copies a source node's data directory
        with mariadb-backup onto both target nodes, node to node. The first run stops
        after naming the copy (result C(copy)); the caller makes it with
        M(shardfleet.fleet.shard_copy) (split.yml does), then runs the split again with
        I(copy_position) and I(copy_id). Needs I(target_standby).
      - C(auto) is C(physical) when the moving shards hold more than I(physical_above)
        bytes of InnoDB data (and I(target_standby) is given), else C(logical); a split
        in progress keeps the method it began with. See docs/runbooks/split.md.
    type: str
    choices: [logical, physical, auto]
    default: logical
  physical_above:
    description: With I(clone=auto), the moving shards' InnoDB data size (bytes) above which
      the copy is physical.
    type: int
    default: 1073741824
  copy_position:
    description: I(clone=physical), second run, the GTID position of the copy installed on
      both target nodes (M(shardfleet.fleet.shard_copy) returns it).
    type: str
    default: ''
  copy_id:
    description: I(clone=physical), second run, the C(copy_id) the first run returned in
      C(copy); a copy named since by another run is refused.
    type: str
    default: ''
  copy_watch:
    description:
      - I(clone=physical), while the copy runs - the receivers (C(host:port) of each target
        node's M(shardfleet.fleet.shard_copy) I(mode=receive)) to poll for the copy's
        progress. The module then only watches - every 2 seconds it writes the progress
        (phase, bytes received of the estimate, rate, ETA) into the journal's
        C(clone_progress), which C(shardfleet ops show) prints, until both receivers
        are done or I(copy_timeout). It takes no lock and changes nothing else.
    type: list
    elements: str
  copy_secret:
    description: With I(copy_watch), the copy's one-shot secret; never logged.
    type: str
    default: ''
  copy_timeout:
    description: With I(copy_watch), seconds to watch at most.
    type: float
    default: 7200
  copy_bytes:
    description: The copy's size as sent, for the journal.
    type: int
  copy_seconds:
    description: The copy's duration, for the journal.
    type: float
  lock_timeout:
    description:
      - Seconds to wait for the source's and target's operation locks in ZooKeeper.
      - A run that was killed holds them until its ZooKeeper session expires (about 5 s),
        so a rerun right after a kill waits for them rather than failing.
    type: float
    default: 20
attributes:
  check_mode:
    support: full
    description: Runs the C(check) step and reports the steps that would run; changes nothing.
  diff_mode:
    support: full
    description: The map before and after (one line per range).
  idempotent:
    support: full
    description: A step that is done already reports no change.
notes:
  - Run it on a host that reaches both masters and ZooKeeper (split.yml uses the source master).
  - MariaDB only (multi-source replication by connection name, snapshot GTID positions).
  - The journal's C(frozen_seconds) is the write stall of the cutover (freeze to flip).
"""

EXAMPLES = r"""
- name: Split the upper half of pair001's range onto pair003
  shardfleet.fleet.shard_split:
    zookeeper_hosts: [zk1:2181]
    zookeeper_user: "{{ zookeeper_admin_user }}"
    zookeeper_password: "{{ zookeeper_admin_password }}"
    source: "10.0.0.11:3306"
    target: "10.0.0.51:3306"
    target_standby: "10.0.0.52:3306"
    login_password: "{{ mysql_admin_password }}"
    replication_password: "{{ mysql_replication_password }}"
    step: all

- name: Give up a split before its cutover
  shardfleet.fleet.shard_split:
    zookeeper_hosts: [zk1:2181]
    source: "10.0.0.11:3306"
    target: "10.0.0.51:3306"
    range: [1024, 2047]
    step: abort
    login_password: "{{ mysql_admin_password }}"
"""

RETURN = r"""
steps:
  description: Each step run, with C(changed), C(msg), C(seconds) and its measurements.
  returned: always
  type: list
  elements: dict
moving:
  description: The moving range, [first, last].
  returned: always
  type: list
  elements: int
journal:
  description: The split's journal after the run (source, target, step reached, GTID positions,
    timestamps, C(frozen_seconds)).
  returned: always
  type: dict
map_before:
  description: The map's ranges before the run, as a table.
  returned: always
  type: str
map_after:
  description: The map's ranges after the run, as a table.
  returned: always
  type: str
copy:
  description: The physical copy to make now (I(clone=physical), first run) - C(source)
    (C(host:port) of the node to copy), C(targets) (both target nodes), C(copy_id),
    C(bytes_estimated); empty when there is none to make.
  returned: always
  type: dict
progress:
  description: With I(copy_watch), the copy's last progress written to the journal.
  returned: when I(copy_watch) is given
  type: dict
clone_method:
  description: C(logical) or C(physical), as chosen (I(clone=auto) resolved).
  returned: always
  type: str
changes:
  description: Readable list of range changes.
  returned: always
  type: list
  elements: str
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
    from shardfleet.operations import split as sp
    from shardfleet.shardmap import diff

    p = module.params
    if p["range"] is not None and len(p["range"]) != 2:
        module.fail_json(msg=f"range must be [first, last], got {p['range']}")
    store = zookeeper_store(module)
    spec = sp.SplitSpec(p["source"], p["target"], p["target_standby"],
                        tuple(p["range"]) if p["range"] else None, p["name"])
    creds = sp.Credentials(p["login_user"], p["login_password"], p["replication_user"],
                           p["replication_password"], p["app_user"], p["app_host"])
    result = dict(changed=False, steps=[], moving=[], journal={}, copy={}, clone_method="")
    with library_errors(module, f"split {p['source']} -> {p['target']}", result):
        try:
            before = store.read().map
            result["map_before"] = before.table() if before else ""
            with sp.Split(store, spec, creds, catchup_timeout=p["catchup_timeout"],
                          cutover_timeout=p["cutover_timeout"], drain_timeout=p["drain_timeout"],
                          connect_timeout=p["connect_timeout"],
                          clone_parallel=p["clone_parallel"], clone=p["clone"],
                          physical_above=p["physical_above"],
                          copy_position=p["copy_position"], copy_id=p["copy_id"],
                          copy_stats={k: p["copy_" + k] for k in ("bytes", "seconds")
                                      if p["copy_" + k] is not None},
                          lock_timeout=p["lock_timeout"], tls=mysql_tls(module)) as split:
                if p["copy_watch"]:  # only the copy's progress: no step runs
                    if not p["copy_secret"]:
                        module.fail_json(msg="copy_watch needs the copy's copy_secret")
                    result["progress"] = split.watch_copy(p["copy_watch"], p["copy_secret"],
                                                          timeout=p["copy_timeout"])
                    res = []
                elif module.check_mode:
                    res = split.run(p["step"], cleanup=p["cleanup"], check=True)
                    todo = [r.step for r in res if r.changed]
                    result["would_run"] = todo
                    result["changed"] = bool(todo)
                else:
                    res = split.run(p["step"], cleanup=p["cleanup"])
                    result["changed"] = any(r.changed for r in res)
                result["steps"] = [r.to_dict() for r in res]
                result["copy"] = next((r.details["copy"] for r in res if r.waits), {})
                result["clone_method"] = split.clone_method
                result["moving"] = list(split.moving)
                result["journal"] = (split.journal.load() if split.journal else None) or {}
            after = store.read().map
            result["map_after"] = after.table() if after else ""
            result["changes"] = diff(before, after)
            if module._diff:
                result["diff"] = dict(before=result["map_before"] + "\n",
                                      after=result["map_after"] + "\n")
        finally:
            store.close(timeout=2)
    module.exit_json(**result)


def main():
    spec = zookeeper_argument_spec()
    spec.update(mysql_tls_argument_spec())
    spec.update(
        source=dict(type="str", required=True),
        target=dict(type="str", required=True),
        target_standby=dict(type="str"),
        range=dict(type="list", elements="int"),
        name=dict(type="str"),
        step=dict(type="str", default="all",
                  choices=["check", "clone", "replicate", "cutover", "cleanup", "abort", "all"]),
        cleanup=dict(type="bool", default=False),
        login_user=dict(type="str", default="shardfleet_admin"),
        login_password=dict(type="str", default="", no_log=True),
        replication_user=dict(type="str", default="shardfleet_repl"),
        replication_password=dict(type="str", default="", no_log=True),
        app_user=dict(type="str", default="shardfleet_app"),
        app_host=dict(type="str", default="%"),
        catchup_timeout=dict(type="float", default=600),
        cutover_timeout=dict(type="float", default=5),
        drain_timeout=dict(type="float", default=2),
        connect_timeout=dict(type="float", default=10),
        clone_parallel=dict(type="int", default=1),
        clone=dict(type="str", default="logical", choices=["logical", "physical", "auto"]),
        physical_above=dict(type="int", default=1 << 30),
        copy_position=dict(type="str", default=""),
        copy_id=dict(type="str", default=""),
        copy_watch=dict(type="list", elements="str"),
        copy_secret=dict(type="str", default="", no_log=True),
        copy_timeout=dict(type="float", default=7200),
        copy_bytes=dict(type="int"),
        copy_seconds=dict(type="float"),
        lock_timeout=dict(type="float", default=20),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
