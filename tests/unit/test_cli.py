"""The ``shardfleet`` command for on-call: strict IDs, locate, map diff, map validate's
holes, one-line errors and the exit codes (2 usage, 1 runtime)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfleet import cli, ids
from shardfleet.shardmap import ShardMap
from shardfleet.testing import free_port, sigint_default

A, B, C = "10.0.0.1:3306", "10.0.0.2:3306", "10.0.0.3:3306"
PIN_ID = ids.compose(3429, 1, 7075733)


def write_map(path: Path, ranges: list[dict], mod: int = 4096) -> str:
    path.write_text(ShardMap.from_ranges(ranges, mod_shard_count=mod).dumps())
    return str(path)


@pytest.fixture
def two(tmp_path) -> str:
    return write_map(tmp_path / "map.json", [
        {"range": [0, 2047], "master": A, "standby": B, "state": "open"},
        {"range": [2048, 4095], "master": C, "standby": None, "state": "frozen",
         "frozen_by": "split-2048-4095"}])


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("text", ["１２３", "٣", "1_000", "+123", "-1", " ", "0x10", "1e3"])
def test_id_decode_takes_plain_ascii_decimal_only(capsys, text):
    rc, out, err = run(capsys, "id", "decode", text)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "not a plain decimal number (ASCII digits only)" in err


def test_id_decode_refuses_an_unknown_type(capsys):
    rc, _, err = run(capsys, "id", "decode", str(ids.compose(3, 0, 123)))
    assert rc == 2 and "has type 0, which the schema does not know" in err and "pin (1)" in err
    rc, _, err = run(capsys, "id", "decode", str(ids.compose(3, 1000, 1)))
    assert rc == 2 and "has type 1000" in err


def test_id_decode_json_has_one_shape_for_one_or_many(capsys):
    rc, out, _ = run(capsys, "id", "decode", str(PIN_ID), "--json")
    assert rc == 0 and json.loads(out) == [{"id": PIN_ID, "shard": 3429, "type": 1,
                                            "type_name": "pin", "local_id": 7075733}]
    rc, out, _ = run(capsys, "id", "decode", str(PIN_ID), str(PIN_ID + 1), "--json")
    assert rc == 0 and [o["local_id"] for o in json.loads(out)] == [7075733, 7075734]


def test_locate_an_id_and_a_shard(capsys, two):
    rc, out, _ = run(capsys, "locate", str(PIN_ID), "--file", two)
    assert rc == 0, out
    assert out.startswith(f"ID {PIN_ID} (pin, local ID 7075733) is on shard 3429 (database "
                          f"db03429): range 2048-4095 frozen, frozen_by split-2048-4095; "
                          f"master {C}, standby none")
    rc, out, _ = run(capsys, "locate", "17", "--file", two, "--json")
    got = json.loads(out)
    assert rc == 0 and got["shard"] == 17 and got["object"] is None
    assert got["range"] == {"range": [0, 2047], "state": "open", "master": A, "standby": B}


def test_locate_a_shard_in_no_range_is_a_runtime_error(capsys, two):
    rc, out, err = run(capsys, "locate", "5000", "--file", two)
    assert rc == 1 and "shard 5000 (database db05000): in no range" in out
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "locate", "70000", "--shard", "--file", two)
    assert rc == 2 and "beyond the largest" in err
    rc, _, err = run(capsys, "locate", "pin", "--file", two)
    assert rc == 2 and "neither an object ID nor a shard number" in err


def test_map_diff_says_what_changed_and_exits_like_diff(capsys, tmp_path, two):
    rc, out, _ = run(capsys, "map", "diff", two, two)
    assert rc == 0 and out.startswith("same map")
    other = write_map(tmp_path / "other.json", [
        {"range": [0, 2047], "master": B, "standby": A, "state": "open"},
        {"range": [2048, 4095], "master": C, "standby": None, "state": "open"}])
    rc, out, _ = run(capsys, "map", "diff", two, other)
    assert rc == 1
    assert f"~ [0, 2047] master: {A} -> {B}; standby: {B} -> {A}" in out
    assert "~ [2048, 4095] state: frozen -> open" in out


def test_map_validate_refuses_a_hole_below_the_mod_shard_count(capsys, tmp_path):
    holed = write_map(tmp_path / "holed.json", [
        {"range": [0, 2000], "master": A, "state": "open"},
        {"range": [2048, 4095], "master": B, "state": "open"}])
    rc, out, err = run(capsys, "map", "validate", holed)
    assert rc == 2 and out == ""
    assert "shards 2001-2047 are in no range" in err and "mod shard count (4096)" in err
    above = write_map(tmp_path / "above.json", [
        {"range": [0, 4095], "master": A, "state": "open"},
        {"range": [5000, 5999], "master": B, "state": "open"}])
    rc, out, err = run(capsys, "map", "validate", above)
    assert rc == 0 and "valid, 2 ranges" in out
    assert err.startswith("warning: shards 4096-4999 are in no range")


def test_a_map_file_that_is_not_a_map_is_a_usage_error(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ranges": [{"range": [0, 10], "master": "x:1"}, '
                   '{"range": [5, 20], "master": "y:1"}]}')
    rc, _, err = run(capsys, "map", "validate", str(bad))
    assert rc == 2 and "overlaps" in err and err.count("\n") == 1


def test_zookeeper_down_is_one_line_naming_the_hosts_as_given():
    """Not even kazoo's own connection messages: one line, exit 1 (a subprocess: the
    logging setup is the command's)."""
    zk = f"127.0.0.1:{free_port()}"
    for argv in (["map", "show"], ["locate", "12"], ["ops", "list"]):
        p = subprocess.run([sys.executable, "-m", "shardfleet.cli", *argv, "--zk", zk,
                            "--timeout", "1"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and p.stdout == "", (argv, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1, (argv, p.stderr)
        assert p.stderr.startswith(f"shardfleet: error: ZooKeeper at {zk} is unreachable"), \
            (argv, p.stderr)


@pytest.mark.parametrize("command", ["status", "exporter", "migrate"])
def test_the_commands_that_log_in_take_the_tls_options(command, monkeypatch):
    """--ca-cert, --client-cert, --client-key, --check-hostname (community.mysql's names),
    each defaulting to its SHARDFLEET_MYSQL_* variable; TLS off unless one is given."""
    for var in cli._TLS_ENV.values():
        monkeypatch.delenv(var, raising=False)
    args = cli.build_parser().parse_args([command])
    assert not cli._tls(args).enabled
    args = cli.build_parser().parse_args([command, "--ca-cert", "/ca.pem", "--no-check-hostname"])
    assert (args.ca_cert, args.check_hostname) == ("/ca.pem", False)
    monkeypatch.setenv("SHARDFLEET_MYSQL_CLIENT_CERT", "/c.pem")
    monkeypatch.setenv("SHARDFLEET_MYSQL_CHECK_HOSTNAME", "true")
    args = cli.build_parser().parse_args([command])
    assert args.client_cert == "/c.pem"


def test_tls_option_errors_are_usage_errors(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLEET_MYSQL_CHECK_HOSTNAME", "maybe")
    rc, _, err = run(capsys, "status", "--zk", f"127.0.0.1:{free_port()}")
    assert rc == 2 and "SHARDFLEET_MYSQL_CHECK_HOSTNAME='maybe'" in err, err
    monkeypatch.delenv("SHARDFLEET_MYSQL_CHECK_HOSTNAME")
    rc, _, err = run(capsys, "status", "--client-key", str(tmp_path / "k.pem"))
    assert rc == 2 and "client_key is given without client_cert" in err, err


def test_status_watch_reports_every_round_and_keeps_watching_without_zookeeper(capsys):
    """--watch prints a report every SECONDS; a round whose ZooKeeper does not answer is
    a CRITICAL line, not the end of the watch; --count stops it; the exit code is the
    last report's, as --check's."""
    zk = f"127.0.0.1:{free_port()}"
    rc, out, err = run(capsys, "status", "--zk", zk, "--timeout", "0.3", "--watch", "0.1",
                       "--count", "3")
    assert rc == 2 and err == "", err
    assert out.count(" every 0.1s (Ctrl-C stops)\n") == 3, out
    assert out.count(f"CRITICAL ZooKeeper at {zk} is unreachable") == 3, out
    assert "\033[" not in out  # the screen is cleared on a terminal only


@pytest.mark.parametrize(("argv", "says"), [
    (["--watch", "0"], "'0' is not a number of seconds above 0"),
    (["--watch", "-1"], "'-1' is not a number of seconds above 0"),
    (["--watch", "soon"], "'soon' is not a number of seconds above 0"),
    (["--watch", "inf"], "'inf' is not a number of seconds above 0"),
    (["--count", "2"], "--count takes a number of reports (0 or more), with --watch"),
    (["--watch", "1", "--count", "-1"], "--count takes a number of reports")])
def test_status_watch_options_are_checked(capsys, argv, says):
    rc, out, err = run(capsys, "status", "--zk", f"127.0.0.1:{free_port()}", *argv)
    assert rc == 2 and out == "" and says in err, (argv, out, err)


def test_status_watch_stops_on_ctrl_c_with_the_last_reports_code():
    """Ctrl-C (SIGINT) between rounds ends the watch quietly: no traceback, no
    'interrupted' error, the exit code of the last report."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfleet.cli", "status", "--zk", f"127.0.0.1:{free_port()}",
         "--timeout", "0.3", "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the watch ended on its own"
            seen += line.startswith("CRITICAL ZooKeeper")
        assert seen == 2
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 2, (out, err)
    assert err == "", err


def test_status_watch_json_is_one_json_document_a_round(capsys):
    """--watch --json: each round is a JSON document (the ZooKeeper problem too), with
    no header line between them, so a consumer reads them one after another."""
    rc, out, err = run(capsys, "status", "--zk", f"127.0.0.1:{free_port()}", "--timeout", "0.3",
                       "--watch", "0.1", "--count", "2", "--json")
    assert rc == 2 and err == "", err
    docs, rest = [], out.strip()
    while rest:
        doc, end = json.JSONDecoder().raw_decode(rest)
        docs.append(doc)
        rest = rest[end:].strip()
    assert len(docs) == 2, out
    assert all(d["problems"][0]["severity"] == "critical" and "unreachable" in
               d["problems"][0]["text"] for d in docs), docs


def test_ops_list_shows_a_physical_copys_progress():
    from shardfleet.cli import _step_text

    text = _step_text({"step": "started", "clone_progress": {
        "phase": "receiving", "copy_id": "ab12", "bytes_done": 3 << 30,
        "bytes_estimated": 12 << 30, "bytes_per_second": 150 << 20, "eta_seconds": 61}})
    assert text == ("started (physical copy ab12: receiving, 3072 of ~12288 MiB, 150 MiB/s, "
                    "ETA 61 s)"), text
    named = _step_text({"step": "started", "clone_progress": {
        "phase": "copying", "copy_id": "ab12", "bytes_estimated": 1 << 20}})
    assert "physical copy ab12: copying, ? of ~1 MiB" in named, named
