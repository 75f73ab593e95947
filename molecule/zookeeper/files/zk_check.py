#!/usr/bin/env python3
"""ZooKeeper checks for the molecule verify step (runs inside a fleet container).

  zk_check.py mode HOST                 print the node's Mode (srvr four-letter word)
  zk_check.py rw HOSTS ZNODE            as admin ("user:password" on stdin): write ZNODE, read it back
  zk_check.py anon HOSTS ZNODE          anonymous: reading ZNODE works, creating a child is refused
"""
import socket
import sys
import time

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError


def mode(host):
    with socket.create_connection((host, 2181), timeout=5) as sock:
        sock.sendall(b"srvr")
        data = b""
        for _ in range(20):  # bounded
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    for line in data.decode().splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return "not-serving"


def client(hosts, auth=None):
    zk = KazooClient(hosts=hosts, timeout=10,
                     auth_data=[("digest", auth)] if auth else None)
    zk.start(timeout=30)
    return zk


def main():
    cmd = sys.argv[1]
    if cmd == "mode":
        print(mode(sys.argv[2]))
        return 0
    hosts, znode = sys.argv[2], sys.argv[3]
    if cmd == "rw":
        zk = client(hosts, sys.stdin.readline().strip())
        try:
            value = ("written at %f" % time.time()).encode()
            if zk.exists(znode):
                zk.set(znode, value)
            else:
                zk.create(znode, value)  # inherits nothing: the library sets child ACLs
            got, _ = zk.get(znode)
            print("read back %r" % got)
            return 0 if got == value else 1
        finally:
            zk.stop()
    if cmd == "anon":
        zk = client(hosts)
        try:
            zk.get(znode)  # anyone may read (the default read policy)
            try:
                zk.create(znode + "/anonymous-write", b"x")
            except NoAuthError:
                print("anonymous write refused (NoAuth)")
                return 0
            print("anonymous write was ACCEPTED")
            return 1
        finally:
            zk.stop()
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
