"""The split's shared context: its spec, accounts, connections, journal and the map edits
every step module chains (the step modules are mixins over it; :class:`Split` joins them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Self

from shardfleet import provision, topology
from shardfleet.errors import DatabaseError, MapError
from shardfleet.mapstore import Updated, ZooKeeperMapStore, update
from shardfleet.operations.runner import Journal, Step, StepResult, journals, stepped
from shardfleet.operations.types import Credentials
from shardfleet.schema import Schema, default_schema, shard_database
from shardfleet.shardmap import ShardMap, ShardRange, freeze_owner
from shardfleet.tls import TLS

from .spec import CLONE_METHODS, PHYSICAL_ABOVE, PROGRESS, SplitError, SplitSpec, upper_half

log = logging.getLogger("shardfleet.split")


class SplitContext:
    """What every step of one split shares (see :class:`shardfleet.operations.split.Split`
    for the keyword arguments)."""

    def __init__(self, store: ZooKeeperMapStore, spec: SplitSpec, creds: Credentials, *,
                 schema: Schema | None = None, catchup_timeout: float = 600.0,
                 cutover_timeout: float = 5.0, drain_timeout: float = 2.0,
                 lock_timeout: float = 5.0, connect_timeout: float = 10.0,
                 tls: TLS | None = None, clone_parallel: int = 1, clone: str = "logical",
                 copy_position: str = "", copy_id: str = "",
                 copy_stats: dict[str, Any] | None = None,
                 physical_above: int = PHYSICAL_ABOVE) -> None:
        if spec.source == spec.target:
            raise SplitError(f"source and target are the same server {spec.source}")
        self.store = store
        self.spec = spec
        self.creds = creds
        self.schema = schema or default_schema()
        self.catchup_timeout = catchup_timeout
        self.cutover_timeout = cutover_timeout
        self.drain_timeout = drain_timeout
        self.lock_timeout = lock_timeout
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.clone_parallel = max(1, int(clone_parallel))
        self.clone_method = self._clone_method(clone, copy_position)
        # seconds a target node of a physical copy is waited for when it refuses
        # connections (restarting on a copy)
        self.start_wait = 300.0
        self.physical_above = int(physical_above)
        # the mysql role's mysql_replication_connect_retry (a target pair's channels that a
        # physical copy replaced are made again with what they had, else this)
        self.pair_connect_retry = 10
        self.copy_position = copy_position
        self.copy_id = copy_id
        self.copy_stats = dict(copy_stats or {})
        self._conns: dict[str, Any] = {}
        self.moving: tuple[int, int] = (0, 0)
        self.original: ShardRange | None = None
        self.journal: Journal | None = None
        # hooks for tests: called with the step name after a step finished, and (on the
        # clone's worker threads) with each database the clone finished
        self.after_step: Callable[[str], None] | None = None
        self.after_clone_db: Callable[[str], None] | None = None

    def _clone_method(self, clone: str, copy_position: str) -> str:
        if clone not in CLONE_METHODS + ("auto",):
            raise SplitError(f"clone must be one of {', '.join(CLONE_METHODS + ('auto',))}, "
                             f"not {clone!r}")
        if copy_position and clone == "auto":
            clone = "physical"
        if clone == "physical" and not self.spec.target_standby:
            raise SplitError("a physical clone copies onto both nodes of the target pair: "
                             "give the target's standby (target_standby)")
        return clone

    # -- what the step modules call of each other (defined in their mixins) ---------
    if TYPE_CHECKING:
        def _channel(self, server: str, name: str | None = None
                     ) -> dict[str, Any] | None: ...
        def _create_channel(self, clone_gtid: str, *, databases: Sequence[str] | None = None,
                            start: bool = True) -> None: ...
        def _start_channel(self, name: str, *, until: str | None = None) -> None: ...
        def _wait_applied(self, pos: str, timeout: float, what: str) -> None: ...
        def _remove_channel(self) -> bool: ...
        def _choose_clone(self, data: dict[str, Any] | None) -> str: ...
        def _clone_physical(self, t0: float) -> StepResult: ...
        def _unfence_receivers(self, nodes: Sequence[str], *, binlog: bool = False
                               ) -> None: ...
        def _unlogged(self, node: str, *, on: bool = True
                      ) -> AbstractContextManager[None]: ...
        def _pair_health(self, timeout: float = 30.0) -> list[str]: ...
        def _pair_up(self, nodes: Sequence[str]) -> None: ...
        def _reset_node(self, node: str, drop: list[str], pos: str) -> list[str]: ...
        def _on_both(self, nodes: Sequence[str], work: Callable[[str], list[str]]
                     ) -> list[list[str]]: ...
        def _set_fence(self, on: bool, *, reads: bool = False) -> int: ...
        def _fence_problems(self, *, fenced: bool = False) -> list[str]: ...
        def _drain(self, fenced_at: float) -> list[str]: ...
        def check(self) -> StepResult: ...
        def clone(self) -> StepResult: ...
        def replicate(self) -> StepResult: ...
        def cutover(self) -> StepResult: ...
        def cleanup(self) -> StepResult: ...
        def abort(self) -> StepResult: ...
        def abort_steps(self) -> list[Step]: ...
        @staticmethod
        def abort_result(results: Sequence[StepResult], seconds: float) -> StepResult: ...
        def _fence_after_flip(self) -> None: ...

    # -- plumbing ----------------------------------------------------------
    def conn(self, server: str) -> Any:
        c = self._conns.get(server)
        if c is None or not c.open:
            c = self._conns[server] = self._connect(server)
        return c

    def _connect(self, server: str) -> Any:
        """An admin connection to *server*. A target node of the physical copy the journal
        names may be restarting on it (the install of a killed run's copy, or of this
        split's, goes on without the playbook): one that refuses connections is waited
        for, up to ``start_wait`` seconds."""
        copy = ((self.journal.data if self.journal else None) or {}).get("copy") or {}
        wait = self.start_wait if server in (copy.get("targets") or ()) else 0.0
        deadline = time.monotonic() + wait
        while True:
            try:
                return topology.connect(
                    server, self.creds.admin_user, self.creds.admin_password,
                    timeout=self.connect_timeout,
                    client_flag=provision.multi_statement_flags(), tls=self.tls)
            except DatabaseError as exc:
                if "cannot connect" not in str(exc) or time.monotonic() >= deadline:
                    if wait:
                        raise DatabaseError(f"{exc} (waited {wait:.0f}s: a target node of "
                                            "the physical copy; is it starting on a "
                                            "copy? see its error log)") from None
                    raise
                log.info("split: %s does not answer yet (%s); waiting for it", server, exc)
                time.sleep(1.0)

    def close(self) -> None:
        for c in self._conns.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._conns.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exec(self, server: str, sql: str, params: Any = None) -> list[Any]:
        with self.conn(server).cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def _shard_dbs(self, server: str) -> set[str]:
        with self.conn(server).cursor() as cur:
            return provision.existing_databases(cur)

    @property
    def shards(self) -> list[int]:
        return list(range(self.moving[0], self.moving[1] + 1))

    @property
    def databases(self) -> list[str]:
        return [shard_database(s) for s in self.shards]

    @property
    def target_nodes(self) -> list[str]:
        """The target pair: its master and standby (a physical clone copies onto both)."""
        return [self.spec.target, str(self.spec.target_standby)]

    @property
    def connection_name(self) -> str:
        return f"split_{self.moving[0]}_{self.moving[1]}"

    @property
    def name(self) -> str:
        assert self.journal is not None
        return self.journal.path.rsplit("/", 1)[1]

    def progress(self, data: dict[str, Any] | None) -> int:
        if not data:
            return -1
        return PROGRESS.get(str(data.get("step")), -1)

    # -- resolving what moves ------------------------------------------------
    def resolve(self) -> dict[str, Any] | None:
        """Work out the moving range and load the journal; returns the journal (or None)."""
        current = self.store.read().map
        if current is None:
            raise SplitError("there is no shard map in ZooKeeper; register the ranges first")
        first, last = self._moving(current)
        if first > last:
            raise SplitError(f"moving range [{first}, {last}] is not first <= last")
        self.moving = (first, last)
        name = self.spec.name or f"split-{first}-{last}"
        self.journal = Journal(self.store, name)
        data = self.journal.load()
        if data and data.get("step") == "aborted":
            data = self.journal.data = None  # an aborted attempt restarts from the beginning
        if data:
            if (data.get("source"), data.get("target"), tuple(data.get("moving", ()))) != (
                    self.spec.source, self.spec.target, self.moving):
                raise SplitError(
                    f"journal {self.journal.path} records another split "
                    f"({data.get('source')} -> {data.get('target')}, shards "
                    f"{data.get('moving')}; step {data.get('step')}); finish or abort it, "
                    "or give another split name")
            self.original = ShardRange.from_dict(data["original"])
        return data

    def _moving(self, current: ShardMap) -> tuple[int, int]:
        """The moving range: the spec's, its named journal's, the newest journal's between
        the source and the target, else the upper half of the one range the source owns."""
        moving = self.spec.moving
        if moving is None and self.spec.name:
            data = Journal(self.store, self.spec.name).load()
            if data and data.get("moving"):
                moving = (int(data["moving"][0]), int(data["moving"][1]))
        if moving is None:
            moving = self._journaled_moving()
        if moving is None:
            mine = [r for r in current.ranges if r.master == self.spec.source
                    and freeze_owner(r) is None]
            if len(mine) != 1:
                owned = ", ".join(f"[{r.first}, {r.last}]" for r in mine) or "no range"
                raise SplitError(f"source {self.spec.source} owns {owned}; give the moving "
                                 "range explicitly")
            moving = upper_half(mine[0])
        return int(moving[0]), int(moving[1])

    def _journaled_moving(self) -> tuple[int, int] | None:
        """The moving range of the newest split journal between this source and target that
        was not aborted (so a rerun without a range continues, or reports, that split)."""
        found = [(float(d.get("updated_at", 0)), (int(d["moving"][0]), int(d["moving"][1])))
                 for n, d in journals(self.store).items()
                 if n.startswith("split") and d.get("step") != "aborted" and d.get("moving")
                 and (d.get("source"), d.get("target")) == (self.spec.source, self.spec.target)]
        return max(found)[1] if found else None

    # -- journal -------------------------------------------------------------
    def _record(self, step: str, **fields: Any) -> dict[str, Any]:
        """Record *step* done in the journal (a new one after an abort)."""
        assert self.journal is not None and self.original is not None
        original = self.original

        def change(data: dict[str, Any]) -> dict[str, Any]:
            if not data or data.get("step") == "aborted":
                data = {"kind": "split", "name": self.name, "source": self.spec.source,
                        "target": self.spec.target, "target_standby": self.spec.target_standby,
                        "moving": list(self.moving), "original": original.to_dict(),
                        "connection": self.connection_name, "started_at": time.time(),
                        "state": "running", "steps": []}
            return stepped(data, step, **fields)

        return self.journal.write(change)

    def _note(self, **fields: Any) -> None:
        """Update journal fields without recording a step."""
        assert self.journal is not None and self.journal.data is not None
        self.journal.note(**fields)

    # -- the map -------------------------------------------------------------
    # Every map change is one edit of the map-change vocabulary (shardmap: freeze, thaw,
    # flip, owned by this split's name) through mapstore.update, which survives a lost
    # reply by reading the map again and deciding by content.

    def _freeze(self) -> bool:
        def edit(m: ShardMap) -> ShardMap:
            cur = m.find(self.moving[0])
            if cur is None or cur.master != self.spec.source:
                raise SplitError(f"shard {self.moving[0]} is on "
                                 f"{cur.master if cur else 'no server'}, not the source")
            return m.freeze([self.moving], self.name)
        return self._update(edit).changed

    def _thaw(self) -> bool:
        """The moving piece's freeze lifted and the source's range whole again (only this
        split's piece: another operation's freeze inside the same range stays)."""
        assert self.original is not None
        bounds = self.original.bounds
        return self._update(lambda m: m.thaw(self.name, rejoin=bounds)).changed

    def _flip(self) -> bool:
        # "rebuild" names a node of the source pair: it says nothing of the target pair
        return self._update(lambda m: m.flip(
            self.name, [self.moving], master=self.spec.target,
            standby=self.spec.target_standby, drop=("rebuild",))).changed

    def _update(self, edit: Callable[[ShardMap], ShardMap]) -> Updated:
        try:
            return update(self.store, edit)
        except MapError as exc:
            raise SplitError(f"the map does not allow this step: {exc}") from None

    def _flipped(self, m: ShardMap) -> bool:
        """The map puts the moving range on the target (the cutover's flip landed)."""
        entry = m.find(self.moving[0])
        return (entry is not None and entry.bounds == self.moving
                and entry.master == self.spec.target and entry.state != "frozen")

    def _settled_map(self) -> ShardMap:
        """The map, read after a sync (retrying within the store's timeout)."""
        sync = getattr(self.store, "sync", None)
        if sync is not None:
            sync()
        m = self.store.read().map
        if m is None:
            raise SplitError("the shard map disappeared from ZooKeeper")
        return m


