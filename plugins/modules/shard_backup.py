#!/usr/bin/python
# Backups of a pair's standby to S3 and restores from them, run on the MySQL node itself:
# the data goes between the node and S3, never through the control node. The work is in
# shardfleet.operations.backup, .restore and .archive; the bucket layout in shardfleet.storage.

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_backup
short_description: Back up a MySQL node to S3, list, restore and prune its pair's backups
description:
  - I(mode=plan) runs on the control node; from I(report) (what C(shard_info) returned)
    it names each pair's standby to back up, and skips, with a warning naming the pair and
    why, a pair whose map entry has no standby or whose standby is not healthy (marked
    C(rebuild) in the map, replication stopped, lagging beyond I(max_lag_seconds) or
    I(max_lag_trx), unreachable or writable).
  - I(mode=backup) runs on a pair's standby. It streams
    C(mariadb-backup --backup --stream=mbstream) (backup locks, the node keeps serving and
    replicating), optionally zstd-compressed, straight into S3 by multipart upload with
    server-side encryption C(AES256), under
    C(<prefix>/<cluster>/<pair>/<backup-id>/), then writes C(manifest.json) last (GTID
    position, size, sha256, per-shard checksums). Only a healthy standby is backed up;
    a writable node (a master) is refused unless I(allow_master); so is a node that
    I(shard_map) marks C(rebuild) or does not name as a standby, one whose replication
    IO or SQL thread is not running, and one further behind than I(max_lag_trx)
    transactions or I(max_lag_seconds). A refusal uploads nothing and returns
    C(refused=true) with the C(source) check. A backup that fails leaves no manifest and
    aborts its upload.
  - I(mode=backup) and I(mode=restore) run on the operation runner with
    I(zookeeper_hosts); the backup holds the server lock of the node it copies, the
    restore that of the node it restores, for the whole run, so a rebuild, split or
    promotion of that pair cannot run beside them (and they are refused, nothing uploaded
    or changed, beside one); each journals its steps and is listed among the operations in
    flight (C(shardfleet ops)) while it runs. Without I(zookeeper_hosts) they are refused
    unless I(unlocked) says to run without a lock.
  - I(mode=list) returns the pair's complete backups (those with a manifest), oldest first.
  - I(mode=restore) runs on the node to restore. It downloads the named or the latest
    backup as a stream, refuses it before touching anything when its sha256 differs from
    the manifest, prepares it, stops the server, puts the copy in place of the data
    directory, starts the server, leaves it read-only without a replication channel
    (C(gtid_slave_pos) at the backup's position) and compares every shard table's
    checksum with the manifest. With I(zookeeper_hosts) (or I(operations), the control
    node's read of them) a target I(node) that an operation in flight touches (an
    unfinished split, promotion or rebuild journal) is refused before anything is read
    or changed.
  - I(mode=prune) deletes complete backups beyond I(keep_count) that are older than
    I(keep_days), and incomplete ones (and pending uploads) older than I(stale_hours);
    never the newest backup taken from a healthy standby.
  - I(mode=archive) runs on a pair's master. It closes the current binary log
    (C(FLUSH BINARY LOGS)) and uploads every closed one not archived yet to
    C(<prefix>/<cluster>/<pair>/binlogs/<node>/). Run it often; a restore with
    I(stop_gtid) or I(stop_datetime) replays them to a point in time.
  - The node needs boto3 (C(python3-boto3)), C(mariadb-backup) and, with I(compress),
    C(zstd).
version_added: "0.3.0"
author: shardfleet
options:
  mode:
    description: What to do.
    type: str
    required: true
    choices: [plan, backup, list, restore, prune, archive]
  bucket:
    description: The S3 bucket (required but with I(mode=plan)).
    type: str
  prefix:
    description: Key prefix before C(<cluster>/<pair>/).
    type: str
    default: shardfleet
  cluster:
    description: The fleet's cluster name (part of the key; with I(zookeeper_hosts) also
      the map's cluster in ZooKeeper, whose locks and journals the runner uses).
    type: str
    default: default
  pair:
    description: The pair whose backups these are (part of the key; required but with
      I(mode=plan), where it names the only pair to plan for).
    type: str
  report:
    description: I(mode=plan) the fleet report C(shard_info) returned (map, pairs, servers).
    type: dict
  shard_map:
    description: I(mode=backup) the map (C(shard_info)'s C(map)); the node is refused when
      it marks the node C(rebuild) or does not name it as a standby. Omitted, the map is
      not checked (replication still is).
    type: dict
  max_lag_seconds:
    description: I(mode=plan) and I(mode=backup) a standby further behind than this
      (C(Seconds_Behind_Master)) is not backed up.
    type: float
    default: 300
  max_lag_trx:
    description: I(mode=plan) and I(mode=backup) a standby further behind than this many
      transactions (by GTID; on the node, received but not applied) is not backed up.
    type: int
    default: 10000
  zookeeper_hosts:
    description: I(mode=backup) and I(mode=restore) the ZooKeeper ensemble (of the map
      whose cluster is I(cluster)); the backup or restore then takes I(node)'s server
      lock, journals its steps and is refused beside another operation on I(node). Empty
      or omitted, I(unlocked=true) is needed. Ignored by the other modes.
    type: list
    elements: str
  unlocked:
    description: I(mode=backup) and I(mode=restore) without I(zookeeper_hosts), run
      without a server lock and without a journal (nothing keeps a rebuild, split or
      promotion of the node from running beside it); a restore still refuses a target
      that I(operations) shows with an operation in flight. Without it, a backup or
      restore with no I(zookeeper_hosts) is refused before anything is read (check mode,
      which changes nothing, then only skips the lock check).
    type: bool
    default: false
  lock_timeout:
    description: I(mode=backup) and I(mode=restore) seconds to wait for I(node)'s lock
      when another operation holds it (then refused, nothing changed).
    type: float
    default: 5
  operations:
    description: I(mode=restore) with I(unlocked), the operations in flight as the control
      node read them (C(shard_info)'s C(operations)); a target I(node) one of them touches
      is refused.
    type: list
    elements: dict
  zookeeper_root:
    description: The ZooKeeper root.
    type: str
    default: /shardfleet
  zookeeper_user:
    description: ZooKeeper digest user.
    type: str
  zookeeper_password:
    description: Its password; never logged.
    type: str
  zookeeper_timeout:
    description: ZooKeeper session timeout (s).
    type: float
    default: 10
  endpoint_url:
    description: S3 endpoint (another region's, or an S3-compatible store); default AWS.
    type: str
  region:
    description: AWS region of the bucket.
    type: str
  access_key:
    description: AWS access key; default boto3's chain (instance profile, environment).
    type: str
  secret_key:
    description: AWS secret key; never logged.
    type: str
  session_token:
    description: AWS session token; never logged.
    type: str
  login_user:
    description: Admin user mariadb-backup and the checks connect as.
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password; written to a 0600 option file for mariadb-backup, never logged.
    type: str
    default: ''
  login_unix_socket:
    description: The server's socket.
    type: str
    default: /run/mysqld/mysqld.sock
  datadir:
    description: The server's data directory (read by mariadb-backup; replaced by a restore).
    type: str
    default: /var/lib/mysql
  parallel:
    description: I(mode=backup) files mariadb-backup copies at once.
    type: int
    default: 4
  compress:
    description: I(mode=backup) zstd-compress the object (CPU on the node; fewer bytes stored).
    type: bool
    default: true
  part_size_mb:
    description: I(mode=backup) multipart part size in MiB (5 to 5120; parts in flight use
      about four times this in memory).
    type: int
    default: 64
  allow_master:
    description: I(mode=backup) back up a writable node (a master) too; I(mode=restore) restore
      onto a writable node (refused by default, it may be serving).
    type: bool
    default: false
  checksums:
    description: I(mode=backup) record per-shard checksums at the backup's position.
    type: bool
    default: true
  node:
    description: I(mode=backup) the node's name recorded in the manifest, looked up in
      I(shard_map) and locked (host:port); I(mode=archive) the node whose binary logs these
      are (host:port, required); I(mode=restore) the target (host:port, locked; required
      with I(zookeeper_hosts)).
    type: str
    default: ''
  stop_gtid:
    description: I(mode=restore) after restoring, replay the archived binary logs of
      I(binlog_node) up to this GTID position (point-in-time recovery).
    type: str
    default: ''
  stop_datetime:
    description: I(mode=restore) or replay up to this time (C(YYYY-MM-DD HH:MM:SS), the
      server's time zone).
    type: str
    default: ''
  binlog_node:
    description: I(mode=restore) the node (host:port) whose archived binary logs are
      replayed (the pair's master at the time), required with I(stop_gtid) or I(stop_datetime).
    type: str
    default: ''
  backup_id:
    description: I(mode=restore) the backup to restore; default the latest complete one.
    type: str
  service:
    description: I(mode=restore) the systemd unit stopped and started around the swap.
    type: str
    default: mariadb
  owner:
    description: I(mode=restore) the owner given to the restored files.
    type: str
    default: mysql
  use_memory:
    description: I(mode=restore) memory for C(mariadb-backup --prepare).
    type: str
    default: 256M
  verify:
    description: I(mode=restore) compare the shard tables' checksums with the manifest.
    type: bool
    default: true
  keep_count:
    description: I(mode=prune) complete backups always kept (the newest ones; at least 1).
    type: int
    default: 7
  keep_days:
    description: I(mode=prune) complete backups younger than this are kept too (0 = by count only).
    type: float
    default: 14
  stale_hours:
    description: I(mode=prune) incomplete backups and pending uploads older than this are removed.
    type: float
    default: 24
attributes:
  check_mode:
    support: full
    description: backup says what it would do after reading the node's read_only; restore
      names the backup it would restore; prune lists what it would delete. Nothing changes.
  diff_mode:
    support: none
  idempotent:
    support: partial
    description: list is read-only and prune converges; every backup run makes a new backup and
      every restore run restores again.
"""

EXAMPLES = r"""
- name: Back up the standby
  shardfleet.fleet.shard_backup:
    mode: backup
    bucket: shardfleet-backups
    cluster: default
    pair: pair001
    node: "10.0.1.12:3306"
    zookeeper_hosts: [10.0.1.5:2181]
    login_password: "{{ mysql_admin_password }}"

- name: Restore the latest backup of pair001 onto this node
  shardfleet.fleet.shard_backup:
    mode: restore
    bucket: shardfleet-backups
    pair: pair001
    node: "10.0.1.14:3306"
    zookeeper_hosts: [10.0.1.5:2181]
    login_password: "{{ mysql_admin_password }}"

- name: Keep a week, at least 7
  shardfleet.fleet.shard_backup:
    mode: prune
    bucket: shardfleet-backups
    pair: pair001
    keep_count: 7
    keep_days: 7
"""

RETURN = r"""
plan:
  description: I(mode=plan) C(backup) (the standbys to back up, host:port) and C(skipped)
    (each pair not backed up, with pair, master, standby, reasons).
  returned: mode=plan
  type: dict
refused:
  description: I(mode=backup) true when the node was refused, nothing uploaded (not a
    healthy standby, or another operation holds its lock or is in flight on it).
  returned: mode=backup
  type: bool
from_healthy_standby:
  description: I(mode=backup) the backup was taken from a healthy standby (retention
    never deletes the newest such backup; prune only after one).
  returned: mode=backup
  type: bool
source:
  description: I(mode=backup) the health check of the node (role, healthy, rebuild,
    reasons, channels).
  returned: mode=backup
  type: dict
manifest:
  description: I(mode=backup) the manifest written; I(mode=restore) the manifest of the
    backup restored (or that would be, in check mode).
  returned: mode=backup or mode=restore
  type: dict
backups:
  description: I(mode=list) the complete backups' manifests, oldest first.
  returned: mode=list
  type: list
  elements: dict
restored:
  description: I(mode=restore) backup_id, position, bytes, seconds, checksums_verified, note.
  returned: mode=restore, not in check mode
  type: dict
pruned:
  description: I(mode=prune) deleted, deleted_incomplete, aborted_uploads, kept.
  returned: mode=prune
  type: dict
archived:
  description: I(mode=archive) the binary log files uploaded by this run.
  returned: mode=archive
  type: list
  elements: str
replayed:
  description: I(mode=restore) with a stop point, the files replayed and the position reached.
  returned: mode=restore with stop_gtid or stop_datetime, not in check mode
  type: dict
"""

import socket
import tempfile
from contextlib import contextmanager

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
    library_errors,
    require_library,
    service_action,
)


def _setup(module):
    from shardfleet import storage

    p = module.params
    loc = storage.Location(p["bucket"], p["cluster"], p["pair"], prefix=p["prefix"])
    s3 = storage.s3_client(endpoint_url=p["endpoint_url"], region=p["region"],
                           access_key=p["access_key"], secret_key=p["secret_key"],
                           session_token=p["session_token"])
    return loc, s3


def _connect(module):
    from shardfleet import topology

    p = module.params
    return lambda: topology.connect("localhost:3306", p["login_user"], p["login_password"],
                                    unix_socket=p["login_unix_socket"])


@contextmanager
def _store(module, node):
    """The map's ZooKeeper store for the runner (its locks and journals), or None with
    unlocked; fail_json when neither is given (nothing was read or changed). Check mode
    changes nothing: without zookeeper_hosts it only skips the lock check."""
    from ansible_collections.shardfleet.fleet.plugins.module_utils.shardfleet_common import (
        zookeeper_store,
    )

    p = module.params
    if not p["zookeeper_hosts"]:
        if not p["unlocked"] and not module.check_mode:
            module.fail_json(msg=f"mode={p['mode']} needs zookeeper_hosts (the runner takes "
                                 f"the lock of {node or 'the node'} and journals the run), or "
                                 "unlocked=true to run without a lock; nothing was changed",
                             refused=True, from_healthy_standby=False, source={})
        yield None
        return
    if not node:
        if module.check_mode:  # e.g. restore.yml's run_once read of the backup to restore
            yield None
            return
        module.fail_json(msg=f"mode={p['mode']} with zookeeper_hosts needs node (host:port "
                             "of the node to lock)")
    store = zookeeper_store(module)
    try:
        yield store
    finally:
        store.close(timeout=2)


def do_plan(module):
    from shardfleet.operations import backup

    p = module.params
    out = backup.plan(p["report"] or {}, pair=p["pair"] or "", max_lag_seconds=p["max_lag_seconds"],
                      max_lag_trx=p["max_lag_trx"])
    for s in out["skipped"]:
        module.warn(f"pair {s['pair'] or '?'} (master {s['master']}, standby "
                    f"{s['standby'] or '-'}) is not backed up: {'; '.join(s['reasons'])}")
    return dict(changed=False, plan=out)


def _refused(module, exc):
    health = getattr(exc, "health", None)
    module.fail_json(msg=str(exc), refused=True, from_healthy_standby=False,
                     source=health.to_dict() if health else {})


def _check_backup(module, backup, store, node, limits):
    """Check mode: the node's health and (with a store) the locks; nothing changes."""
    loc, _ = _setup(module)
    p = module.params
    if store is not None:
        backup.refuse_beside(store, node)
    conn = _connect(module)()
    try:
        health = backup.check_source(conn, node, allow_master=p["allow_master"], **limits)
    finally:
        conn.close()
    if not health.healthy:
        _refused(module, backup.BackupRefused(
            f"backup of {node} refused: {'; '.join(health.reasons)}", health))
    module.exit_json(changed=True, refused=False, source=health.to_dict(),
                     from_healthy_standby=health.healthy_standby,
                     msg=f"would back up {node} ({p['datadir']}) to "
                         f"s3://{loc.bucket}/{loc.root}")


def do_backup(module):
    from shardfleet import physical
    from shardfleet.operations import backup

    loc, s3 = _setup(module)
    p = module.params
    node = p["node"] or f"{socket.getfqdn()}:3306"
    limits = dict(shard_map=p["shard_map"], max_lag_seconds=p["max_lag_seconds"],
                  max_lag_trx=p["max_lag_trx"])
    with _store(module, node) as store:
        try:
            if module.check_mode:
                _check_backup(module, backup, store, node, limits)
            with tempfile.TemporaryDirectory(prefix="sf-backup-") as tmp:
                cnf = physical.client_defaults(tmp, p["login_user"], p["login_password"])
                argv = physical.backup_argv(defaults_file=cnf, datadir=p["datadir"],
                                            socket_path=p["login_unix_socket"],
                                            parallel=p["parallel"])
                manifest = backup.backup(
                    s3, loc, argv, connect=_connect(module), node=node,
                    compress=p["compress"], part_size=p["part_size_mb"] << 20,
                    allow_master=p["allow_master"], checksums=p["checksums"], store=store,
                    lock_timeout=p["lock_timeout"], **limits)
        except backup.BackupRefused as exc:
            _refused(module, exc)
    if not manifest["checksums_at_position"]:
        module.warn(f"backup {manifest['backup_id']} has no checksums: "
                    f"{manifest['checksums_note']}")
    return dict(changed=True, manifest=_brief(manifest), refused=False,
                source=manifest["source"],
                from_healthy_standby=manifest["from_healthy_standby"])


def _brief(manifest):
    """The manifest without the per-table checksums (thousands of lines for a pair)."""
    out = {k: v for k, v in manifest.items() if k != "checksums"}
    out["checksummed_databases"] = len(manifest.get("checksums") or {})
    return out


def do_list(module):
    from shardfleet import storage

    loc, s3 = _setup(module)
    return dict(changed=False, backups=[_brief(m) for m in storage.list_backups(s3, loc)])


def _would_restore(module, manifest):
    p = module.params
    module.exit_json(changed=True, manifest=_brief(manifest),
                     msg=f"would restore backup {manifest['backup_id']} "
                         f"(position {manifest['position']['gtid']}) into {p['datadir']}"
                         + (f", then replay the binary logs of {p['binlog_node']} to "
                            f"{p['stop_gtid'] or p['stop_datetime']}"
                            if p["stop_gtid"] or p["stop_datetime"] else ""))


def do_restore(module):
    from shardfleet import storage
    from shardfleet.operations import restore

    loc, s3 = _setup(module)
    p = module.params
    with _store(module, p["node"]) as store:
        if store is None and p["operations"] is not None:
            restore.refuse_if_in_flight(None, p["node"], p["operations"])
        if store is not None:
            restore.refuse_beside(store, p["node"])
        manifest = (storage.read_manifest(s3, loc, p["backup_id"]) if p["backup_id"]
                    else storage.latest(s3, loc))
        if module.check_mode:
            _would_restore(module, manifest)
        r = restore.restore(s3, loc, datadir=p["datadir"], stop=service_action(module, "stop"),
                            start=service_action(module, "start"), connect=_connect(module),
                            backup_id=manifest["backup_id"], owner=p["owner"],
                            use_memory=p["use_memory"], verify=p["verify"],
                            allow_master=p["allow_master"], store=store, node=p["node"],
                            lock_timeout=p["lock_timeout"])
    if r.note:
        module.warn(r.note)
    out = dict(changed=True, manifest=_brief(manifest), restored=dict(vars(r)))
    if p["stop_gtid"] or p["stop_datetime"]:
        out["replayed"] = _replay(module, loc, s3, r.position)
    return out


def _replay(module, loc, s3, position):
    """The archived binary logs of binlog_node replayed from the restored position."""
    from shardfleet import physical
    from shardfleet.operations import archive

    p = module.params
    with tempfile.TemporaryDirectory(prefix="sf-replay-") as tmp:
        cnf = physical.client_defaults(tmp, p["login_user"], p["login_password"])
        client = [physical._tool("mariadb", "mysql"), f"--defaults-extra-file={cnf}",
                  f"--socket={p['login_unix_socket']}"]
        return archive.replay(s3, loc, node=p["binlog_node"], start=position,
                              client_argv=client, connect=_connect(module),
                              stop_gtid=p["stop_gtid"], stop_datetime=p["stop_datetime"])


def do_archive(module):
    from shardfleet import storage
    from shardfleet.operations import archive

    loc, s3 = _setup(module)
    p = module.params
    if not p["node"]:
        module.fail_json(msg="mode=archive needs node (host:port of this server)")
    if module.check_mode:
        module.exit_json(changed=True, msg=f"would archive the closed binary logs of "
                                           f"{p['node']} to {storage.binlog_root(loc, p['node'])}")
    sent = archive.archive_binlogs(s3, loc, connect=_connect(module), node=p["node"])
    return dict(changed=bool(sent), archived=sent)


def do_prune(module):
    from shardfleet import storage

    loc, s3 = _setup(module)
    p = module.params
    out = storage.retention(s3, loc, keep_count=p["keep_count"], keep_days=p["keep_days"],
                            stale_hours=p["stale_hours"], check=module.check_mode)
    changed = bool(out["deleted"] or out["deleted_incomplete"] or out["aborted_uploads"])
    return dict(changed=changed, pruned=out)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            mode=dict(type="str", required=True,
                      choices=["plan", "backup", "list", "restore", "prune", "archive"]),
            bucket=dict(type="str"),
            prefix=dict(type="str", default="shardfleet"),
            cluster=dict(type="str", default="default"),
            pair=dict(type="str"),
            report=dict(type="dict"),
            shard_map=dict(type="dict"),
            max_lag_seconds=dict(type="float", default=300),
            max_lag_trx=dict(type="int", default=10000),
            operations=dict(type="list", elements="dict"),
            zookeeper_hosts=dict(type="list", elements="str"),
            zookeeper_root=dict(type="str", default="/shardfleet"),
            zookeeper_user=dict(type="str"),
            zookeeper_password=dict(type="str", no_log=True),
            zookeeper_timeout=dict(type="float", default=10),
            unlocked=dict(type="bool", default=False),
            lock_timeout=dict(type="float", default=5),
            endpoint_url=dict(type="str"),
            region=dict(type="str"),
            access_key=dict(type="str", no_log=True),
            secret_key=dict(type="str", no_log=True),
            session_token=dict(type="str", no_log=True),
            login_user=dict(type="str", default="shardfleet_admin"),
            login_password=dict(type="str", default="", no_log=True),
            login_unix_socket=dict(type="str", default="/run/mysqld/mysqld.sock"),
            datadir=dict(type="str", default="/var/lib/mysql"),
            parallel=dict(type="int", default=4),
            compress=dict(type="bool", default=True),
            part_size_mb=dict(type="int", default=64),
            allow_master=dict(type="bool", default=False),
            checksums=dict(type="bool", default=True),
            node=dict(type="str", default=""),
            backup_id=dict(type="str"),
            stop_gtid=dict(type="str", default=""),
            stop_datetime=dict(type="str", default=""),
            binlog_node=dict(type="str", default=""),
            service=dict(type="str", default="mariadb"),
            owner=dict(type="str", default="mysql"),
            use_memory=dict(type="str", default="256M"),
            verify=dict(type="bool", default=True),
            keep_count=dict(type="int", default=7),
            keep_days=dict(type="float", default=14),
            stale_hours=dict(type="float", default=24),
        ),
        supports_check_mode=True,
        required_if=[("mode", m, ("bucket", "pair"))
                     for m in ("backup", "list", "restore", "prune", "archive")]
        + [("mode", "plan", ("report",))],
    )
    require_library(module)
    p = module.params
    if not 5 <= p["part_size_mb"] <= 5120:
        module.fail_json(msg=f"part_size_mb {p['part_size_mb']} must be 5..5120 (S3's limits)")
    if (p["stop_gtid"] or p["stop_datetime"]) and not p["binlog_node"]:
        module.fail_json(msg="a point-in-time restore (stop_gtid or stop_datetime) needs "
                             "binlog_node, the node whose archived binary logs to replay")
    if p["stop_gtid"] and p["stop_datetime"]:
        module.fail_json(msg="give stop_gtid or stop_datetime, not both")
    run = {"plan": do_plan, "backup": do_backup, "list": do_list, "restore": do_restore,
           "prune": do_prune, "archive": do_archive}[p["mode"]]
    with library_errors(module, f"backup ({p['mode']}) of {p['pair']}"):
        out = run(module)
    module.exit_json(**out)


if __name__ == "__main__":
    main()
