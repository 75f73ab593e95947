"""``shardfleet.backup`` stays the import path earlier callers use (playbooks' modules of
older releases, the benches, the fault campaign): every name it exported before the move
into ``shardfleet.operations`` (backup, restore, archive) and ``shardfleet.storage`` is
still there, and is the moved object itself."""

from __future__ import annotations

import inspect

import pytest

from shardfleet import backup, storage
from shardfleet.operations import archive, restore
from shardfleet.operations import backup as op_backup

# shardfleet.backup's __all__ before the move, and the names tests and tools read
BEFORE = ["BackupFailed", "BackupRefused", "Location", "Progress", "RestoreFailed",
          "RestoreRefused", "Restored", "SourceHealth", "StreamWatcher", "backup",
          "check_source", "list_backups", "plan", "refuse_if_in_flight", "latest",
          "read_manifest", "restore", "retention", "s3_client", "new_backup_id",
          "ArchiveConflict", "archive_binlogs", "binlog_root", "replay", "moving_domains",
          "needed_files", "tenure_of", "binlog_head", "map_problems", "channel_problems",
          "_verify", "_objects"]


@pytest.mark.parametrize("name", BEFORE)
def test_the_old_import_path_keeps_every_name(name):
    assert hasattr(backup, name), f"shardfleet.backup.{name} is gone"


def test_the_shim_re_exports_the_moved_objects():
    assert backup.backup is op_backup.backup and backup.restore is restore.restore
    assert backup.replay is archive.replay and backup.Location is storage.Location
    assert backup.BackupRefused is storage.BackupRefused is op_backup.BackupRefused


def test_the_bucket_layout_is_one_module_no_operation():
    """storage is not under operations/, and the backup, restore and archive operations
    all read the layout from it (test_layout checks that they do not import one
    another)."""
    assert "operations" not in storage.__name__
    for op in (op_backup, restore, archive):
        src = inspect.getsource(op)
        assert "from shardfleet.storage import" in src, op.__name__
