"""Physical copies (shardfleet.physical) and the rebuild of a standby by one: the master's
data directory streamed by mariadb-backup straight to the node (host processes here; the
``shard_copy`` module does the same between fleet hosts), prepared, put in place, and the
node re-attached, under a writer.

Its own pair (the fixtures of test_promote.py); every test leaves it whole.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from shardfleet import ops, physical, promote, replication
from shardfleet.physical import CopyFailed
from shardfleet.testing import MariaDBServer

from . import test_promote as tp
from .test_promote import PAIR, SHARDS, nodes, opts, roles, wait_applied
from .test_promote_faults import both_ways, ropts

pair, zk_store, writer_store = tp.pair, tp.zk_store, tp.writer_store

pytestmark = pytest.mark.skipif(shutil.which("mariadb-backup") is None,
                                reason="mariadb-backup is not installed (make host-deps)")


def backup_of(server: MariaDBServer, workdir: str, password: str | None = None) -> list[str]:
    cnf = physical.client_defaults(workdir, "root",
                                   MariaDBServer.root_password if password is None else password)
    return physical.backup_argv(defaults_file=cnf, datadir=str(server.datadir),
                                socket_path=str(server.socket), parallel=2)


def stream(server: MariaDBServer, dest: str, *, secret: str = "s3cret",
           sender_secret: str | None = None, password: str | None = None,
           compress: bool = False, wait: float = 60, rx_tls: Any = None, tx_tls: Any = None,
           errors: dict[str, Any] | None = None) -> tuple[physical.Sent | None, Any]:
    """Send a backup of *server* to a receiver extracting into *dest* (the receiver's and
    the sender's StreamTLS *rx_tls*, *tx_tls*): (what the sender reports or None, what the
    receiver returned or the exception it raised); the sender's CopyFailed goes into
    *errors* ("sent_error") when given."""
    rx = physical.Receiver(secret, bind="127.0.0.1", tls=rx_tls)
    got: dict[str, Any] = {}

    def receive() -> None:
        try:
            got["r"] = rx.receive(dest, timeout=wait)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            got["r"] = exc

    t = threading.Thread(target=receive)
    t.start()
    sent = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sent = physical.send(f"127.0.0.1:{rx.port}", sender_secret or secret,
                                 backup_of(server, tmp, password), compress=compress,
                                 connect_timeout=10, reply_timeout=60, tls=tx_tls)
    except CopyFailed as exc:
        got["sent_error"] = exc
        if errors is not None:
            errors["sent_error"] = exc
    finally:
        t.join(wait + 30)
        rx.close()
    if "sent_error" in got:
        assert sent is None
    return sent, got.get("r")


def emergency(pair: Any, zk_store: Any) -> tuple[MariaDBServer, MariaDBServer]:
    """The master SIGKILLed, the emergency promotion, the old master started again (read
    only, marked for rebuild): (old master, new master)."""
    master, standby = roles(pair)
    master.kill()
    res = promote.promote(zk_store, PAIR, nodes(pair), mode="emergency", opts=opts())
    assert res.changed and res.new_master == standby.address
    master.start()
    return master, standby


def copy_into(node: MariaDBServer, source: MariaDBServer) -> str:
    """rebuild-standby.yml's copy: *source* streamed to *node*'s ``.incoming``, prepared
    and installed (the node stopped and started); the copy's GTID position."""
    incoming = str(Path(str(node.datadir) + ".incoming"))
    sent, got = stream(source, incoming)
    assert sent is not None and isinstance(got, physical.Received), got
    physical.prepare(incoming)
    pos = physical.position(incoming)
    physical.install(incoming, str(node.datadir), stop=node.stop, start=node.start)
    assert not Path(incoming).exists()
    return pos


def checksums(server: MariaDBServer) -> dict[str, int]:
    out: dict[str, int] = {}
    for shard in SHARDS:
        for table, value in server.sql(f"CHECKSUM TABLE db{shard:05d}.pins"):
            out[table] = int(value or 0)
    return out


def test_a_sender_without_the_secret_is_refused_and_nothing_is_written(pair, tmp_path):
    master, _ = roles(pair)
    dest = tmp_path / "copy"
    sent, got = stream(master, str(dest), sender_secret="not-the-secret", wait=5)
    assert sent is None and isinstance(got, CopyFailed), (sent, got)
    assert "no sender with the copy's secret" in str(got), got
    assert not dest.exists(), "a refused sender's bytes were extracted"


def test_a_failed_backup_leaves_no_copy(pair, tmp_path):
    master, _ = roles(pair)
    dest = tmp_path / "copy"
    sent, got = stream(master, str(dest), password="wrong-password")
    assert sent is None and isinstance(got, CopyFailed), (sent, got)
    assert "mariadb-backup failed" in str(got) or "did not" in str(got), got
    assert not dest.exists(), "a failed backup left a directory that looks like a copy"


@pytest.mark.parametrize("compress", [False, True])
def test_a_streamed_copy_prepares_and_carries_its_gtid_position(pair, tmp_path, compress):
    master, _ = roles(pair)
    dest = tmp_path / "copy"
    sent, got = stream(master, str(dest), compress=compress)
    assert sent is not None and isinstance(got, physical.Received), got
    assert got.bytes == sent.bytes > 0
    physical.prepare(str(dest))
    pos = physical.position(str(dest))
    assert replication.gtid_covers(master.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0], pos)
    assert all((dest / f"db{s:05d}").is_dir() for s in SHARDS)


def test_rebuild_standby_by_a_physical_copy_under_a_writer(pair, zk_store, writer_store):
    w = tp.Writer(writer_store, max_seconds=120).start()
    try:
        assert w.wait_acks(100), f"writer made no progress\n{w.status()}"
        old, new = emergency(pair, zk_store)
        o = ropts(copy="physical")
        # 1: fenced; the library says which copy to make, the rebuild stays in flight
        first = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=o)
        cid = first.copy.pop("copy_id")
        assert first.copy == {"source": new.address, "target": old.address}, first.to_dict()
        # a second call names a newer copy: the re-attach from the first one is refused
        newer = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=o)
        assert newer.copy["copy_id"] != cid
        with pytest.raises(promote.PromotionRefused, match="named a newer copy"):
            promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts(
                copy="physical", copy_position="0-1-1", copy_id=cid))
        cid = newer.copy["copy_id"]
        assert "copy" in first.next_step
        assert [j.name for j in ops.in_flight(zk_store)] == [f"rebuild-{PAIR}"]
        assert zk_store.read().map.ranges[0].extra.get("rebuild") == old.address
        # a call with a position that is not one fails as one message (no driver error)
        with pytest.raises(promote.PromotionFailed,
                           match=r"(?s)failed after step.*MySQL error \d+.*rebuild-standby"):
            promote.rebuild_standby(zk_store, PAIR, nodes(pair),
                                    opts=ropts(copy="physical", copy_position="not-a-gtid"))
        # 2: the copy, new -> old, while the writer writes to new
        n_before = len(w.acked)
        pos = copy_into(old, new)
        # 3: the same rebuild, with the copy's position, finishes it
        rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair),
                                     opts=ropts(copy="physical", copy_position=pos,
                                                copy_id=cid))
        assert rr.changed and not rr.warnings and not rr.copy, rr.to_dict()
        assert rr.gtid["copy"] == pos
        assert w.wait_acks(50), f"writer stopped\n{w.status()}"
        assert len(w.acked) > n_before
    finally:
        w.stop()
    m = zk_store.read().map
    assert all(r.master == new.address and r.standby == old.address
               and "rebuild" not in r.extra for r in m.ranges), m.dumps()
    assert ops.in_flight(zk_store) == []
    wait_applied(old, new)
    conn = old.connect()
    try:
        assert tp.missing_ids(conn, w.acked) == [], "the rebuilt standby lacks acknowledged writes"
    finally:
        conn.close()
    assert checksums(old) == checksums(new)
    both_ways(old, new)
    for s in (old, new):
        assert tp.channel(s)["Slave_heartbeat_period"] == replication.HEARTBEAT_PERIOD
    # a rerun changes nothing
    assert promote.rebuild_standby(zk_store, PAIR, nodes(pair),
                                   opts=ropts(copy="physical")).changed is False


def test_a_copy_the_server_cannot_start_on_puts_the_old_data_back(pair, tmp_path):
    master, standby = roles(pair)
    conn = standby.connect()
    with conn.cursor() as c:  # a marker only the standby's own data directory has
        c.execute("SET SESSION sql_log_bin=0")
        c.execute("CREATE DATABASE IF NOT EXISTS sf_marker")
    conn.close()
    incoming = str(tmp_path / "copy")
    sent, got = stream(master, incoming)
    assert isinstance(got, physical.Received), got
    physical.prepare(incoming)
    starts: list[str] = []

    def start() -> None:
        starts.append("start")
        if len(starts) == 1:
            raise OSError("the server did not start on the copy")
        standby.start()

    with pytest.raises(CopyFailed, match="old contents are back"):
        physical.install(incoming, str(standby.datadir), stop=standby.stop, start=start)
    assert starts == ["start", "start"] and standby.running
    assert standby.sql("SHOW DATABASES LIKE 'sf_marker'"), "the old data did not come back"
    assert not Path(incoming).exists()
    assert not Path(str(standby.datadir) + ".replaced").exists()
    conn = standby.connect()
    with conn.cursor() as c:
        c.execute("SET SESSION sql_log_bin=0")
        c.execute("DROP DATABASE sf_marker")
    conn.close()
    # like every node of the fleet it starts no replica at boot (skip_slave_start, as the
    # mysql role configures it; the rebuild had stopped it anyway): the rebuild's rerun
    # starts it, here by hand
    standby.sql("START SLAVE")
    both_ways(master, standby)


# A fleet node holds more tablespaces than its open-files limit allows (2,048 shards of 14
# tables, about 28,700 .ibd files, in containers capped at 8,192 files): mariadb-backup
# keeps every tablespace it opens open by default and failed with OS error 24. Here: 300
# shards (4,200 tablespaces) and a copy made and prepared under a limit of 512 files.
FEW_FILES = 512
SHARDS_OVER_LIMIT = 300
COPY_UNDER_A_LIMIT = """
import json, sys, threading
from shardfleet import physical
spec = json.loads(sys.argv[1])
rx = physical.Receiver("s3cret", bind="127.0.0.1")
got = {}
t = threading.Thread(target=lambda: got.update(r=rx.receive(spec["dest"], timeout=120)))
t.start()
argv = physical.backup_argv(defaults_file=physical.client_defaults(spec["tmp"], "root",
                            spec["password"]), datadir=spec["datadir"],
                            socket_path=spec["socket"], parallel=2)
physical.send(f"127.0.0.1:{rx.port}", "s3cret", argv, connect_timeout=10, reply_timeout=120)
t.join(150)
physical.prepare(spec["dest"])
print(json.dumps({"close_files": "--close-files" in argv,
                  "position": physical.position(spec["dest"])}))
"""


def test_a_node_with_more_tablespaces_than_open_files_is_copied(tmp_path):
    from shardfleet import provision
    from shardfleet.schema import default_schema

    server = MariaDBServer(tmp_path, server_id=61, extra=["--innodb-file-per-table=1"]).start()
    try:
        conn = server.connect(client_flag=provision.multi_statement_flags())
        provision.ensure_shards(conn, list(range(SHARDS_OVER_LIMIT)), default_schema())
        conn.close()
        # a clean restart checkpoints the redo log: the shards' creation is not left in it
        # for the copy's prepare to replay (a fleet's shards are created long before a
        # rebuild; replaying 4,200 creations opens every one of those tablespaces)
        server.stop()
        server.start()
        conn = server.connect()
        with conn.cursor() as c:
            c.execute("INSERT INTO db00299.pins (body) VALUES ('{\"last\": 1}')")
        conn.close()
        ibd = len(list(Path(server.datadir).glob("*/*.ibd")))
        assert ibd > FEW_FILES + 200, ibd
        dest, work = tmp_path / "copy", tmp_path / "work"
        work.mkdir()
        spec = {"dest": str(dest), "tmp": str(work), "password": MariaDBServer.root_password,
                "datadir": str(server.datadir), "socket": str(server.socket)}
        r = subprocess.run(["prlimit", f"--nofile={FEW_FILES}:{FEW_FILES}", sys.executable,
                            "-c", COPY_UNDER_A_LIMIT, json.dumps(spec)],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, f"the copy under {FEW_FILES} open files failed: " \
                                  f"{r.stderr[-1500:]}"
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["close_files"], "the backup was not told to close the files it copied"
        assert replication.gtid_covers(server.sql("SELECT @@GLOBAL.gtid_binlog_pos")[0][0],
                                       out["position"])
        assert len(list(dest.glob("*/*.ibd"))) == ibd
        copy = MariaDBServer(tmp_path, server_id=62)
        shutil.move(str(dest), str(copy.datadir))
        copy.start()
        try:
            assert copy.sql("SELECT body FROM db00299.pins") == [('{"last": 1}',)]
            assert copy.sql("SELECT COUNT(*) FROM information_schema.TABLES "
                            "WHERE TABLE_SCHEMA = 'db00000'")[0][0] == len(default_schema().ddl())
        finally:
            copy.stop(remove=True)
    finally:
        server.stop(remove=True)


def test_a_node_left_unstartable_by_a_killed_install_gets_a_new_copy(pair, zk_store):
    """A physical rebuild killed while it moved its copy into the node (here: the node
    stopped and its data directory moved aside whole, as the kill leaves it) can leave a
    node that no longer starts. The rerun's plan (check mode, what rebuild-standby.yml
    reads first) says a new copy replaces its data directory (the playbook then leaves the
    node out of the mysql role), and the first call names that copy instead of refusing
    'does not answer: start it'; the copy and the second call finish the rebuild."""
    old, new = emergency(pair, zk_store)
    o = ropts(copy="physical")
    first = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=o)
    assert first.copy["target"] == old.address, first.to_dict()
    old.stop()  # the killed install: stopped, every entry moved aside, nothing moved in
    aside = Path(str(old.datadir) + ".replaced")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    for entry in list(Path(old.datadir).iterdir()):
        shutil.move(str(entry), str(aside / entry.name))
    try:
        plan = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=o, check=True)
        assert any(promote.RECOPY in w for w in plan.warnings), plan.to_dict()
        assert not plan.copy and plan.changed
        again = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=o)
        assert again.copy["target"] == old.address and again.copy["source"] == new.address
        assert any(promote.RECOPY in w for w in again.warnings), again.to_dict()
        pos = copy_into(old, new)
        rr = promote.rebuild_standby(zk_store, PAIR, nodes(pair), opts=ropts(
            copy="physical", copy_position=pos, copy_id=again.copy["copy_id"]))
        assert rr.changed and not rr.copy, rr.to_dict()
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        if not old.running:  # leave the pair whole for the next test, whatever happened
            shutil.rmtree(old.datadir, ignore_errors=True)
    m = zk_store.read().map
    assert all(r.master == new.address and r.standby == old.address
               and "rebuild" not in r.extra for r in m.ranges), m.dumps()
    assert ops.in_flight(zk_store) == []
    both_ways(old, new)


def test_a_copy_over_tls_arrives_and_plaintext_or_another_ca_gets_nothing(pair, tmp_path,
                                                                          certs):
    """shard_copy's tls_dir: the receiver shows its certificate (IP SAN 127.0.0.1), the
    sender verifies it with the CA and sends over TLS; a sender trusting another CA
    refuses to send, and a plaintext sender to a TLS receiver gets no copy in."""
    from shardfleet.tls import StreamTLS

    master, _ = roles(pair)
    rx_tls = StreamTLS(str(certs / "ca.pem"), str(certs / "server.pem"),
                       str(certs / "server.key"))
    sent, got = stream(master, str(tmp_path / "tls"), rx_tls=rx_tls,
                       tx_tls=StreamTLS(str(certs / "ca.pem")))
    assert sent is not None and sent.bytes > 0, got
    assert isinstance(got, physical.Received) and got.bytes == sent.bytes, got
    assert (tmp_path / "tls" / physical.BINLOG_INFO).exists()

    errors: dict[str, Any] = {}
    sent, got = stream(master, str(tmp_path / "other"), rx_tls=rx_tls,
                       tx_tls=StreamTLS(str(certs / "other.pem")), wait=10, errors=errors)
    assert sent is None and "CERTIFICATE_VERIFY_FAILED" in str(errors["sent_error"]), errors
    assert not (tmp_path / "other").exists()

    sent, got = stream(master, str(tmp_path / "plain"), rx_tls=rx_tls, wait=10,
                       errors=errors)
    assert sent is None and isinstance(got, CopyFailed) and "no sender" in str(got), got
    assert not (tmp_path / "plain").exists()


def test_a_sender_never_streams_into_another_copys_receiver(pair, tmp_path):
    """An older copy's receiver (a killed run's, still receiving) holds the port when a
    rerun's sender connects: the sender is not taken there (another secret), so it
    connects again until its own receiver listens on the port, and its copy arrives
    whole. Before the receiver's "+", it streamed into the old receiver's status thread
    and failed (or, for the old receiver's sender, broke the copy)."""
    import socket as _socket

    master, _ = roles(pair)
    old = physical.Receiver("old-secret", bind="127.0.0.1")
    port = old.port
    # the old copy is under way: its sender came (the status thread answers the port)
    peer = _socket.create_connection(("127.0.0.1", port))
    got: dict[str, Any] = {}

    def old_receive() -> None:
        try:
            got["old"] = old.receive(str(tmp_path / "old"), timeout=30)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            got["old"] = exc

    t_old = threading.Thread(target=old_receive)
    t_old.start()
    challenge = physical._recv_exact(peer, len(physical.MAGIC) + 32)
    peer.sendall(physical._proof("old-secret", challenge[len(physical.MAGIC):]) + b"-")
    assert peer.recv(1) == physical.ACCEPTED

    new: dict[str, Any] = {}

    def send_new() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                new["sent"] = physical.send(f"127.0.0.1:{port}", "new-secret",
                                            backup_of(master, tmp), connect_timeout=60,
                                            reply_timeout=60)
            except CopyFailed as exc:
                new["sent"] = exc

    t_new = threading.Thread(target=send_new)
    t_new.start()
    import time as _time

    _time.sleep(3)  # the new sender knocks at the old receiver meanwhile
    assert "sent" not in new, new
    # the old copy ends (its sender's zero frame), its receiver goes; the new one listens
    peer.sendall(b"\x00\x00\x00\x00")
    peer.recv(64)  # its answer to an empty stream: not this test's point
    peer.close()
    t_old.join(60)
    old.close()
    rx = None
    for _ in range(50):  # the port is free again once the old listener closed
        try:
            rx = physical.Receiver("new-secret", bind="127.0.0.1", port=port)
            break
        except OSError:
            _time.sleep(0.1)
    assert rx is not None, "the port never came free"
    try:
        got_new = rx.receive(str(tmp_path / "new"), timeout=60)
    finally:
        t_new.join(90)
        rx.close()
    assert isinstance(new.get("sent"), physical.Sent), new
    assert got_new.bytes == new["sent"].bytes
    assert (tmp_path / "new" / physical.BINLOG_INFO).exists()
