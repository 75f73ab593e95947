"""The operation runner's old import path: everything lives in
:mod:`shardfleet.operations.runner` now (journals, fences and the registry in
:mod:`shardfleet.operations.journal`, re-exported by the runner)."""

from shardfleet.operations.runner import *  # noqa: F403
from shardfleet.operations.runner import __all__  # noqa: F401
