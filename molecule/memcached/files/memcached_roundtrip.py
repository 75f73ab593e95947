#!/usr/bin/env python3
"""Store an item in memcached and read it back: memcached_roundtrip.py HOST [PORT]."""
import socket
import sys

host = sys.argv[1]
port = int(sys.argv[2]) if len(sys.argv) > 2 else 11211
with socket.create_connection((host, port), timeout=5) as sock:
    sock.sendall(b"set verify 0 60 5\r\nhello\r\nget verify\r\n")
    data = b""
    for _ in range(20):  # bounded: a few reads at most
        if data.endswith(b"END\r\n"):
            break
        data += sock.recv(4096)
print(data.decode())
ok = data.startswith(b"STORED\r\n") and b"VALUE verify 0 5\r\nhello\r\n" in data
sys.exit(0 if ok else 1)
