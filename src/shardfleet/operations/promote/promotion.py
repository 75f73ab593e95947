"""A promotion: its planned and emergency tables over one pair, run on the runner."""

from __future__ import annotations

from shardfleet.operations.promote.emergency import Emergency, _semisync_warnings
from shardfleet.operations.promote.planned import Planned
from shardfleet.operations.runner import Runner
from shardfleet.operations.types import close


class Promotion(Planned, Emergency):
    """One promotion's step tables over its pair (planned, emergency): each row a name,
    "is it done?" read from the map and the servers, the action, the check-mode text."""

    def execute(self, runner: Runner) -> None:
        try:
            if self.mode == "planned":
                self._connect_planned()
                runner.run(self.planned_steps(), check=self.run.check)
                if not self.run.check:
                    self._check_old_replicates()
            else:
                self._connect_emergency()
                runner.run(self.emergency_steps(), check=self.run.check)
                if self.run.check:
                    _semisync_warnings(self.res, self.mconn, self.why)
        finally:
            close(self.mconn)
            close(self.sconn)
