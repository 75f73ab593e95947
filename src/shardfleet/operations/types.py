"""What the operations share: the accounts they use, the options of a promotion or a
rebuild, and the report an operation returns (the map before and after, the changes, the
next step). No operation imports another; what two of them need lives here or in the
runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardfleet.tls import TLS


@dataclass(frozen=True)
class Credentials:
    """The MySQL accounts a split uses (the ``mysql`` role's users)."""

    admin_user: str
    admin_password: str
    repl_user: str
    repl_password: str
    app_user: str = "shardfleet_app"
    app_host: str = "%"


@dataclass
class Options:
    """Bounds and credentials of one promotion (all times in seconds)."""

    user: str = "shardfleet_admin"
    password: str = ""
    connect_timeout: float = 2.0
    read_timeout: float = 30.0     # every read on an admin connection, the greeting too
    # emergency: the probe of a master that may be dead; a master that does not answer it
    # is dead only if its standby does not hear it either (see Listening)
    probe_timeout: float = 1.0
    silence_timeout: float = 5.0
    catchup_timeout: float = 30.0   # standby catches up before anything is frozen
    drain_timeout: float = 10.0     # standby applies the fenced master's last position
    trx_timeout: float = 2.0        # open write transactions on the fenced master
    lock_timeout: float = 2.0
    force: bool = False
    # a plain request this soon after a finished promotion of the pair is refused as a
    # rerun of the same command (it would swap the pair back); see _check_not_a_rerun
    rerun_window: float = 86400.0
    # the pair's replication account: a rebuild after an emergency recreates the new
    # master's channel to the rebuilt node (the emergency removed it), and MariaDB never
    # shows a channel's password, so it cannot be copied from the other side
    replication_user: str = "shardfleet_repl"
    replication_password: str = ""
    # rebuild: "logical" (mariadb-dump of the shards through the control node) or
    # "physical" (shardfleet.physical: mariadb-backup streamed from the master's host to
    # the node's; the playbook runs the copy between two calls of rebuild_standby, the
    # second with the copy's GTID position)
    copy: str = "logical"
    copy_position: str = ""
    # the copy this call re-attaches the node from (what the call that named the copy
    # returned in Result.copy["copy_id"]): a newer copy named since refuses it
    copy_id: str = ""
    # client TLS of every admin connection and of the logical rebuild's mariadb-dump and
    # mariadb (shardfleet.tls; off by default)
    tls: TLS = field(default_factory=TLS)


@dataclass
class Result:
    changed: bool = False
    mode: str = ""
    pair: str = ""
    old_master: str = ""
    new_master: str = ""
    ranges: list[list[int]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errant: list[str] = field(default_factory=list)
    semisync: dict[str, Any] = field(default_factory=dict)
    gtid: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    map_before: str = ""
    map_after: str = ""
    changes: list[str] = field(default_factory=list)
    resumed: bool = False
    next_step: str = ""
    channel_removed: dict[str, Any] = field(default_factory=dict)
    copy: dict[str, str] = field(default_factory=dict)  # a physical copy to run (rebuild)
    # (rebuild) the node does not answer after this rebuild fenced it for a physical copy:
    # a new copy replaces its data directory whole (RECOPY); leave it out of the mysql role
    recopy: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
