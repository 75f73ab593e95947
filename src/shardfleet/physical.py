"""Physical copies of a MariaDB node: ``mariadb-backup`` streamed from a source node
straight to a target node, never through the control node.

The source runs ``mariadb-backup --backup --stream=mbstream`` (backup locks: the server
keeps serving) and sends the stream over one TCP connection; the target listens, lets
in one sender that proves it holds the copy's secret, extracts the stream with
``mbstream -x``, prepares it, and puts it in place of its data directory. The secret
never crosses the wire: the receiver sends a random challenge and the sender answers
with its HMAC-SHA256. The GTID position of the copy comes from the backup's own
``xtrabackup_binlog_info``.

The receiver answers the sender it takes with ``+``; a sender that gets anything else
(the connection closed: a receiver of another copy, an older run's still holding the
port, or a wrong secret) closes and connects again until its *connect_timeout*, so it
never streams into a receiver that is not its own.

Wire format after the handshake: frames of a 4-byte big-endian length and that many
bytes; a zero length ends the stream. The receiver then answers ``OK <bytes>\\n`` once
``mbstream`` extracted everything, or ``ERR <reason>\\n``: a sender that gets no
``OK`` knows the copy did not land. Compression (zstd) is a flag in the handshake.

With *tls* (:class:`shardfleet.tls.StreamTLS`: the hosts' certificates from the fleet's
CA, as the ``tls_cert`` role installs them) the whole connection, handshake included,
runs over TLS: the sender and a status client verify the receiver's certificate (chain
and address) before anything else; a plaintext or unverified peer gets nothing.

Both ends are plain functions so that the integration tier runs them on host processes
and the ``shard_copy`` module runs them on fleet nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shardfleet.errors import ShardfleetError
from shardfleet.tls import TLS, StreamTLS

MAGIC = b"SFCOPY2\n"
FRAME = 1 << 20          # bytes read from the backup per frame
ACCEPTED = b"+"          # the receiver's answer to the sender it takes
BINLOG_INFO = "xtrabackup_binlog_info"


class CopyFailed(ShardfleetError):
    """A physical copy did not complete; the target's data directory is untouched unless
    the message says otherwise."""


@dataclass
class Sent:
    bytes: int
    seconds: float


@dataclass
class Received:
    bytes: int
    seconds: float
    directory: str


def new_secret() -> str:
    """A one-shot secret for one copy (the playbook makes its own the same way)."""
    return secrets.token_hex(24)


def _proof(secret: str, challenge: bytes) -> bytes:
    return hmac.new(secret.encode(), challenge, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise CopyFailed(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _tool(name: str, *alternatives: str) -> str:
    for n in (name, *alternatives):
        path = shutil.which(n)
        if path:
            return path
    raise CopyFailed(f"{name} is not installed here (apt-get install mariadb-backup"
                     f"{' zstd' if name == 'zstd' else ''})")


# -- the source ----------------------------------------------------------------------------

def backup_argv(*, defaults_file: str, datadir: str | None = None, socket_path: str | None = None,
                host: str | None = None, port: int | None = None, parallel: int = 4,
                close_files: bool | None = None) -> list[str]:
    """``mariadb-backup`` streaming a full backup to stdout (the password in
    *defaults_file*, never on a command line).

    *close_files* (default: when :func:`too_many_tablespaces` says so for *datadir*)
    adds ``--close-files``: mariadb-backup otherwise keeps open every tablespace it
    opened, and a fleet node (2,048 shards of 14 tables, about 28,700 ``.ibd`` files)
    fails with OS error 24 under a container's 8,192. With it, a file is closed once
    copied. Its documentation warns that DDL during such a copy may make it
    inconsistent: a rebuild holds the pair's operation lock (no split or promotion of
    the pair runs beside it), and its runbook says not to create or drop shards on the
    pair meanwhile (``docs/runbooks/rebuild-standby.md``, "Open files")."""
    if close_files is None:
        close_files = bool(datadir) and too_many_tablespaces(str(datadir))
    argv = [_tool("mariadb-backup", "mariabackup"), f"--defaults-extra-file={defaults_file}",
            "--backup", "--stream=mbstream", f"--parallel={max(1, parallel)}",
            "--open-files-limit=1048576",
            f"--target-dir={tempfile.gettempdir()}"]
    if close_files:
        argv.append("--close-files")
    if datadir:
        argv.append(f"--datadir={datadir}")
    if socket_path:
        argv.append(f"--socket={socket_path}")
    if host:
        argv += [f"--host={host}", f"--port={port or 3306}"]
    return argv


def client_defaults(directory: str, user: str, password: str, tls: TLS | None = None) -> str:
    """A ``[client]`` option file (mode 0600) holding the credential, in *directory*, and
    the client TLS options (``ssl-ca`` ...; :meth:`shardfleet.tls.TLS.option_lines`) for a
    tool that connects over TCP (over the socket, MariaDB's tools stay plain)."""
    path = os.path.join(directory, "client.cnf")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"[client]\nuser={user}\npassword={password}\n"
                f"{(tls or TLS()).option_lines()}")
    return path


def send(target: str | Sequence[str], secret: str, argv: list[str], *, compress: bool = False,
         connect_timeout: float = 60.0, reply_timeout: float = 3600.0,
         tls: StreamTLS | None = None) -> Sent:
    """Run *argv* (a streaming backup) and send its output to the receiver at *target*
    (``host:port``), or to each of several receivers at once (one backup, the same bytes
    to every one: copies at one GTID position, as a split's new pair needs). A receiver
    may still be starting: connecting is retried until *connect_timeout*. Returns once
    every receiver confirmed it extracted everything; one that did not fails the send
    (the others keep what they extracted, unused until installed). With *tls*, each
    receiver's certificate is verified first (module docstring)."""
    targets = [target] if isinstance(target, str) else list(target)
    if not targets:
        raise CopyFailed("no receiver to send the copy to")
    _raise_open_files()
    t0 = time.monotonic()
    socks: list[socket.socket] = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryFile() as err:
        for t in targets:
            sock = stack.enter_context(_open_receiver(t, secret, b"z" if compress else b"-",
                                                      tls, connect_timeout))
            sock.settimeout(reply_timeout)
            socks.append(sock)
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                  stdin=subprocess.DEVNULL)]
        if compress:
            procs.append(subprocess.Popen([_tool("zstd"), "-q", "-1", "-T0", "-c"],
                                          stdin=procs[0].stdout, stdout=subprocess.PIPE,
                                          stderr=err))
            procs[0].stdout.close()  # type: ignore[union-attr]
        sent = 0
        try:
            sent = _pump_frames(procs[-1].stdout, socks)  # type: ignore[arg-type]
        except OSError as exc:
            for p in procs:
                p.kill()
            raise CopyFailed(f"sending to {', '.join(targets)} failed after {sent} bytes: "
                             f"{exc}") from None
        finally:
            codes = [p.wait() for p in procs]
        if any(codes):
            for sock in socks:  # abort: the receivers keep nothing
                sock.sendall(struct.pack(">I", 0xFFFFFFFF))
            err.seek(0)
            raise CopyFailed(f"mariadb-backup failed (exit {codes}): "
                             f"{err.read().decode(errors='replace')[-800:]}")
        for sock in socks:
            sock.sendall(struct.pack(">I", 0))
        for t, sock in zip(targets, socks, strict=True):
            reply = _read_line(sock)
            if not reply.startswith("OK "):
                raise CopyFailed(f"{t} did not take the copy: {reply or 'no answer'}")
        return Sent(bytes=sent, seconds=time.monotonic() - t0)


def too_many_tablespaces(datadir: str, *, headroom: int = 1024) -> bool:
    """Whether *datadir* holds more InnoDB tablespaces (``.ibd`` files) than this process
    may keep open (its open-files limit, raised as far as it goes, less *headroom* for
    everything else). A data directory that cannot be read counts as too many."""
    import resource

    _raise_open_files()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = soft - headroom
    n = 0
    try:
        with os.scandir(datadir) as top:
            for entry in top:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(entry.path) as files:
                    n += sum(1 for f in files if f.name.endswith(".ibd"))
                if n > budget:
                    return True
    except OSError:
        return True
    return False


def _raise_open_files(want: int = 1 << 20) -> None:
    """mariadb-backup opens every tablespace at once (a fleet node holds tens of thousands:
    2,048 shards of a dozen tables): raise this process's open-files limit, which it
    inherits, as far as the system lets (root may raise the hard limit too)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in ((want, max(hard, want)), (hard, hard)):
        if limit[0] <= soft:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)
            return
        except (ValueError, OSError):
            continue


def _open_receiver(target: str, secret: str, flag: bytes, tls: StreamTLS | None,
                   timeout: float) -> socket.socket:
    """A connection to the receiver of this copy at *target* that took this sender (its
    ``+``), connecting again until *timeout* while what answers there does not take it:
    an older copy's receiver still holding the port, or one not listening yet. A
    receiver whose certificate fails the check is not tried again."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    why = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CopyFailed(f"no copy receiver for this copy at {target} within "
                             f"{timeout:.0f}s ({why or 'nothing answered'})")
        try:
            plain = socket.create_connection((host, int(port)), timeout=min(5.0, left))
        except OSError as exc:
            why = str(exc)
            time.sleep(0.2)
            continue
        sock = _client_tls(plain, host, tls, target)
        try:
            sock.settimeout(min(30.0, max(left, 1.0)))
            challenge = _recv_exact(sock, len(MAGIC) + 32)
            if challenge.startswith(MAGIC):
                sock.sendall(_proof(secret, challenge[len(MAGIC):]) + flag)
                if sock.recv(1) == ACCEPTED:
                    return sock
                why = "a receiver answered that did not take this copy's secret"
            else:
                why = "what answered is not a shardfleet copy receiver (of this version)"
        except (OSError, CopyFailed) as exc:
            why = str(exc)
        sock.close()
        time.sleep(0.5)


def _client_tls(sock: socket.socket, host: str, tls: StreamTLS | None,
                where: str) -> socket.socket:
    """*sock* over TLS when *tls* is given, the receiver at *host* verified (closed and
    CopyFailed when it cannot be)."""
    if tls is None:
        return sock
    try:
        return tls.client_context.wrap_socket(sock, server_hostname=host)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise CopyFailed(f"TLS to the copy receiver at {where} failed: {exc}") from None


def _pump_frames(src: IO[bytes], socks: Sequence[socket.socket]) -> int:
    total = 0
    while True:
        chunk = src.read1(FRAME) if hasattr(src, "read1") else src.read(FRAME)
        if not chunk:
            return total
        frame = struct.pack(">I", len(chunk)) + chunk
        for sock in socks:
            sock.sendall(frame)
        total += len(chunk)


def _read_line(sock: socket.socket) -> str:
    buf = bytearray()
    while not buf.endswith(b"\n") and len(buf) < 4096:
        chunk = sock.recv(1)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


# -- the target ----------------------------------------------------------------------------

class Receiver:
    """A one-shot listener for one copy. Bind first (so the sender can be started with
    the port), then :meth:`receive`.

    Until :meth:`close`, it also answers status requests (:func:`status`: the same
    challenge, answered with the flag ``s``) with its :attr:`state` as one JSON line:
    ``phase`` (``waiting``, ``receiving``, then what its caller sets: ``preparing``,
    ``installing``, ``installed``, ``failed``), ``bytes`` received and ``seconds`` since
    the sender came. A split's runner polls it for the copy's progress."""

    def __init__(self, secret: str, bind: str = "0.0.0.0", port: int = 0,
                 tls: StreamTLS | None = None) -> None:
        self.secret = secret
        self.tls = tls
        if tls is not None:
            tls.server_context  # noqa: B018 - a bad file fails here, before any listening
        self.sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, port))
        self.sock.listen(4)
        self.port = int(self.sock.getsockname()[1])
        self.state: dict[str, Any] = {"phase": "waiting", "bytes": 0}
        self._since: float | None = None
        self._closed = threading.Event()
        self._status_thread: threading.Thread | None = None

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._status_thread is not None:
            self._status_thread.join(10)

    def set_phase(self, phase: str, **fields: Any) -> None:
        """What the receiver's caller does with the copy now (for status requests)."""
        self.state = {**self.state, "phase": phase, **fields}

    def _status_line(self) -> bytes:
        st = dict(self.state)
        if self._since is not None:
            st["seconds"] = round(time.monotonic() - self._since, 3)
        return (json.dumps(st) + "\n").encode()

    def _accepted(self, conn: socket.socket) -> socket.socket | None:
        """*conn* over TLS when the receiver has it (None: the peer did not complete the
        handshake, a plaintext client say, and is dropped)."""
        if self.tls is None:
            return conn
        try:
            return self.tls.server_context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return None

    def _challenge(self, conn: socket.socket) -> bytes | None:
        """Challenge *conn*: the flag byte it sent with a right answer (``z`` or ``-``:
        the sender, compressed or not; ``s``: a status request, answered here), or None
        (a wrong answer, a broken connection)."""
        challenge = secrets.token_bytes(32)
        try:
            conn.sendall(MAGIC + challenge)
            answer = _recv_exact(conn, 33)
            if not hmac.compare_digest(answer[:32], _proof(self.secret, challenge)):
                return None
            if answer[32:] == b"s":
                conn.sendall(self._status_line())
        except (OSError, CopyFailed):
            return None
        return answer[32:]

    def _serve_status(self) -> None:
        """After the sender came: answer status requests until closed."""
        while not self._closed.is_set():
            try:
                self.sock.settimeout(1.0)
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5.0)
            secured = self._accepted(conn)
            if secured is None:
                continue
            with secured:  # a second sender gets no "+": this copy is taken
                self._challenge(secured)

    def receive(self, directory: str, timeout: float = 3600.0,
                on_sender: Callable[[], Any] | None = None) -> Received:
        """Wait (up to *timeout*) for a sender holding the secret, extract its stream into
        *directory* (created; must not exist). Senders that fail the challenge are dropped
        and the wait goes on; *on_sender* is called once one passed it. The directory is
        removed when the copy does not complete."""
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CopyFailed(f"no sender with the copy's secret within {timeout:.0f}s")
            self.sock.settimeout(left)
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(min(left, 60.0))
            secured = self._accepted(conn)
            if secured is None:
                continue  # a peer that does not speak TLS to a receiver that does
            conn = secured
            with conn:
                flag = self._challenge(conn)
                if flag is None or flag == b"s":
                    continue  # not the sender of this copy, or a status request
                try:
                    conn.sendall(ACCEPTED)
                except OSError:
                    continue  # it went away: wait for it to come again
                if on_sender is not None:
                    on_sender()
                self._since = time.monotonic()
                self.set_phase("receiving")
                self._status_thread = threading.Thread(target=self._serve_status,
                                                       daemon=True, name="copy-status")
                self._status_thread.start()
                conn.settimeout(max(left, 1.0))
                n = self._extract(conn, directory, compressed=flag == b"z")
                return Received(bytes=n, seconds=time.monotonic() - t0, directory=directory)

    def _extract(self, conn: socket.socket, directory: str, compressed: bool) -> int:
        Path(directory).mkdir(parents=True)
        with tempfile.TemporaryFile() as err:
            procs = []
            if compressed:
                procs.append(subprocess.Popen([_tool("zstd"), "-q", "-d", "-c"],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=err))
            procs.append(subprocess.Popen(
                [_tool("mbstream"), "-x", "-C", directory],
                stdin=procs[0].stdout if procs else subprocess.PIPE, stderr=err))
            if compressed:
                procs[0].stdout.close()  # type: ignore[union-attr]
            sink = procs[0].stdin
            assert sink is not None
            total, ok, why = 0, False, ""
            try:
                while True:
                    (n,) = struct.unpack(">I", _recv_exact(conn, 4))
                    if n == 0:
                        ok = True
                        break
                    if n == 0xFFFFFFFF:
                        why = "the sender's backup failed"
                        break
                    sink.write(_recv_exact(conn, n))
                    total += n
                    self.state = {**self.state, "bytes": total}
            except (OSError, CopyFailed) as exc:
                why = f"stream broken after {total} bytes: {exc}"
            finally:
                try:
                    sink.close()
                except OSError:
                    pass
                codes = [p.wait() for p in procs]
            if ok and any(codes):
                err.seek(0)
                ok, why = False, (f"mbstream failed (exit {codes}): "
                                  f"{err.read().decode(errors='replace')[-500:]}")
            try:
                conn.sendall((f"OK {total}\n" if ok else f"ERR {why}\n").encode())
            except OSError:
                pass
            if not ok:
                shutil.rmtree(directory, ignore_errors=True)
                raise CopyFailed(f"the copy did not arrive: {why}")
            return total


def status(target: str, secret: str, timeout: float = 5.0,
           tls: StreamTLS | None = None) -> dict[str, Any] | None:
    """The receiver at *target*'s state (:class:`Receiver`), or None when nothing there
    answers as one (not listening yet, or done and gone, or, with *tls*, not verified)."""
    host, _, port = target.rpartition(":")
    try:
        plain = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        with _client_tls(plain, host.strip("[]"), tls, target) as sock:
            sock.settimeout(timeout)
            challenge = _recv_exact(sock, len(MAGIC) + 32)
            if not challenge.startswith(MAGIC):
                return None
            sock.sendall(_proof(secret, challenge[len(MAGIC):]) + b"s")
            line = _read_line(sock)
    except (OSError, CopyFailed):
        return None
    try:
        got = json.loads(line)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def prepare(directory: str, use_memory: str = "256M") -> None:
    """``mariadb-backup --prepare``: the copy made consistent, ready to be a data directory."""
    _raise_open_files()
    r = subprocess.run([_tool("mariadb-backup", "mariabackup"), "--prepare",
                        "--open-files-limit=1048576",
                        f"--target-dir={directory}", f"--use-memory={use_memory}"],
                       capture_output=True, text=True, check=False)
    if r.returncode:
        raise CopyFailed(f"preparing the copy in {directory} failed: {r.stderr[-800:]}")


def position(directory: str) -> str:
    """The copy's GTID position, from the backup's own binlog info (``file pos gtid``)."""
    path = Path(directory) / BINLOG_INFO
    try:
        fields = path.read_text().split()
    except OSError as exc:
        raise CopyFailed(f"the copy has no {BINLOG_INFO}: {exc}") from None
    return fields[2] if len(fields) >= 3 else ""


class CopyBusy(CopyFailed):
    """Another copy into the same data directory is running: nothing was touched."""


class CopyCancelled(CopyFailed):
    """The node's copies were cancelled (:data:`FENCE_DB`): this copy was not installed."""


#: A database the split's abort creates on a target node (not binlogged) before it empties
#: the node: from then on no copy is installed there (:func:`install` looks for its
#: directory in the data directory, before and after it stops the server). The next split
#: that names a copy onto the node, or clones onto it, drops it.
FENCE_DB = "shardfleet_copy_fence"


def cancelled(datadir: str) -> bool:
    """Whether copies into the server of *datadir* are cancelled (its :data:`FENCE_DB`
    database's directory is there). The server's data directory is the one place both a
    receiver on the node and a split on the control node reach (the split through SQL),
    with no credential on the node and no ZooKeeper."""
    return (Path(datadir) / FENCE_DB).is_dir()


def cancelled_message(datadir: str, what: str) -> str:
    return (f"the copy into {datadir} was cancelled: the split that named it was aborted "
            f"(database {FENCE_DB} on the node); {what}. A new split onto the node names a "
            "new copy (and drops that database)")


@contextmanager
def copy_lock(datadir: str, *, wait: float = 0.0) -> Iterator[Callable[[str], None]]:
    """Hold the data directory's copy lock (``<datadir>.copy.lock``, an exclusive
    ``flock``) for a whole receive, prepare and install: two copies into one node at once
    would extract into the same place and swap in each other's halves. The kernel drops
    the lock when its holder dies, so a copy killed at any instant never blocks the next.

    Yields ``mark(state)``, which writes the holder's state beside its pid in the lock
    file: ``waiting`` (no sender yet; the state on entry), ``receiving``, ``installing``.
    A holder still *waiting* is preempted (SIGTERM): it is the receiver of a run that
    was killed or superseded before its sender came (an ``async`` task outlives the
    playbook that started it), and would hold the node for its whole timeout. A holder
    receiving or installing is waited for up to *wait* seconds (its copy lands, the new
    one replaces it); then :class:`CopyBusy`, nothing touched."""
    import fcntl
    import signal

    path = Path(datadir.rstrip("/") + ".copy.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait
    preempted: set[int] = set()

    def mark(state: str) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {state}\n".encode(), 0)

    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").split()
                pid = int(holder[0]) if holder and holder[0].isdigit() else 0
                state = holder[1] if len(holder) > 1 else "?"
                if state == "waiting" and pid > 1 and pid != os.getpid() \
                        and pid not in preempted:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                    preempted.add(pid)
                    deadline = max(deadline, time.monotonic() + 30)  # for it to exit
                elif time.monotonic() >= deadline:
                    raise CopyBusy(f"another copy into {datadir} is running (pid "
                                   f"{pid or '?'}, {state}); nothing was touched: wait for "
                                   "it, or rerun once it ended") from None
                time.sleep(0.2)
        mark("waiting")
        yield mark
    finally:
        os.close(fd)  # releases the lock


def receive_copy(secret: str, datadir: str, *, stop: Callable[[], Any],
                 start: Callable[[], Any], bind: str = "0.0.0.0", port: int = 0,
                 tls: StreamTLS | None = None, timeout: float = 3600.0,
                 owner: str | None = None, use_memory: str = "256M",
                 on_listening: Callable[[Receiver], Any] | None = None) -> dict[str, Any]:
    """A target node's whole part of a copy (``shard_copy`` ``mode=receive``): under the
    data directory's :func:`copy_lock`, listen (:class:`Receiver`; *on_listening* gets it
    once bound), extract the stream next to *datadir* (``<datadir>.incoming``),
    :func:`prepare` it and :func:`install` it in place of *datadir* (*stop* / *start* the
    server around the swap). Returns the copy's ``position``, ``bytes`` and ``seconds``.

    Refused before anything (:class:`CopyCancelled`, no lock taken, nothing listening) when
    the node's copies are cancelled (:func:`cancelled`); :func:`install` looks again before
    and after it stops the server."""
    if cancelled(datadir):
        raise CopyCancelled(cancelled_message(datadir, "nothing listened, nothing was touched"))
    incoming = datadir.rstrip("/") + ".incoming"
    # one copy into a node at a time, from the receive to the restart (a killed copy's
    # lock goes with its process)
    with copy_lock(datadir, wait=timeout) as mark:
        shutil.rmtree(incoming, ignore_errors=True)  # a copy that never completed
        rx = Receiver(secret, bind=bind, port=port, tls=tls)
        try:  # open until the end: it answers status requests (the split's watch)
            if on_listening is not None:
                on_listening(rx)
            got = rx.receive(incoming, timeout=timeout, on_sender=lambda: mark("receiving"))
            mark("installing")
            rx.set_phase("preparing")
            prepare(incoming, use_memory=use_memory)
            pos = position(incoming)
            rx.set_phase("installing")
            install(incoming, datadir, stop=stop, start=start, owner=owner)
            rx.set_phase("installed", position=pos)
        except BaseException as exc:
            rx.set_phase("cancelled" if isinstance(exc, CopyCancelled) else "failed")
            raise
        finally:
            rx.close()
    return {"position": pos, "bytes": got.bytes, "seconds": round(got.seconds, 3)}


def install(directory: str, datadir: str, *, stop: Callable[[], Any],
            start: Callable[[], Any], owner: str | None = None) -> None:
    """Replace the contents of *datadir* by the prepared copy in *directory*: *stop* the
    server, move the old contents aside (``<datadir>.replaced``), move the copy in, give
    it to *owner*, *start* the server, then remove the old contents.

    When anything fails before the server runs on the copy, the old contents go back and
    the server is started on them (the node answers, and a rerun makes a new copy); the
    copy is removed. A data directory on a filesystem of its own (a mount point) cannot
    keep its old contents aside: they are deleted first, and a failure leaves it empty.

    Copies into the node cancelled (:func:`cancelled`: a split's abort fenced it) are not
    installed: :class:`CopyCancelled`, the copy removed. That is looked at before the
    server is stopped (nothing touched) and again once it stopped, right before the swap:
    with the server down nothing can fence it any more, so an abort that fenced the node
    before is always seen, and one that had not fenced it by then cannot fence it before
    the server runs on the copy (and then empties the copy)."""
    data, new = Path(datadir), Path(directory)
    if cancelled(datadir):
        shutil.rmtree(new, ignore_errors=True)
        raise CopyCancelled(cancelled_message(datadir, "nothing was touched"))
    old = data.with_name(data.name + ".replaced")
    if old.exists():
        shutil.rmtree(old)
    aside = data.parent.stat().st_dev == data.stat().st_dev
    stop()
    if _fenced_after_stop(datadir):
        shutil.rmtree(new, ignore_errors=True)
        try:
            start()
        except Exception as exc:
            raise CopyCancelled(cancelled_message(datadir, f"starting its server again on its "
                                               f"own data failed ({exc})")) from exc
        raise CopyCancelled(cancelled_message(datadir, "its server was started again on its "
                                           "own data"))
    try:
        if aside:
            old.mkdir()
        for entry in list(data.iterdir()):
            if aside:
                shutil.move(str(entry), str(old / entry.name))
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in list(new.iterdir()):
            shutil.move(str(entry), str(data / entry.name))
        if owner:
            for root, dirs, files in os.walk(data):
                for n in dirs + files:
                    shutil.chown(os.path.join(root, n), owner, owner)
        start()
    except BaseException as exc:
        if not aside:
            raise CopyFailed(f"installing the copy into {datadir} failed ({exc}); its old "
                             "contents were deleted (a mount point): rerun the copy") from exc
        _restore(data, old, stop, start)
        raise CopyFailed(f"installing the copy into {datadir} failed ({exc}); the old "
                         "contents are back and the server was started on them") from exc
    finally:
        shutil.rmtree(new, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def _fenced_after_stop(datadir: str) -> bool:
    """The look right before the swap, the server stopped (its own function: the tests
    hold a receiver here)."""
    return cancelled(datadir)


def _restore(data: Path, old: Path, stop: Callable[[], Any], start: Callable[[], Any]) -> None:
    try:
        stop()
    except Exception:  # noqa: BLE001 - it may not have started
        pass
    for entry in list(data.iterdir()):  # what arrived of the copy
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in list(old.iterdir()):
        shutil.move(str(entry), str(data / entry.name))
    old.rmdir()
    start()
