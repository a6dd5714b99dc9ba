"""DeepSeek's re-placing EPLB (``planner/baselines/deepseek.py``) against its rules and by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from planner_helpers import copy_counts, domain_problems, holdings, SETTINGS
from ultraep_megatron.planner.baselines import deepseek_eplb, placement_metrics
from ultraep_megatron.planner.baselines.placement import (
    cross_domain_copies,
    main_moves,
    weight_copies,
)


def minimax_per_copy(lam: np.ndarray, num_physical: int) -> float:
    """min over copy counts c_e >= 1 with sum c = num_physical of max_e lam_e / c_e (no cap), by
    trying every candidate value lam_e / c."""
    if lam.max() == 0:
        return 0.0
    for value in sorted({x / c for x in lam.tolist() for c in range(1, num_physical + 1) if x}):
        needed = sum(max(1, math.ceil(x / value - 1e-9)) for x in lam.tolist())
        if needed <= num_physical:
            return value
    raise AssertionError


@settings(max_examples=300, **SETTINGS)
@given(domain_problems(max_ranks=8))
def test_deepseek_eplb_places_all_physical_experts_and_computes_the_load(problem):
    load, S, _, N = problem
    R, E = load.shape
    G = E // R
    placement = deepseek_eplb(load, S)
    layout = placement.physical_expert.numpy()
    split = placement.split.numpy()
    # every rank holds exactly G + S physical experts, every expert at least one copy
    assert layout.shape == (R, G + S) and (layout >= 0).all() and (layout < E).all()
    ranks = holdings(layout, E)
    assert all(ranks[e] for e in range(E))
    # conservation, and tokens only where the expert's weights are
    assert np.array_equal(split.sum(2), load.numpy()) and (split >= 0).all()
    for e in range(E):
        assert split[:, e, [t for t in range(R) if t not in ranks[e]]].sum() == 0
    # round-robin over the copies in physical order: source s's i-th copy gets load // n + extra
    for s in range(R):
        for e in range(E):
            n = len(ranks[e])
            expected = np.zeros(R, np.int64)
            for i, t in enumerate(ranks[e]):
                expected[t] += load[s, e].item() // n + ((i - s) % n < load[s, e].item() % n)
            assert np.array_equal(split[s, e], expected)
    # EPLB's replication minimizes the largest load per copy
    lam = load.sum(0).numpy()
    counts = np.array([len(ranks[e]) for e in range(E)])
    assert max(lam / counts) == pytest.approx(minimax_per_copy(lam, R * (G + S)))
    # the copy counters agree with plain loops
    copies, moves, cross = copy_counts(layout, E, N)
    assert (weight_copies(placement), main_moves(placement), cross_domain_copies(placement, N)) == (
        copies,
        moves,
        cross,
    )


def test_deepseek_eplb_by_hand():
    """R=2, G=2, S=1: 6 physical experts. Replication: expert 0 (100) gets both extra copies
    (100/2 = 50 > 40). Copies by descending load per copy: e3 (40) -> rank 0; the three e0 copies
    (33.3): rank 1, rank 1 (33.3 < 40), rank 0 (40 < 66.7); e1 (10) -> rank 1 (66.7 < 73.3); e2 ->
    rank 0, the only one with room. Rank 1 holds expert 0 twice; experts 1, 2 and 3 left home."""
    load = torch.tensor([[100, 10, 10, 40], [0, 0, 0, 0]])
    placement = deepseek_eplb(load, 1)
    assert placement.physical_expert.tolist() == [[3, 0, 2], [0, 0, 1]]
    # source 0's 100 tokens of expert 0 round-robin over its copies (rank 0, rank 1, rank 1)
    assert placement.split[0, 0].tolist() == [34, 66]
    assert (weight_copies(placement), main_moves(placement)) == (4, 3)
    m = placement_metrics(load, placement)
    assert m["imbalance_after"] == pytest.approx(84 / 80) and m["max_fanout"] == 2


def test_deepseek_hierarchical_keeps_groups_inside_nodes():
    """4 groups of 2 experts packed to 2 nodes of 2 ranks by descending group load: groups 3 (90)
    -> node 0, 0 (60) -> node 1, 1 (40) -> node 1, 2 (10) -> node 0. All copies of a group's
    experts stay in its node; the global policy is free to cross."""
    lam = [50, 10, 20, 20, 5, 5, 45, 45]  # groups: 60, 40, 10, 90
    load = torch.tensor([lam, [0] * 8, [0] * 8, [0] * 8])
    placement = deepseek_eplb(load, 2, num_groups=4, num_nodes=2)
    node_of_group = {3: 0, 0: 1, 1: 1, 2: 0}
    layout = placement.physical_expert.numpy()
    for e, ranks in enumerate(holdings(layout, 8)):
        assert {t // 2 for t in ranks} == {node_of_group[e // 2]}
    assert cross_domain_copies(placement, 2) == copy_counts(layout, 8, 2)[2] > 0  # groups moved
    # num_groups not a multiple of num_nodes: EPLB falls back to the global policy
    assert torch.equal(
        deepseek_eplb(load, 2, num_groups=3, num_nodes=2).physical_expert,
        deepseek_eplb(load, 2).physical_expert,
    )
