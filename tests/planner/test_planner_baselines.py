"""Baselines (identity, EPLB, EPLB++) and ``metrics``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from planner_invariants import check_plan
from planner_strategies import domain_problems, problems
from ultraep_megatron.planner import metrics, plan_from_split, solve
from ultraep_megatron.planner.baselines import eplb, eplb_exact, eplb_slots, identity_plan, round_robin
from ultraep_megatron.planner.synthetic import zipf_load


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
    split = check_plan(load, plan, S, check_min_quota=False, check_locality=False,
                       check_no_worse=False)
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
    check_plan(current, from_stack, 2, check_min_quota=False, check_locality=False,
               check_no_worse=False)
    check_plan(history.sum(0), eplb(history, 2), 2, check_min_quota=False, check_locality=False,
               check_no_worse=False)
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


@pytest.mark.parametrize("fn", [lambda l: identity_plan(l, -1), lambda l: identity_plan(l - 1), lambda l: eplb(l, -1),
                                lambda l: eplb(l.float(), 1), lambda l: eplb_exact(l - 1, 1),
                                lambda l: eplb(l, 1, load=l - 1)])
def test_baselines_reject_bad_input(fn):
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 4, dtype=torch.int64))


def test_metrics_by_hand():
    # R=2, G=1, S=1: expert 0 (home rank 0) gets 6 tokens from source 0 and 2 from source 1; a
    # replica on rank 1 takes source 1's 2 tokens locally and 2 of source 0's.
    load = torch.tensor([[6, 0], [2, 0]])
    split = torch.zeros(2, 2, 2, dtype=torch.int64)
    split[0, 0, 0], split[0, 0, 1], split[1, 0, 1] = 4, 2, 2
    plan = plan_from_split(torch.tensor([[-1], [0]]), split)
    assert metrics(load, plan) == {
        "imbalance_before": 2.0, "imbalance_after": 1.0, "memory_spread_before": 2.0,
        "memory_spread_after": 1.0, "threshold": 4, "lower_bound": 4, "replicas": 1,
        "max_fanout": 2, "max_replicas_per_home": 1, "cross_domain_replicas": 0,
        "inflight_ratio": 0.25, "min_replica_quota": 4}
    assert metrics(load, solve(load, 1, min_quota=1)) == metrics(load, plan)
    # one rank per domain: the replica on rank 1 of rank 0's expert crosses
    assert metrics(load, plan, domain_size=1)["cross_domain_replicas"] == 1
    zero = torch.zeros(2, 2, dtype=torch.int64)
    m = metrics(zero, identity_plan(zero, 1))
    assert m["imbalance_before"] == m["imbalance_after"] == 1.0
    assert m["inflight_ratio"] == 0.0 and m["min_replica_quota"] is None and m["replicas"] == 0


def metrics_by_loops(load: torch.Tensor, plan, N: int) -> dict:
    """``metrics`` recomputed with Python loops over the plan's lists (max / mean as max / (total / R))."""
    counts, quota, slots = load.tolist(), plan.quota.tolist(), plan.slot_expert.tolist()
    split = plan.physical_split.tolist()
    R, E = len(counts), len(counts[0])
    G, P = E // R, E // R + len(slots[0])
    imbalance = lambda rows: max(rows) / (sum(rows) / R) if sum(rows) > 0 else 1.0  # noqa: E731
    before = [sum(counts[s][e] for s in range(R) for e in range(t * G, (t + 1) * G)) for t in range(R)]
    after = [sum(quota[e][t] for e in range(E)) for t in range(R)]
    replicas = [(t, e) for t in range(R) for e in slots[t] if e >= 0]
    per_expert = [sum(1 for _, e in replicas if e == x) for x in range(E)]
    total = sum(map(sum, counts))
    local = sum(split[s][s * P + j] for s in range(R) for j in range(P))
    return {
        "imbalance_before": imbalance(before), "imbalance_after": imbalance(after),
        "memory_spread_before": imbalance(before), "memory_spread_after": imbalance(after),
        "threshold": plan.threshold, "lower_bound": -(-total // R), "replicas": len(replicas),
        "max_fanout": 1 + max(per_expert),
        "max_replicas_per_home": max(sum(per_expert[r * G:(r + 1) * G]) for r in range(R)),
        "cross_domain_replicas": sum(1 for t, e in replicas if t // N != e // (G * N)),
        "inflight_ratio": 1.0 - local / total if total else 0.0,
        "min_replica_quota": min(quota[e][t] for t, e in replicas) if replicas else None,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(domain_problems())
def test_metrics_against_plain_loops(problem):
    """Every figure of ``metrics`` (a compiled pass) equals the loops', value and type."""
    load, S, min_quota, N = problem
    for plan in (solve(load, S, min_quota=min_quota, domain_size=N), eplb_exact(load, S),
                 identity_plan(load, S)):
        got, expected = metrics(load, plan, domain_size=N), metrics_by_loops(load, plan, N)
        assert got == expected
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}


def test_plan_from_split_rejects_tokens_without_instance():
    split = torch.zeros(2, 2, 2, dtype=torch.int64)
    split[0, 0, 1] = 3  # expert 0 has no instance on rank 1
    with pytest.raises(ValueError, match="without an instance"):
        plan_from_split(torch.tensor([[-1], [-1]]), split)
