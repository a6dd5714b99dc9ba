"""Placements and their metrics (``planner/baselines/placement.py``), for every balancer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from planner_helpers import copy_counts, domain_problems, SETTINGS
from ultraep_megatron.planner import metrics, solve
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.baselines import Placement, deepseek_eplb, llep, placement_metrics
from ultraep_megatron.planner.baselines.placement import (
    cross_domain_copies,
    main_moves,
    weight_copies,
)
from ultraep_megatron.traces.synthetic import zipf_load


@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_placement_metrics_agree_with_plan_metrics(problem):
    load, S, min_quota, N = problem
    for plan in (solve(load, S, min_quota=min_quota, domain_size=N), baselines.eplb_exact(load, S)):
        m, p = (
            metrics(load, plan, domain_size=N),
            placement_metrics(load, Placement.from_plan(plan), domain_size=N),
        )
        for key in (
            "imbalance_before",
            "imbalance_after",
            "memory_spread_before",
            "memory_spread_after",
            "max_fanout",
            "inflight_ratio",
        ):
            assert p[key] == pytest.approx(m[key]), key
        assert (p["weight_copies"], p["main_moves"], p["cross_domain_copies"]) == (
            m["replicas"],
            0,
            m["cross_domain_replicas"],
        )


@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_memory_spread_against_plain_loops(problem):
    """Rows received per rank recomputed from ``physical_split`` and the load with loops; equal to
    the compute imbalance (a rank computes exactly the rows it receives)."""
    load, S, min_quota, N = problem
    plan = solve(load, S, min_quota=min_quota, domain_size=N)
    R, E = load.shape
    G, L = E // R, plan.physical_slots_per_rank
    physical = plan.physical_split.numpy()
    after = [sum(int(physical[s, t * L + j]) for s in range(R) for j in range(L)) for t in range(R)]
    before = [
        sum(int(load[s, e]) for s in range(R) for e in range(t * G, (t + 1) * G)) for t in range(R)
    ]
    total = int(load.sum())
    m = metrics(load, plan, domain_size=N)
    for key, rows in (("memory_spread_before", before), ("memory_spread_after", after)):
        assert m[key] == (pytest.approx(max(rows) * R / total) if total else 1.0)
    assert m["memory_spread_after"] == pytest.approx(m["imbalance_after"])
    assert m["cross_domain_replicas"] == 0


def test_memory_spread_and_copies_of_the_peers_on_zipf_load():
    """The peers on one benchmark load: DeepSeek's EPLB re-places nearly every expert (copies ~
    the physical slots off home), UltraEP copies only its replicas; every balancer's memory spread
    drops with its imbalance."""
    load = zipf_load(32, 128, 3.0, seed=2)
    ultra = Placement.from_plan(solve(load, 2))
    deepseek = deepseek_eplb(load, 2)
    lazy = Placement.from_plan(llep(load))
    fixed = Placement.from_plan(baselines.eplb_exact(load, 2))
    for placement in (ultra, deepseek, lazy, fixed):
        m = placement_metrics(load, placement, domain_size=8)
        assert m["memory_spread_after"] < m["memory_spread_before"]
        assert (m["weight_copies"], m["main_moves"], m["cross_domain_copies"]) == copy_counts(
            placement.physical_expert.numpy(), 128, 8
        )
    assert main_moves(fixed) == main_moves(ultra) == main_moves(lazy) == 0
    assert weight_copies(deepseek) > 4 * weight_copies(ultra)


@pytest.mark.parametrize(
    "call",
    [
        lambda l: deepseek_eplb(l, -1),
        lambda l: deepseek_eplb(l - 1, 1),
        lambda l: deepseek_eplb(l, 1, num_groups=0),
        lambda l: deepseek_eplb(l, 1, num_groups=3),
        lambda l: llep(l - 1),
        lambda l: llep(l, capacity_factor=0),
        lambda l: llep(l, min_tokens_per_gemm=-1),
        lambda l: cross_domain_copies(Placement.from_plan(baselines.identity_plan(l, 1)), 3),
        lambda l: placement_metrics(l + 1, Placement.from_plan(baselines.identity_plan(l, 1))),
    ],
)
def test_peers_reject_bad_input(call):
    with pytest.raises(ValueError):
        call(torch.zeros(2, 4, dtype=torch.int64))
