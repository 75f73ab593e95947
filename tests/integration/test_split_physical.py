"""The split's physical clone on real MariaDB host processes (a source pair and a target
pair, GTID master-master) and ZooKeeper: the source's standby streamed with
``mariadb-backup`` to both target nodes at once (one backup, one GTID position), the
copy attached (the shards the target does not take dropped, the pair replicating both
ways from the copy's position), then the split goes on as ever, under a bounded writer;
a stale or half-attached copy refused, and abort after a copy."""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

import pytest

from shardfleet import physical, provision
from shardfleet.operations.split import SplitError
from shardfleet.testing import MariaDBServer
from shardfleet.testing.kit import (
    SplitFleet,
    make_server,
    pair_up,
    physical_copy,
    rows,
    verify,
    wait_pair_synced,
)

from .test_split import ALL_SHARDS, MOVING, run_split_under_writer

pytestmark = pytest.mark.skipif(shutil.which("mariadb-backup") is None,
                                reason="mariadb-backup is not installed (make host-deps)")

SOURCE_SHARDS = [f"db{s:05d}" for s in ALL_SHARDS]
MOVING_DBS = [f"db{s:05d}" for s in range(MOVING[0], MOVING[1] + 1)]


@pytest.fixture(scope="module")
def physical_servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("split-physical")
    sa, sb = make_server(base, 13), make_server(base, 14, "b")
    pair_up(sa, sb)
    # target nodes boot read_only, as the mysql role's do (a node on a fresh copy is one)
    ta = make_server(base, 33, "a", extra=["--read-only=ON"])
    tb = make_server(base, 34, "b", extra=["--read-only=ON"])
    pair_up(ta, tb)
    yield sa, sb, ta, tb
    for s in (sa, sb, ta, tb):
        s.stop(remove=True)


@pytest.fixture
def fleet(physical_servers, zookeeper):
    sa, sb, ta, tb = physical_servers
    f = SplitFleet(sa, ta, tb, zookeeper.address, source_standby=sb)
    f.reset()
    yield f
    f.close()


def servers(fleet: SplitFleet) -> dict[str, MariaDBServer]:
    assert fleet.source_standby is not None
    return {s.address: s for s in (fleet.source, fleet.source_standby, fleet.target,
                                   fleet.standby)}


def copy_physically(fleet: SplitFleet, copy: dict[str, Any],
                    watch: Any = None) -> tuple[str, dict[str, Any]]:
    """The copy split.yml has shard_copy make (:func:`shardfleet.testing.kit.physical_copy`)."""
    return physical_copy(servers(fleet), copy, watch=watch)


def shard_dbs(server: MariaDBServer) -> set[str]:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            return provision.existing_databases(cur)
    finally:
        conn.close()


def target_pair_holds_the_moving_shards(fleet: SplitFleet) -> None:
    """The target pair holds the moving shards and nothing else, the same rows on both
    nodes, each having applied the other's position."""
    for node in (fleet.target, fleet.standby):
        assert shard_dbs(node) == set(MOVING_DBS), node.address
    wait_pair_synced(fleet.target, fleet.standby)
    wait_pair_synced(fleet.standby, fleet.target)
    shards = list(range(MOVING[0], MOVING[1] + 1))
    assert rows(fleet.standby, shards) == rows(fleet.target, shards)


def journal(fleet: SplitFleet) -> dict[str, Any]:
    with fleet.split() as sp:
        sp.resolve()
        return (sp.journal.load() if sp.journal else None) or {}


def test_a_physical_split_under_live_writes_loses_nothing(fleet, tmp_path):
    results: list[Any] = []
    named: list[dict[str, Any]] = []

    watched: list[dict[str, Any]] = []

    def watch(receivers: list[str], secret: str) -> None:
        with fleet.split() as sp:
            real = sp._note_copy_progress

            def noted(copy_id: str, progress: dict[str, Any]) -> None:
                watched.append(progress)
                real(copy_id, progress)

            sp._note_copy_progress = noted  # type: ignore[method-assign]
            sp.watch_copy(receivers, secret, timeout=120, interval=0.2)

    def go() -> None:
        with fleet.split(clone="physical") as sp:
            first = sp.run("all")
        assert [r.step for r in first] == ["check", "clone"] and first[-1].waits, \
            [r.to_dict() for r in first]
        copy = first[-1].details["copy"]
        named.append(copy)
        pos, stats = copy_physically(fleet, copy, watch)
        named.append({"progress": journal(fleet).get("clone_progress")})
        with fleet.split(clone="physical", copy_position=pos, copy_id=copy["copy_id"],
                         copy_stats=stats) as sp:
            results.extend(sp.run("all"))

    log = run_split_under_writer(fleet, tmp_path, [go], seconds=40.0)
    assert fleet.source_standby is not None
    assert named[0]["source"] == fleet.source_standby.address, \
        "the copy was not taken from the source's standby"
    assert named[0]["targets"] == [fleet.target.address, fleet.standby.address]
    assert [r.step for r in results] == ["check", "clone", "replicate", "cutover"]
    by = {r.step: r for r in results}
    stall = by["cutover"].details["frozen_seconds"]
    assert stall < 1.0, f"writes to the moving shards were held {stall:.3f} s (goal < 1 s)"
    moving_errors = [e for e in log.errors if MOVING[0] <= e[0] <= MOVING[1]]
    assert not moving_errors, f"the writer got errors for moving shards: {moving_errors[:3]}"
    m = fleet.map()
    moved = m.range_for(20)
    assert (moved.bounds, moved.master, moved.standby) == (
        MOVING, fleet.target.address, fleet.standby.address)
    verify(fleet, log, MOVING)
    target_pair_holds_the_moving_shards(fleet)
    # the copy's progress was in the journal while it ran, and its end
    receiving = [w for w in watched if "receiving" in w["phase"] and w["bytes_done"] > 0]
    assert receiving, f"no progress seen while the copy streamed: {watched[:3]}"
    assert all(w["bytes_estimated"] > 0 for w in watched)
    last = named[1]["progress"]
    assert last["phase"] == "installed" and last["bytes_done"] > 0, last
    assert last["receivers"] == {a: "installed" for a in last["receivers"]}, last
    j = journal(fleet)
    assert j.get("clone_method") == "physical" and j.get("copy_bytes"), j
    assert j["dropped_on_target"] == 2 * (len(SOURCE_SHARDS) - len(MOVING_DBS)), j
    print(f"\nphysical split: copy {j['copy_bytes']} bytes in {j['copy_seconds']} s, "
          f"attach {by['clone'].seconds:.2f} s, stall {stall * 1000:.0f} ms, "
          f"{len(log.acked)} objects")


def test_a_half_attached_or_superseded_copy_is_refused_and_a_new_copy_finishes(
        fleet, tmp_path, monkeypatch):
    """Kills inside the attach (here: a failure after the target's master was reset, before
    its standby was) and a second run beside the first (a newer copy named): attaching the
    old copy again is refused, nothing changed; a rerun from the start makes a new copy
    and the split completes with nothing lost."""
    outcome: dict[str, Any] = {}

    def go() -> None:
        with fleet.split(clone="physical") as sp:
            old = sp.run("all")[-1].details["copy"]
        pos, stats = copy_physically(fleet, old)
        calls = []
        real_drop = provision.apply_drop

        def dies_on_the_second_node(conn: Any, dbs: Any, **kw: Any) -> int:
            calls.append(len(dbs))
            if len(calls) == 2:
                raise OSError("killed inside the attach")
            return real_drop(conn, dbs, **kw)

        monkeypatch.setattr(provision, "apply_drop", dies_on_the_second_node)
        with pytest.raises(OSError), fleet.split(clone="physical", copy_position=pos,
                                                 copy_id=old["copy_id"]) as sp:
            sp.run("all")
        monkeypatch.undo()
        with pytest.raises(SplitError) as half:
            with fleet.split(clone="physical", copy_position=pos,
                             copy_id=old["copy_id"]) as sp:
                sp.run("all")
        outcome["half"] = str(half.value)
        # the rerun from the start names a new copy; the older one is refused after that
        with fleet.split(clone="physical") as sp:
            new = sp.run("all")[-1].details["copy"]
        assert new["copy_id"] != old["copy_id"]
        with pytest.raises(SplitError) as stale:
            with fleet.split(clone="physical", copy_position=pos,
                             copy_id=old["copy_id"]) as sp:
                sp.run("all")
        outcome["stale"] = str(stale.value)
        assert fleet.map().range_for(20).master == fleet.source.address
        pos, stats = copy_physically(fleet, new)
        with fleet.split(clone="physical", copy_position=pos, copy_id=new["copy_id"],
                         copy_stats=stats) as sp:
            outcome["done"] = sp.run("all")

    log = run_split_under_writer(fleet, tmp_path, [go], seconds=60.0)
    assert "cut short" in outcome["half"] and "nothing changed" in outcome["half"], outcome
    assert "newer copy" in outcome["stale"] and "nothing changed" in outcome["stale"], outcome
    assert [r.step for r in outcome["done"]] == ["check", "clone", "replicate", "cutover"]
    assert fleet.map().range_for(20).master == fleet.target.address
    verify(fleet, log, MOVING)
    target_pair_holds_the_moving_shards(fleet)


@pytest.mark.parametrize("attached", [False, True], ids=["copy-installed", "copy-attached"])
def test_abort_after_a_physical_copy_leaves_an_empty_target_pair(fleet, attached):
    with fleet.split(clone="physical") as sp:
        copy = sp.run("all")[-1].details["copy"]
    pos, _ = copy_physically(fleet, copy)
    if attached:
        with fleet.split(clone="physical", copy_position=pos, copy_id=copy["copy_id"]) as sp:
            assert [r.step for r in sp.run("clone")] == ["check", "clone"]
    before = fleet.map()
    with fleet.split() as sp:
        res = sp.run("abort")
    assert res[-1].changed, res[-1].msg
    assert fleet.map().ranges == before.ranges
    for node in (fleet.target, fleet.standby):
        assert shard_dbs(node) == set(), node.address
        names = [r[0] for r in node.sql("SHOW ALL SLAVES STATUS")]
        assert names == [""], f"{node.address} has channels {names}"
    # the empty pair replicates both ways: a database made on each reaches the other
    for me, peer in ((fleet.target, fleet.standby), (fleet.standby, fleet.target)):
        me.sql("CREATE DATABASE probe_physical_abort")
        wait_pair_synced(me, peer)
        assert peer.sql("SHOW DATABASES LIKE 'probe_physical_abort'"), peer.address
        me.sql("DROP DATABASE probe_physical_abort")
        wait_pair_synced(me, peer)
    # and a split onto it runs again
    with fleet.split() as sp:
        assert [r.step for r in sp.run("all")][-1] == "cutover"


def test_a_rerun_waits_for_a_target_node_restarting_on_a_copy(fleet):
    """The e2e rerun after a kill found the target's master refusing connections: the
    killed run's copy was installing there (the server restarting on it). The rerun's
    check waits for it (bounded) instead of failing."""
    import threading
    import time

    with fleet.split(clone="physical") as sp:
        first = sp.run("all")[-1].details["copy"]
    fleet.target.stop()
    back = threading.Timer(4.0, fleet.target.start)
    back.start()
    try:
        t0 = time.monotonic()
        with fleet.split(clone="physical") as sp:
            res = sp.run("all")
        waited = time.monotonic() - t0
    finally:
        back.join()
    assert res[-1].waits and res[-1].details["copy"]["copy_id"] != first["copy_id"]
    assert waited >= 3.0, waited
    with fleet.split() as sp:
        sp.run("abort")


def test_a_killed_runs_watch_writing_progress_does_not_fail_the_rerun(fleet, monkeypatch):
    """The e2e rerun after a kill failed its first journal write ("is at version 23,
    expected 22"): the killed run's watch, a module that outlives its playbook, wrote the
    old copy's progress between the rerun's read of the journal and its write. Here that
    write lands at that instant, before each of the rerun's first three journal writes:
    the rerun writes again over it, and the watch stops once the journal names the new
    copy."""
    from shardfleet import ops

    with fleet.split(clone="physical") as sp:
        old = sp.run("all")[-1].details["copy"]
    watcher = fleet.split()
    watcher.resolve()
    real_save = ops.Journal.save
    injected = []

    def save_after_the_watch(self: Any, data: dict[str, Any]) -> None:
        if self is not watcher.journal and len(injected) < 3:
            injected.append(watcher._note_copy_progress(old["copy_id"], {
                "phase": "receiving", "bytes_done": len(injected), "bytes_estimated": 1}))
        real_save(self, data)

    monkeypatch.setattr(ops.Journal, "save", save_after_the_watch)
    try:
        with fleet.split(clone="physical") as sp:
            new = sp.run("all")[-1].details["copy"]
    finally:
        monkeypatch.undo()
        watcher.close()
    assert len(injected) == 3
    j = journal(fleet)
    assert new["copy_id"] != old["copy_id"] and j["copy"]["copy_id"] == new["copy_id"], j
    assert (j.get("clone_progress") or {}).get("copy_id") == new["copy_id"], j
    with fleet.split() as sp:
        sp.run("abort")


# -- abort beside a copy receiver that is still installing -----------------------------------

def _copy_held_at_swap(fleet: SplitFleet, arrived: list[str], release: threading.Event
                       ) -> tuple[threading.Thread, dict[str, Any]]:
    """A physical split's copy, run in the background until both receivers reached the
    point their test holds them at (*arrived* names them, *release* lets them go: set
    here when they never got there): the copy's thread and outcome."""
    with fleet.split(clone="physical") as sp:
        copy = sp.run("all")[-1].details["copy"]
    copying, outcome = _copy_in_background(fleet, copy)
    try:
        _wait_for("both receivers at their swap",
                  lambda: len(arrived) == 2 or not copying.is_alive())
        assert len(arrived) == 2, f"the copy ended before its swap: {outcome}"
    except BaseException:
        release.set()
        raise
    return copying, outcome


def _copy_in_background(fleet: SplitFleet, copy: dict[str, Any]
                        ) -> tuple[threading.Thread, dict[str, Any]]:
    """The copy split.yml's receivers and sender make, in a thread (its outcome in the
    returned dict: ``position`` or ``error``)."""
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["position"] = copy_physically(fleet, copy)[0]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True, name="copy")
    t.start()
    return t, out


def _wait_for(what: str, cond: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("hold", ["prepared", "server-stopped"])
def test_abort_beside_a_receiver_still_installing_leaves_the_target_pair_empty(
        fleet, monkeypatch, hold):
    """Both target nodes' receivers got the whole copy and hold at the instant before their
    swap (*prepared*: before the install begins; *server-stopped*: the node's server
    stopped for the swap) while the split is aborted; then they go on. Whatever the
    instant, no receiver installs after the abort completed: the target pair ends empty
    and a new split of the same range onto it is accepted (no 'target not empty')."""
    release = threading.Event()
    arrived: list[str] = []
    if hold == "prepared":
        real_install = physical.install

        def held_install(directory: str, datadir: str, **kw: Any) -> None:
            arrived.append(datadir)
            release.wait(600)
            real_install(directory, datadir, **kw)

        monkeypatch.setattr(physical, "install", held_install)
    else:
        for node in (fleet.target, fleet.standby):
            def held_stop(remove: bool = False, _real: Any = node.stop,
                          _addr: str = node.address) -> None:
                _real(remove=remove)
                if _addr not in arrived:  # the swap's stop, not a later one
                    arrived.append(_addr)
                    release.wait(600)

            monkeypatch.setattr(node, "stop", held_stop)
    copying, outcome = _copy_held_at_swap(fleet, arrived, release)
    try:
        aborted: dict[str, Any] = {}

        def abort() -> None:
            try:
                with fleet.split() as sp:
                    aborted["result"] = sp.run("abort")
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                aborted["error"] = exc

        aborting = threading.Thread(target=abort, daemon=True, name="abort")
        aborting.start()
        if hold == "prepared":
            aborting.join(300)  # nothing keeps the abort waiting here
            assert not aborting.is_alive(), "the abort hung"
        else:
            aborting.join(3.0)  # the servers are down: the abort cannot be done yet
            assert not aborting.is_alive() or "result" not in aborted, aborted
        release.set()
        copying.join(600)
        aborting.join(600)
        assert not copying.is_alive() and not aborting.is_alive()
    finally:
        release.set()
    assert "error" not in aborted, f"the abort failed: {aborted['error']!r}"
    assert aborted["result"][-1].changed, aborted["result"][-1].msg
    assert journal(fleet).get("step") == "aborted"
    for node in (fleet.target, fleet.standby):
        left = shard_dbs(node)
        assert left == set(), (f"{node.address} holds {len(left)} shard database(s) after "
                               f"the abort (the receiver installed after it: {outcome})")
    with fleet.split(clone="physical") as sp:  # the same range onto the same target
        res = sp.run("check")
    assert [r.step for r in res] == ["check"] and "ok" in res[0].msg, res[0].msg
    if hold == "prepared":  # cancelled before it touched anything
        assert "cancelled" in str(outcome.get("error")), outcome


def test_abort_takes_the_target_standbys_lock(fleet):
    """Abort changes the target's standby too: a lock held on it (a rebuild of it, say)
    makes the abort refuse with LockBusy, nothing changed; once it is free the abort runs."""
    from shardfleet import ops
    from shardfleet.mapstore import ZooKeeperMapStore

    with fleet.split(clone="physical") as sp:
        sp.run("all")  # a copy named: the split is in flight
    other = ZooKeeperMapStore(fleet.zk_address, fleet.cluster)
    try:
        with ops.pair_lock(other, ops.server_lock_name(fleet.standby.address),
                           identifier="rebuild of the target's standby"):
            with pytest.raises(ops.LockBusy, match="rebuild of the target's standby"):
                with fleet.split(lock_timeout=1.0) as sp:
                    sp.run("abort")
    finally:
        other.close()
    assert journal(fleet).get("step") == "started"
    with fleet.split() as sp:
        assert sp.run("abort")[-1].changed
    assert journal(fleet).get("step") == "aborted"


def test_abort_refuses_beside_another_operation_in_flight_on_the_target_standby(fleet):
    """Another unfinished operation on the target's standby (its journal: a rebuild that
    holds no lock between its runs) makes the abort refuse (OperationInFlight), nothing
    changed; the split's own journal never does."""
    from shardfleet import ops

    with fleet.split(clone="physical") as sp:
        sp.run("all")  # a copy named: the split is in flight
    rebuild = ops.Journal(fleet.store, "rebuild-target-standby")
    rebuild.load()
    rebuild.save({"kind": "rebuild", "servers": [fleet.standby.address],
                  "node": fleet.standby.address, "step": "copy", "done": False})
    try:
        with pytest.raises(ops.OperationInFlight, match="rebuild-target-standby"):
            with fleet.split() as sp:
                sp.run("abort")
        assert journal(fleet).get("step") == "started"
    finally:
        rebuild.load()
        rebuild.delete()
    with fleet.split() as sp:
        assert sp.run("abort")[-1].changed
    assert journal(fleet).get("step") == "aborted"


def test_a_receiver_whose_node_was_fenced_as_it_stopped_the_server_installs_nothing(
        fleet, monkeypatch):
    """The abort's fence landed on a target node just before its receiver stopped the
    server for the swap (the look before the stop saw nothing): the look after the stop
    sees it, the server is started again on its own data, nothing is installed."""
    release = threading.Event()
    arrived: list[str] = []
    for node in (fleet.target, fleet.standby):
        def held_stop(remove: bool = False, _real: Any = node.stop,
                      _node: MariaDBServer = node) -> None:
            _real(remove=remove)
            if _node.address not in arrived:
                # what a CREATE DATABASE that completed right before the shutdown leaves
                (_node.datadir / physical.FENCE_DB).mkdir()
                arrived.append(_node.address)
                release.wait(600)

        monkeypatch.setattr(node, "stop", held_stop)
    copying, outcome = _copy_held_at_swap(fleet, arrived, release)
    release.set()
    copying.join(600)
    assert "cancelled" in str(outcome.get("error")) and "started again" in str(
        outcome.get("error")), outcome
    for node in (fleet.target, fleet.standby):
        assert shard_dbs(node) == set(), node.address  # its own (empty) data, running
        assert node.sql("SHOW DATABASES LIKE %s", (physical.FENCE_DB,)), node.address
    with fleet.split() as sp:
        assert sp.run("abort")[-1].changed
    with fleet.split(clone="physical") as sp:  # a new copy lifts the fence
        assert sp.run("all")[-1].waits
    for node in (fleet.target, fleet.standby):
        assert not node.sql("SHOW DATABASES LIKE %s", (physical.FENCE_DB,)), node.address
    with fleet.split() as sp:
        sp.run("abort")


def test_a_receiver_on_a_fenced_node_refuses_before_listening(tmp_path):
    """shard_copy's receive on a node whose copies an abort cancelled: refused before any
    lock or listening, nothing touched."""
    datadir = tmp_path / "mysql"
    (datadir / physical.FENCE_DB).mkdir(parents=True)
    listening: list[Any] = []
    with pytest.raises(physical.CopyCancelled, match="cancelled.*nothing listened"):
        physical.receive_copy("s", str(datadir), stop=lambda: None, start=lambda: None,
                              bind="127.0.0.1", on_listening=listening.append)
    assert not listening
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mysql"]
