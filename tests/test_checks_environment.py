"""Lab 0's exercise on the engine: the solution passes, every named mistake is named, the placeholder is not."""

import exercise_harness as harness

from utils.checks import environment

LAB = "lab0_example"
EXERCISES = [environment.ACCURACY]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)
