"""Lab 3's exercises on the engine: each solution passes, each named mistake is named, each placeholder
is not implemented; the rank-run ones on real processes (slow)."""

import exercise_harness as harness
import pytest

from utils.checks import ddp

LAB = "lab3_ddp"
IN_NOTEBOOK = [ddp.SHARD_BATCHES, ddp.SAVE_ON_RANK0]
ON_RANKS = [ddp.RING_ALL_REDUCE, ddp.AVERAGE_GRADIENTS, ddp.OVERLAP_DDP, ddp.OVERLAP_TRACE]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, IN_NOTEBOOK)
test_ranked_solution, test_ranked_mistake, test_ranked_placeholder = (
    pytest.mark.slow(t) for t in harness.tests_for(LAB, ON_RANKS)
)
