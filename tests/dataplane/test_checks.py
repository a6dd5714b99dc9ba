"""Input checks shared by the transfers (``checks.py``): the rank lookup of a process group."""

from __future__ import annotations

import gc

import torch.distributed as dist

from dataplane_helpers import run_world
from ultraep_megatron.dataplane import checks


def _group_ranks_on_subgroups(rank, world_size):
    upper, odd = dist.new_group([2, 3]), dist.new_group([1, 3])  # every rank creates both
    seen = {}
    for name, group, members in (("upper", upper, [2, 3]), ("odd", odd, [1, 3])):
        if rank in members:
            first = checks.group_rank(group)
            assert group in checks._group_ranks and checks.group_rank(group) == first
            seen[name] = first
    cached = len(checks._group_ranks)
    for group in (upper, odd):
        dist.destroy_process_group(group)
    del upper, odd, group
    gc.collect()
    return seen, cached, len(checks._group_ranks)


def test_group_rank_is_the_rank_in_the_group_and_not_kept_past_the_group():
    per_rank = run_world(4, _group_ranks_on_subgroups)
    assert [seen for seen, _, _ in per_rank] == [
        {},
        {"odd": (0, 2)},
        {"upper": (0, 2)},
        {"upper": (1, 2), "odd": (1, 2)},
    ]
    assert [(cached, left) for _, cached, left in per_rank] == [(0, 0), (1, 0), (1, 0), (2, 0)]
