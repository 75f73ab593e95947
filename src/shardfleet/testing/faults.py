"""Fault injection for tests: a TCP proxy that loses a reply after its request was applied.

``ReplyLosingProxy`` sits between a client (kazoo, PyMySQL) and a server on
127.0.0.1. Armed with :meth:`ReplyLosingProxy.lose_reply_to_next`, it forwards the
next client packet larger than a threshold (a map write is kilobytes; pings and
small reads are tens of bytes), waits until the server has had time to apply it,
then closes both sides without forwarding the server's answer: the server applied
the request, the client sees a lost connection. New connections work as before.

:meth:`ReplyLosingProxy.partition` turns it into a partition between its clients and the
server: while on, nothing is forwarded either way and new connections are accepted and
never answered (a blackhole: clients wait out their own timeouts, as across a real
network partition); healing cuts every connection held so far, and new connections are
forwarded again.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


class ReplyLosingProxy:
    """Forward 127.0.0.1:<port> to *target*; lose the reply to an armed request."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self._armed_min = 0
        self._apply_wait = 0.0
        self._lock = threading.Lock()
        self.lost = threading.Event()
        self.refusing = False
        self.partitioned = False
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="sf-proxy-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def lose_reply_to_next(self, min_bytes: int = 200, apply_wait: float = 0.5) -> None:
        """Arm: the next client packet of at least *min_bytes* is forwarded, and after
        *apply_wait* seconds the connection is cut before any reply reaches the client."""
        with self._lock:
            self._armed_min, self._apply_wait = min_bytes, apply_wait
            self.lost.clear()

    def refuse(self, on: bool) -> None:
        """While on, cut every connection and refuse new ones (the server looks away)."""
        self.refusing = on
        if on:
            self._cut_all()

    def partition(self, on: bool) -> None:
        """While on, forward nothing and answer no new connection; off: cut every
        connection (those held across the partition are dead to their clients)."""
        self.partitioned = on
        if not on:
            self._cut_all()

    def _cut_all(self) -> None:
        for s in list(self._conns):
            try:
                s.close()
            except OSError:
                pass
        self._conns.clear()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            if self.partitioned:
                self._conns.append(client)  # held, never answered, cut when healed
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True,
                             name="sf-proxy-pump").start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        socks = [client, server]
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select(socks, [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if self.partitioned:
                        continue  # lost in the partition
                    if s is client:
                        with self._lock:
                            armed = 0 < self._armed_min <= len(data)
                            wait = self._apply_wait
                            if armed:
                                self._armed_min = 0
                        server.sendall(data)
                        if armed:
                            time.sleep(wait)  # the server applies it; its reply is dropped
                            log.info("proxy: lost the reply to a %d-byte request", len(data))
                            self.lost.set()
                            return
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            for s in socks:
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._cut_all()
