"""Lab 2's exercises on the engine: each solution passes, every named mistake is named, the placeholder is not."""

import statistics
import time
import timeit

import exercise_harness as harness
import pytest

from utils.checks import CheckFailed, throughput

LAB = "lab2_throughput"
EXERCISES = [throughput.STATE_BYTES, throughput.TIME_STEP, throughput.WAIT_FRACTION]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)


def _timed(read):  # a right time_step whose clock is ``read``, a function of no argument returning seconds
    def time_step(step, sync, warmup=3, repeats=5):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            sync()
            t0 = read()
            step()
            sync()
            times.append(read() - t0)
        return statistics.median(times)

    return time_step


def _timeit_repeat(step, sync, warmup=3, repeats=5):
    for _ in range(warmup):
        step()
    sync()
    return statistics.median(timeit.repeat(lambda: (step(), sync()), setup=sync, repeat=repeats, number=1))


def _default_clock(step, sync, warmup=3, repeats=5, clock=time.perf_counter):
    return _timed(clock)(step, sync, warmup, repeats)


def test_timers_on_other_wall_clocks_pass_and_cpu_time_is_named(capsys):
    for answer in (
        _timed(lambda: time.time_ns() * 1e-9),
        _timed(lambda: time.monotonic()),
        _timeit_repeat,
        _default_clock,
    ):
        throughput.check_time_step(answer)
    assert capsys.readouterr().out.count("correct") == 4
    with pytest.raises(CheckFailed, match="a clock that the check's simulated GPU does not drive"):
        throughput.check_time_step(_timed(time.process_time))
