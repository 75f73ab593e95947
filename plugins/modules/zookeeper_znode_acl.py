#!/usr/bin/python
# Copyright: shardfleet contributors
# Apache License 2.0
"""Ensure a znode exists and carries exactly the wanted digest ACL."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: zookeeper_znode_acl
short_description: Ensure a ZooKeeper znode exists with a digest ACL
description:
  - Creates O(path) when it is missing and sets its ACL to exactly two entries
    when it differs. The admin digest credential gets all permissions; read
    access goes to the read digest credential or, when O(read_user) is empty,
    to anyone (C(world:anyone)).
  - Connects with the admin credential, so it can also repair an ACL it set before.
options:
  hosts:
    description: ZooKeeper connection string (C(host:port[,host:port])).
    type: str
    default: 127.0.0.1:2181
  path:
    description: Absolute path of the znode.
    type: str
    required: true
  admin_user:
    description: Digest user that gets all permissions.
    type: str
    required: true
  admin_password:
    description: Password of O(admin_user).
    type: str
    required: true
  read_user:
    description: Digest user that gets read permission; empty means anyone may read.
    type: str
    default: ""
  read_password:
    description: Password of O(read_user).
    type: str
    default: ""
  timeout:
    description: Seconds to wait for a ZooKeeper session.
    type: float
    default: 15
attributes:
  check_mode:
    support: full
  idempotent:
    support: full
requirements:
  - kazoo (Debian python3-kazoo)
"""

EXAMPLES = r"""
- name: Protect /shardfleet
  shardfleet.fleet.zookeeper_znode_acl:
    path: /shardfleet
    admin_user: shardfleet_admin
    admin_password: "{{ zookeeper_admin_password }}"
  no_log: true
"""

RETURN = r"""
created:
  description: Whether the znode was created.
  type: bool
  returned: always
acl:
  description: The ACL entries now on the znode, as C(scheme:id:perms) (digests, not passwords).
  type: list
  elements: str
  returned: always
"""

from ansible.module_utils.basic import AnsibleModule

try:
    from kazoo.client import KazooClient
    from kazoo.security import ACL, Id, Permissions, make_digest_acl

    HAS_KAZOO = True
except ImportError:  # pragma: no cover - reported by fail_json below
    HAS_KAZOO = False


def _key(acl):
    return (acl.id.scheme, acl.id.id, acl.perms)


def _show(acl):
    return f"{acl.id.scheme}:{acl.id.id}:{acl.perms:d}"


def main():
    module = AnsibleModule(
        argument_spec=dict(
            hosts=dict(type="str", default="127.0.0.1:2181"),
            path=dict(type="str", required=True),
            admin_user=dict(type="str", required=True),
            admin_password=dict(type="str", required=True, no_log=True),
            read_user=dict(type="str", default=""),
            read_password=dict(type="str", default="", no_log=True),
            timeout=dict(type="float", default=15),
        ),
        supports_check_mode=True,
    )
    if not HAS_KAZOO:
        module.fail_json(msg="kazoo is required (apt-get install python3-kazoo)")
    p = module.params
    if not p["path"].startswith("/") or p["path"] == "/":
        module.fail_json(msg="path must be an absolute znode path below /")

    wanted = [make_digest_acl(p["admin_user"], p["admin_password"], all=True)]
    if p["read_user"]:
        wanted.append(make_digest_acl(p["read_user"], p["read_password"], read=True))
    else:
        wanted.append(ACL(Permissions.READ, Id("world", "anyone")))

    zk = KazooClient(
        hosts=p["hosts"],
        timeout=p["timeout"],
        auth_data=[("digest", f"{p['admin_user']}:{p['admin_password']}")],
    )
    try:
        zk.start(timeout=p["timeout"])
    except Exception as exc:  # kazoo raises its own timeout types
        module.fail_json(msg=f"cannot reach ZooKeeper at {p['hosts']}: {exc}")
    try:
        created = False
        changed = False
        if zk.exists(p["path"]) is None:
            changed = created = True
            if not module.check_mode:
                zk.create(p["path"], b"", acl=wanted, makepath=True)
            current = wanted
        else:
            current, _stat = zk.get_acls(p["path"])
            if sorted(map(_key, current)) != sorted(map(_key, wanted)):
                changed = True
                if not module.check_mode:
                    zk.set_acls(p["path"], wanted)
                current = wanted
        module.exit_json(
            changed=changed,
            created=created,
            acl=[_show(a) for a in current],
        )
    except Exception as exc:
        module.fail_json(msg=f"cannot set the ACL of {p['path']}: {exc}")
    finally:
        zk.stop()
        zk.close()


if __name__ == "__main__":
    main()
