#!/usr/bin/python
# Copyright: shardfleet contributors
# Apache License 2.0
"""A host's converged stamp: the digest of the inputs a play last converged it with."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: converged
short_description: Tell whether a host is converged with this run's inputs and state
description:
  - A play that ends with O(state=present) leaves a stamp on the host
    (C(<path>/<name>.json)) naming the digest of its inputs and the host's observed
    state as the play left it (O(observe)). The next run's O(state=check) returns
    RV(converged) true only when nothing the play reads has changed and the host still
    looks as the play left it; the play then ends for that host (C(meta) C(end_host))
    instead of checking each of its tasks again.
  - The digest is computed on the control node by the module's action plugin, never
    given by hand. It covers the collection's files (roles, playbooks, plugins, the
    library), the inventory's files and every host and group variable of the loaded
    inventory (a dynamic inventory's too), this host's inventory variables as
    templated now (environment lookups, vault values), the C(-e) arguments, the
    contents of O(paths) and O(inputs). A secret (a variable named like one) enters
    it as a keyed hash whose key stays on the control node, so a rotation is seen and
    the digest is no oracle for the value.
  - The observed state is read on the host (module_utils C(observe)) and covers
    the files the play manages (content, mode, owner), its services (active and
    enabled), its packages' versions, and the servers' runtime settings the play sets
    (MariaDB users, grants, global variables, replication channels, C(read_only); the
    Redis configuration; memcached's settings).
  - RV(converged) is false, and the play runs in full, when there is no stamp, the
    digest differs, the stamp is older than O(max_age) seconds (time-bound work such
    as certificate renewal gets its turn), the host's address changed, a part of the
    observed state differs or cannot be read (RV(reason) names which), or O(enabled)
    is false.
  - O(state=check) removes a stamp that does not match, so a run that fails half-way
    never leaves one behind. O(state=present) writes the stamp only when the run was
    not narrowed by C(--tags), C(--skip-tags), C(--start-at-task) or C(--step) (a
    partial run is not a converged host). Neither reports a change, the stamp being
    bookkeeping, not configuration.
options:
  name:
    description:
      - The stamp's name, one per play (C(mysql), C(monitoring), ...); required but for
        O(state=observe).
    type: str
  state:
    description:
      - C(check) compares (and removes a stale stamp); C(present) writes one.
      - C(observe) reads every stamp the host holds and observes each one's state again,
        returning RV(plays) (site.yml's first play, one call a host for the whole run);
        a later O(state=check) given O(observed) then decides on the control node,
        with no call to the host unless there is a stale stamp to remove.
      - C(absent) removes the stamp O(name).
    type: str
    choices: [check, present, observe, absent]
    default: check
  digest:
    description:
      - For O(state=present), the RV(digest) the play's O(state=check) returned.
      - For O(state=check), set by the action plugin; do not set it.
    type: str
  enabled:
    description: False makes O(state=check) answer false (a full run).
    type: bool
    default: true
  observe:
    description:
      - For O(state=present), what the play manages on the host, observed now and
        recorded in the stamp; O(state=check) observes the same again. Keys
        C(files), C(services), C(packages) (lists), C(mariadb) (C(socket), C(users),
        C(variables_from), C(exclude), C(replication), C(read_only), C(db_grants),
        C(databases), a LIKE pattern), C(redis) (C(conf)), C(memcached) (C(address), C(port)).
    type: dict
    default: {}
  paths:
    description:
      - Files on the control node whose contents are inputs (a CA certificate); a
        missing file is an input too.
    type: list
    elements: path
    default: []
  inputs:
    description:
      - Further inputs of the play, any data (the shard map).
      - For O(state=present) with O(base), the inputs as the play left them.
    type: raw
  base:
    description:
      - For O(state=present), in place of O(digest), the host's RV(base) from the
        check; the stamp's digest is then computed with O(inputs). A play that
        changed an input it had read (the shards play registering the first map) is
        converged with the input it wrote, so the next run's check, which reads that,
        matches.
    type: str
  observed:
    description:
      - For O(state=check), the RV(plays) of an earlier O(state=observe) in this run; the
        action plugin compares the digest with the observed stamp's on the control node.
        Leave it out for a host a play of this run changed (observe it again).
    type: dict
  max_age:
    description: Seconds a stamp stays good for; 0 means no limit.
    type: int
    default: 86400
  path:
    description: The directory of the stamps on the host.
    type: path
    default: /var/lib/shardfleet/converged
attributes:
  action:
    support: full
  check_mode:
    support: full
  idempotent:
    support: full
"""

EXAMPLES = r"""
- name: Compare the host's stamp with this run's inputs and the host's state
  shardfleet.fleet.converged:
    name: memcached
    paths: ["{{ shardfleet_tls_ca_cert }}"]
  register: converged

- name: End the play for a converged host
  ansible.builtin.meta: end_host
  when: converged.converged

# ... the roles ...

- name: Stamp the host converged
  shardfleet.fleet.converged:
    name: memcached
    state: present
    digest: "{{ converged.digest }}"
    observe:
      files: [/etc/memcached.conf]
      services: [memcached]
      packages: [memcached]
      memcached: {address: 10.242.0.51, port: 11211}
"""

RETURN = r"""
converged:
  description: Whether the host's stamp matches this run's inputs and state (O(state=check)).
  type: bool
  returned: always
digest:
  description: The digest of this run's inputs (O(state=check)), or the one written.
  type: str
  returned: always
base:
  description:
    - The host's digest of everything but O(inputs) (O(state=check)); O(state=present)
      takes it as O(base).
  type: str
  returned: when O(state=check)
reason:
  description:
    - Why the host is not converged (empty when it is) - C(no stamp), C(inputs changed),
      C(stamp is N s old), C(address changed ...), C(observed state differs - PARTS).
  type: str
  returned: always
drift:
  description: The parts of the observed state that differ from the stamp (O(state=check)).
  type: list
  elements: str
  returned: always
plays:
  description:
    - For O(state=observe), each stamp's play name mapped to its C(digest), C(reason)
      (empty when the host still looks as the stamp says) and C(drift).
  type: dict
  returned: when O(state=observe)
written:
  description: Whether O(state=present) wrote the stamp.
  type: bool
  returned: always
"""

import json
import os
import re
import socket
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.observe import (
    differences,
    inputs_reason,
    observe,
)

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def host_address():
    """The address the host reaches the world from (Ansible's default_ipv4 takes the same
    route): a UDP socket's connect sends nothing. Empty without a default route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 53))
            return s.getsockname()[0]
    except OSError:
        return ""


def read_stamp(path):
    try:
        with open(path, encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def verdict(stamp, address, max_age, now):
    """Why ``stamp`` does not show the host as its play left it (empty: it does), and the
    parts of the observed state that differ. The inputs' digest is the caller's."""
    age = now - float(stamp.get("time", 0))
    if max_age and not 0 <= age <= max_age:
        return f"stamp is {age:.0f} s old (max_age {max_age})", []
    if stamp.get("address", "") != address:
        return (f"address changed from {stamp.get('address') or 'none'} to "
                f"{address or 'none'}"), []
    recorded = stamp.get("observed")
    if not isinstance(recorded, dict):
        return "the stamp records no observed state", []
    drift = differences(recorded, observe(stamp.get("spec") or {}))
    if drift:
        return "observed state differs: " + ", ".join(drift), drift
    return "", []


def mismatch(enabled, stamp, digest, address, max_age, now):
    """Why ``stamp`` does not show a host converged with ``digest`` (empty: it does), and
    the parts of the observed state that differ."""
    reason = inputs_reason(enabled, None if stamp is None else stamp.get("digest"), digest)
    if reason:
        return reason, []
    return verdict(stamp, address, max_age, now)


def observe_all(directory, max_age):
    """Every stamp in ``directory``: its digest and verdict, by play name."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return {}
    address, now, plays = host_address(), time.time(), {}
    for n in names:
        stamp = read_stamp(os.path.join(directory, n))
        if stamp is None or not NAME.match(n[:-5]):
            continue
        reason, drift = verdict(stamp, address, max_age, now)
        plays[n[:-5]] = dict(digest=str(stamp.get("digest", "")), reason=reason, drift=drift)
    return plays


def write_stamp(path, stamp):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stamp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(stamp, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str"),
            state=dict(type="str", choices=["check", "present", "observe", "absent"],
                       default="check"),
            digest=dict(type="str"),
            enabled=dict(type="bool", default=True),
            observe=dict(type="dict", default={}),
            paths=dict(type="list", elements="path", default=[]),
            inputs=dict(type="raw"),
            base=dict(type="str"),
            max_age=dict(type="int", default=86400),
            path=dict(type="path", default="/var/lib/shardfleet/converged"),
            observed=dict(type="dict"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] == "observe":
        module.exit_json(changed=False, plays=observe_all(p["path"], p["max_age"]))
    if not NAME.match(p["name"] or ""):
        module.fail_json(msg=f"name {p['name']!r}: lowercase letters, digits, "
                             "'.', '_' and '-' only")
    if not p["digest"] and p["state"] != "absent":
        module.fail_json(msg="digest is missing: the action plugin computes it for state=check, "
                             "and state=present takes the check's returned digest")
    stamp_path = os.path.join(p["path"], p["name"] + ".json")
    if p["state"] == "absent":
        gone = os.path.lexists(stamp_path) and not module.check_mode
        if gone:
            os.unlink(stamp_path)
        module.exit_json(changed=False, removed=gone)
    result = dict(changed=False, converged=False, digest=p["digest"], reason="", drift=[],
                  written=False)
    if p["state"] == "present":
        spec = p["observe"] or {}
        stamp = dict(digest=p["digest"], time=time.time(), address=host_address(),
                     spec=spec, observed=observe(spec))
        if not module.check_mode:
            write_stamp(stamp_path, stamp)
            result["written"] = True
        module.exit_json(**result)

    reason, drift = mismatch(p["enabled"], read_stamp(stamp_path), p["digest"],
                             host_address(), p["max_age"], time.time())
    result.update(converged=not reason, reason=reason, drift=drift)
    if reason and os.path.lexists(stamp_path) and not module.check_mode:
        os.unlink(stamp_path)  # a run that stops half-way leaves no stamp behind
    module.exit_json(**result)


if __name__ == "__main__":
    main()
