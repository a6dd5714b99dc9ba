"""LLEP (``planner/baselines/least_loaded.py``): by hand, its trigger and its limits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_helpers import check_plan, problems, SETTINGS
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.baselines import Placement, llep
from ultraep_megatron.planner.baselines.placement import main_moves


def test_llep_by_hand():
    """R=2, G=2, capacity 1.0 * 1000 / 2 = 500, m = 50. Expert 0 (500, home 0): rank 0 still has
    expert 1 (300) pending, so it takes 200 and spills 300 to rank 1 (room 500 - 200 pending).
    Experts 1, 2, 3 fit at home. Source order fills the chunks: source 0's first 200 tokens of
    expert 0 stay on rank 0, its last 50 and all of source 1's go to rank 1."""
    load = torch.tensor([[250, 150, 50, 50], [250, 150, 50, 50]])
    plan = llep(load, capacity_factor=1.0, min_tokens_per_gemm=50)
    check_plan(load, plan, 1, check_min_quota=False, check_locality=False)
    assert plan.slot_expert.tolist() == [[-1], [0]]
    assert plan.quota.tolist() == [[200, 300], [300, 0], [0, 100], [0, 100]]
    assert plan.split[:, 0].tolist() == [[200, 50], [0, 250]]


def test_llep_floor_is_not_hard_for_the_last_chunk():
    """m = 400 > the 300-token spill: LLEP skips chunks below m only when more remains, so the last
    one goes through anyway."""
    load = torch.tensor([[250, 150, 50, 50], [250, 150, 50, 50]])
    plan = llep(load, capacity_factor=1.0, min_tokens_per_gemm=400)
    assert plan.quota[0].tolist() == [200, 300]


def test_llep_trigger():
    """Rank loads 625 / 375 (imbalance 1.25): below lambda = 1.3 nothing moves; with lambda = 1.2
    LLEP balances to its capacity."""
    load = torch.tensor([[300, 325, 200, 175]])
    load = torch.cat([load, torch.zeros_like(load)])
    identity = llep(load, trigger=1.3)
    assert identity.slot_expert.shape == (2, 0)
    assert torch.equal(identity.quota, baselines.identity_plan(load, 0).quota)
    balanced = llep(load, trigger=1.2, min_tokens_per_gemm=1)
    assert balanced.threshold == int(1.1 * 500) and balanced.slot_expert.numel() > 0
    assert torch.equal(llep(load, trigger=None, min_tokens_per_gemm=1).quota, balanced.quota)


@settings(max_examples=300, **SETTINGS)
@given(problems(max_ranks=8), st.sampled_from([0.8, 1.0, 1.1, 1.5]), st.sampled_from([0, 1, 7, 50]))
def test_llep_conserves_load_keeps_mains_and_respects_its_limits(problem, alpha, m):
    load, _, _ = problem
    R, E = load.shape
    plan = llep(load, capacity_factor=alpha, min_tokens_per_gemm=m, trigger=None)
    # conservation, tokens only to instances, one instance per rank, mains at home
    check_plan(
        load,
        plan,
        plan.num_slots,
        check_min_quota=False,
        check_locality=False,
        check_no_worse=False,
    )
    assert main_moves(Placement.from_plan(plan)) == 0
    total = int(load.sum())
    capacity = max(int(alpha * (total // R)) if total // R else total, 1)
    quota, slot_expert = plan.quota.numpy(), plan.slot_expert.numpy()
    # the floor binds all but the last spilled chunk of an expert
    for e in range(E):
        small = [t for t in range(R) if e in slot_expert[t] and quota[e, t] < m]
        assert len(small) <= 1
    # the capacity binds whenever it can hold the load and no chunk below m must be skipped
    if m <= 1 and capacity * R >= total:
        assert plan.threshold <= capacity
