"""The one reader of how ranks failed (utils/rank_failures.py), against hand-written outputs in the
formats torchrun, torch.distributed's excepthook and launch produce (the oracle: which rank a person
reading them would name, and its exception line)."""

from __future__ import annotations

import signal

from utils.rank_failures import (
    GLOO_EXIT_ABORT,
    RankFailure,
    by_rank,
    exception_line,
    exit_abort_after_success,
    first_failure,
    is_peer_error,
    last_traceback,
    torchrun_summary,
)

# torchrun's report of a rank aborted at exit (torch 2.13, copied from a run)
ABORT_SUMMARY = """terminate called without an active exception
E1126 14:10:36.592000 5414 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 5427) of binary: /venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
tr.py FAILED
-----------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_14:10:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 5427)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5427
=====================================================
"""


def _summary(root: int, root_code: int, others: dict) -> str:
    """torchrun's report: ``others`` {rank: exit code} under Failures, then the root cause."""
    entry = (
        "[{i}]:\n  time      : t\n  host      : h\n  rank      : {r} (local_rank: {r})\n  exitcode  : {c} (pid: 7)\n"
    )
    fails = "".join(entry.format(i=i, r=r, c=c) for i, (r, c) in enumerate(others.items(), 1))
    root_entry = entry.format(i=0, r=root, c=root_code)
    return f"Failures:\n{fails or '  <NO_OTHER_FAILURES>'}\nRoot Cause (first observed failure):\n{root_entry}"


OWN = (
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/tmp/ddp_train.py", line 40, in <module>\n'
    "[rank0]:     main()\n"
    '[rank0]:   File "/tmp/ddp_train.py", line 31, in main\n'
    "[rank0]:     sd = model.module.state_dict()\n"
    "[rank0]:          ^^^^^^^^^^^^\n"
    "[rank0]: AttributeError: 'Sequential' object has no attribute 'module'\n"
)
PEER = (
    "[rank1]: Traceback (most recent call last):\n"
    '[rank1]:   File "/tmp/ddp_train.py", line 33, in main\n'
    "[rank1]:     dist.barrier()\n"
    "[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\n"
)


def test_the_rank_whose_error_is_its_own_comes_before_the_root_cause_that_lost_its_peer():
    # torchrun observed rank 1 first, but rank 1 only lost its peer: rank 0's error is the cause
    out = "epoch 0: loss 1.2\n" + PEER + OWN + _summary(1, 1, {0: 1})
    first = first_failure(out)
    assert first == RankFailure(
        0,
        "AttributeError: 'Sequential' object has no attribute 'module'",
        OWN.replace("[rank0]: ", "").rstrip("\n"),
        1,
    )
    assert by_rank(out)[1].splitlines()[-1].startswith("RuntimeError: [../gloo")
    assert first_failure(PEER + _summary(1, 1, {})).rank == 1, "a peer error is named when it is all there is"


def test_among_own_errors_the_root_cause_then_the_earliest_then_the_lowest_rank():
    tb = 'Traceback (most recent call last):\n  File "w.py", line 3, in f\nValueError: rank {r} broke\n'
    ranks = {r: tb.format(r=r) for r in (0, 1, 2)}
    assert first_failure(ranks=ranks).rank == 0
    assert first_failure(ranks=ranks, times={0: 5.0, 1: 3.0, 2: 4.0}).rank == 1
    assert first_failure(_summary(2, 1, {0: 1, 1: 1}), ranks, times={0: 5.0, 1: 3.0, 2: 4.0}).rank == 2
    assert first_failure(ranks=ranks, times={0: 5.0, 1: 3.0, 2: 4.0}).error == "ValueError: rank 1 broke"


def test_a_rank_killed_without_a_traceback_explains_its_peers_lost_connections():
    out = PEER.replace("rank1", "rank0") + _summary(0, 1, {1: -9})
    assert first_failure(out) == RankFailure(1, "", "", -9)
    # launch's form: each rank's traceback kept apart, exit codes from the processes
    ranks = {0: PEER.replace("[rank1]: ", "")}
    assert first_failure(ranks=ranks, exitcodes={0: 1, 1: -9}).rank == 1
    # but an error of its own still comes first
    assert first_failure(ranks={0: OWN}, exitcodes={0: 1, 1: -9}).rank == 0


def test_a_peer_error_is_recognised_on_any_line_of_its_message():
    nccl = (
        'Traceback (most recent call last):\n  File "t.py", line 9, in <module>\n'
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited\n"
        "Last error:\nsocketProgress: Connection closed by remote peer\n"
    )
    assert first_failure(ranks={0: nccl, 1: OWN}).rank == 1
    assert is_peer_error("torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15")
    assert not is_peer_error("ValueError: batch size 0")


def test_a_traceback_printed_by_a_rank_that_exited_cleanly_is_not_a_failure():
    assert first_failure(ranks={0: OWN}, exitcodes={0: 0}) is None
    assert first_failure("all good\n") is None
    assert first_failure(ranks={0: "no traceback, still running"}) is None


def test_the_last_traceback_and_its_exception_line():
    chained = (
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\nKeyError: 'x'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File \"a.py\", line 3, in <module>\n    raise ValueError('y')\n"
        "ValueError: y\n  second line of the message\n"
        "[W1126 gloo] a warning printed after it\n"
    )
    block = last_traceback(chained)
    assert block.startswith('Traceback (most recent call last):\n  File "a.py", line 3')
    assert exception_line(block) == "ValueError: y"
    assert first_failure(ranks={0: chained}).traceback == chained, "the whole chain is shown"
    assert exception_line('Traceback (most recent call last):\n  File "a.py", line 3') == "", "cut short"
    assert last_traceback("no traceback here") == ""


def test_torchrun_summary_names_the_root_cause_and_every_failed_rank():
    assert torchrun_summary(ABORT_SUMMARY) == (1, {1: -6})
    assert torchrun_summary(_summary(0, 1, {1: -15, 2: -9})) == (0, {0: 1, 1: -15, 2: -9})
    assert torchrun_summary("no summary\n") == (None, {})


def test_only_sigabrt_with_gloo_s_line_after_a_finished_rank_is_an_exit_abort():
    abort = -signal.SIGABRT
    assert GLOO_EXIT_ABORT in ABORT_SUMMARY
    assert exit_abort_after_success(abort, True, ABORT_SUMMARY)
    assert not exit_abort_after_success(abort, False, ABORT_SUMMARY), "the rank had not finished"
    assert not exit_abort_after_success(-signal.SIGSEGV, True, ABORT_SUMMARY), "another signal"
    assert not exit_abort_after_success(1, True, ABORT_SUMMARY), "an exit status"
    assert not exit_abort_after_success(abort, True, "Aborted (core dumped)\n"), "another abort"
