"""The fixed-layout baselines (``planner/baselines/fixed_layout.py``): identity, EPLB on history and on the exact load, round-robin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from planner_helpers import check_plan, problems
from ultraep_megatron.planner.baselines import eplb, eplb_exact, identity_plan, round_robin
from ultraep_megatron.planner.baselines.fixed_layout import eplb_slots
from ultraep_megatron.traces.synthetic import zipf_load


def minimax_load_per_instance(expert_load: np.ndarray, num_instances: int, num_ranks: int) -> float:
    """min over instance counts n (1 <= n_e <= R, sum n = num_instances) of max_e load_e / n_e,
    by trying every candidate value load_e / c."""
    best = math.inf
    for value in sorted({x / c for x in expert_load.tolist() for c in range(1, num_ranks + 1)}):
        if value <= 0:
            needed = [1 if x == 0 else math.inf for x in expert_load.tolist()]
        else:
            needed = [max(1, math.ceil(x / value - 1e-9)) for x in expert_load.tolist()]
        if max(needed) <= num_ranks and sum(needed) <= num_instances:
            best = min(best, value)
            break
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_ranks=8))
def test_eplb_exact_plan_is_valid_round_robin_and_minimax(problem):
    load, S, _ = problem
    R, E = load.shape
    G = E // R
    plan = eplb_exact(load, S)
    split = check_plan(
        load, plan, S, check_min_quota=False, check_locality=False, check_no_worse=False
    )
    slot_expert = plan.slot_expert.numpy()
    instances = [[e // G] + [t for t in range(R) if e in slot_expert[t]] for e in range(E)]
    # Round-robin: a source's tokens of an expert differ by at most one between instances.
    for e in range(E):
        per_instance = split[:, e, instances[e]]
        assert (per_instance.max(1) - per_instance.min(1) <= 1).all()
    # EPLB's rule: the instance counts minimize the max load per instance (when every replica it
    # wanted found a slot: min(R * S, E * (R - 1)) of them).
    filled = int((slot_expert >= 0).sum())
    if filled == min(R * S, E * (R - 1)):
        lam = load.sum(0).numpy()
        counts = np.array([len(h) for h in instances])
        achieved = max(lam / counts)
        assert achieved == pytest.approx(minimax_load_per_instance(lam, E + filled, R))


def test_eplb_replication_and_packing_by_hand():
    # R=2, G=2, S=1: expert 0 (100) gets the first replica; capped at R instances, the second goes
    # to expert 1 (tie at 10 broken by id). Expert 0's replica can only go to rank 1; expert 1's
    # would need rank 1 too, which is full, so it is dropped.
    load = torch.tensor([[100, 10, 10, 10], [0, 0, 0, 0]])
    assert eplb_slots(load.sum(0), 2, 1).tolist() == [[-1], [0]]
    # Expert 3 (90) gets a replica, on rank 0, the only rank without it; the second replica goes
    # to expert 0 (tie with expert 1 at 5, broken by id), on rank 1.
    assert eplb_slots(torch.tensor([5, 5, 1, 90]), 2, 1).tolist() == [[3], [0]]
    # Packing picks the least-loaded allowed rank: expert 0's first replica (25 per instance)
    # goes to idle rank 2, not to ranks 1 (25) or 3 (20).
    assert eplb_slots(torch.tensor([100, 50, 0, 20]), 4, 1).tolist() == [[1], [0], [0], [0]]


def test_eplb_history_forms_and_rerouting_another_load():
    history = torch.stack([zipf_load(4, 16, 3.0, seed=s) for s in range(3)])  # [H, R, E]
    current = zipf_load(4, 16, 3.0, seed=10)
    from_stack = eplb(history, 2, load=current)
    from_sum = eplb(history.sum(0), 2, load=current)
    assert torch.equal(from_stack.slot_expert, from_sum.slot_expert)
    assert torch.equal(from_stack.slot_expert, eplb_slots(history.sum((0, 1)), 4, 2))
    check_plan(
        current, from_stack, 2, check_min_quota=False, check_locality=False, check_no_worse=False
    )
    check_plan(
        history.sum(0),
        eplb(history, 2),
        2,
        check_min_quota=False,
        check_locality=False,
        check_no_worse=False,
    )
    exact = eplb_exact(current, 2)
    assert torch.equal(exact.slot_expert, eplb_slots(current.sum(0), 4, 2))


def test_identity_plan_is_the_unbalanced_routing():
    load = zipf_load(4, 8, 2.0, seed=1)
    plan = identity_plan(load, 2)
    split = check_plan(load, plan, 2, check_min_quota=False)
    assert (plan.slot_expert == -1).all()
    for e in range(8):
        assert np.array_equal(split[:, e, e // 2], load[:, e].numpy())
    assert plan.threshold == load.sum(0).view(4, 2).sum(1).max()
    # The same plan as round-robin over a layout without replicas (an independent construction).
    spread = round_robin(load, torch.full((4, 2), -1, dtype=torch.int64))
    for a, b in ((plan.quota, spread.quota), (plan.physical_split, spread.physical_split)):
        assert torch.equal(a, b)


def test_round_robin_spreads_remainders_over_instances():
    load = torch.tensor([[5, 0], [5, 0]])
    plan = round_robin(load, torch.tensor([[-1], [0]]))
    # 5 tokens over 2 instances: source 0 starts at instance 0 (main), source 1 at instance 1.
    assert plan.split[:, 0].tolist() == [[3, 2], [2, 3]]


@pytest.mark.parametrize(
    "fn",
    [
        lambda l: identity_plan(l, -1),
        lambda l: identity_plan(l - 1),
        lambda l: eplb(l, -1),
        lambda l: eplb(l.float(), 1),
        lambda l: eplb_exact(l - 1, 1),
        lambda l: eplb(l, 1, load=l - 1),
    ],
)
def test_baselines_reject_bad_input(fn):
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 4, dtype=torch.int64))
