#!/usr/bin/python
# Create or drop the shard databases of a range on one MySQL server.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_databases
short_description: Create or drop shard databases (db00000...) with every schema table
description:
  - Creates the shard databases of a range on one server, with every table of the
    shardfleet schema file and the application user's per-shard grants
    (C(SELECT, INSERT, UPDATE, DELETE) on each C(dbNNNNN.*), so a single shard
    can be fenced by revoking it).
  - Reads the server's state in a few queries, then creates only what is missing,
    batched over one connection (thousands of shards in one call).
  - A table whose columns differ from the schema is reported in C(drifted), never altered.
    That check opens every table's definition (about 10 s for 2,048 shards), so a clean
    one is recorded on the server (database C(shardfleet_provision), replicated with the
    shards) and by default repeated only when the schema changed; see
    I(check_definitions).
  - With I(state=absent), drops the shard databases of the range, refusing any
    shard that holds rows unless I(force=true).
version_added: "0.1.0"
author: shardfleet
extends_documentation_fragment:
  - shardfleet.fleet.mysql
options:
  range:
    description: First and last shard, inclusive. Mutually exclusive with I(shards).
    type: list
    elements: int
  shards:
    description: Explicit shard numbers. Mutually exclusive with I(range).
    type: list
    elements: int
  schema:
    description: Path to a schema file; the library's own C(schema.yml) by default.
    type: path
  state:
    description: C(present) creates what is missing; C(absent) drops the shard databases.
    type: str
    choices: [present, absent]
    default: present
  app_user:
    description: Application user to grant per-shard privileges to (must exist). Empty skips grants.
    type: str
    default: shardfleet_app
  app_host:
    description: Host part of the application user's account.
    type: str
    default: "%"
  force:
    description: With I(state=absent), drop shards even if they hold rows.
    type: bool
    default: false
  batch:
    description: Shards per round trip.
    type: int
    default: 64
  check_definitions:
    description:
      - When to compare the existing tables' columns with the schema (C(drifted)).
      - C(changed) compares them unless the server records a clean check of these
        shards against this schema; a table altered by hand since that check is not seen.
      - C(always) compares them on every run; C(never) skips the comparison.
      - A clean comparison, and every run that creates the range from the schema, is
        recorded (not in check mode); a run that finds drift records nothing, so the
        warning comes back until the tables are fixed.
    type: str
    choices: [changed, always, never]
    default: changed
attributes:
  check_mode:
    support: full
    description: Reports what would be created or dropped; changes nothing.
  diff_mode:
    support: full
    description: The databases and tables that would be created or dropped.
  idempotent:
    support: full
    description: A second run with the same options reports no change.
notes:
  - Run it on the master of a pair; DDL and grants reach the standby through replication.
"""

EXAMPLES = r"""
- name: Create the post's 4,096 shards on pair001's master
  shardfleet.fleet.shard_databases:
    login_host: 127.0.0.1
    login_user: "{{ mysql_admin_user }}"
    login_password: "{{ mysql_admin_password }}"
    range: [0, 4095]
    app_user: "{{ mysql_app_user }}"

- name: Drop moved shards from the old pair (refuses shards with rows)
  shardfleet.fleet.shard_databases:
    login_user: "{{ mysql_admin_user }}"
    login_password: "{{ mysql_admin_password }}"
    range: [2048, 4095]
    state: absent
"""

RETURN = r"""
databases_created:
  description: Shard databases created (or that would be, in check mode).
  returned: state=present
  type: int
  sample: 4096
tables_created:
  description: Tables created (or that would be).
  returned: state=present
  type: int
  sample: 57344
grants_added:
  description: Per-shard grants added to the application user.
  returned: state=present
  type: int
drifted:
  description: Tables whose live columns differ from the schema (never altered).
  returned: always
  type: list
  elements: dict
definitions_checked:
  description: Whether the existing tables' columns were compared with the schema.
  returned: state=present
  type: bool
databases_dropped:
  description: Shard databases dropped (or that would be).
  returned: state=absent
  type: int
shards_with_rows:
  description: Shard databases in the range that hold rows.
  returned: state=absent
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    mysql_argument_spec,
    mysql_connect,
    require_library,
)


def _summary(names, limit=20):
    names = list(names)
    if len(names) <= limit:
        return names
    return names[:limit // 2] + [f"... {len(names) - limit} more ..."] + names[-limit // 2:]


def run(module):
    from shardfleet import provision
    from shardfleet.schema import load_schema

    p = module.params
    with library_errors(module):
        schema = load_schema(p["schema"])
        shards = provision.shard_list(p["range"], p["shards"])
    # a statement of a plan over thousands of shards (information_schema, a batch of
    # CREATE TABLE) may take minutes on a busy server: its answer is waited for that long
    conn = mysql_connect(module, client_flag=provision.multi_statement_flags(),
                         read_timeout=600)
    result = dict(changed=False, drifted=[])
    with library_errors(module, f"{p['login_host']}:{p['login_port']}", result):
        try:
            if p["state"] == "present":
                plan = provision.plan_shards(conn, shards, schema,
                                             app_user=p["app_user"] or None,
                                             app_host=p["app_host"],
                                             check_definitions=p["check_definitions"])
                result.update(definitions_checked=plan.definitions_checked,
                              databases_created=len(plan.databases),
                              tables_created=len(plan.tables),
                              grants_added=len(plan.grants), drifted=plan.drifted,
                              changed=plan.changed)
                if module._diff:
                    lines = (_summary(f"+ database {d}" for d in plan.databases)
                             + _summary(f"+ table {d}.{t}" for d, t in plan.tables)
                             + _summary(f"+ grant {provision.APP_PRIVILEGES} on {d}.*"
                                        for d in plan.grants))
                    result["diff"] = dict(before="", after="\n".join(lines) + "\n")
                if plan.changed and not module.check_mode:
                    provision.apply_plan(conn, plan, schema, app_user=p["app_user"] or None,
                                         app_host=p["app_host"], batch=p["batch"])
                if not module.check_mode:
                    # a record of the check, not a change of the shards
                    provision.record_definitions_check(conn, plan, schema)
            else:
                present, with_rows = provision.plan_drop(conn, shards, schema)
                result.update(databases_dropped=len(present), shards_with_rows=with_rows,
                              changed=bool(present))
                if with_rows and not p["force"]:
                    module.fail_json(msg=f"refusing to drop {len(with_rows)} shard(s) that hold "
                                         f"rows ({', '.join(_summary(with_rows, 6))}); set "
                                         "force: true to drop them anyway", **result)
                if module._diff:
                    result["diff"] = dict(
                        before="\n".join(_summary(f"database {d}" for d in present)) + "\n",
                        after="")
                if present and not module.check_mode:
                    provision.apply_drop(conn, present, app_user=p["app_user"] or None,
                                         app_host=p["app_host"], batch=p["batch"])
        finally:
            conn.close()
    if result["drifted"]:
        module.warn(f"{len(result['drifted'])} table(s) differ from the schema and were left "
                    "as they are; see 'drifted'")
    module.exit_json(**result)


def main():
    spec = mysql_argument_spec()
    spec.update(
        range=dict(type="list", elements="int"),
        shards=dict(type="list", elements="int"),
        schema=dict(type="path"),
        state=dict(type="str", default="present", choices=["present", "absent"]),
        app_user=dict(type="str", default="shardfleet_app"),
        app_host=dict(type="str", default="%"),
        force=dict(type="bool", default=False),
        batch=dict(type="int", default=64),
        check_definitions=dict(type="str", default="changed",
                               choices=["changed", "always", "never"]),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True,
                           mutually_exclusive=[("range", "shards")],
                           required_one_of=[("range", "shards")])
    require_library(module)
    run(module)


if __name__ == "__main__":
    main()
