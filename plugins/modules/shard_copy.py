#!/usr/bin/python
# One physical copy of a MariaDB node, run on the two nodes themselves: the data never
# passes through the control node. The work is in shardfleet.physical.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_copy
short_description: Stream a physical copy (mariadb-backup) from one MySQL node to another
description:
  - Runs on a fleet node. I(mode=send) on the source streams
    C(mariadb-backup --backup --stream=mbstream) (backup locks, the server keeps
    serving) over one TCP connection to the target. I(mode=receive) on the target
    listens for one sender that proves it holds I(secret) (a challenge answered with
    its HMAC-SHA256, so the secret never crosses the network), extracts the stream next
    to the data directory, prepares it, stops the server, puts the copy in place of the
    data directory, starts the server and returns the copy's GTID position.
  - Start the receiver first (C(async), C(poll=0)), then the sender, which
    retries connecting for I(connect_timeout) seconds. C(playbooks/rebuild-standby.yml)
    does this; the library's rebuild then finishes with the returned position.
  - A copy that does not complete leaves the target's data directory untouched and
    no partial copy behind.
  - I(mode=receive) installs nothing on a node whose copies a split's abort cancelled
    (the database C(shardfleet_copy_fence) on the node, which the abort creates before it
    empties the target pair). It fails before listening; or, when the abort came while
    it received, before the swap (looked at again once the server is stopped, and then
    the server is started again on its own data). The next split onto the node drops it.
version_added: "0.2.0"
author: shardfleet
options:
  mode:
    description: C(send) on the source node, C(receive) on the target node.
    type: str
    required: true
    choices: [send, receive]
  secret:
    description: The copy's one-shot secret (both sides the same); never logged.
    type: str
    required: true
  target:
    description:
      - I(mode=send) the receiver, C(host:port), or a list of receivers.
      - Several receivers get the same stream of one backup at once, so their copies are at
        one GTID position (a split's physical clone copies onto both nodes of the new pair).
    type: list
    elements: str
  port:
    description: I(mode=receive) the TCP port to listen on (open it between the nodes only).
    type: int
    default: 4444
  bind:
    description: I(mode=receive) the address to listen on (the node's fleet address).
    type: str
    default: 0.0.0.0
  datadir:
    description: The server's data directory (source, read by mariadb-backup; target, replaced).
    type: str
    default: /var/lib/mysql
  login_user:
    description: I(mode=send) the admin user mariadb-backup connects as (unix socket).
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password; written to a 0600 option file for the run, never logged.
    type: str
    default: ''
  login_unix_socket:
    description: I(mode=send) the server's socket.
    type: str
    default: /run/mysqld/mysqld.sock
  parallel:
    description: I(mode=send) files mariadb-backup copies at once.
    type: int
    default: 4
  compress:
    description: I(mode=send) compress the stream with zstd (slow links; CPU on both nodes).
    type: bool
    default: false
  service:
    description: I(mode=receive) the systemd unit stopped and started around the swap.
    type: str
    default: mariadb
  owner:
    description: I(mode=receive) the owner given to the copied files.
    type: str
    default: mysql
  use_memory:
    description: I(mode=receive) memory for C(mariadb-backup --prepare).
    type: str
    default: 256M
  timeout:
    description: Seconds the whole copy may take; the sender's wait for the receiver's answer.
    type: float
    default: 3600
  connect_timeout:
    description: I(mode=send) seconds to keep trying to reach the receiver.
    type: float
    default: 120
  tls_dir:
    description:
      - Directory of this node's TLS files as the C(tls_cert) role installs them
        (C(ca.pem), C(server.pem), C(server.key)); given, the copy runs over TLS.
      - I(mode=receive) shows this node's certificate; I(mode=send) verifies each
        receiver's against C(ca.pem) and its address before sending anything. A peer
        that does not speak TLS gets nothing.
      - Unset (or empty), plain TCP (the copy's secret still decides who may send).
        The playbooks set it when the fleet has TLS (C(shardfleet_tls_enabled)).
    type: path
attributes:
  check_mode:
    support: full
    description: Says what it would do; copies nothing.
  diff_mode:
    support: none
  idempotent:
    support: none
    description: Every run makes a new copy; the rebuild that calls it decides when one is needed.
"""

EXAMPLES = r"""
- name: Receive the copy (target node)
  shardfleet.fleet.shard_copy:
    mode: receive
    secret: "{{ copy_secret }}"
  async: 3600
  poll: 0
  register: receiving

- name: Send the copy (source node)
  shardfleet.fleet.shard_copy:
    mode: send
    target: "10.0.1.12:4444"
    secret: "{{ copy_secret }}"
    login_password: "{{ mysql_admin_password }}"
"""

RETURN = r"""
position:
  description: I(mode=receive) the copy's GTID position (from the backup's binlog info).
  returned: success, mode=receive
  type: str
bytes:
  description: Bytes of the stream (compressed if I(compress)).
  returned: success
  type: int
seconds:
  description: Time the copy took on this side.
  returned: success
  type: float
"""

import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    require_library,
    service_action,
)


def receive(module):
    from shardfleet import physical

    p = module.params
    incoming = p["datadir"].rstrip("/") + ".incoming"
    if module.check_mode:
        if p.get("tls_dir"):  # a missing or bad certificate fails the preflight, named
            stream_tls(p).server_context  # noqa: B018
        if physical.cancelled(p["datadir"]):  # the preflight says so before any copy
            raise physical.CopyCancelled(physical.cancelled_message(
                p["datadir"], "nothing would be received"))
        module.exit_json(changed=True, msg=f"would listen on {p['bind']}:{p['port']}, extract "
                                           f"into {incoming}, prepare, replace {p['datadir']}")
    out = physical.receive_copy(p["secret"], p["datadir"],
                                stop=service_action(module, "stop"),
                                start=service_action(module, "start"), bind=p["bind"],
                                port=p["port"], tls=stream_tls(p), timeout=p["timeout"],
                                owner=p["owner"], use_memory=p["use_memory"])
    return dict(changed=True, **out)


def stream_tls(p):
    """The copy's TLS from tls_dir, or None (plain TCP)."""
    from shardfleet.tls import StreamTLS

    return StreamTLS.from_dir(p["tls_dir"]) if p.get("tls_dir") else None


def send(module):
    from shardfleet import physical

    p = module.params
    if not p["target"]:
        module.fail_json(msg="mode=send needs target (host:port of each receiver)")
    if module.check_mode:
        module.exit_json(changed=False, msg=f"would stream a backup of {p['datadir']} to "
                                            f"{', '.join(p['target'])}")
    with tempfile.TemporaryDirectory(prefix="sf-copy-") as tmp:
        cnf = physical.client_defaults(tmp, p["login_user"], p["login_password"])
        argv = physical.backup_argv(defaults_file=cnf, datadir=p["datadir"],
                                    socket_path=p["login_unix_socket"], parallel=p["parallel"])
        sent = physical.send(p["target"], p["secret"], argv, compress=p["compress"],
                             connect_timeout=p["connect_timeout"], reply_timeout=p["timeout"],
                             tls=stream_tls(p))
    return dict(changed=False, bytes=sent.bytes, seconds=round(sent.seconds, 3))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            mode=dict(type="str", required=True, choices=["send", "receive"]),
            secret=dict(type="str", required=True, no_log=True),
            target=dict(type="list", elements="str"),
            port=dict(type="int", default=4444),
            bind=dict(type="str", default="0.0.0.0"),
            datadir=dict(type="str", default="/var/lib/mysql"),
            login_user=dict(type="str", default="shardfleet_admin"),
            login_password=dict(type="str", default="", no_log=True),
            login_unix_socket=dict(type="str", default="/run/mysqld/mysqld.sock"),
            parallel=dict(type="int", default=4),
            compress=dict(type="bool", default=False),
            service=dict(type="str", default="mariadb"),
            owner=dict(type="str", default="mysql"),
            use_memory=dict(type="str", default="256M"),
            timeout=dict(type="float", default=3600),
            connect_timeout=dict(type="float", default=120),
            tls_dir=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    require_library(module)
    with library_errors(module, f"copy ({module.params['mode']})"):
        out = receive(module) if module.params["mode"] == "receive" else send(module)
    module.exit_json(**out)


if __name__ == "__main__":
    main()
