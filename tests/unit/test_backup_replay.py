"""The point-in-time replay's positions (shardfleet.backup.moving_domains): mariadb-binlog
fails a replay whose start or stop names a GTID domain with no event after the start, so
only the domains that move are passed (the integration tier replays real binary logs)."""
from __future__ import annotations

import pytest

from shardfleet.backup import RestoreFailed, moving_domains


@pytest.mark.parametrize(("start", "stop", "want"), [
    # the e2e pair after a promotion: the former master's domain 21 did not move
    ("21-21-29271,22-22-40", "21-21-29271,22-22-75", ("22-22-40", "22-22-75")),
    ("1-1-5", "1-1-9", ("1-1-5", "1-1-9")),
    # nothing after the backup: nothing to replay
    ("1-1-5,2-2-3", "1-1-5,2-2-3", ("", "")),
    # a domain new since the backup starts at 0
    ("1-1-5", "1-1-5,3-3-2", ("3-3-0", "3-3-2")),
    # a domain only in the start (the stop does not name it) is left out
    ("1-1-5,7-7-1", "1-1-6", ("1-1-5", "1-1-6")),
])
def test_only_the_domains_that_move_are_replayed(start, stop, want):
    assert moving_domains(start, stop) == want


def test_a_point_before_the_backup_is_refused():
    with pytest.raises(RestoreFailed, match=r"before the backup's position .* domain\(s\) 1: "
                       r"nothing was replayed .* restore an older backup"):
        moving_domains("1-1-9,2-2-3", "1-1-5,2-2-4")
