"""Promotion and rebuild as step tables on the runner (no servers): the tables' journal
step names, the "is it done?" predicates read from the map, check-mode text, and the
runner's check-mode lock refusal."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations import rebuild
from shardfleet.operations import runner as ops
from shardfleet.operations.promote.common import PromotionRun, _flip, _freeze
from shardfleet.operations.promote.promotion import Promotion
from shardfleet.operations.types import Options, PromotionRefused, Result
from shardfleet.shardmap import ShardMap

A, B = "10.0.0.1:3306", "10.0.0.2:3306"
BOUNDS = {(0, 9), (10, 19)}


def base() -> ShardMap:
    return ShardMap.from_ranges([
        {"range": [0, 9], "master": A, "standby": B, "state": "open"},
        {"range": [10, 19], "master": A, "standby": B, "state": "closed"},
    ])


@dataclass
class Read:
    map: ShardMap | None
    version: int = 0


@dataclass
class Client:
    locked: set[str] = field(default_factory=set)

    def exists(self, path: str) -> bool:
        return path in self.locked

    def get_children(self, path: str) -> list[str]:
        if path in self.locked:
            return ["holder"]
        from kazoo.exceptions import NoNodeError
        raise NoNodeError(path)


@dataclass
class FakeStore:
    """What the predicates and the runner's check mode read (no ZooKeeper)."""

    map: ShardMap | None
    client: Client = field(default_factory=Client)
    root: str = "/shardfleet"
    cluster: str = "t"

    OPS_KINDS = ZooKeeperMapStore.OPS_KINDS
    ops_node = ZooKeeperMapStore.ops_node

    @property
    def ops_path(self) -> str:
        return f"{self.root}/{self.cluster}/ops"

    def read(self) -> Read:
        return Read(self.map)

    def children(self, path: str) -> list[str]:
        """ZooKeeperMapStore.children: [] when the znode is absent."""
        return ["holder"] if path in self.client.locked else []


def promotion(store: FakeStore, mode: str, check: bool = True) -> Promotion:
    run = PromotionRun(store, "pair001", Result(mode=mode, pair="pair001"), check)  # type: ignore[arg-type]
    run.nodes = [A, B]
    return Promotion(run, mode, A, B, base().ranges, Options())


def names(steps: list[ops.Step]) -> list[str]:
    return [s.name for s in steps]


def test_the_tables_keep_the_journal_step_names():
    p = promotion(FakeStore(base()), "planned")
    assert names(p.planned_steps()) == ["caught_up", "frozen", "old_read_only", "drained",
                                        "new_writable", "flipped"]
    assert names(p.emergency_steps()) == [
        "frozen", "old_fenced", "received_final", "drained", "errant_checked",
        "new_writable", "flipped", "replication_stopped", "channel_removed"]
    assert [s.always for s in p.planned_steps()] == [True] + [False] * 5


def test_frozen_and_flipped_read_the_map():
    store = FakeStore(base())
    p = promotion(store, "planned")
    assert not p._frozen() and not p._flipped()
    store.map = _freeze(base(), BOUNDS, "pair001")
    assert p._frozen() and not p._flipped()
    store.map = _freeze(base(), BOUNDS, "pair002")  # another owner's freeze
    assert not p._frozen()
    store.map = _flip(_freeze(base(), BOUNDS, "pair001"), BOUNDS, B, A, False,
                              "pair001")
    assert p._flipped() and p._frozen()  # flipped counts as past the freeze
    # an emergency's flip leaves the rebuild mark: a planned flip is not one, and back
    e = promotion(store, "emergency")
    assert not e._flipped()
    store.map = _flip(_freeze(base(), BOUNDS, "pair001"), BOUNDS, B, A, True,
                              "pair001")
    assert e._flipped() and not p._flipped()


def test_check_mode_lists_the_would_lines_of_steps_not_done():
    store = FakeStore(base())
    p = promotion(store, "emergency")
    steps = [s for s in p.emergency_steps() if s.name in ("frozen", "drained", "flipped")]
    assert [s.done() for s in steps] == [False, False, False]
    assert p.res.steps == [
        "freeze (would)", f"{B}: stop the I/O thread, apply the relay log (would)",
        f"{B}: stop replication from {A} (would)",
        f"write the swapped map with rebuild={A} (would)"]
    store.map = _freeze(base(), BOUNDS, "pair001")
    p.res.steps.clear()
    assert steps[0].done() and p.res.steps == ["frozen: done already"]


def test_check_mode_refuses_when_a_lock_is_held():
    store = FakeStore(base())
    runner = ops.Runner(store, "promote-pair001", [A, B])  # type: ignore[arg-type]
    store.client.locked.add(f"/shardfleet/t/ops/locks/{ops.server_lock_name(B)}")
    with pytest.raises(ops.LockBusy, match="another operation holds"), runner.held(check=True):
        pass
    store.client.locked.clear()
    with runner.held(check=True):  # free: no lock taken, the registry empty
        pass


def test_a_held_lock_is_a_refusal_of_the_promotion():
    store = FakeStore(base())
    store.client.locked.add(f"/shardfleet/t/ops/locks/{ops.server_lock_name(A)}")
    run = PromotionRun(store, "pair001", Result(), True)  # type: ignore[arg-type]
    run.nodes = [A, B]
    with pytest.raises(PromotionRefused, match="another operation holds"), \
            run.held(Options().lock_timeout):
        pass


def test_rebuild_table_names():
    run = rebuild.RebuildRun(FakeStore(base()), "rebuild-pair001", Result(), True,  # type: ignore[arg-type]
                             pair="pair001")
    assert run.name == "rebuild-pair001" and run.kind() == "rebuild"
    rb = rebuild._Rebuild(run, A, base().ranges, Options())
    assert names(rb.steps()) == ["fenced_and_cleared", "master_writable", "copied", "replicating",
                                 "mark_cleared"]
    assert not rb._did("copied")
    rb.resumed = {"steps": [{"step": "copied"}]}
    assert rb._did("copied") and not rb._did("replicating")
    # the map still marks the node: the mark is not cleared
    marked = ShardMap.from_ranges([dict(r.to_dict(), rebuild=A) for r in base().ranges])
    run.store.map = marked  # type: ignore[attr-defined]
    assert not rb._mark_cleared()
    run.store.map = base()  # type: ignore[attr-defined]
    assert rb._mark_cleared()


def test_slave_sql_quotes_the_connection_name():
    from shardfleet import replication

    assert replication.slave_sql("START") == "START SLAVE"
    assert replication.slave_sql("STOP", "split_a", "IO_THREAD") == "STOP SLAVE 'split_a' IO_THREAD"
    assert replication.slave_sql("RESET", "o'k\\", "ALL") == "RESET SLAVE 'o''k\\\\' ALL"
