"""Real servers as plain host processes, for tests and benchmarks (like kazoo.testing).

Each server runs from Debian's packages with a temporary data directory on a
free port of 127.0.0.1, and is stopped (and its directory removed) on ``stop()``.
"""

from shardfleet.testing.servers import (
    MariaDBServer,
    MemcachedServer,
    RedisServer,
    ZooKeeperServer,
    free_port,
)

__all__ = ["MariaDBServer", "MemcachedServer", "RedisServer", "ZooKeeperServer", "free_port"]
