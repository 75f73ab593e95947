"""The test servers themselves: what the other tiers rely on them for."""

from __future__ import annotations

from pathlib import Path

from shardfleet.testing import MariaDBServer


def test_a_starting_server_leaves_other_servers_temporary_files_alone(mariadb_pair,
                                                                      tmp_path):
    """A starting mariadbd deletes every '#sql*' file in its tmpdir. With one /tmp for all
    test servers, a server the fault campaign restarted deleted another server's on-disk
    temporary table mid-statement, which then crashed (signal 11 in ha_maria::drop_table;
    campaign seed 500115) or failed ('Error on delete of /tmp/#sql-temptable-…'). Each
    server has a tmpdir of its own."""
    running = mariadb_pair[0]
    tmpdir = Path(running.sql("SELECT @@GLOBAL.tmpdir")[0][0])
    assert tmpdir != Path("/tmp") and running.dir in tmpdir.parents, tmpdir
    probe = tmpdir / "#sql-probe-of-the-test.MAI"
    probe.write_bytes(b"")
    other = MariaDBServer(tmp_path, server_id=77).start()
    try:
        assert Path(other.sql("SELECT @@GLOBAL.tmpdir")[0][0]) != tmpdir
        assert probe.exists(), "a starting server deleted another server's temporary file"
    finally:
        other.stop(remove=True)
        probe.unlink(missing_ok=True)
