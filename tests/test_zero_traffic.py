"""The ZeRO paper's communication per stage (utils.parallel.shard.zero_traffic), against the
paper's own counts (Rajbhandari et al., arXiv 1910.02054, section 7.2: DDP 2 psi, stages 1 and 2
2 psi, stage 3 3 psi, for psi parameters) and hand-computed ring bytes."""

import pytest

from utils.parallel import shard


@pytest.mark.parametrize("n", [2, 4, 8, 1024])
def test_stages_1_and_2_move_what_ddp_moves_and_stage_3_half_as_much_again(n):
    psi = 1_000_000.0  # bytes of gradients (= of parameters, at one precision)
    sent = {s: shard.zero_traffic(psi, n, s)["sent"] for s in range(4)}
    ring = (n - 1) / n  # a ring sends (N-1)/N of the buffer per pass
    paper = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi, 3: 3 * psi}  # the paper's volumes (section 7.2)
    for s in range(4):
        assert sent[s] == pytest.approx(ring * paper[s])
    assert sent[1] == sent[2] == pytest.approx(sent[0])
    assert sent[3] == pytest.approx(1.5 * sent[0])


def test_by_hand_and_the_collectives_named():
    # 4 ranks, 100 bytes: an all-reduce sends 2 * 3/4 * 100 = 150, an all-gather or reduce-scatter 75
    assert shard.zero_traffic(100, 4, 0) == {"calls": {"all_reduce": 1}, "sent": 150}
    assert shard.zero_traffic(100, 4, 2) == {"calls": {"reduce_scatter": 1, "all_gather": 1}, "sent": 150}
    assert shard.zero_traffic(100, 4, 3) == {"calls": {"reduce_scatter": 1, "all_gather": 2}, "sent": 225}
    with pytest.raises(ValueError, match="stage"):
        shard.zero_traffic(100, 4, 4)
