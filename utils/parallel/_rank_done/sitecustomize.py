"""Loaded into each rank that ``parallel.torchrun`` starts (this folder is first on its
PYTHONPATH): when the rank's script has run to its end, it leaves a marker, so that the launcher
can tell a rank that gloo's teardown aborted at interpreter exit, after its work, from a rank that
failed.

The marker ``rank{RANK}`` (it holds WORLD_SIZE) is written in the last exit handler, only when no
exception ended the script and ``sys.exit`` was not called with a failing status (a bare
``raise SystemExit(2)`` goes unseen). Standard library only. Processes without RANK (torchrun's agent) are left alone, and the ranks' own children never
see the variable. Any other ``sitecustomize`` further down the path still runs.
"""

import os
import sys


def _install(folder: str) -> None:
    import atexit

    rank, world = os.environ["RANK"], os.environ.get("WORLD_SIZE", "")
    marker = os.path.join(folder, f"rank{rank}")
    if os.path.exists(marker):
        os.unlink(marker)  # a restarted rank: the previous attempt's marker is not this one's
    status = []
    real_exit = sys.exit

    def recording_exit(code=None):
        status.append(code)
        real_exit(code)

    def finished() -> None:  # registered first, so it runs after every other exit handler
        if getattr(sys, "last_value", None) is None and all(c in (None, 0) for c in status):
            with open(marker, "w") as f:
                f.write(world)

    sys.exit = recording_exit
    atexit.register(finished)


def _next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":
    if os.environ.get("LAB_RANK_DONE_DIR") and "RANK" in os.environ:
        _install(os.environ.pop("LAB_RANK_DONE_DIR"))
    _next_sitecustomize()
