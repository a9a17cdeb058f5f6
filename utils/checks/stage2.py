"""Self-checks for stage 2: throughput (lab2)."""
from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401
