"""The operation runner's locks against a real ZooKeeper: a run that loses its session
(its lock znodes go with it) acts no more, a run that took the locks after it fences it
out of its own journal, and every journal carries the one header the registry reads."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations import runner as ops
from shardfleet.operations.runner import LockLost, Runner, Step, StepResult
from shardfleet.testing.nemesis import expire_store_session

pytestmark = pytest.mark.integration

A, B = "10.0.0.1:3306", "10.0.0.2:3306"


@pytest.fixture
def stores(zookeeper):
    cluster = "r" + uuid.uuid4().hex[:10]
    a = ZooKeeperMapStore(zookeeper.address, cluster, timeout=10)
    b = ZooKeeperMapStore(zookeeper.address, cluster, timeout=10)
    yield a, b
    a.close()
    b.close()


def table(log: list[str], journal: ops.Journal, between: Any = None) -> list[Step]:
    def act(name: str) -> StepResult:
        log.append(name)
        journal.step(name)
        if between is not None and name == "one":
            between()
        return StepResult(name, True, name)

    return [Step(n, lambda: False, lambda n=n: act(n)) for n in ("one", "two")]


def test_a_run_whose_session_expired_stops_before_its_next_action(stores):
    a, _ = stores
    did: list[str] = []
    run = Runner(a, "test-op", [A, B], kind="test")
    journal = ops.Journal(a, "test-op")
    with pytest.raises(LockLost, match="session"):
        with run.held():
            run.run(table(did, journal, lambda: expire_store_session(a)))
    assert did == ["one"], did
    assert journal.load()["step"] == "one"


def test_a_run_fenced_out_by_the_next_holder_writes_nothing(stores):
    a, b = stores
    did: list[str] = []
    first = Runner(a, "test-op", [A, B], kind="test")
    journal = ops.Journal(a, "test-op")

    def the_next_run_takes_over() -> None:
        expire_store_session(a)
        with Runner(b, "test-op", [A, B], kind="test").held():
            j = ops.Journal(b, "test-op")
            j.load()
            j.step("taken over")

    with pytest.raises(LockLost):
        with first.held():
            first.run(table(did, journal, the_next_run_takes_over))
            journal.save(dict(journal.data or {}, step="must not land"))
    assert did == ["one"]
    assert ops.Journal(b, "test-op").load()["step"] == "taken over"


def test_the_fence_is_checked_in_the_journal_write_itself(stores):
    """Between the runner's check and the write another holder bumped the fence: the
    write fails in the same ZooKeeper transaction (a fencing token, not a look)."""
    a, b = stores
    run = Runner(a, "test-op", [A], kind="test")
    with run.held():
        journal = ops.Journal(a, "test-op")
        journal.save({"step": "start"})
        assert run.fence is not None
        path = next(iter(run.fence.tokens))
        _, version = b.read_raw(path)
        b.write_raw(path, b"usurper", version)  # as a later holder's take() would
        run.fence.session = a.session()  # the session check alone would not see it
        with pytest.raises(LockLost, match="moved|took"):
            journal.save(dict(journal.data or {}, step="late"))
    assert ops.Journal(b, "test-op").load()["step"] == "start"


def test_every_journal_carries_the_header_the_registry_reads(stores):
    a, _ = stores
    run = Runner(a, "thing-1", [B, A], kind="thing", finished_by=("end",))
    with run.held():
        j = ops.Journal(a, "thing-1")
        j.save({"step": "middle", "private_field": "10.9.9.9:3306"})
        data = j.load()
        assert {k: data[k] for k in ("kind", "servers", "step", "done")} == {
            "kind": "thing", "servers": [A, B], "step": "middle", "done": False}
        assert data["epoch"] >= 0
        [op] = ops.in_flight(a)
        assert (op.name, op.kind, op.servers) == ("thing-1", "thing", (A, B))
        j.step("end")
    assert ops.Journal(a, "thing-1").load()["done"] is True
    assert ops.in_flight(a) == []
    # a journal written later outside its runner (an abort, a cleanup) keeps the header
    # it had: its finishing steps still finish it
    j = ops.Journal(a, "thing-1")
    j.load()
    j.save(dict(j.data or {}, done=False, step="middle"))
    assert [op.name for op in ops.in_flight(a)] == ["thing-1"]
    j.step("end")
    assert ops.in_flight(a) == []


def test_a_journal_step_written_beside_another_writer_keeps_both(stores):
    """The one compare-and-set write with retry: a step recorded after another writer (a
    physical copy's watch, which takes no lock) wrote the journal loads it again and
    records the step on top of what that writer wrote, under the run's fence."""
    a, b = stores
    run = Runner(a, "test-op", [A, B], kind="test")
    journal = ops.Journal(a, "test-op")
    with run.held():
        journal.step("one")
        watch = ops.Journal(b, "test-op")
        watch.load()
        watch.save({**watch.data, "clone_progress": {"phase": "copying"}})
        journal.step("two", at_two=True)
        journal.note(cutover_phase="freezing")
    got = ops.Journal(b, "test-op").load()
    assert [s["step"] for s in got["steps"]] == ["one", "two"], got
    assert got["clone_progress"] == {"phase": "copying"} and got["at_two"], got
    assert got["cutover_phase"] == "freezing" and got["kind"] == "test", got
