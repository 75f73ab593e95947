"""The split's old import path: the operation lives in :mod:`shardfleet.operations.split`
now (a package: its step table, check, clone, physical, replicate, fence, cutover,
cleanup and abort modules)."""

from shardfleet.operations.split import *  # noqa: F403
from shardfleet.operations.split import __all__  # noqa: F401
