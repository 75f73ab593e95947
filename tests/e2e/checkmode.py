"""--check of every operation playbook on the e2e fleet, in the states on-call meets them.

On-call runs a playbook with --check first (the runbooks say so), in whatever state the
fleet is in: healthy; after an emergency promotion, before the old master's rebuild; with
a split held between its steps (its journal unfinished). :func:`assert_check_changes_nothing`
runs each operation playbook there with --check, one after another (check runs of two
operations at once could meet on an operation's lock), and holds that each exits 0, or
refuses where refusing is that playbook's documented behaviour in that state (rc != 0
and the documented words in its output), and that it changed nothing:

- the map's znode and every operation znode under ``ops/`` (journals, fences): the
  same bytes (a lock a check took and let go leaves nothing behind either);
- every MySQL server's ``@@gtid_binlog_pos`` and ``@@read_only`` (a server down before
  is down after);
- the fleet's containers (its label) and the inventory's files (fleet-add.yml writes both);
- every object in the S3 store backup.yml and restore.yml are pointed at.

The fleet must be quiet while this runs (no writer): a write moves gtid_binlog_pos. The
tests call it where their fleet is in one of those states and nothing writes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pymysql

from shardfleet.mapstore import ZooKeeperMapStore
from tests.integration.s3_fixtures import KEYS, S3

from .conftest import E2E_ID, E2E_TLS, SHARDS, Fleet

# the bucket backup.yml and restore.yml are checked against (empty: --check of backup.yml
# lists what its prune would delete, and must write nothing there)
BUCKET = "shardfleet-check"


@dataclass(frozen=True)
class CheckRun:
    """One playbook run with --check: its arguments, and the documented refusal (words of
    its output) when refusing is what it does in this state; None: it must exit 0."""

    playbook: str
    args: tuple[str, ...] = ()
    refused: str | None = None

    def label(self) -> str:
        return " ".join((self.playbook, *self.args))


def s3_args(s3: S3) -> list[str]:
    """backup.yml's and restore.yml's S3 options for *s3*'s check bucket (made if missing)."""
    client = s3.client()
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)
    return ["-e", f"backup_s3_bucket={BUCKET}", "-e", f"backup_s3_endpoint_url={s3.url}",
            "-e", f"backup_s3_access_key={KEYS['AWS_ACCESS_KEY_ID']}",
            "-e", f"backup_s3_secret_key={KEYS['AWS_SECRET_ACCESS_KEY']}"]


def operations(*, s3: S3, pair: str, split: tuple[str, str], open_pair: str, add_pair: str,
               refused: dict[str, str] | None = None,
               split_range: tuple[int, int] | None = None) -> list[CheckRun]:
    """The seven operation playbooks as on-call would first run them for *pair* (promote,
    rebuild its standby, back it up to *s3*, restore it), a split *split* = (source,
    target), opening the next shards after the fleet's on *open_pair* and adding
    *add_pair*; *refused* maps a playbook to the words of its documented refusal in this
    state."""
    refused = dict(refused or {})
    bucket = s3_args(s3)
    # restore.yml onto the pair's own hosts, which the map names: refused before any
    # download, in every state (restore.yml's header; docs/runbooks/backup-restore.md)
    refused.setdefault("restore.yml", "serve ranges in the map")
    rng = ["-e", json.dumps({"split_range": list(split_range)})] if split_range else []
    runs = [
        ("promote.yml", ["-e", f"pair={pair}"]),
        ("rebuild-standby.yml", ["-e", f"pair={pair}"]),
        ("split.yml", ["-e", f"split_source_pair={split[0]}", "-e", f"split_target_pair={split[1]}",
                       *rng]),
        ("backup.yml", [*bucket, "-e", f"pair={pair}"]),
        ("restore.yml", [*bucket, "-e", f"pair={pair}"]),
        ("open-range.yml", ["-e", json.dumps({"open_range": [SHARDS + 100, SHARDS + 115],
                                              "open_pairs": [open_pair]})]),
        ("fleet-add.yml", ["-e", f"pair={add_pair}"]),
    ]
    return [CheckRun(pb, tuple(args), refused.get(pb)) for pb, args in runs]


@dataclass
class Snapshot:
    znodes: dict[str, bytes | None]
    servers: dict[str, tuple[str, int] | str]
    containers: set[str]
    inventory: dict[str, str] = field(default_factory=dict)
    objects: set[str] = field(default_factory=set)

    def differences(self, other: Snapshot) -> list[str]:
        out = [f"znode {p}: {self.znodes.get(p)!r} -> {other.znodes.get(p)!r}"
               for p in sorted(self.znodes.keys() | other.znodes.keys())
               if self.znodes.get(p) != other.znodes.get(p)]
        out += [f"server {n}: (gtid_binlog_pos, read_only) {self.servers.get(n)} -> "
                f"{other.servers.get(n)}" for n in sorted(self.servers)
                if self.servers[n] != other.servers.get(n)]
        if self.containers != other.containers:
            out.append(f"containers: {sorted(self.containers ^ other.containers)} appeared "
                       "or went")
        out += [f"inventory file {f} written" for f in sorted(self.inventory.keys()
                                                              | other.inventory.keys())
                if self.inventory.get(f) != other.inventory.get(f)]
        if self.objects != other.objects:
            out.append(f"S3 objects {sorted(self.objects ^ other.objects)[:10]} appeared or went")
        return out


def _znodes(store: ZooKeeperMapStore) -> dict[str, bytes | None]:
    """The map and every journal and fence znode (the ops tree but its locks), by path."""
    out: dict[str, bytes | None] = {store.path: store.read_raw(store.path)[0]}
    todo = [store.ops_node("journal"), store.ops_node("fence")]
    while todo:
        path = todo.pop()
        for child in store.children(path):
            sub = f"{path}/{child}"
            out[sub] = store.read_raw(sub)[0]
            todo.append(sub)
    return out


def _server(address: str, password: str) -> tuple[str, int] | str:
    host, _, port = address.rpartition(":")
    try:
        conn = pymysql.connect(host=host, port=int(port), user="shardfleet_admin",
                               password=password, connect_timeout=5, read_timeout=10,
                               **E2E_TLS.pymysql_kwargs())
    except pymysql.err.MySQLError as exc:
        return f"DOWN ({exc.args[0] if exc.args else exc})"
    try:
        with conn.cursor() as c:
            c.execute("SELECT @@GLOBAL.gtid_binlog_pos, @@GLOBAL.read_only")
            pos, ro = c.fetchone()
        return str(pos), int(ro)
    finally:
        conn.close()


def _containers() -> set[str]:
    """Every container of this fleet (its label: other tiers' containers come and go beside
    it, make test's lanes running side by side): its name, id and state."""
    out = subprocess.run(["podman", "ps", "--all", "--filter", f"label=shardfleet.fleet={E2E_ID}",
                          "--format", "json"], text=True, capture_output=True, check=True).stdout
    return {f"{c['Names'][0]} {c['Id'][:12]} {c['State']}" for c in json.loads(out or "[]")}


def _files(inventory: Path) -> dict[str, str]:
    return {str(p.relative_to(inventory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(inventory.rglob("*")) if p.is_file()}


def _objects(s3: S3 | None) -> set[str]:
    """Every object in every bucket of *s3*, with its ETag."""
    if s3 is None:
        return set()
    client = s3.client()
    return {f"{b['Name']}/{o['Key']} {o['ETag']}"
            for b in client.list_buckets().get("Buckets", [])
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=b["Name"])
            for o in page.get("Contents", [])}


def snapshot(fleet: Fleet, store: ZooKeeperMapStore, nodes: Iterable[str],
             inventory: Path, s3: S3 | None = None) -> Snapshot:
    password = fleet.secrets["vault_mysql_admin_password"]
    return Snapshot(_znodes(store), {n: _server(n, password) for n in sorted(set(nodes))},
                    _containers(), _files(inventory), _objects(s3))


def mysql_nodes(fleet: Fleet, store: ZooKeeperMapStore, extra: Iterable[str] = ()) -> set[str]:
    """The fleet's MySQL servers (its inventory's), every server the map names (a split's
    target pair, a rebuild's old master) and *extra*, as host:port."""
    nodes = {f"{fleet.ip(h)}:3306" for h in fleet.group("mysql")} | set(extra)
    m = store.read().map
    for r in m.ranges if m is not None else []:
        nodes |= {str(n) for n in (r.master, r.standby, r.extra.get("rebuild")) if n}
    return nodes


def assert_check_changes_nothing(fleet: Fleet, store: ZooKeeperMapStore, runs: list[CheckRun],
                                 *, state: str, s3: S3 | None = None,
                                 inventory: Path | None = None,
                                 nodes: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
    """Run each of *runs* with --check on *inventory* (default: the fleet's) in *state*
    (a name for the messages); each exits 0, or refuses as documented, and changes
    nothing (the module docstring). Returns one report line per run, and each
    playbook's output by its name."""
    inv = inventory or fleet.inventory
    servers = mysql_nodes(fleet, store, nodes)
    report: list[str] = []
    outputs: dict[str, str] = {}
    before = snapshot(fleet, store, servers, inv, s3)
    down = [n for n, v in before.servers.items() if isinstance(v, str)]
    for run in runs:
        r = fleet.playbook(run.playbook, "--check", *run.args, inventory=inv)
        flat = " ".join(r.output.split())  # Ansible wraps long messages
        if run.refused is None:
            assert r.rc == 0, f"{state}: {run.label()} --check failed (rc {r.rc}):\n" \
                              f"{r.output[-4000:]}"
        else:
            assert r.rc != 0 and run.refused in flat, \
                f"{state}: {run.label()} --check was to refuse ({run.refused!r}); rc {r.rc}:\n" \
                f"{r.output[-4000:]}"
        outputs[run.playbook] = r.output
        after = snapshot(fleet, store, servers, inv, s3)
        changed = before.differences(after)
        assert not changed, f"{state}: {run.label()} --check changed the fleet:\n" + \
            "\n".join(changed)
        report.append(f"{state}: {run.playbook} --check "
                      f"{'refused as documented' if run.refused else 'rc 0'}, "
                      f"{r.seconds:.0f}s")
    return report + ([f"{state}: servers down throughout: {down}"] if down else []), outputs
