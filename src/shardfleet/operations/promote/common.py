"""What the promotion's modules share: the run (its journal ``promote-<pair>``, its
messages), the map edits under the promotion's name, the commands it prints, and the
side connection that stops a replication I/O thread (:class:`_Stopper`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pymysql
from kazoo.exceptions import KazooException

from shardfleet import replication
from shardfleet.errors import DatabaseError, ShardfleetError
from shardfleet.mapstore import ZooKeeperMapStore
from shardfleet.operations.runner import Run
from shardfleet.operations.types import (
    Options,
    PromotionFailed,
    PromotionRefused,
    Result,
    close,
    connect,
    describe,
    owner,
)
from shardfleet.shardmap import ShardMap

log = logging.getLogger("shardfleet.promote")

MODES = ("planned", "emergency")

# The server primitives live in :mod:`shardfleet.replication`; the names the promotion's
# callers and tests have used.
replica_status = replication.replica_rows
semisync_state = replication.semisync_state
errant_against = replication.errant_gtids


class PromotionRun(Run):
    """One promotion on the runner: journal ``promote-<pair>`` (:func:`owner`), header
    kind ``promotion (<mode>)``."""

    refusal, failure = PromotionRefused, PromotionFailed

    def __init__(self, store: ZooKeeperMapStore, pair: str, res: Result, check: bool) -> None:
        super().__init__(store, owner(pair), res, check, pair=pair)
        self.switched = False  # an unfinished planned promotion continued as an emergency

    def kind(self) -> str:
        return f"promotion ({self.res.mode})"

    def refused(self, what: str) -> ShardfleetError:
        return PromotionRefused(f"promotion of {self.pair} ({', '.join(self.nodes)}) stopped "
                                f"before any change: {what}; nothing changed")

    def failed(self, step: str, what: str) -> ShardfleetError:
        return PromotionFailed(
            f"promotion of {self.pair} ({self.res.mode}) failed after step {step!r}: {what}. "
            "The pair's ranges may be left frozen (writes to them wait); the journal "
            f"{self.journal.path} records the steps: fix the cause and rerun the same "
            "command to continue")


def _freeze(m: ShardMap, bounds: set[tuple[int, int]], pair: str) -> ShardMap:
    return m.freeze(bounds, owner(pair))


def _unfreeze(m: ShardMap, bounds: set[tuple[int, int]], pair: str) -> ShardMap:
    return m.thaw(owner(pair), bounds)


def _flip(m: ShardMap, bounds: set[tuple[int, int]], new_master: str, old_master: str,
          rebuild: bool, pair: str) -> ShardMap:
    return m.flip(owner(pair), bounds, master=new_master, standby=old_master,
                  drop=() if rebuild else ("rebuild",),
                  set_extra={"rebuild": old_master} if rebuild else None)


def _rerun_cmd(pair: str, mode: str, expect: str) -> str:
    return (f"ansible-playbook playbooks/promote.yml -e pair={pair}"
            f"{' -e mode=emergency' if mode == 'emergency' else ''} -e expect_master={expect}")


def _resume_cmd(pair: str, master: str) -> str:
    return f"ansible-playbook playbooks/promote.yml -e pair={pair} -e promote_master={master}"


def _record_failure(run: PromotionRun, exc: BaseException) -> None:
    """Note the failure in the (unfinished) journal; best effort, ZooKeeper may be the cause."""
    try:
        run.journal.note(failed=describe(exc), failed_at=time.time())
    except (ShardfleetError, KazooException, OSError):
        log.warning("promote %s: could not record the failure in %s", run.pair,
                    run.journal.path, exc_info=True)


class _Stopper:
    """``STOP SLAVE IO_THREAD`` on its own connection and thread."""

    def __init__(self, server: str, ch: dict[str, Any], opts: Options) -> None:
        self.error = ""
        self._t = threading.Thread(target=self._run, args=(server, ch, opts), daemon=True,
                                   name="shardfleet-stop-io")
        self._t.start()

    def _run(self, server: str, ch: dict[str, Any], opts: Options) -> None:
        conn = None
        try:
            conn = connect(server, opts)
            with conn.cursor() as c:
                c.execute(replication.channel_sql("STOP", ch, "IO_THREAD"))
        except (DatabaseError, pymysql.err.MySQLError) as exc:
            self.error = str(exc)
        finally:
            close(conn)

    def join(self, timeout: float) -> None:
        self._t.join(timeout)

    def is_alive(self) -> bool:
        return self._t.is_alive()
