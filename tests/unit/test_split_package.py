"""The split package without servers: the old import path is the same operation, the
abort's step table folds into one ``abort`` result, and the replication primitives the
split chains send the statements it used to write itself."""

from __future__ import annotations

from typing import Any

from shardfleet import replication
from shardfleet.operations import split as pkg
from shardfleet.operations.runner import StepResult


class Cursor:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def __enter__(self) -> Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def execute(self, sql: str, params: Any = None) -> int:
        self.log.append((sql, params))
        return 0


class Conn:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def cursor(self, *a: Any) -> Cursor:
        return Cursor(self.log)


def test_the_old_import_path_is_the_package():
    from shardfleet import split as old

    for name in ("Split", "SplitSpec", "SplitError", "CutoverAborted", "Credentials",
                 "PROGRESS", "pending_writes", "merge_gtids", "upper_half", "map_changes"):
        assert getattr(old, name) is getattr(pkg, name), name


def test_the_abort_rows_fold_into_one_result_naming_what_changed():
    rows = [StepResult("refuse", False, "before the cutover"),
            StepResult("cancel copies", False, "none"),
            StepResult("remove replication", True, "removed the replication"),
            StepResult("lift fence", True, "lifted the fence on 16 grant(s)"),
            StepResult("thaw", False, "restored the map"),
            StepResult("drop copies", True, "dropped 16 copies from the target"),
            StepResult("verify", False, "ok"), StepResult("record", False, "recorded")]
    res = pkg.Split.abort_result(rows, 0.5)
    assert (res.step, res.changed) == ("abort", True)
    assert res.msg == ("aborted: removed the replication, lifted the fence on 16 grant(s), "
                       "dropped 16 copies from the target")
    assert [r["step"] for r in res.details["steps"]] == [r.step for r in rows]
    nothing = StepResult("abort", False, "no split in progress; nothing to undo")
    assert pkg.Split.abort_result([nothing], 0.0) is nothing


def test_the_channel_primitives_send_what_the_split_sent():
    c = Conn()
    replication.set_channel_databases(c, "split_16_31", ["db00016", "db00017"])
    replication.start_channel(c, "split_16_31", until="1-11-42")
    replication.remove_channel(c, "split_16_31")
    replication.set_ignore_duplicates(c, True)
    assert c.log == [
        ("SET GLOBAL `split_16_31`.replicate_do_db = %s", ("db00016,db00017",)),
        ("START SLAVE 'split_16_31' UNTIL master_gtid_pos = %s", ("1-11-42",)),
        ("STOP SLAVE 'split_16_31'", None), ("RESET SLAVE 'split_16_31' ALL", None),
        ("SET GLOBAL gtid_ignore_duplicates = ON", None)]


def test_a_node_reset_to_no_position_keeps_an_empty_binlog_state():
    c = Conn()
    replication.reset_binlog_history(c, "", applied_too=True)
    assert c.log == [("RESET MASTER", None), ("SET GLOBAL gtid_slave_pos = %s", ("",))]
    c = Conn()
    replication.reset_binlog_history(c, "1-11-42", applied_too=True)
    assert [s for s, _ in c.log] == ["RESET MASTER", "SET GLOBAL gtid_binlog_state = %s",
                                     "SET GLOBAL gtid_slave_pos = %s"]
