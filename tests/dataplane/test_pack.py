"""Packing of per-expert tensors into flat rows and back (``pack.py``, single process)."""

from __future__ import annotations

import pytest
import torch

from ultraep_megatron.dataplane import expert_views, pack_experts


def test_pack_concatenates_each_expert_in_order_and_casts():
    experts = [
        [torch.arange(6.0).view(2, 3) + 10 * i, torch.arange(4.0).view(4, 1) - i] for i in range(3)
    ]
    packed = pack_experts(experts, torch.float64)
    assert packed.shape == (3, 10) and packed.dtype == torch.float64
    for i in range(3):
        assert packed[i].tolist() == [float(x + 10 * i) for x in range(6)] + [
            float(x - i) for x in range(4)
        ]


def test_pack_of_parameters_does_not_track_autograd():
    experts = [[torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]]
    packed = pack_experts(experts)
    assert not packed.requires_grad and packed.grad_fn is None


def test_expert_views_invert_one_packed_row():
    shapes = [(4, 3), (3, 2)]
    expert = [torch.randn(s) for s in shapes]
    row = pack_experts([expert])[0]
    views = expert_views(row, shapes)
    assert all(torch.equal(v, t) for v, t in zip(views, expert))
    views[1].fill_(7.0)  # views share storage with the row
    assert bool((row[12:] == 7.0).all())
    with pytest.raises(ValueError, match="18 elements"):
        expert_views(torch.zeros(17), shapes)
