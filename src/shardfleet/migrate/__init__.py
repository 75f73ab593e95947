"""Migration from a legacy single database: copy, then repeat the copy until the drift is zero.

* :mod:`shardfleet.migrate.legacy` — the legacy schema, a generator and a live writer.
* :mod:`shardfleet.migrate.engine` — passes, drift, verification (:class:`Migration`).
* :mod:`shardfleet.migrate.progress` — the progress bar.
"""

from shardfleet.migrate.engine import (
    KINDS,
    Migration,
    MigrationError,
    MigrationResult,
    PassReport,
    TypeCheck,
)

__all__ = ["KINDS", "Migration", "MigrationError", "MigrationResult", "PassReport", "TypeCheck"]
