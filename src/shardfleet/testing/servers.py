"""Start and stop MariaDB, ZooKeeper, Redis and memcached on 127.0.0.1 for tests."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout: float, what: str,
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
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, **kw)
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

    def start(self, timeout: float = 90.0) -> MariaDBServer:
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


class ZooKeeperServer(_Process):
    """A standalone ZooKeeper (Debian's package) on a free port."""

    name = "zookeeper"

    def start(self, timeout: float = 60.0) -> ZooKeeperServer:
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        conf = self.dir / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "zoo.cfg").write_text(
            f"tickTime=500\ninitLimit=10\nsyncLimit=5\ndataDir={data}\n"
            f"clientPort={self.port}\nclientPortAddress={HOST}\nadmin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,mntr\nmaxClientCnxns=200\n")
        (conf / "log4j.properties").write_text(
            "log4j.rootLogger=WARN, F\nlog4j.appender.F=org.apache.log4j.FileAppender\n"
            f"log4j.appender.F.File={self.dir / 'zk.log'}\n"
            "log4j.appender.F.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.F.layout.ConversionPattern=%d %p %c: %m%n\n")
        argv = ["java", "-Xmx128m", "-XX:+UseSerialGC", "-Xshare:auto",
                "-Dzookeeper.admin.enableServer=false",
                "-cp", f"{conf}:/usr/share/java/zookeeper.jar",
                "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(conf / "zoo.cfg")]
        self._spawn(argv, timeout)
        self._wait_ok(timeout)
        return self

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
