# Filters the shards role uses; the arithmetic lives in the shardfleet library.

from __future__ import annotations

from ansible.errors import AnsibleFilterError

try:
    from shardfleet.errors import ShardfleetError
    from shardfleet.shardmap import even_split
except ImportError:  # pragma: no cover
    even_split = None


def shard_split(pairs, first=0, last=4095):
    """``{pair: [first, last]}`` for the sorted pair names, spread evenly."""
    if even_split is None:
        raise AnsibleFilterError("the shardfleet library is not installed on the controller")
    names = sorted(set(pairs))
    try:
        return {p: list(r) for p, r in zip(names, even_split(int(first), int(last), len(names)),
                                           strict=True)}
    except ShardfleetError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"shard_split": shard_split}
