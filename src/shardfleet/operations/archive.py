"""The binary-log archive of a pair's master, and the point-in-time replay from it.

:func:`archive_binlogs` uploads a node's closed binary logs, each into its *tenure*
(one unbroken history of the server's binary log; :mod:`shardfleet.storage` holds the
layout and how the tenures chain); :func:`replay` applies one tenure's archived files
from a restored backup's position up to a GTID position or a time. The SQL they need is
:mod:`shardfleet.topology`'s and :mod:`shardfleet.replication`'s.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardfleet import physical, replication, topology
from shardfleet.errors import ShardfleetError
from shardfleet.storage import (
    SSE,
    ArchiveConflict,
    BinlogFile,
    Location,
    RestoreFailed,
    archived_tenures,
    binlog_root,
    head_meta,
    sha256_file,
    subfolders,
    successor,
    tenure_chain,
    tenure_files,
)

_FDE, _GTID_LIST, _START_ENCRYPTION = 15, 163, 164


def binlog_head(path: str | Path) -> tuple[int, str]:
    """(created, start) of a binary log file: its Format_description event's timestamp and
    its Gtid_list event (the GTID state the file starts from, the highest sequence of each
    domain). Read from the file's first events (a few hundred bytes)."""
    with open(path, "rb") as f:
        data = f.read(64 * 1024)
    if data[:4] != b"\xfebin":
        raise ArchiveConflict(f"{path} is not a binary log (no magic)")
    created, pos = 0, 4
    state: dict[int, tuple[int, int]] = {}
    for _ in range(16):
        if pos + 19 > len(data):
            break
        ts, etype, _srv, size = struct.unpack_from("<IBII", data, pos)
        if etype == _FDE:
            created = ts
        elif etype == _START_ENCRYPTION:
            raise ArchiveConflict(f"{path} is encrypted: its GTID list cannot be read")
        elif etype == _GTID_LIST:
            (count,) = struct.unpack_from("<I", data, pos + 19)
            for i in range(count & 0x0FFFFFFF):
                d, s, n = struct.unpack_from("<IIQ", data, pos + 23 + 16 * i)
                if n >= state.get(d, (0, -1))[1]:
                    state[d] = (s, n)
            return created, replication.format_gtids(state)
        if size < 19:
            break
        pos += size
    raise ArchiveConflict(f"{path}: no GTID list among its first events")



def tenure_of(s3: Any, loc: Location, node: str, first: BinlogFile) -> str:
    """The archived tenure the server's oldest binary log *first* belongs to, or the name
    of the new one it begins (see the section's comment)."""
    root = binlog_root(loc, node)
    for t in reversed(subfolders(s3, loc.bucket, root)):
        meta = head_meta(s3, loc.bucket, f"{root}{t}/{first.name}")
        if meta is not None:
            if meta.get("created") == str(first.created) and meta.get("start") == first.start:
                return t
            continue  # the same name in another history
        names = list(tenure_files(s3, loc, node, t))
        if names and successor(names[-1]) == first.name:
            last = head_meta(s3, loc.bucket, f"{root}{t}/{names[-1]}") or {}
            if last.get("end") == first.start:
                return t
    stamp = datetime.fromtimestamp(first.created, UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{first.name}"



def _server_binlogs(connect: Callable[[], Any], node: str,
                    flush: bool) -> tuple[Path, list[BinlogFile]]:
    conn = connect()
    try:
        basename, logs = topology.binary_logs(conn, flush=flush)
    finally:
        conn.close()
    if not basename or not logs:
        raise ShardfleetError(f"{node} has no binary log to archive")
    directory = Path(basename).parent
    files = []
    for name, size in logs:
        created, start = binlog_head(directory / name)
        files.append(BinlogFile(name, size, created, start))
    for f, nxt in zip(files, files[1:], strict=False):
        f.end = nxt.start
    return directory, files


def archive_binlogs(s3: Any, loc: Location, *, connect: Callable[[], Any], node: str,
                    flush: bool = True, verify: bool = True) -> list[str]:
    """Upload *node*'s closed binary logs not archived yet in their tenure
    (``<root>binlogs/<node>/<tenure>/<file>``, with sha256, start, end and created as
    metadata); *flush* closes the current one first (``FLUSH BINARY LOGS``), so the
    archive reaches the present. An archived object is never written again: a file of the
    same name already archived in the tenure must have the same size and (*verify*) the
    same sha256, else :class:`ArchiveConflict`. Run it on the master, often (cron);
    returns the files uploaded (``<tenure>/<file>``)."""
    directory, files = _server_binlogs(connect, node, flush)
    tenure = tenure_of(s3, loc, node, files[0])
    root = f"{binlog_root(loc, node)}{tenure}/"
    have = tenure_files(s3, loc, node, tenure)
    sent = []
    for f in files[:-1]:  # the last one is still being written
        if f.name in have:
            _check_archived(s3, loc, root, f, have[f.name], directory if verify else None)
            continue
        f.sha256 = sha256_file(directory / f.name)
        s3.upload_file(str(directory / f.name), loc.bucket, root + f.name,
                       ExtraArgs={"ServerSideEncryption": SSE, "Metadata": f.meta(tenure)})
        sent.append(f"{tenure}/{f.name}")
    return sent


def _check_archived(s3: Any, loc: Location, root: str, f: BinlogFile, size: int,
                    directory: Path | None) -> None:
    """ArchiveConflict when the archived *f* differs from the server's (size; sha256 read
    from the file when *directory* is given)."""
    where = f"s3://{loc.bucket}/{root}{f.name}"
    if size != f.size:
        raise ArchiveConflict(f"{where} has {size} bytes, the server's {f.name} {f.size}: "
                              "the same file of the same tenure differs. Nothing was "
                              "overwritten; find out which copy is right")
    if directory is None:
        return
    meta = head_meta(s3, loc.bucket, root + f.name) or {}
    sha = sha256_file(directory / f.name)
    if meta.get("sha256") != sha:
        raise ArchiveConflict(f"{where} has sha256 {meta.get('sha256') or 'unknown'}, the "
                              f"server's {f.name} {sha}: the same file of the same tenure "
                              "differs. Nothing was overwritten; find out which copy is right")



def needed_files(chain: list[BinlogFile], start: str, *, stop_gtid: str = "",
                 stop_epoch: float | None = None, node: str = "",
                 tenure: str = "") -> list[BinlogFile]:
    """The files of *chain* a replay from *start* needs: from the last one whose start
    *start* covers (RestoreFailed when the first does not: the archive does not reach back
    to the start) to the first whose end covers *stop_gtid*, or the last opened by
    *stop_epoch*; to the archive's end when it does not reach the stop."""
    if not chain:
        raise RestoreFailed(f"no archived binary logs of {node} in tenure {tenure}")
    first = max((i for i, f in enumerate(chain) if replication.gtid_covers(start, f.start)),
                default=None)
    if first is None:
        raise RestoreFailed(
            f"the archive of {node} (tenure {tenure}) does not cover the start {start!r}: "
            f"its first file {chain[0].name} begins at {chain[0].start!r}, and what came "
            "before it is not archived (another tenure, or never archived). Nothing was "
            "replayed; restore a backup taken within this tenure, or name the tenure")
    last = len(chain) - 1
    for i in range(first, len(chain)):
        if stop_gtid and chain[i].end and replication.gtid_covers(chain[i].end, stop_gtid):
            last = i
            break
        if stop_epoch is not None and i + 1 < len(chain) and chain[i + 1].created > stop_epoch:
            last = i
            break
    return chain[first:last + 1]


def replay(s3: Any, loc: Location, *, node: str, start: str, client_argv: list[str],
           connect: Callable[[], Any], stop_gtid: str = "", stop_datetime: str = "",
           workdir: str | None = None, tenure: str = "") -> dict[str, Any]:
    """Apply *node*'s archived binary logs of one *tenure* (default: its newest, the
    node's present history) from GTID position *start* (a restored backup's) up to
    *stop_gtid* or *stop_datetime* (server-local time, ``YYYY-MM-DD HH:MM:SS``) to the
    server *client_argv* (a ``mariadb`` client command) reaches: ``mariadb-binlog
    --start-position=START --stop-position=STOP`` piped into it, both reduced to the
    domains that move (``moving_domains``); a time is first turned into the position the
    archive holds at that time. The tenure's files must be one unbroken chain that covers
    *start* (RestoreFailed otherwise, nothing replayed); only the files from the start to
    the stop are downloaded, one after the other. Then ``gtid_slave_pos`` is the position
    reached. Nothing stops the replay at a position the archive does not reach yet: the
    result says where it ended."""
    if bool(stop_gtid) == bool(stop_datetime):
        raise ShardfleetError("replay: give exactly one of stop_gtid and stop_datetime")
    tenures = archived_tenures(s3, loc, node)
    if not tenures:
        raise RestoreFailed(f"no archived binary logs of {node} under "
                            f"s3://{loc.bucket}/{binlog_root(loc, node)}")
    tenure = tenure or tenures[-1]
    if tenure not in tenures:
        raise RestoreFailed(f"no tenure {tenure} in the archive of {node} ({', '.join(tenures)})")
    chain = tenure_chain(s3, loc, node, tenure)
    epoch = (time.mktime(time.strptime(stop_datetime, "%Y-%m-%d %H:%M:%S"))
             if stop_datetime else None)
    files = needed_files(chain, start, stop_gtid=stop_gtid, stop_epoch=epoch, node=node,
                         tenure=tenure)
    root = f"{binlog_root(loc, node)}{tenure}/"
    with tempfile.TemporaryDirectory(dir=workdir, prefix="sf-binlogs-") as tmp:
        paths = []
        for f in files:  # one at a time, only those needed
            path = os.path.join(tmp, f.name)
            s3.download_file(loc.bucket, root + f.name, path)
            if f.sha256 and sha256_file(Path(path)) != f.sha256:
                raise RestoreFailed(f"s3://{loc.bucket}/{root}{f.name} is corrupted (sha256 "
                                    "differs from its metadata): nothing was replayed")
            paths.append(path)
        tool = physical._tool("mariadb-binlog", "mysqlbinlog")
        if stop_datetime:  # the position the archive holds at that time
            stop_gtid = _position_at(tool, paths, stop_datetime, node)
        begin, end = moving_domains(start, stop_gtid)
        begin = _with_listed(begin, start, files[0].start)
        if end:  # else nothing after the backup's position up to the stop
            _apply(tool, begin, end, paths, client_argv, node)
    reached = _reached(connect, start)
    return {"files": [f.name for f in files], "tenure": tenure, "position": reached}


def _with_listed(begin: str, start: str, listed: str) -> str:
    """*begin* plus *start*'s position in every domain the first file's GTID list names:
    mariadb-binlog refuses a start that leaves out a domain the files list ("does not
    specify an initial value for domain"), moving or not."""
    have = replication.parse_gtids(start)
    out = replication.parse_gtids(begin)
    for d in replication.parse_gtids(listed):
        if d not in out and d in have:
            out[d] = have[d]
    return replication.format_gtids(out)



def _reached(connect: Callable[[], Any], start: str) -> str:
    """The position the replay reached (the start merged with what the server wrote);
    the server's channels stopped, its replication position set there."""
    conn = connect()
    try:
        reached = _merge(start, replication.gtid_position(conn))
        replication.stop_all_channels(conn)
        replication.set_replica_pos(conn, reached)
    finally:
        conn.close()
    return reached


def moving_domains(start: str, stop: str) -> tuple[str, str]:
    """(start, stop) for ``mariadb-binlog``, reduced to the GTID domains in which *stop*
    is past *start*. mariadb-binlog fails a replay whose start or stop names a domain
    with no event after the start ("Binary logs never reached expected GTID state"): a
    former master's domain, after a promotion, is one. A domain new since *start* starts
    at sequence 0. A stop before the start in any domain fails (RestoreFailed), nothing replayed."""
    have, want = replication.parse_gtids(start), replication.parse_gtids(stop)
    behind = sorted(d for d, (_, seq) in want.items() if d in have and seq < have[d][1])
    if behind:
        raise RestoreFailed(
            f"the point in time ({stop}) is before the backup's position ({start}) in "
            f"domain(s) {', '.join(map(str, behind))}: nothing was replayed (the node holds "
            "the backup, read-only); restore an older backup (-e backup_id=...)")
    moving = sorted(d for d, (_, seq) in want.items() if seq > have.get(d, (0, 0))[1])
    begin = {d: have.get(d, (want[d][0], 0)) for d in moving}
    return replication.format_gtids(begin), replication.format_gtids({d: want[d] for d in moving})


_GTID_EVENT = re.compile(rb"^#\d{6}\s.*\sGTID (\d+)-(\d+)-(\d+)\b", re.M)


def _position_at(tool: str, files: list[str], stop_datetime: str, node: str) -> str:
    """The GTID position *files* (binary logs, oldest first) hold at *stop_datetime*:
    the last GTID of each domain among the events before it."""
    out: dict[int, tuple[int, int]] = {}
    proc = subprocess.Popen([tool, f"--stop-datetime={stop_datetime}", *files],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = _GTID_EVENT.match(line)
        if m:
            d, srv, seq = (int(x) for x in m.groups())
            if seq > out.get(d, (0, 0))[1]:
                out[d] = (srv, seq)
    err = proc.stderr.read() if proc.stderr else b""
    if proc.wait():
        raise RestoreFailed(f"reading the binary logs of {node} up to {stop_datetime} failed: "
                            f"{err.decode(errors='replace')[-800:]}")
    return replication.format_gtids(out)


def _apply(tool: str, begin: str, end: str, files: list[str], client_argv: list[str],
           node: str) -> None:
    """``mariadb-binlog --start-position=BEGIN --stop-position=END FILES | client``."""
    # a start naming a domain that does not move after it (the first file's GTID list
    # names it, so it must be named) is "never reached" for strict mode: the events up to
    # the start are skipped all the same, so strict mode's check is off
    argv = [tool, "--skip-gtid-strict-mode", f"--start-position={begin}",
            f"--stop-position={end}", *files]
    with tempfile.TemporaryFile() as err:
        dump = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
        apply = subprocess.run(client_argv, stdin=dump.stdout, stdout=subprocess.DEVNULL,
                               stderr=err, check=False)
        assert dump.stdout is not None
        dump.stdout.close()
        code = dump.wait()
        if code or apply.returncode:
            err.seek(0)
            raise RestoreFailed(f"replaying the binary logs of {node} failed (exit "
                                f"{code}, {apply.returncode}): "
                                f"{err.read().decode(errors='replace')[-800:]}")


def _merge(*positions: str) -> str:
    out: dict[int, tuple[int, int]] = {}
    for pos in positions:
        for d, (srv, seq) in replication.parse_gtids(pos).items():
            if d not in out or seq > out[d][1]:
                out[d] = (srv, seq)
    return replication.format_gtids(out)


__all__ = ["ArchiveConflict", "archive_binlogs", "binlog_head", "moving_domains",
           "needed_files", "replay", "tenure_of"]
