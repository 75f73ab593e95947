"""The earlier import path of backups, restores and the binary-log archive.

They live in :mod:`shardfleet.operations.backup`, :mod:`shardfleet.operations.restore`
and :mod:`shardfleet.operations.archive` now, and the bucket layout they share in
:mod:`shardfleet.storage`; this module re-exports them so existing callers keep working.
New code imports from those modules.
"""

from __future__ import annotations

from shardfleet.operations.archive import (
    archive_binlogs,
    binlog_head,
    moving_domains,
    needed_files,
    replay,
    tenure_of,
)
from shardfleet.operations.backup import (
    MAX_LAG_SECONDS,
    MAX_LAG_TRX,
    SourceHealth,
    backup,
    channel_problems,
    check_source,
    map_problems,
    plan,
)
from shardfleet.operations.restore import (
    Restored,
    download,
    refuse_if_in_flight,
    restore,
)
from shardfleet.operations.restore import _verify as _verify  # noqa: F401 - tests use it
from shardfleet.storage import (
    BACKUP_ID,
    BINLOGS,
    DEFAULT_PART_SIZE,
    FORMAT,
    MANIFEST,
    MIN_PART_SIZE,
    SSE,
    ArchiveConflict,
    BackupFailed,
    BackupRefused,
    BinlogFile,
    Location,
    Progress,
    RestoreFailed,
    RestoreRefused,
    StreamWatcher,
    archived_tenures,
    binlog_info,
    binlog_root,
    latest,
    list_backups,
    new_backup_id,
    read_manifest,
    retention,
    s3_client,
)
from shardfleet.storage import objects as _objects  # noqa: F401 - tests use it

__all__ = ["BACKUP_ID", "BINLOGS", "DEFAULT_PART_SIZE", "FORMAT", "MANIFEST", "MAX_LAG_SECONDS",
           "MAX_LAG_TRX", "MIN_PART_SIZE", "SSE", "ArchiveConflict", "BackupFailed",
           "BackupRefused", "BinlogFile", "Location", "Progress", "RestoreFailed",
           "RestoreRefused", "Restored", "SourceHealth", "StreamWatcher", "archive_binlogs",
           "archived_tenures", "backup", "binlog_head", "binlog_info", "binlog_root",
           "channel_problems", "check_source", "download", "latest", "list_backups",
           "map_problems", "moving_domains", "needed_files", "new_backup_id", "plan",
           "read_manifest", "refuse_if_in_flight", "replay", "restore", "retention",
           "s3_client", "tenure_of"]
