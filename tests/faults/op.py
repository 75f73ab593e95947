"""One operation in its own process, for the fault campaign to SIGKILL at any instant.

    python tests/faults/op.py '<json>'

The JSON names the operation (``split``: ``Split.run("all")``, what playbooks/split.yml
runs; ``promote``: ``promote.promote``, what playbooks/promote.yml runs) and its
arguments (``die_after``: the name of a ``Split`` method after which the process
SIGKILLs itself, for a named schedule). The process prints ``READY`` once its
ZooKeeper session is up (the nemesis times its fault from there), then ``RESULT ok
<summary>`` or ``RESULT error <type>: <message>`` (exit 3).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def die_after(cls: type, name: str) -> None:
    """SIGKILL this process right after ``cls.name`` returns the first time (a named
    schedule: the instant a seed found, replayed exactly)."""
    real = getattr(cls, name)

    def dying(self: object, *a: object, **kw: object) -> object:
        out = real(self, *a, **kw)
        print(f"DYING after {name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(cls, name, dying)


def main() -> int:
    spec = json.loads(sys.argv[1])
    from shardfleet import promote
    from shardfleet.mapstore import ZooKeeperMapStore
    from shardfleet.split import Credentials, Split, SplitSpec

    store = ZooKeeperMapStore(spec["zk"], spec["cluster"], timeout=float(spec.get("zk_timeout",
                                                                                  5.0)))
    store.read()  # the session is up
    print("READY", time.monotonic(), flush=True)
    try:
        if spec["op"] == "split":
            if spec.get("die_after"):
                die_after(Split, spec["die_after"])
            creds = Credentials(*spec["creds"])
            with Split(store, SplitSpec(spec["source"], spec["target"], spec["standby"]),
                       creds, lock_timeout=float(spec.get("lock_timeout", 20.0))) as sp:
                res = sp.run("all")
            summary = ", ".join(f"{r.step}{'*' if r.changed else ''}" for r in res)
        else:
            opts = promote.Options(**spec["opts"])
            r = promote.promote(store, spec["pair"], spec["nodes"], mode=spec["mode"],
                                expect_master=spec.get("expect_master"), opts=opts)
            summary = f"changed={r.changed} resumed={r.resumed} steps={','.join(r.steps)}"
    except Exception as exc:  # noqa: BLE001 - reported to the campaign, which judges it
        print(f"RESULT error {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
        return 3
    finally:
        store.close()
    print(f"RESULT ok {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
