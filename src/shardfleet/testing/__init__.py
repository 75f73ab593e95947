"""Real servers as plain host processes, for tests and benchmarks (like kazoo.testing).

Each server runs from Debian's packages with a temporary data directory on a
free port of 127.0.0.1, and is stopped (and its directory removed) on ``stop()``.
:class:`ZooKeeperEnsemble` runs a ZooKeeper quorum (three members by default).
"""

from shardfleet.testing.servers import (
    MariaDBServer,
    MemcachedServer,
    RedisServer,
    ZooKeeperEnsemble,
    ZooKeeperMember,
    ZooKeeperServer,
    free_port,
    sigint_default,
)

__all__ = ["MariaDBServer", "MemcachedServer", "RedisServer", "ZooKeeperEnsemble",
           "ZooKeeperMember", "ZooKeeperServer", "free_port", "sigint_default"]
