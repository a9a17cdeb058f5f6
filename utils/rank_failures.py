"""How a run of several ranks ended, read from what they printed: which rank failed first and with
what error, and gloo's abort at interpreter exit told apart from a failure.

One reader for every way the course starts ranks: ``parallel.launch`` (each rank's traceback and
exit code), torchrun's output (its summary, and each traceback line of rank N prefixed ``[rankN]:``
by torch.distributed) as ``parallel.torchrun`` returns it, and the grader's per-rank logs beside
torchrun's summary. Standard library only, so that every layer may import it.

When one rank fails, its peers fail moments later with errors of their own ("Connection closed by
peer", a SIGTERM from torchrun): the rank to name is the one whose error is its own.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "GLOO_EXIT_ABORT",
    "PEER_ERRORS",
    "RANK_PREFIX",
    "RankFailure",
    "by_rank",
    "exception_line",
    "exit_abort_after_success",
    "first_failure",
    "is_peer_error",
    "last_traceback",
    "torchrun_summary",
]

# What the C++ runtime prints when gloo's teardown aborts a process at interpreter exit (torch 2.13
# on a CPU, now and then), after the script's work is done.
GLOO_EXIT_ABORT = "terminate called without an active exception"

# Errors a rank raises because ANOTHER rank died or was stopped: never the first failure.
PEER_ERRORS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "remote worker crashing",
    "remote process exit",
    "communicator was aborted",
    "got signal",
    "sigterm",
)

_HEADER = "Traceback (most recent call last):"
_RANK_LINE = re.compile(r"^\[rank(\d+)\]:[ ]?(.*)$")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:[ ]?", re.M)  # torch.distributed's excepthook, on each line
_SUMMARY_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)", re.S)


@dataclass(frozen=True)
class RankFailure:
    """The rank that failed first. ``error``: the last exception line of its traceback
    (``ValueError: ...``), '' when it left none; ``traceback``: its output from its first
    traceback on, '' when none; ``exitcode``: negative for a signal, None when unknown."""

    rank: int
    error: str
    traceback: str
    exitcode: int | None


def by_rank(output: str) -> dict[int, str]:
    """Each rank's lines of torchrun's output (``[rankN]: ...``), prefix removed, indentation kept."""
    lines: dict[int, list] = {}
    for line in output.splitlines():
        m = _RANK_LINE.match(line)
        if m:
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return {r: "\n".join(ls) for r, ls in sorted(lines.items())}


def last_traceback(text: str) -> str:
    """The last Python traceback in ``text`` (``[rankN]:`` prefixes removed), to the end of the
    text; '' when there is none."""
    text = RANK_PREFIX.sub("", text)
    at = text.rfind(_HEADER)
    return text[at:] if at >= 0 else ""


def exception_line(traceback: str) -> str:
    """The exception a traceback ends with (``ValueError: batch size 0``): the first line after its
    frames that is not indented; '' when the traceback is cut short."""
    for line in traceback.splitlines()[1:]:
        if line.strip() and not line[0].isspace():
            return line.strip()
    return ""


def is_peer_error(text: str) -> bool:
    """Does this error say that another rank died or that the launcher stopped this one?"""
    low = text.lower()
    return any(p in low for p in PEER_ERRORS)


def torchrun_summary(output: str) -> tuple[int | None, dict[int, int]]:
    """torchrun's report of a failed run: (the rank it names as the root cause, {rank: exit code}
    of every rank it lists as failed); (None, {}) when the output holds no such report."""
    codes = {int(r): int(c) for r, c in _SUMMARY_ENTRY.findall(output)}
    m = _ROOT_CAUSE.search(output)
    return (int(m.group(1)) if m else None), codes


def first_failure(
    output: str = "",
    ranks: Mapping[int, str] | None = None,
    *,
    exitcodes: Mapping[int, int | None] | None = None,
    times: Mapping[int, float] | None = None,
) -> RankFailure | None:
    """The rank that failed first, or None when no rank left a sign of failing.

    ``output``: what torchrun printed (its summary, and, when ``ranks`` is None, each rank's
    traceback lines ``[rankN]: ...``). ``ranks``: each rank's own output where it is kept apart (log
    files, ``launch``'s reports). ``exitcodes``: exit codes known besides torchrun's summary;
    ``times``: when each rank reported its error.

    The order: a rank whose error is its own; else a rank that died without a Python traceback (a
    signal, a crash in native code), which explains its peers' lost connections; else a rank whose
    error says it lost a peer. Within each, torchrun's root cause, then the earliest, then the
    lowest rank."""
    root, codes = torchrun_summary(output)
    codes = {**codes, **(exitcodes or {})}
    texts = by_rank(output) if ranks is None else dict(ranks)
    own, peer, silent = [], [], []
    for r in sorted(set(texts) | set(codes)):
        code = codes.get(r)
        text = RANK_PREFIX.sub("", texts.get(r, ""))
        first, last = text.find(_HEADER), last_traceback(text)
        error = exception_line(last) if last else ""
        if error and code != 0:
            tail = last[last.find(error) :]  # the exception's whole message, over several lines too
            (peer if is_peer_error(tail) else own).append(RankFailure(r, error, text[first:], code))
        elif code not in (None, 0):
            silent.append(RankFailure(r, "", "", code))
    for group in (own, silent, peer):
        if group:
            return min(group, key=lambda f: (f.rank != root, (times or {}).get(f.rank, 0.0), f.rank))
    return None


def exit_abort_after_success(exitcode: int | None, finished: bool, output: str) -> bool:
    """Was this rank's failure gloo's abort at interpreter exit, after its work was done?

    ``finished``: evidence the launcher holds that the rank's code returned without an error (its
    result sent back, its completion marker written). Only SIGABRT with gloo's line in ``output``
    qualifies: any other exit of a finished rank is still a failure."""
    return finished and exitcode == -signal.SIGABRT and GLOO_EXIT_ABORT in output
