"""shardfleet: a toolkit for a hand-sharded MySQL fleet.

The library routes reads and writes for objects whose 64-bit IDs carry their own
shard (:mod:`shardfleet.ids`), using a shard map kept in ZooKeeper
(:mod:`shardfleet.shardmap`, :mod:`shardfleet.mapstore`), over ordinary MySQL
databases whose tables come from one schema file (:mod:`shardfleet.schema`).
"""

from shardfleet.errors import ShardfleetError

__version__ = "0.1.0"
__all__ = ["ShardfleetError", "__version__"]
