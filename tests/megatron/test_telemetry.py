"""Per-layer expert-load imbalance (``megatron/run/telemetry.py``): the per-EP-rank load and its
imbalance, by hand. (Logged on real runs: test_balanced_training.py, tests/product.)"""

import pytest
import torch

from ultraep_megatron.megatron.run.telemetry import per_rank_load
from ultraep_megatron.planner import load_imbalance


def test_per_rank_load_and_imbalance_by_hand():
    # 2 layers, 4 experts, EP=2: rank 0 holds experts 0-1, rank 1 experts 2-3.
    tokens = torch.tensor([[3.0, 1.0, 0.0, 4.0], [2.0, 2.0, 2.0, 2.0]])
    load = per_rank_load(tokens, ep_size=2)
    assert load.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    tokens[0, 0] = 8.0  # rank 0 now gets 9 of 13 tokens
    assert load_imbalance(per_rank_load(tokens, 2)).tolist() == pytest.approx([9 / 6.5, 1.0])
    assert load_imbalance(torch.zeros(1, 4)).tolist() == [1.0]
    with pytest.raises(ValueError):
        per_rank_load(tokens, ep_size=3)
