"""The split's check step: refuse (nothing changed) unless the split can run or continue."""

from __future__ import annotations

import time
from typing import Any

from shardfleet import replication, topology
from shardfleet.operations.runner import StepResult
from shardfleet.shardmap import ShardMap, ShardRange, freeze_owner

from .context import SplitContext
from .spec import CLONE_METHODS, PROGRESS, SplitError, few


class CheckMixin(SplitContext):
    def check(self) -> StepResult:
        """Refuse (SplitError, nothing changed) unless the split can run or continue."""
        t0 = time.monotonic()
        data = self.resolve()
        done = self.progress(data)
        m = self.store.read().map
        assert m is not None
        first, last = self.moving
        if done >= PROGRESS["cutover"]:
            entry = m.find(first)
            if entry is None or entry.master != self.spec.target:
                raise SplitError(f"the journal says the cutover is done but the map puts "
                                 f"shard {first} on {entry.master if entry else 'no server'}")
            return StepResult("check", False, f"split {self.name} is past its cutover "
                              f"(step {data and data.get('step')})", time.monotonic() - t0,
                              {"moving": list(self.moving)})
        # the source owns the moving range
        flipped = m.find(first)
        if (done >= PROGRESS["replicate"] and flipped is not None
                and flipped.bounds == self.moving and flipped.master == self.spec.target):
            return StepResult("check", False, f"the map puts shards {first}..{last} on the "
                              "target already; the cutover step will finish", time.monotonic() - t0,
                              {"moving": list(self.moving)})
        owner = self._source_owner(m)
        if self.original is None:
            self.original = owner
        problems = self._check_problems(m, data, done)
        if problems:
            raise SplitError("; ".join(problems) + "; nothing changed")
        if self.clone_method == "auto":
            self.clone_method = self._choose_clone(data)
        return StepResult("check", False,
                          f"ok: move shards {first}..{last} from {self.spec.source} to "
                          f"{self.spec.target}" + (f" (resuming after {data['step']})"
                                                   if data else ""),
                          time.monotonic() - t0,
                          {"moving": list(self.moving), "original": owner.to_dict()})

    def _source_owner(self, m: ShardMap) -> ShardRange:
        """The source's range that holds the moving one (SplitError, nothing changed, when
        the source does not own it whole or another operation froze it)."""
        first, last = self.moving
        holder = [r for r in m.ranges if r.first <= last and first <= r.last]
        owner = holder[0] if len(holder) == 1 else None
        if owner is None or not (owner.first <= first and last <= owner.last) \
                or owner.master != self.spec.source:
            mine = ", ".join(f"[{r.first}, {r.last}]" for r in m.ranges
                             if r.master == self.spec.source) or "nothing"
            raise SplitError(f"source {self.spec.source} does not own shards {first}..{last} "
                             f"(it owns {mine}); nothing changed")
        if owner.state == "frozen" and freeze_owner(owner) != self.name:
            raise SplitError(f"range [{owner.first}, {owner.last}] is frozen by another "
                             f"operation ({dict(owner.extra)}); nothing changed")
        return owner

    def _check_problems(self, m: ShardMap, data: dict[str, Any] | None,
                        done: int) -> list[str]:
        """Why the split cannot run: the target is not new and empty, the source lacks a
        moving database, replication or the fence would not work."""
        problems: list[str] = []
        # the target is new: in no range of the map
        for server in filter(None, (self.spec.target, self.spec.target_standby)):
            used = m.ranges_of(server)
            if used:
                problems.append(f"target server {server} already serves "
                                + ", ".join(f"[{r.first}, {r.last}]" for r in used))
        # ... and empty, or holding this split's own earlier copies
        have = self._shard_dbs(self.spec.target)
        mine_ok = set(self.databases) if done >= PROGRESS["started"] else set()
        if done >= PROGRESS["started"] and (data or {}).get("copy"):
            # a physical copy of the source named by this split may be installed and not
            # yet attached: every shard database the source node held is there
            mine_ok |= have
        foreign = sorted(have - mine_ok)
        if foreign:
            problems.append(f"target {self.spec.target} is not empty: it holds "
                            f"{len(foreign)} shard database(s) ({few(foreign)})"
                            + ("" if done >= 0 else " and no journal says they are this "
                               "split's"))
        # the source has every moving database
        missing = sorted(set(self.databases) - self._shard_dbs(self.spec.source))
        if missing:
            problems.append(f"source {self.spec.source} lacks {len(missing)} moving shard "
                            f"database(s) ({few(missing)})")
        problems += self._check_replication()
        if not missing:
            problems += self._fence_problems()
        return problems

    def _choose_clone(self, data: dict[str, Any] | None) -> str:
        """``clone="auto"``: the method an earlier run of this split began with, else
        physical when the moving shards hold more than ``physical_above`` bytes of InnoDB
        data (and the target has a standby to copy onto), else logical."""
        if (data or {}).get("clone_method") in CLONE_METHODS:
            return str((data or {})["clone_method"])
        if not self.spec.target_standby:
            return "logical"
        size = estimate(self.conn(self.spec.source), self.databases)["bytes"]
        return "physical" if size > self.physical_above else "logical"

    def _check_replication(self) -> list[str]:
        out: list[str] = []
        servers = {"source": self.spec.source, "target": self.spec.target}
        info: dict[str, dict[str, Any]] = {}
        for role, server in servers.items():
            c = self.conn(server)
            d = topology.server_dialect(c)
            if not d.is_mariadb:
                out.append(f"{role} {server} runs {d.version}: splits support MariaDB only")
                continue
            info[role] = replication.binlog_settings(c)
            if not int(info[role]["log_bin"]):
                out.append(f"{role} {server} has no binary log (GTID replication is off)")
            if str(info[role]["fmt"]).upper() != "ROW":
                out.append(f"{role} {server} logs {info[role]['fmt']}, not ROW (the split's "
                           "per-database replication filter needs ROW)")
        if len(info) == 2:
            if info["source"]["sid"] == info["target"]["sid"]:
                out.append(f"source and target share server_id {info['source']['sid']}")
            src_domains = set(replication.parse_gtids(replication.gtid_position(
                self.conn(self.spec.source))))
            if int(info["target"]["dom"]) in src_domains:
                out.append(f"target's gtid_domain_id {info['target']['dom']} is already used "
                           "in the source's binlog")
            if self.spec.target_standby and not int(info["target"]["lsu"]):
                out.append(f"target {self.spec.target} has log_slave_updates off: its standby "
                           "would not get the replicated changes")
        return out


def estimate(snap: Any, dbs: list[str]) -> dict[str, int]:
    """InnoDB's persistent statistics of *dbs*: rows and bytes (for progress; never
    exact). ``mysql.innodb_table_stats`` is a plain table: information_schema.TABLES
    would open every table of a 2,048-shard server to answer."""
    rows = size = 0
    with snap.cursor() as cur:
        for i in range(0, len(dbs), 500):
            part = dbs[i:i + 500]
            cur.execute("SELECT COALESCE(SUM(n_rows), 0), COALESCE(SUM("
                        "clustered_index_size + sum_of_other_index_sizes), 0) * "
                        "@@innodb_page_size FROM mysql.innodb_table_stats WHERE "
                        f"database_name IN ({', '.join(['%s'] * len(part))})", part)
            r, b = cur.fetchone()
            rows, size = rows + int(r), size + int(b)
    return {"rows": rows, "bytes": size}
