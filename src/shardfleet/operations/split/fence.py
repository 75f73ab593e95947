"""The split's fence: the application user's privileges on the moving databases taken on
the source (and given back), checked to hold, and the drain of the writes that passed the
privilege check before it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shardfleet import replication

from .context import SplitContext
from .spec import SplitError, few

WRITE_PRIVILEGES = ("Insert_priv", "Update_priv", "Delete_priv")
# the same, as information_schema.SCHEMA_PRIVILEGES names the privileges the server enforces
LIVE_WRITE_PRIVILEGES = ", ".join(f"'{p.removesuffix('_priv').upper()}'"
                                  for p in WRITE_PRIVILEGES)

#: The application's connections on the source with their statement and InnoDB
#: transaction, our own query id (column 6) and the server's clock (column 12).
DRAIN_SQL = ("SELECT p.ID, p.COMMAND, p.QUERY_ID, t.trx_id, t.trx_rows_modified, "
             "t.trx_rows_locked, (SELECT QUERY_ID FROM information_schema.PROCESSLIST "
             "WHERE ID = CONNECTION_ID()), p.STATE, p.TIME_MS, LEFT(p.INFO, 120), "
             "t.trx_state, t.trx_started, NOW() FROM information_schema.PROCESSLIST p "
             "LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID "
             "WHERE p.USER = %s")


class FenceMixin(SplitContext):
    def _set_fence(self, on: bool, *, reads: bool = False) -> int:
        """Take (on) or give back (off) the application user's write privileges on the moving
        databases on the source master; returns how many grants changed.

        One UPDATE of ``mysql.db`` and ``FLUSH PRIVILEGES``: constant time, where a REVOKE per
        database costs ~0.6 ms each. Both are binlogged (row events, FLUSH is logged), so the
        source's standby holds the same fence; the split's replication filter skips them.
        The FLUSH runs whether or not the UPDATE changed a row: a run killed between the two
        left the table fenced and the live privileges open, and only a FLUSH closes them.
        """
        flag = "N" if on else "Y"
        dbs = self.databases
        privs = WRITE_PRIVILEGES + (("Select_priv",) if reads or not on else ())
        marks = ",".join(["%s"] * len(dbs))
        sets = ", ".join(f"{p} = %s" for p in privs)
        not_yet = " OR ".join(f"{p} <> %s" for p in privs)
        sql = (f"UPDATE mysql.db SET {sets} WHERE User = %s AND Host = %s "
               f"AND Db IN ({marks}) AND ({not_yet})")
        with self.conn(self.spec.source).cursor() as cur:
            n = cur.execute(sql, [flag] * len(privs) + [self.creds.app_user,
                                                        self.creds.app_host] + dbs
                            + [flag] * len(privs))
            cur.execute("FLUSH PRIVILEGES")
        return int(n)

    def _fence_problems(self, *, fenced: bool = False) -> list[str]:
        """Why the fence would not (or, *fenced*, does not) stop the application's writes to
        the moving databases on the source: a database without a grant row for
        ``app_user@app_host`` (the fence takes privileges from those rows, so an
        ``app_host`` that matches none fences nothing), another host pattern of the same
        user that may write them, global write privileges, and once fenced any row still
        writable. Empty: the fence holds."""
        user, host, dbs = self.creds.app_user, self.creds.app_host, self.databases
        marks = ",".join(["%s"] * len(dbs))
        writable = " OR ".join(f"{p} = 'Y'" for p in WRITE_PRIVILEGES)
        rows = self._exec(self.spec.source, f"SELECT Db, ({writable}) FROM mysql.db WHERE "
                          f"User = %s AND Host = %s AND Db IN ({marks})", [user, host] + dbs)
        have = {str(r[0]): bool(r[1]) for r in rows}
        out = []
        missing = [d for d in dbs if d not in have]
        if missing:
            out.append(f"the application user '{user}'@'{host}' has no grant on {len(missing)} "
                       f"moving database(s) on the source ({few(missing)}): the fence takes "
                       "write privileges from those grants, so it would stop nothing (give "
                       "the app_host its grants use)")
        if fenced:
            out += self._still_writable(have, marks)
        others = self._exec(self.spec.source, f"SELECT DISTINCT Host FROM mysql.db WHERE "
                            f"User = %s AND Host <> %s AND Db IN ({marks}) AND ({writable})",
                            [user, host] + dbs)
        if others:
            out.append(f"'{user}' may also write the moving databases from host(s) "
                       f"{', '.join(str(r[0]) for r in others)}, which the fence (on "
                       f"'{host}') does not cover")
        glob = self._exec(self.spec.source, f"SELECT Host FROM mysql.user WHERE User = %s "
                          f"AND ({writable})", [user])
        if glob:
            out.append(f"'{user}' has global write privileges (host "
                       f"{', '.join(str(r[0]) for r in glob)}): a fence on databases cannot "
                       "hold it")
        return out

    def _still_writable(self, have: dict[str, bool], marks: str) -> list[str]:
        """The fenced moving databases the application user can still write: in the grant
        table (*have*) and in what the server enforces (the privileges it holds in memory)."""
        user, host, dbs = self.creds.app_user, self.creds.app_host, self.databases
        live = self._exec(self.spec.source, "SELECT DISTINCT TABLE_SCHEMA FROM "
                          "information_schema.SCHEMA_PRIVILEGES WHERE GRANTEE = %s AND "
                          f"PRIVILEGE_TYPE IN ({LIVE_WRITE_PRIVILEGES}) AND TABLE_SCHEMA "
                          f"IN ({marks})", [f"'{user}'@'{host}'"] + dbs)
        still = sorted({d for d, w in have.items() if w} | {str(r[0]) for r in live})
        if still:
            return [f"'{user}'@'{host}' can still write {len(still)} moving "
                    f"database(s) ({few(still)})"]
        return []

    def _drain(self, fenced_at: float) -> list[str]:
        """Wait (bounded) for the application's writes that may have passed the privilege check
        before the fence (the rule is :func:`pending_writes`). New statements on the moving
        shards are refused (1142), so once these end nothing else can land there. Returns a
        description of each one still open when the wait ends (empty: drained).

        InnoDB's transaction view is read every ``replication.TRX_VIEW_PERIOD`` and a
        reading counts only when it was refreshed after the fence
        (:func:`replication.innodb_trx_view`)."""
        c = self.conn(self.spec.source)
        deadline = fenced_at + self.drain_timeout
        q: int | None = None
        cutoff: Any = None
        pending = ["InnoDB's transaction view (information_schema.INNODB_TRX) was not "
                   "refreshed: another client reads it more often than every 0.1 s"]
        while True:
            snapshot = replication.innodb_trx_view(c, DRAIN_SQL, (self.creds.app_user,))
            if snapshot is not None:
                if not snapshot:
                    return []
                if q is None:
                    q, cutoff = int(snapshot[0][6]), snapshot[0][12]
                pending = pending_writes(snapshot, q, cutoff)
                if not pending:
                    return []
            if time.monotonic() + replication.TRX_VIEW_PERIOD > deadline:
                return pending
            time.sleep(replication.TRX_VIEW_PERIOD)

    def _fence_after_flip(self) -> None:
        """The source refuses the moved shards to the application for good: writes (a
        router still on the old map must not write where nothing replicates any more) and
        reads (it must not read, and fill caches with, the source's stale copy)."""
        self._set_fence(True, reads=True)
        problems = self._fence_problems(fenced=True)
        if problems:
            raise SplitError("the map is flipped but the fence on the source does not hold: "
                             + "; ".join(problems) + "; fix the grants, rerun the cutover step")


def pending_writes(snapshot: Sequence[Sequence[Any]], q: int, cutoff: Any) -> list[str]:
    """The application's writes in *snapshot* (rows of :data:`DRAIN_SQL`, read after the
    fence) that may have passed the privilege check before it, described for people.

    Statements get a server-wide increasing query id when they start (before their
    privilege check); *q* is our own query id right after the fence and *cutoff* the
    server's clock at the first reading after it. A connection is pending when

    * it runs a statement with a query id <= *q* (started before the fence), or
    * its transaction started at or before *cutoff* and modified or locked rows: it may
      hold a pre-fence write that is not committed (and binlogged) yet. This is decided
      per reading, not from the first one: InnoDB gives a read-only transaction a
      temporary id that changes when it first writes, and its COMMIT is a new statement
      with a new query id, so neither the id nor the statement tells it apart later.

    A transaction begun after *cutoff* can only touch the moving shards with statements
    begun after the fence, which are refused; ``trx_started`` has one-second resolution,
    so transactions of the fence's own second count as pending (conservative)."""
    out = []
    for (cid, command, qid, trx, modified, locked, _, state, ms, info, trx_state,
         trx_started, *_rest) in snapshot:
        old_stmt = command == "Query" and int(qid or 0) <= q
        old_trx = (trx is not None and (int(modified or 0) > 0 or int(locked or 0) > 0)
                   and (trx_started is None or cutoff is None or trx_started <= cutoff))
        if old_stmt or old_trx:
            out.append(f"connection {cid} ({command}, {state or 'no state'}, "
                       f"{float(ms or 0) / 1000:.1f} s, query id {qid} vs fence {q}; "
                       f"transaction {trx} {trx_state or ''} since {trx_started}, "
                       f"{modified} row(s) modified, {locked} locked; {info or 'idle'})")
    return out
