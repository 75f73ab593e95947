"""Operations on the fleet: each a table of steps on one runner.

    runner.py    steps, the run (journal begin/step, rows), locks + fencing, check mode
    journal.py   the journal (one header, one compare-and-set write), fences, registry
    types.py     options, credentials, the report, the errors every operation shares
    split/       spec, table, check, clone, physical, replicate, fence, cutover,
                 cleanup, abort (a table of its own)
    promote/     planned, emergency (the "dead" decision's window: listening)
    rebuild.py  backup.py  restore.py  archive.py

Operation modules hold their step table, not a framework, and no operation imports
another (``tests/unit/test_layout.py``); what two share lives in the runner, the
journal, ``types``, or below (topology, replication, physical, mapstore, storage).
``shardfleet.ops``, ``shardfleet.split``, ``shardfleet.promote`` and
``shardfleet.backup`` are the earlier import paths (re-exports).
"""
