"""Lab 2's exercises on the engine: each solution passes, every named mistake is named, the placeholder is not."""

import exercise_harness as harness

from utils.checks import throughput

LAB = "lab2_throughput"
EXERCISES = [throughput.STATE_BYTES, throughput.TIME_STEP, throughput.WAIT_FRACTION]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)
