#!/usr/bin/python
# Copyright: shardfleet contributors
# Apache License 2.0
"""A host's converged stamp: the digest of the inputs a play last converged it with."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: converged
short_description: Tell whether a host is converged with this run's inputs (site.yml's fast path)
description:
  - A play that ends with O(state=present) leaves a stamp on the host
    (C(<path>/<name>.json)) naming the digest of its inputs, the services it left
    running and the host's address. The next run's O(state=check) compares it and
    returns RV(converged) true only when nothing the play reads has changed and the
    host still looks as the play left it; the play then ends for that host
    (C(meta) C(end_host)) instead of checking each of its tasks again.
  - The digest is computed on the control node by the module's action plugin, never
    given by hand. It covers the collection's files (roles, playbooks, plugins, the
    library), the inventory's files and every host and group variable of the loaded
    inventory (a dynamic inventory's too), this host's inventory variables as
    templated now (environment lookups, vault values), the C(-e) arguments, the
    contents of O(paths) and O(inputs).
  - RV(converged) is false, and the play runs in full, when there is no stamp, the
    digest differs, the stamp is older than O(max_age) seconds (time-bound work such
    as certificate renewal gets its turn), the host's address changed, a service the
    stamp names is not active, or O(enabled) is false.
  - O(state=check) removes a stamp that does not match, so a run that fails half-way
    never leaves one behind. O(state=present) writes the stamp only when the run was
    not narrowed by C(--tags), C(--skip-tags), C(--start-at-task) or C(--step) (a
    partial run is not a converged host). Neither reports a change, the stamp being
    bookkeeping, not configuration.
options:
  name:
    description: The stamp's name, one per play (C(mysql), C(monitoring), ...).
    type: str
    required: true
  state:
    description: C(check) compares (and removes a stale stamp); C(present) writes one.
    type: str
    choices: [check, present]
    default: check
  digest:
    description:
      - For O(state=present), the RV(digest) the play's O(state=check) returned.
      - For O(state=check), set by the action plugin; do not set it.
    type: str
  enabled:
    description: False makes O(state=check) answer false (a full run, the drift check).
    type: bool
    default: true
  services:
    description:
      - For O(state=present), the systemd units the play left running; a later check
        wants each of them active.
    type: list
    elements: str
    default: []
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
      - For O(state=present), in place of O(digest), the host's entry of the check's
        RV(bases); the stamp's digest is then computed with O(inputs). A play that
        changed an input it had read (the shards play registering the first map) is
        converged with the input it wrote, so the next run's check, which reads that,
        matches.
    type: str
  max_age:
    description: Seconds a stamp stays good for; 0 means no limit.
    type: int
    default: 86400
  path:
    description: The directory of the stamps on the host (on the keeper, see O(keeper)).
    type: path
    default: /var/lib/shardfleet/converged
  keeper:
    description:
      - The fleet's stamps are kept on one host, the one the task runs on
        (C(shardfleet_converged_keeper); the task is delegated to it), instead of each
        host keeping its own. O(state=check) runs once for the play
        (C(run_once)). The action plugin computes every play host's digest, and the
        keeper compares each host's stamp (C(<path>/hosts/<host>/<name>.json)) and
        probes the ports it names on the address it names, so no host is asked one by
        one. A host whose stamp does not match loses the play's stamp; one whose ports
        do not answer loses all its stamps (it may have been rebuilt).
      - O(state=present) writes O(host)'s stamp on the keeper, with O(address) and
        O(ports) in place of O(services).
    type: bool
    default: false
  host:
    description: For O(keeper) and O(state=present), the inventory name the stamp is for.
    type: str
  address:
    description: For O(keeper) and O(state=present), the host's fleet address the probes use.
    type: str
  ports:
    description:
      - For O(keeper) and O(state=present), the TCP ports the play left listening on
        O(address); a later check wants each of them to accept a connection from the
        keeper.
    type: list
    elements: int
    default: []
  hosts:
    description: For O(keeper) and O(state=check), set by the action plugin (each host's digest).
    type: dict
attributes:
  action:
    support: full
  check_mode:
    support: full
  idempotent:
    support: full
"""

EXAMPLES = r"""
- name: Compare the host's stamp with this run's inputs
  shardfleet.fleet.converged:
    name: mysql
    paths: ["{{ shardfleet_tls_ca_cert }}"]
  register: mysql_converged

- name: End the play for a converged host
  ansible.builtin.meta: end_host
  when: mysql_converged.converged

# ... the roles ...

- name: Stamp the host converged
  shardfleet.fleet.converged:
    name: mysql
    state: present
    digest: "{{ mysql_converged.digest }}"
    services: [mariadb]
"""

RETURN = r"""
converged:
  description: Whether the host's stamp matches this run's inputs (O(state=check)).
  type: bool
  returned: always
digest:
  description: The digest of this run's inputs (O(state=check)), or the one written.
  type: str
  returned: always
reason:
  description: Why the host is not converged (empty when it is).
  type: str
  returned: always
written:
  description: Whether O(state=present) wrote the stamp.
  type: bool
  returned: always
converged_hosts:
  description:
    - The hosts known converged (O(state=check)); the play's consumers test
      C(inventory_hostname in converged.converged_hosts), the same with or without
      O(keeper).
  type: list
  elements: str
  returned: always
digests:
  description: Each checked host's digest (O(state=check)), by inventory name.
  type: dict
  returned: always
bases:
  description:
    - Each checked host's digest of everything but O(inputs) (O(state=check)), by
      inventory name; O(state=present) takes it as O(base).
  type: dict
  returned: when O(state=check)
reasons:
  description: Why each host that is not converged is not (O(keeper), O(state=check)).
  type: dict
  returned: when O(keeper)
"""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule

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


def inactive(services):
    """The units of ``services`` that are not active (one systemctl call)."""
    if not services:
        return []
    proc = subprocess.run(["systemctl", "is-active", *services], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, check=False)
    states = proc.stdout.split()
    if len(states) != len(services):
        return list(services)
    return [s for s, state in zip(services, states, strict=True) if state != "active"]


def read_stamp(path):
    try:
        with open(path, encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def stale(stamp, digest, max_age, now):
    """Why ``stamp`` is not one of ``digest`` young enough (empty: it is)."""
    if stamp is None:
        return "no stamp"
    if stamp.get("digest") != digest:
        return "inputs changed"
    age = now - float(stamp.get("time", 0))
    if max_age and not 0 <= age <= max_age:
        return f"stamp is {age:.0f} s old (max_age {max_age})"
    return ""


def mismatch(stamp, digest, address, max_age, now):
    """Why ``stamp`` does not show a host converged with ``digest`` (empty: it does)."""
    reason = stale(stamp, digest, max_age, now)
    if reason:
        return reason
    if stamp.get("address", "") != address:
        return f"address changed from {stamp.get('address') or 'none'} to {address or 'none'}"
    down = inactive([str(s) for s in stamp.get("services") or []])
    if down:
        return "not active: " + ", ".join(down)
    return ""


def closed_ports(targets, timeout=2.0):
    """Of ``targets`` ((address, port) pairs), those that refuse or do not answer a TCP
    connection: probed at once, each bounded by ``timeout``."""
    def closed(target):
        try:
            with socket.create_connection((target[0], int(target[1])), timeout=timeout):
                return False
        except (OSError, ValueError):
            return True

    if not targets:
        return set()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return {t for t, c in zip(targets, pool.map(closed, targets), strict=True) if c}


def keeper_mismatch(stamp, digest, max_age, now):
    """Why a kept ``stamp`` does not show its host converged with ``digest`` (empty: it
    does, once its ports answer)."""
    reason = stale(stamp, digest, max_age, now)
    if reason:
        return reason
    if not stamp.get("address"):
        return "the stamp names no address"
    return ""


def remove_host_stamps(directory):
    """Every stamp a host has on the keeper: a host that fails one check may have been
    rebuilt, so none of its plays is taken as done."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for n in names:
        if n.endswith(".json"):
            try:
                os.unlink(os.path.join(directory, n))
            except OSError:
                pass


def keeper_check(module, p):
    """The play's hosts at once, on the keeper: each stamp, then the ports of those whose
    stamps match, probed together."""
    hosts = p["hosts"] or {}
    now = time.time()
    reasons, stamps = {}, {}
    for host, digest in sorted(hosts.items()):
        if not NAME.match(host.lower()) or "/" in host:
            module.fail_json(msg=f"host {host!r}: not a name a stamp can be kept under")
        stamp = read_stamp(os.path.join(p["path"], "hosts", host, p["name"] + ".json"))
        reasons[host] = "disabled (enabled=false)" if not p["enabled"] else \
            keeper_mismatch(stamp, digest, p["max_age"], now)
        stamps[host] = stamp
    probed = [h for h in sorted(hosts) if not reasons[h]]
    closed = closed_ports([(stamps[h]["address"], port) for h in probed
                           for port in stamps[h].get("ports") or []])
    down = set()
    for h in probed:
        ports = [port for port in stamps[h].get("ports") or []
                 if (stamps[h]["address"], port) in closed]
        if ports:
            down.add(h)
            reasons[h] = (f"not listening on {stamps[h]['address']}: port "
                          + ", ".join(str(x) for x in ports))
    if not module.check_mode:
        for h, reason in reasons.items():
            if h in down:  # a service down, the host perhaps rebuilt: none of its plays holds
                remove_host_stamps(os.path.join(p["path"], "hosts", h))
            elif reason:  # this play's stamp only: the earlier plays' of this run stay good
                path = os.path.join(p["path"], "hosts", h, p["name"] + ".json")
                if os.path.lexists(path):
                    os.unlink(path)
    ok = sorted(h for h, r in reasons.items() if not r)
    module.exit_json(changed=False, converged=False, digest="", reason="", written=False,
                     converged_hosts=ok, digests=dict(hosts),
                     reasons={h: r for h, r in reasons.items() if r})


def write_stamp(path, stamp):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stamp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(stamp, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            state=dict(type="str", choices=["check", "present"], default="check"),
            digest=dict(type="str"),
            enabled=dict(type="bool", default=True),
            services=dict(type="list", elements="str", default=[]),
            paths=dict(type="list", elements="path", default=[]),
            inputs=dict(type="raw"),
            max_age=dict(type="int", default=86400),
            path=dict(type="path", default="/var/lib/shardfleet/converged"),
            keeper=dict(type="bool", default=False),
            host=dict(type="str"),
            address=dict(type="str"),
            ports=dict(type="list", elements="int", default=[]),
            hosts=dict(type="dict"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not NAME.match(p["name"]):
        module.fail_json(msg=f"name {p['name']!r}: lowercase letters, digits, "
                             "'.', '_' and '-' only")
    if p["keeper"] and p["state"] == "check":
        keeper_check(module, p)
    if not p["digest"]:
        module.fail_json(msg="digest is missing: the action plugin computes it for state=check, "
                             "and state=present takes the check's returned digest")
    stamp_path = os.path.join(p["path"], p["name"] + ".json")
    result = dict(changed=False, converged=False, digest=p["digest"], reason="", written=False)
    if p["state"] == "present":
        if p["keeper"]:
            if not p["host"] or not NAME.match(p["host"].lower()) or not p["address"]:
                module.fail_json(msg="keeper=true and state=present take the stamp's host "
                                     "(an inventory name) and its address")
            stamp_path = os.path.join(p["path"], "hosts", p["host"], p["name"] + ".json")
            stamp = dict(digest=p["digest"], time=time.time(), address=p["address"],
                         ports=p["ports"])
        else:
            stamp = dict(digest=p["digest"], time=time.time(), address=host_address(),
                         services=p["services"])
        if not module.check_mode:
            write_stamp(stamp_path, stamp)
            result["written"] = True
        module.exit_json(**result)

    stamp = read_stamp(stamp_path)
    reason = "disabled (enabled=false)" if not p["enabled"] else \
        mismatch(stamp, p["digest"], host_address(), p["max_age"], time.time())
    result.update(converged=not reason, reason=reason)
    if reason and os.path.lexists(stamp_path) and not module.check_mode:
        os.unlink(stamp_path)  # a run that stops half-way leaves no stamp behind
    module.exit_json(**result)  # the action adds converged_hosts and digests


if __name__ == "__main__":
    main()
