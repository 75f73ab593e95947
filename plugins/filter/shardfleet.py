# Filters the shards role uses; the arithmetic lives in the shardfleet library.
#
# The library comes from the collection's own copy (src/, the same version as the
# modules and the bundle the shards role ships to the hosts: docs/collection.md), so an
# installed collection needs nothing pip-installed on the controller for this filter.

from __future__ import annotations

import sys
from pathlib import Path

from ansible.errors import AnsibleFilterError

_SRC = Path(__file__).resolve().parents[2] / "src"
if (_SRC / "shardfleet" / "__init__.py").is_file() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

try:
    from shardfleet.errors import ShardfleetError
    from shardfleet.shardmap import even_split
except ImportError:  # pragma: no cover
    even_split = None


def shard_split(pairs, first=0, last=4095):
    """``{pair: [first, last]}`` for the sorted pair names, spread evenly."""
    if even_split is None:
        raise AnsibleFilterError(f"the shardfleet library is neither in {_SRC} nor installed "
                                 "on the controller")
    names = sorted(set(pairs))
    try:
        return {p: list(r) for p, r in zip(names, even_split(int(first), int(last), len(names)),
                                           strict=True)}
    except ShardfleetError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"shard_split": shard_split}
