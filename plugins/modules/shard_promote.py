#!/usr/bin/python
# Promote a pair's standby to master (planned or emergency), or re-attach a rebuilt one.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_promote
short_description: Promote a MySQL pair's standby to master, planned or in an emergency
description:
  - Human-triggered promotion of one master-master pair; the work is done by
    C(shardfleet.operations.promote) and C(shardfleet.operations.rebuild) in the library.
  - I(mode=planned) (the master answers) freezes the pair's ranges in the map, sets
    the master C(read_only=ON), waits for its open write transactions (bounded),
    waits until the standby applied the master's last GTID position, makes the
    standby writable and writes the map with master and standby swapped and the
    ranges unfrozen. The old master keeps replicating from the new one. No write
    is lost; if the standby does not catch up in time, everything is rolled back.
  - I(mode=emergency) (the master is dead) is refused while the master answers,
    unless I(force=true). It freezes the ranges, stops the standby's replication
    I/O thread, waits until it applied every relay log event it received, stops
    its replication from the old master, reports errant transactions (GTIDs the
    standby wrote that the master never had), makes the standby writable and
    writes the swapped map with C(rebuild) naming the old master, then removes the
    standby's channel to the old master (C(RESET SLAVE ALL); C(channel_removed) says
    what it was), so a restart cannot pull the old master's tail. It is refused while
    the master answers with a MySQL error (1040, 1129, 1045, ...), since that master
    is alive, not dead. With semi-sync
    on, no acknowledged write is lost; when semi-sync was off or its state cannot
    be read the result says so in C(warnings).
  - I(mode=rebuild) re-attaches the server a map marks C(rebuild) as the standby
    (it must answer and keep its replication channel; apply the C(mysql) role
    first); it recreates the master's channel to it (needs I(replication_password)).
    Its shard databases are replaced by a consistent copy of the master's
    (C(mariadb-dump) and the C(mariadb) client run where the module runs), its
    binary log history reset to the copy's GTID position, replication restarted
    both ways and the mark cleared.
  - One operation at a time per pair (a lock in ZooKeeper under
    C(<zookeeper_root>/<cluster>/ops/locks/<pair>)); a journal at
    C(ops/journal/promote-<pair>) records each step, and a rerun after a failure
    finishes the recorded promotion.
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.zookeeper
  - shardfleet.fleet.mysql.tls
options:
  pair:
    description: The pair's name (its lock and journal are named after it), e.g. C(pair001).
    type: str
    required: true
  nodes:
    description: The pair's two MySQL servers as C(host:port), as the map names them.
    type: list
    elements: str
    required: true
  mode:
    description: C(planned) (master alive), C(emergency) (master dead), C(rebuild) (re-attach).
    type: str
    choices: [planned, emergency, rebuild]
    default: planned
  master:
    description:
      - The server that should be the master afterwards (default the map's standby).
        With it set, a rerun of a finished promotion is no change.
    type: str
  expect_master:
    description:
      - The server (C(host:port)) the caller believes is the pair's master now. When the
        map names another master the module fails and changes nothing (the promotion
        already happened, or someone else promoted), so rerunning a finished command never
        swaps the pair back. An unfinished promotion from it is continued.
      - C(playbooks/promote.yml) passes the map's master read at the start of the run and
        prints the rerun command with it.
    type: str
  force:
    description: In I(mode=emergency), promote even though the master answers (it is fenced).
    type: bool
    default: false
  login_user:
    description: MySQL administrative user on both servers (the C(mysql) role's admin).
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password; comes from Ansible Vault, never logged.
    type: str
    default: ''
  connect_timeout:
    description: Seconds to wait for a server to answer.
    type: float
    default: 2
  probe_timeout:
    description:
      - I(mode=emergency) tests the master with this connect timeout (at most
        I(connect_timeout)). A master that does not answer is taken for dead only when its
        standby does not hear it either (no event or heartbeat within about three heartbeat
        periods); a standby that still hears it means the control node alone is cut off,
        and the module refuses, even with I(force=true).
    type: float
    default: 1
  catchup_timeout:
    description: Seconds the standby may take to catch up before anything is frozen.
    type: float
    default: 30
  drain_timeout:
    description: Seconds the standby may take to apply the last transactions while writes wait.
    type: float
    default: 10
  copy:
    description:
      - I(mode=rebuild) how the node gets the master's data.
      - C(physical), what C(playbooks/rebuild-standby.yml) uses. The first call fences the
        node and returns C(copy) (source and target); the caller runs M(shard_copy) on the
        two nodes, then calls again with I(copy_position).
      - C(logical), C(mariadb-dump) of every shard database through the control node
        (tiny fleets; needs the mariadb client here).
    type: str
    choices: [logical, physical]
    default: logical
  copy_position:
    description: I(mode=rebuild, copy=physical) the GTID position M(shard_copy) returned.
    type: str
    default: ''
  copy_id:
    description:
      - I(mode=rebuild, copy=physical) the C(copy_id) the first call returned in C(copy).
        When a run of the same rebuild named a newer copy since (the playbook started
        twice), the re-attach is refused and nothing changes.
    type: str
    default: ''
  replication_user:
    description:
      - The pair's replication account (the C(mysql) role's C(mysql_replication_user)).
        I(mode=rebuild) recreates the master's channel to the rebuilt node with it when an
        emergency removed that channel (host, port and user are taken from what the
        emergency recorded in its journal).
    type: str
    default: shardfleet_repl
  replication_password:
    description:
      - Its password (C(mysql_replication_password), from Ansible Vault; never logged).
        Needed by I(mode=rebuild) after an emergency, since no server shows a channel's password.
    type: str
    default: ''
attributes:
  check_mode:
    support: full
    description:
      - Runs every check (servers answer, replication, lag, lock) and lists the steps it
        would take; changes nothing.
  diff_mode:
    support: full
    description: The map before and after (in check mode, the ranges that would change).
  idempotent:
    support: partial
    description:
      - With I(master) set, a rerun after a finished promotion changes nothing; with
        I(expect_master) set to the master before, a rerun is refused and changes nothing;
        with neither, a planned promotion always promotes the current standby (a rerun
        swaps back).
      - An emergency rerun finds the old master marked for rebuild and changes nothing; a
        rebuild rerun finds no mark and changes nothing.
"""

EXAMPLES = r"""
- name: Planned promotion of pair001's standby
  shardfleet.fleet.shard_promote:
    zookeeper_hosts: [10.242.0.31:2181]
    zookeeper_user: "{{ zookeeper_admin_user }}"
    zookeeper_password: "{{ zookeeper_admin_password }}"
    pair: pair001
    nodes: [10.242.0.11:3306, 10.242.0.12:3306]
    login_password: "{{ mysql_admin_password }}"

- name: The master is dead
  shardfleet.fleet.shard_promote:
    zookeeper_hosts: [10.242.0.31:2181]
    pair: pair001
    nodes: [10.242.0.11:3306, 10.242.0.12:3306]
    mode: emergency
    login_password: "{{ mysql_admin_password }}"
"""

RETURN = r"""
mode:
  description: The mode that ran (a resumed promotion runs the journal's mode).
  returned: always
  type: str
old_master:
  description: The master before (C(host:port)).
  returned: always
  type: str
new_master:
  description: The master after.
  returned: always
  type: str
ranges:
  description: The pair's ranges, C([first, last]) each.
  returned: always
  type: list
  elements: list
steps:
  description: The steps done (in check mode, the checks and the steps it would take).
  returned: always
  type: list
  elements: str
warnings_list:
  description: What the operator must read (semi-sync off, errant transactions, a failed fence).
  returned: always
  type: list
  elements: str
errant:
  description: GTID ranges written on the standby that the old master never had.
  returned: always
  type: list
  elements: str
semisync:
  description: Semi-sync settings and status of the servers that answered.
  returned: always
  type: dict
timings:
  description: Seconds from the start to each step; C(frozen_seconds) is how long writes waited.
  returned: always
  type: dict
map_before:
  description: The map as a table before.
  returned: always
  type: str
map_after:
  description: The map as a table after (empty in check mode).
  returned: always
  type: str
changes:
  description: Readable range changes.
  returned: always
  type: list
  elements: str
next_step:
  description: What to do next (for example the rebuild command).
  returned: always
  type: str
copy:
  description: I(mode=rebuild, copy=physical) the copy to make now, C(source) and C(target)
    as C(host:port); empty when none is needed.
  returned: always
  type: dict
resumed:
  description: True when the run finished a promotion an earlier run started.
  returned: always
  type: bool
recopy:
  description: I(mode=rebuild) True when the node does not answer after this rebuild fenced
    it for a physical copy (its install was cut short); a new copy replaces its data
    directory whole, so the node is left out of the C(mysql) role until then.
  returned: always
  type: bool
channel_removed:
  description: Emergency only, the new master's removed channel to the old master
    (C(name), C(host), C(port), C(user), C(connect_retry)); no password.
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
    from shardfleet.operations.promote import promote
    from shardfleet.operations.rebuild import rebuild_standby
    from shardfleet.operations.types import Options

    p = module.params
    opts = Options(user=p["login_user"], password=p["login_password"],
                   connect_timeout=p["connect_timeout"], probe_timeout=p["probe_timeout"],
                   catchup_timeout=p["catchup_timeout"], drain_timeout=p["drain_timeout"],
                   force=p["force"], replication_user=p["replication_user"],
                   replication_password=p["replication_password"], copy=p["copy"],
                   copy_position=p["copy_position"], copy_id=p["copy_id"],
                   tls=mysql_tls(module))
    store = zookeeper_store(module)
    with library_errors(module, f"promote {p['pair']}"):
        try:
            if p["mode"] == "rebuild":
                res = rebuild_standby(store, p["pair"], p["nodes"], opts=opts,
                                      check=module.check_mode)
            else:
                res = promote(store, p["pair"], p["nodes"], mode=p["mode"],
                              master=p["master"], expect_master=p["expect_master"],
                              opts=opts, check=module.check_mode)
        finally:
            store.close(timeout=2)
    out = res.to_dict()
    out["warnings_list"] = out.pop("warnings")
    for w in out["warnings_list"]:
        module.warn(w)
    if module._diff:
        out["diff"] = dict(before=res.map_before + "\n",
                           after=(res.map_after or "\n".join(res.changes)) + "\n")
    module.exit_json(**out)


def main():
    spec = zookeeper_argument_spec()
    spec.update(mysql_tls_argument_spec())
    spec.update(
        pair=dict(type="str", required=True),
        nodes=dict(type="list", elements="str", required=True),
        mode=dict(type="str", default="planned", choices=["planned", "emergency", "rebuild"]),
        master=dict(type="str"),
        expect_master=dict(type="str"),
        force=dict(type="bool", default=False),
        login_user=dict(type="str", default="shardfleet_admin"),
        login_password=dict(type="str", default="", no_log=True),
        connect_timeout=dict(type="float", default=2),
        probe_timeout=dict(type="float", default=1),
        catchup_timeout=dict(type="float", default=30),
        drain_timeout=dict(type="float", default=10),
        replication_user=dict(type="str", default="shardfleet_repl"),
        replication_password=dict(type="str", default="", no_log=True),
        copy=dict(type="str", default="logical", choices=["logical", "physical"]),
        copy_position=dict(type="str", default=""),
        copy_id=dict(type="str", default=""),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
