"""benchmarks/_common.py: the interleaving order and the ratio summary, against hand-computed
values; every benchmark script ends with the line its docstring promises."""

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import interleave, paired_ratio, quartiles, time_table  # noqa: E402


def test_interleave_rotates_the_order_and_returns_what_each_variant_measured():
    calls = []

    def variant(name, value):
        def run():
            calls.append(name)
            return value

        return run

    times = interleave(
        {"A": variant("A", 1.0), "B": variant("B", 2.0), "C": variant("C", 3.0)}, repeats=4, warmup_rounds=1
    )
    assert calls == list("ABC" + "ABC" + "BCA" + "CAB" + "ABC"), "one warm-up round, then rotating rounds"
    assert times == {"A": [1.0] * 4, "B": [2.0] * 4, "C": [3.0] * 4}
    with pytest.raises(ValueError, match="repeats"):
        interleave({"A": variant("A", 1.0)}, repeats=0)


def test_paired_ratio_is_the_median_of_per_round_ratios():
    num, den = [2.0, 3.0, 10.0, 4.0, 7.5], [1.0, 2.0, 4.0, 4.0, 3.0]
    r = paired_ratio(num, den)
    per_round = [2.0, 1.5, 2.5, 1.0, 2.5]
    assert r.ratios == tuple(per_round) and r.n == 5
    assert r.median == statistics.median(per_round) == 2.0
    assert (r.min, r.max) == (1.0, 2.5)
    assert r.iqr == (1.5, 2.5)  # inclusive quartiles of [1, 1.5, 2, 2.5, 2.5]
    assert r.median != pytest.approx(statistics.median(num) / statistics.median(den)), (
        "the test data should tell a paired ratio from a ratio of medians"
    )
    assert str(r).startswith("2.000 (IQR 1.500-2.500, min-max 1.000-2.500, 5 repeats)")
    with pytest.raises(ValueError, match="same length"):
        paired_ratio([1.0], [1.0, 2.0])


def test_quartiles_and_table():
    assert quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert quartiles([1, 2, 3, 4, 5]) == (2.0, 3.0, 4.0)
    table = time_table({"fast": [0.001, 0.002, 0.003], "slow": [0.010, 0.020, 0.030]}, "ms")
    assert "fast" in table and "2.000" in table and "20.000" in table


@pytest.mark.parametrize(
    "script,last",
    [
        ("gpt_step.py", "ratio "),
        ("optimizer_step.py", "ratio "),
        ("train_loop_overhead.py", "ratio "),
        ("throughput.py", "speedup "),
    ],
)
def test_each_benchmark_documents_its_last_line(script, last):
    text = (ROOT / "benchmarks" / script).read_text()
    assert f'print(f"{last}' in text or f'print(f"{last}' in text, f"{script} should end with `{last}<median>`"
    assert "interleave(" in text and "paired_ratio(" in text, f"{script} should interleave and report paired ratios"
