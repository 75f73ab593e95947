"""Operations on the fleet: each a table of steps on one runner.

    runner.py   steps, journal, resume, locks + fencing, registry, check mode

Operation modules hold their step table, not a framework, and no operation
imports another; ``shardfleet.ops`` is the runner's earlier import path.
"""
