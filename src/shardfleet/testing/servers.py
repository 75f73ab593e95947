"""Start and stop MariaDB, ZooKeeper (standalone or a quorum), Redis and memcached on
127.0.0.1 for tests."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


def sigint_default() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT as a terminal gives it. A
    test run started in the background by a shell without job control inherits SIGINT
    ignored, and a Python child then keeps ignoring it (it installs its
    KeyboardInterrupt handler only over the default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: Any, timeout: float, what: str,
               logfile: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            if logfile and logfile.exists():
                tail = logfile.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening:\n{tail}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {HOST}:{port} within {timeout}s")


class _Alive:
    """Popen's ``poll``/``returncode`` for a process this one did not start."""

    def __init__(self, pid: Any) -> None:
        self._pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self._pid() is None:
            self.returncode = -1
        return self.returncode


class _Process:
    name = "server"

    def __init__(self, base: str | Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"sf-{self.name}-", dir=base))
        self.port = free_port()
        self.proc: subprocess.Popen[Any] | None = None
        self.log = self.dir / "server.log"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _spawn(self, argv: list[str], timeout: float = 60.0, **kw: Any) -> None:
        self._launch(argv, **kw)
        self._wait_listening(timeout)

    def _launch(self, argv: list[str], **kw: Any) -> None:
        """Start the process without waiting for it (see :meth:`_wait_listening`)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, **kw)

    def _wait_listening(self, timeout: float) -> None:
        if self.proc is None:
            raise RuntimeError(f"{self.name} on {self.address} is not started")
        _wait_port(self.port, self.proc, timeout, self.name, self.log)

    def stop(self, remove: bool = False) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 20 s); keep the data unless *remove*."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class MariaDBServer(_Process):
    """A MariaDB server with binary logs and GTIDs on (so it can be a replication source).

    ``root`` connects over TCP with the password in :attr:`root_password`.
    """

    name = "mariadb"
    root_password = "sf-test-root"

    def __init__(self, base: str | Path | None = None, server_id: int = 1,
                 extra: list[str] | None = None) -> None:
        super().__init__(base)
        self.server_id = server_id
        self.extra = extra or []
        self.datadir = self.dir / "data"
        self.socket = self.dir / "mysqld.sock"

    def argv(self) -> list[str]:
        argv = [shutil.which("mariadbd") or "/usr/sbin/mariadbd", "--no-defaults",
                f"--datadir={self.datadir}", f"--socket={self.socket}", f"--port={self.port}",
                f"--bind-address={HOST}", f"--pid-file={self.dir / 'mysqld.pid'}",
                # a tmpdir of its own: a starting mariadbd deletes every '#sql*' file in
                # its tmpdir, and with a shared /tmp a server restarted by one test (the
                # fault campaign restarts them all the time) deleted the temporary
                # tables of another test's server mid-statement ("Error on delete of
                # '/tmp/#sql-temptable-….MAI'")
                f"--tmpdir={self.dir / 'tmp'}",
                f"--server-id={self.server_id}", f"--gtid-domain-id={self.server_id}",
                "--log-bin=binlog", "--binlog-format=ROW", "--log-slave-updates",
                "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=48M",
                "--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0",
                "--skip-name-resolve", "--max-connections=500",
                # every shard has a dozen tables: keep their definitions and handles open
                "--table-definition-cache=8000", "--table-open-cache=8000",
                f"--log-error={self.log}", *self.extra]
        if os.geteuid() == 0:
            argv.append("--user=root")
        return argv

    # -- the server by its pid file: any process may stop or start it -------------
    # A physical copy stops the server, swaps its data directory and starts it again,
    # from whatever process runs the copy (the fault campaign's operation process, which
    # it SIGKILLs at any instant). The handle below names the server; every handle of it
    # (this test's, that process's) finds the running mariadbd by its pid file.

    def handle(self) -> dict[str, Any]:
        """What :meth:`attach` needs to drive this server from another process."""
        return {"dir": str(self.dir), "port": self.port, "server_id": self.server_id,
                "extra": list(self.extra)}

    @classmethod
    def attach(cls, handle: dict[str, Any]) -> MariaDBServer:
        """A handle on the server :meth:`handle` described (running or not)."""
        obj = cls.__new__(cls)
        obj.dir = Path(handle["dir"])
        obj.port = int(handle["port"])
        obj.proc = None
        obj.log = obj.dir / "server.log"
        obj.server_id = int(handle["server_id"])
        obj.extra = list(handle.get("extra") or [])
        obj.datadir = obj.dir / "data"
        obj.socket = obj.dir / "mysqld.sock"
        return obj

    def _pid(self) -> int | None:
        """The pid of this server's running mariadbd, whoever started it (None: none)."""
        try:
            pid = int((self.dir / "mysqld.pid").read_text().strip())
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            return None  # exited; its parent has not reaped it yet
        if f"--datadir={self.datadir}".encode() not in cmdline:
            return None  # the pid was reused
        return pid

    def _signal_and_wait(self, sig: int, timeout: float) -> bool:
        pid = self._pid()
        if pid is None:
            return True
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pid() is None:
                return True
            time.sleep(0.05)
        return False

    @property
    def running(self) -> bool:
        return super().running or self._pid() is not None

    def stop(self, remove: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 20 s), whoever started it."""
        super().stop()
        if not self._signal_and_wait(15, 20):
            self._signal_and_wait(9, 10)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        super().kill()
        self._signal_and_wait(9, 10)

    def start(self, timeout: float = 90.0) -> MariaDBServer:
        if self._pid() is not None:
            # started by another handle (another process): wait until it listens
            _wait_port(self.port, _Alive(self._pid), timeout, self.name, self.log)
            return self
        (self.dir / "tmp").mkdir(parents=True, exist_ok=True)
        fresh = not self.datadir.exists()
        if fresh:
            self.datadir.mkdir(parents=True)
            cmd = [shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db",
                   "--no-defaults", f"--datadir={self.datadir}", "--skip-test-db",
                   "--auth-root-authentication-method=normal"]
            if os.geteuid() == 0:
                cmd.append("--user=root")
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=120)
        self._spawn(self.argv(), timeout)
        if fresh:
            self._root_setup()
        return self

    def _root_setup(self) -> None:
        import pymysql

        conn = pymysql.connect(unix_socket=str(self.socket), user="root", autocommit=True)
        with conn.cursor() as cur:
            cur.execute("SET sql_log_bin=0")
            for host in ("127.0.0.1", "localhost"):
                cur.execute(f"CREATE USER IF NOT EXISTS 'root'@'{host}' IDENTIFIED BY %s",
                            (self.root_password,))
                cur.execute(f"ALTER USER 'root'@'{host}' IDENTIFIED BY %s", (self.root_password,))
                cur.execute(f"GRANT ALL PRIVILEGES ON *.* TO 'root'@'{host}' WITH GRANT OPTION")
        conn.close()

    def connect(self, user: str = "root", password: str | None = None, **kw: Any) -> Any:
        import pymysql

        return pymysql.connect(host=HOST, port=self.port, user=user,
                               password=self.root_password if password is None else password,
                               autocommit=True, charset="utf8mb4", **kw)

    def sql(self, statement: str, params: Any = None) -> list[Any]:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(statement, params)
                return list(cur.fetchall())
        finally:
            conn.close()


# Both are dependencies of Debian's libzookeeper-java. Without a binding on the class
# path SLF4J drops every message (and no zk.log is written); with these ZooKeeper logs
# through log4j 1.2, configured by the log4j.properties in the server's conf/.
_ZK_LOG_JARS = ("/usr/share/java/slf4j-log4j12.jar", "/usr/share/java/log4j-1.2.jar")
_ZK_JAR = "/usr/share/java/zookeeper.jar"
_MODE = re.compile(r"^Mode: (\w+)", re.M)
SERVING = ("leader", "follower")


def four_letter(port: int, command: str, timeout: float = 2.0) -> str:
    """Send a ZooKeeper four-letter command to 127.0.0.1:*port*; its whole reply."""
    chunks = []
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(command.encode())
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ZooKeeperServer(_Process):
    """A standalone ZooKeeper (Debian's package) on a free port.

    The JVM's output goes to ``server.log`` (:attr:`log`), ZooKeeper's own log to
    ``zk.log``; both are in :attr:`dir`, which is kept across ``stop()``/``start()``.
    """

    name = "zookeeper"
    heap = "128m"
    log_level = "WARN"
    whitelist = "ruok,srvr,mntr"

    def start(self, timeout: float = 60.0) -> ZooKeeperServer:
        self.launch()
        self._wait_listening(timeout)
        self._wait_ok(timeout)
        return self

    def launch(self) -> None:
        """Write the configuration and start the JVM, without waiting for it."""
        if self.running:
            raise RuntimeError(f"{self.name} on {self.address} is already running")
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        conf = self.dir / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "zoo.cfg").write_text(self._config(data))
        (conf / "log4j.properties").write_text(
            f"log4j.rootLogger={self.log_level}, F\n"
            "log4j.appender.F=org.apache.log4j.FileAppender\n"
            f"log4j.appender.F.File={self.dir / 'zk.log'}\n"
            "log4j.appender.F.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.F.layout.ConversionPattern=%d %p %c: %m%n\n")
        classpath = [str(conf), _ZK_JAR, *(j for j in _ZK_LOG_JARS if os.path.exists(j))]
        argv = ["java", f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-Xshare:auto",
                *self._jvm_options(),
                "-Dzookeeper.admin.enableServer=false", "-Dzookeeper.jmx.log4j.disable=true",
                "-cp", ":".join(classpath),
                "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(conf / "zoo.cfg")]
        self._launch(argv)

    def _config(self, data: Path) -> str:
        return (f"tickTime=500\ninitLimit=10\nsyncLimit=5\ndataDir={data}\n"
                f"clientPort={self.port}\nclientPortAddress={HOST}\nadmin.enableServer=false\n"
                f"4lw.commands.whitelist={self.whitelist}\nmaxClientCnxns=200\n")

    def _jvm_options(self) -> list[str]:
        return []

    def mode(self, timeout: float = 2.0) -> str | None:
        """``leader``, ``follower`` or ``standalone`` as ``srvr`` reports it; None when
        the server does not answer or is not serving (no quorum, election running)."""
        try:
            m = _MODE.search(four_letter(self.port, "srvr", timeout))
        except OSError:
            return None
        return m.group(1) if m else None

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as s:
                    s.sendall(b"ruok")
                    if s.recv(16) == b"imok":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"ZooKeeper on {self.address} never answered imok")


class ZooKeeperMember(ZooKeeperServer):
    """One member of a :class:`ZooKeeperEnsemble`: *myid* and client, quorum and
    election ports. :attr:`peers` (every member's ``myid: (quorum, election)``) is set
    by the ensemble before the member starts. Its data, ports and logs stay the same
    across restarts."""

    heap = "96m"
    whitelist = "ruok,srvr,mntr,stat"

    def __init__(self, base: str | Path | None, myid: int, ports: tuple[int, int, int], *,
                 init_limit: int = 20, sync_limit: int = 10, log_level: str = "INFO") -> None:
        if myid < 1:
            raise ValueError(f"myid {myid} must be at least 1")
        self.name = f"zookeeper{myid}"
        super().__init__(base)
        self.myid = myid
        self.port, self.quorum_port, self.election_port = ports
        self.peers: dict[int, tuple[int, int]] = {myid: (self.quorum_port, self.election_port)}
        self.init_limit = init_limit
        self.sync_limit = sync_limit
        self.log_level = log_level

    def _config(self, data: Path) -> str:
        (data / "myid").write_text(f"{self.myid}\n")
        servers = "".join(f"server.{n}={HOST}:{q}:{e}\n"
                          for n, (q, e) in sorted(self.peers.items()))
        return (f"tickTime=500\ninitLimit={self.init_limit}\nsyncLimit={self.sync_limit}\n"
                f"dataDir={data}\nclientPort={self.port}\nclientPortAddress={HOST}\n"
                f"admin.enableServer=false\n4lw.commands.whitelist={self.whitelist}\n"
                "maxClientCnxns=200\nstandaloneEnabled=false\nreconfigEnabled=false\n"
                f"{servers}")

    def _jvm_options(self) -> list[str]:
        # C1 only: a test server needs a quick start more than peak throughput
        return ["-XX:TieredStopAtLevel=1"]

    def start(self, timeout: float = 120.0) -> ZooKeeperMember:
        """Start this member alone and wait until it serves as leader or follower (which
        needs a quorum of its peers running); :meth:`ZooKeeperEnsemble.start_member` is
        the usual way."""
        deadline = time.monotonic() + timeout
        self.launch()
        self._wait_listening(timeout)
        while self.mode() not in SERVING:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{_tail(self.dir / 'zk.log')}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.name} on {self.address} did not join a quorum "
                                   f"within {timeout}s")
            time.sleep(0.2)
        return self


class ZooKeeperEnsemble:
    """A ZooKeeper quorum of *size* host processes on 127.0.0.1 (like kazoo.testing's
    harness): ``ZooKeeperEnsemble(base).start()``.

    :attr:`address` is the client host string of all members; :attr:`members` are
    :class:`ZooKeeperMember` objects (``.address``, ``.port``, ``.dir``, ``.log``,
    ``.running``; ZooKeeper's log is ``zk.log`` in each ``.dir``). Every wait is
    bounded and polls ``srvr``.
    """

    def __init__(self, base: str | Path | None = None, size: int = 3, *,
                 init_limit: int = 20, sync_limit: int = 10, log_level: str = "INFO") -> None:
        if size < 1:
            raise ValueError(f"an ensemble needs at least one member, not {size}")
        self.dir = Path(tempfile.mkdtemp(prefix="sf-zkensemble-", dir=base))
        used: set[int] = set()

        def port() -> int:
            while (p := free_port()) in used:
                pass
            used.add(p)
            return p

        self.members = [
            ZooKeeperMember(self.dir, i + 1, (port(), port(), port()), init_limit=init_limit,
                            sync_limit=sync_limit, log_level=log_level)
            for i in range(size)]
        peers = {m.myid: (m.quorum_port, m.election_port) for m in self.members}
        for m in self.members:
            m.peers = dict(peers)

    @property
    def address(self) -> str:
        return ",".join(m.address for m in self.members)

    def __enter__(self) -> ZooKeeperEnsemble:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(remove=True)

    def start(self, timeout: float = 120.0) -> ZooKeeperEnsemble:
        """Start every member at once and wait until they serve as a quorum."""
        deadline = time.monotonic() + timeout
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m._wait_listening(max(0.1, deadline - time.monotonic()))
            self.wait_quorum(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()  # keep the directories (and logs) for a look
            raise
        return self

    def modes(self) -> list[str | None]:
        """Each member's ``srvr`` mode (None: down or not serving)."""
        return [m.mode() if m.running else None for m in self.members]

    def wait_quorum(self, timeout: float = 120.0) -> int:
        """Wait until every running member serves as leader or follower, exactly one is
        the leader and they are a majority; return the leader's index."""
        deadline = time.monotonic() + timeout
        while True:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"{m.name} exited with {m.proc.returncode}:\n"
                                       f"{_tail(m.log)}{_tail(m.dir / 'zk.log')}")
            modes = self.modes()
            running = [i for i, m in enumerate(self.members) if m.running]
            leaders = [i for i, mode in enumerate(modes) if mode == "leader"]
            if (len(running) > len(self.members) // 2 and len(leaders) == 1
                    and all(modes[i] in SERVING for i in running)):
                return leaders[0]
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"ZooKeeper ensemble {self.address} has no quorum after {timeout}s "
                    f"(modes {modes}); logs in {self.dir}")
            time.sleep(0.2)

    def leader(self, timeout: float = 60.0) -> int:
        """The index in :attr:`members` of the current leader (waits for a quorum)."""
        return self.wait_quorum(timeout)

    def kill(self, i: int) -> None:
        """SIGKILL member *i*."""
        self.members[i].kill()

    def stop_member(self, i: int) -> None:
        """Stop member *i* (SIGTERM), keeping its data."""
        self.members[i].stop()

    def start_member(self, i: int, timeout: float = 120.0) -> ZooKeeperMember:
        """Restart member *i* with its data and ports; wait until it serves again as
        leader or follower in a quorum."""
        m = self.members[i]
        deadline = time.monotonic() + timeout
        m.launch()
        m._wait_listening(timeout)
        self.wait_quorum(max(0.1, deadline - time.monotonic()))
        return m

    def stop(self, remove: bool = False) -> None:
        """Stop every member (all at once); remove the directories if *remove*."""
        for m in self.members:
            if m.running and m.proc is not None:
                m.proc.terminate()
        for m in self.members:
            m.stop()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(_Process):
    name = "redis"

    def __init__(self, base: str | Path | None = None, password: str | None = None) -> None:
        super().__init__(base)
        self.password = password

    def start(self, timeout: float = 30.0) -> RedisServer:
        argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(self.port),
                "--bind", HOST, "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
        if self.password:
            argv += ["--requirepass", self.password]
        self._spawn(argv, timeout)
        return self


class MemcachedServer(_Process):
    name = "memcached"

    def start(self, timeout: float = 30.0) -> MemcachedServer:
        argv = [shutil.which("memcached") or "/usr/bin/memcached", "-l", HOST, "-p", str(self.port),
                "-U", "0", "-m", "64", "-c", "1024"]
        if os.geteuid() == 0:
            argv += ["-u", "root"]
        self._spawn(argv, timeout)
        return self
