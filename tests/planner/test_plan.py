"""The ``Plan`` (``planner/plan.py``)."""

from __future__ import annotations


import pytest
import torch

from ultraep_megatron.planner.plan import plan_from_split


def test_plan_from_split_rejects_tokens_without_instance():
    split = torch.zeros(2, 2, 2, dtype=torch.int64)
    split[0, 0, 1] = 3  # expert 0 has no instance on rank 1
    with pytest.raises(ValueError, match="without an instance"):
        plan_from_split(torch.tensor([[-1], [-1]]), split)
