#!/usr/bin/env python3
"""Print memcached's `stats settings` from 127.0.0.1."""
import socket

with socket.create_connection(("127.0.0.1", 11211), timeout=5) as sock:
    sock.sendall(b"stats settings\r\n")
    data = b""
    for _ in range(50):  # bounded
        if data.endswith(b"END\r\n"):
            break
        data += sock.recv(65536)
print(data.decode())
