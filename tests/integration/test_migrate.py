"""Migration of a live legacy database into the fleet: passes until the drift is zero.

The legacy database lives on its own MariaDB server (as it would), the fleet is
the integration tier's two servers with 16 shards each.
"""

from __future__ import annotations

import io
import random

import pytest

from shardfleet import cli, ids
from shardfleet.migrate import Migration, MigrationError
from shardfleet.migrate.legacy import LegacyWriter, generate
from shardfleet.migrate.progress import Progress
from shardfleet.testing import MariaDBServer

from .conftest import APP_PASSWORD, APP_USER


@pytest.fixture(scope="module")
def legacy_server(tmp_path_factory):
    s = MariaDBServer(tmp_path_factory.mktemp("legacy"), server_id=9).start()
    yield s
    s.stop(remove=True)


def _migration(store, legacy_server, db, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("out", lambda line: None)
    return Migration(store, legacy_server.connect, db, state_db=f"{db}_state",
                     rng=random.Random(3), **kw)


def test_live_legacy_database_migrates_to_zero_drift(store, legacy_server):
    conn = legacy_server.connect()
    counts = generate(conn, "legacy_big", 10_000, seed=1)
    conn.close()
    assert counts["users"] == 10_000 and counts["pins"] > 10_000 and counts["likes"] > 10_000
    # bounded well past the passes it must span: the test stops it after the second pass
    # (on a busy machine the first pass alone outlasted a 40 s bound)
    writer = LegacyWriter(legacy_server.connect, "legacy_big", seed=4, max_ops=200_000,
                          max_seconds=600, pause=0.003)
    seen: list[tuple[int, int, int]] = []

    def after_pass(rep):
        seen.append((rep.number, rep.drift, writer.ops))
        if rep.number == 2:  # the application stops writing after the second pass
            writer.stop()
            writer.join(30)

    lines: list[str] = []
    mig = _migration(store, legacy_server, "legacy_big", out=lines.append)
    writer.start()
    result = mig.run(after_pass=after_pass)
    writer.stop()
    writer.join(30)
    assert writer.error is None, f"the legacy writer failed: {writer.error}"
    assert seen[0][2] > 0, "the writer wrote during the first pass"
    assert seen[1][2] > seen[0][2], f"the writer still wrote during the second pass: {seen}"
    assert seen[1][1] > 0, f"the second pass found the writer's changes: {seen}"
    print("\n".join(lines))  # the pass and verification lines, for -s runs
    assert len(result.passes) >= 3 and result.passes[-1].drift == 0, lines
    assert result.verified, "\n".join(c.line() for c in result.checks)
    names = {c.name for c in result.checks}
    assert {"user", "board", "pin", "board_has_pins", "user_likes_pins"} <= names
    users = next(c for c in result.checks if c.name == "user")
    assert users.fleet_count >= 10_000

    # placement: a user's boards and pins live on the user's shard; mappings are right
    legacy = legacy_server.connect()
    with legacy.cursor() as cur:
        cur.execute("SELECT id FROM legacy_big.users ORDER BY id LIMIT 1")
        (uid,) = cur.fetchone()
        cur.execute("SELECT COUNT(*) FROM legacy_big.boards WHERE user_id=%s", (uid,))
        (n_boards,) = cur.fetchone()
    legacy.close()
    mig.open()
    new_user = mig.idmap["user"][uid]
    mig.close()
    boards = store.list("user_has_boards", new_user, limit=100).ids
    assert len(boards) == n_boards
    assert {ids.shard_of(b) for b in boards} <= {ids.shard_of(new_user)}
    assert store.get(new_user)["legacy_id"] == uid

    # a rerun copies nothing
    again = _migration(store, legacy_server, "legacy_big").run()
    assert [p.drift for p in again.passes] == [0], "a rerun must find no drift"
    assert again.verified


def test_rerun_updates_instead_of_duplicating_and_deletes(store, legacy_server):
    conn = legacy_server.connect()
    generate(conn, "legacy_small", 60, seed=7)
    _migration(store, legacy_server, "legacy_small").run()
    with conn.cursor() as cur:
        cur.execute("UPDATE legacy_small.pins SET description='edited' WHERE id=1")
        cur.execute("DELETE FROM legacy_small.likes LIMIT 3")
        cur.execute("DELETE FROM legacy_small.boards WHERE id=2")  # cascades to its pins
    res = _migration(store, legacy_server, "legacy_small").run()
    first = res.passes[0].steps
    assert first["pin"].updated >= 1 and first["pin"].new == 0
    assert first["like"].deleted >= 3 and first["board"].deleted == 1
    assert res.passes[-1].drift == 0 and res.verified
    # the fleet has exactly one object per legacy pin (no duplicates)
    pins = next(c for c in res.checks if c.name == "pin")
    with conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM legacy_small.pins")
        assert pins.fleet_count == cur.fetchone()[0]
    conn.close()


def test_verification_reports_a_changed_fleet_object(store, legacy_server):
    conn = legacy_server.connect()
    generate(conn, "legacy_tamper", 20, seed=8)
    conn.close()
    mig = _migration(store, legacy_server, "legacy_tamper")
    mig.run()
    mig.open()
    victim = next(iter(mig.idmap["board"].values()))
    store.update(victim, {"name": "changed in the fleet"})
    checks = {c.name: c for c in mig.verify()}
    mig.close()
    assert not checks["board"].ok and checks["user"].ok
    assert checks["board"].missing, "the changed board is named"


def test_cli_dry_run_plan_then_run_with_plain_progress(store, legacy_server, zookeeper, cluster,
                                                       capsys, monkeypatch):
    conn = legacy_server.connect()
    generate(conn, "legacy_cli", 50, seed=9)
    conn.close()
    monkeypatch.setenv("SHARDFLEET_LEGACY_PASSWORD", legacy_server.root_password)
    monkeypatch.setenv("SHARDFLEET_APP_USER", APP_USER)
    monkeypatch.setenv("SHARDFLEET_APP_PASSWORD", APP_PASSWORD)
    argv = ["migrate", "--legacy", legacy_server.address, "--legacy-db", "legacy_cli",
            "--zk", zookeeper.address, "--cluster", cluster]
    assert cli.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "users: 50 rows -> user objects: copy 50 new" in out, out
    assert "pins:" in out and "board_has_pins" in out
    assert store.router.map  # the dry run wrote nothing:
    assert cli.main([*argv, "--dry-run"]) == 0
    assert "copy 50 new" in capsys.readouterr().out

    assert cli.main(argv) == 0
    cap = capsys.readouterr()
    assert "pass 1: drift" in cap.out and "drift 0" in cap.out
    assert "user: legacy 50, fleet 50" in cap.out and "MISMATCH" not in cap.out
    assert "\r" not in cap.err and "rows/s" in cap.err, "plain progress lines off a TTY"

    assert cli.main([*argv, "--legacy-db", "Bad-Name"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardfleet: error:") and err.count("\n") == 1


def test_progress_bar_on_a_tty_and_plain_lines_otherwise():
    tty = io.StringIO()
    p = Progress("pass 1 pins", 200, stream=tty, tty=True)
    p.update(100)
    p.finish()
    assert "\r[" in tty.getvalue() and "200/200" not in tty.getvalue().split("\r")[1]
    assert "100/200 rows (50%)" in tty.getvalue() and "left" in tty.getvalue()
    plain = io.StringIO()
    p = Progress("pass 1 pins", 200, stream=plain, tty=False, every=0)
    p.update(100)
    p.update(100)
    p.finish()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("pass 1 pins: 100/200 rows (50%)") and "\r" not in plain.getvalue()


def test_bad_names_are_refused(store, legacy_server):
    with pytest.raises(MigrationError, match="not valid"):
        Migration(store, legacy_server.connect, "legacy; DROP")


def test_the_lock_is_free_as_soon_as_a_migration_closes(store, legacy_server):
    """close() releases the lock itself: a CI run's rerun, started right after the run
    before it closed, was refused ("another migration holds the lock") while the server
    had not yet noticed the closed connection that held it."""
    name = "shardfleet_migrate.legacy_lock_state"
    conn = legacy_server.connect()
    try:
        held = []
        for _ in range(200):
            mig = _migration(store, legacy_server, "legacy_lock")
            mig.open()
            mig.close()
            with conn.cursor() as cur:
                cur.execute("SELECT IS_FREE_LOCK(%s)", (name,))
                held.append(cur.fetchone()[0] != 1)
        assert not any(held), f"the lock was still held after close() {sum(held)} of 200 times"
    finally:
        conn.close()


def test_a_second_migration_beside_a_running_one_is_refused(store, legacy_server):
    first = _migration(store, legacy_server, "legacy_lock")
    first.open()
    try:
        with pytest.raises(MigrationError, match="another migration holds the lock"):
            _migration(store, legacy_server, "legacy_lock").open()
    finally:
        first.close()
    second = _migration(store, legacy_server, "legacy_lock")
    second.open()  # free again
    second.close()
