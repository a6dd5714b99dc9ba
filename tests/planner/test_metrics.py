"""Balance metrics (``planner/metrics.py``): by hand, against plain loops, one imbalance formula."""

from __future__ import annotations


import torch
from hypothesis import HealthCheck, given, settings

from planner_helpers import domain_problems
from ultraep_megatron import planner
from ultraep_megatron.planner import metrics, solve
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.baselines import eplb_exact, identity_plan
from ultraep_megatron.planner.plan import plan_from_split


def test_metrics_by_hand():
    # R=2, G=1, S=1: expert 0 (home rank 0) gets 6 tokens from source 0 and 2 from source 1; a
    # replica on rank 1 takes source 1's 2 tokens locally and 2 of source 0's.
    load = torch.tensor([[6, 0], [2, 0]])
    split = torch.zeros(2, 2, 2, dtype=torch.int64)
    split[0, 0, 0], split[0, 0, 1], split[1, 0, 1] = 4, 2, 2
    plan = plan_from_split(torch.tensor([[-1], [0]]), split)
    assert metrics(load, plan) == {
        "imbalance_before": 2.0,
        "imbalance_after": 1.0,
        "memory_spread_before": 2.0,
        "memory_spread_after": 1.0,
        "threshold": 4,
        "lower_bound": 4,
        "replicas": 1,
        "max_fanout": 2,
        "max_replicas_per_home": 1,
        "cross_domain_replicas": 0,
        "inflight_ratio": 0.25,
        "min_replica_quota": 4,
    }
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
    before = [
        sum(counts[s][e] for s in range(R) for e in range(t * G, (t + 1) * G)) for t in range(R)
    ]
    after = [sum(quota[e][t] for e in range(E)) for t in range(R)]
    replicas = [(t, e) for t in range(R) for e in slots[t] if e >= 0]
    per_expert = [sum(1 for _, e in replicas if e == x) for x in range(E)]
    total = sum(map(sum, counts))
    local = sum(split[s][s * P + j] for s in range(R) for j in range(P))
    return {
        "imbalance_before": imbalance(before),
        "imbalance_after": imbalance(after),
        "memory_spread_before": imbalance(before),
        "memory_spread_after": imbalance(after),
        "threshold": plan.threshold,
        "lower_bound": -(-total // R),
        "replicas": len(replicas),
        "max_fanout": 1 + max(per_expert),
        "max_replicas_per_home": max(sum(per_expert[r * G : (r + 1) * G]) for r in range(R)),
        "cross_domain_replicas": sum(1 for t, e in replicas if t // N != e // (G * N)),
        "inflight_ratio": 1.0 - local / total if total else 0.0,
        "min_replica_quota": min(quota[e][t] for t, e in replicas) if replicas else None,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(domain_problems())
def test_metrics_against_plain_loops(problem):
    """Every figure of ``metrics`` (a compiled pass) equals the loops', value and type."""
    load, S, min_quota, N = problem
    for plan in (
        solve(load, S, min_quota=min_quota, domain_size=N),
        eplb_exact(load, S),
        identity_plan(load, S),
    ):
        got, expected = metrics(load, plan, domain_size=N), metrics_by_loops(load, plan, N)
        assert got == expected
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}


def test_one_imbalance_formula():
    load = torch.tensor([[3, 1, 0, 0], [0, 0, 0, 0]])
    assert planner.load_imbalance(torch.tensor([6.0, 2.0])).item() == 1.5
    assert planner.load_imbalance(torch.zeros(2, 3)).tolist() == [1.0, 1.0]
    m = planner.metrics(load, baselines.identity_plan(load))
    assert m["imbalance_before"] == m["imbalance_after"] == 4 / 2
    from ultraep_megatron.megatron.run import telemetry

    assert telemetry.load_imbalance is planner.load_imbalance
