"""The base of a promotion's step tables (:mod:`.planned`, :mod:`.emergency`): the pair,
its connections, the "is it done?" predicates read from the map and the servers, the
map's freeze and flip, and the guard that turns a driver error into the step's failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from shardfleet import replication
from shardfleet.operations.promote.common import (
    PromotionRun,
    _flip,
    _freeze,
    _Stopper,
    semisync_state,
)
from shardfleet.operations.runner import ERRORS, LockLost
from shardfleet.operations.types import Options, owner, write_map
from shardfleet.shardmap import ShardRange, freeze_owner

T = TypeVar("T")


class Table:
    """One promotion over its pair: the state its steps share, and what both of its
    tables (planned, emergency) read: each row a name, "is it done?" read from the map
    and the servers, the action, the check-mode text."""

    def __init__(self, run: PromotionRun, mode: str, old: str, new: str, ranges: list[ShardRange],
                 opts: Options) -> None:
        self.run, self.res, self.mode, self.opts = run, run.res, mode, opts
        self.old, self.new, self.ranges = old, new, ranges
        self.bounds = {r.bounds for r in ranges}
        self.mconn: Any = None
        self.sconn: Any = None
        self.why = ""                       # why the old master does not answer
        self.ch: dict[str, Any] | None = None  # the new master's channel from the old
        self.stopper: _Stopper | None = None
        self.fence_failed = self.stop_failed = False
        self.received = ""
        self.t_freeze = 0.0

    # -- "is it done?" -------------------------------------------------------
    def _mine(self) -> list[ShardRange]:
        m = self.run.store.read().map
        return [r for r in m.ranges if r.bounds in self.bounds] if m else []

    def _is_flipped(self, r: ShardRange) -> bool:
        """*r* as the flip leaves it: on the new master, not frozen by this promotion,
        the old master marked for rebuild (emergency) or not (planned)."""
        frozen = r.state == "frozen" and freeze_owner(r) == owner(self.run.pair)
        marked = r.extra.get("rebuild") == self.old if self.mode == "emergency" \
            else "rebuild" not in r.extra
        return r.master == self.new and r.standby == self.old and not frozen and marked

    def _flipped(self) -> bool:
        """The map names the new master for every range of the pair (the flip is done)."""
        rs = self._mine()
        return len(rs) == len(self.bounds) and all(self._is_flipped(r) for r in rs)

    def _frozen(self) -> bool:
        """The map shows the pair's ranges frozen by this promotion, or already flipped."""
        rs = self._mine()
        return len(rs) == len(self.bounds) and all(
            (r.state == "frozen" and freeze_owner(r) == owner(self.run.pair))
            or self._is_flipped(r) for r in rs)

    def _new_writable(self) -> bool:
        """The new master has read_only=OFF (emergency: and semi-sync master off)."""
        if replication.is_read_only(self.sconn):
            return False
        return self.mode == "planned" or not semisync_state(self.sconn)["master_enabled"]

    def _nothing_to_receive(self) -> bool:
        return self.mconn is None or self.fence_failed or self._flipped()

    def _no_channel(self) -> bool:
        """The new master has no replication channel from the old one."""
        return replication.peer_channel(self.sconn) is None

    # -- the map -------------------------------------------------------------
    def _freeze(self) -> None:
        """Routers hold writes to the pair's ranges instead of sending them."""
        self.t_freeze = time.monotonic()
        write_map(self.run.store, lambda m: _freeze(m, self.bounds, self.run.pair))
        self.run.step("frozen")

    def _flip_map(self, rebuild: bool) -> None:
        write_map(self.run.store, lambda m: _flip(m, self.bounds, self.new, self.old,
                                                   rebuild, self.run.pair))

    def _guard(self, fn: Callable[[], T],
               failure: Callable[[BaseException], Exception]) -> Callable[[], T]:
        """*fn*, with a driver error turned into *failure(exc)* (check mode: as it is)."""
        if self.run.check:
            return fn

        def guarded() -> T:
            try:
                return fn()
            except LockLost as exc:  # another run may hold the pair: act no more
                raise self.run.lost(exc) from exc
            except ERRORS as exc:
                raise failure(exc) from exc
        return guarded
