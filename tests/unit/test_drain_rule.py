"""The split's drain rule (split.pending_writes): which of the application's connections on
the source may still hold a write that passed the privilege check before the fence."""

from __future__ import annotations

from datetime import datetime

from shardfleet.split import pending_writes

FENCE_Q = 120
T_FENCE = datetime(2026, 12, 1, 3, 0, 0)
BEFORE = datetime(2026, 12, 1, 2, 59, 59)
AFTER = datetime(2026, 12, 1, 3, 0, 1)


def row(cid, command, qid, trx=None, modified=0, locked=0, started=None, info=None):
    return (cid, command, qid, trx, modified, locked, FENCE_Q, "state", 5, info,
            "RUNNING" if trx else None, started, T_FENCE)


def test_a_pre_fence_write_committing_under_a_new_id_and_statement_stays_pending():
    """First reading: the INSERT (query id before the fence) runs in a read-only
    transaction with InnoDB's temporary id and no rows yet. Next reading: the row is in,
    the transaction has its real id, and the connection runs COMMIT, a new statement.
    Until it is gone the source's GTID position may lack it."""
    first = [row(5, "Query", 100, trx="421337", started=BEFORE, info="INSERT INTO db00020.pins")]
    later = [row(5, "Query", 130, trx="9001", modified=1, locked=1, started=BEFORE,
                 info="COMMIT")]
    assert pending_writes(first, FENCE_Q, T_FENCE)
    assert pending_writes(later, FENCE_Q, T_FENCE), "a committing pre-fence write was drained"


def test_what_cannot_hold_a_pre_fence_write_is_drained():
    snapshot = [
        row(6, "Sleep", 90),                                        # idle, no transaction
        row(7, "Query", 140, info="SELECT 1"),                       # a post-fence statement
        row(8, "Query", 141, trx="9002", modified=2, started=AFTER),  # a post-fence trx
        row(9, "Sleep", 95, trx="421338", started=BEFORE),           # read-only, no locks
    ]
    assert pending_writes(snapshot, FENCE_Q, T_FENCE) == []


def test_a_statement_begun_before_the_fence_is_pending_until_it_ends():
    pend = pending_writes([row(10, "Query", 119, info="UPDATE db00021.pins")], FENCE_Q, T_FENCE)
    assert len(pend) == 1 and "connection 10" in pend[0] and "UPDATE" in pend[0]
