"""One MoE layer's balancing loop (``planner/balancer.py``): each balancer's plan, the trigger, EPLB's history."""

from __future__ import annotations


import pytest
import torch

from ultraep_megatron import planner
from ultraep_megatron.planner.solve import default_min_quota
from ultraep_megatron.planner import BalancerConfig, LayerBalancer
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.baselines.fixed_layout import eplb_slots
from ultraep_megatron.traces.synthetic import zipf_load


def test_layer_balancer_plans_each_balancer():
    load = zipf_load(4, 16, 2.0, seed=3)
    assert LayerBalancer(BalancerConfig("ideal")).plan(load) is None
    identity = LayerBalancer(BalancerConfig("none")).plan(load)
    assert identity.num_slots == 0 and torch.equal(
        identity.quota, baselines.identity_plan(load).quota
    )
    ultraep = BalancerConfig("ultraep", num_slots=2, min_quota=8).build().plan(load)
    direct = planner.solve(load, 2, min_quota=8)
    assert torch.equal(ultraep.physical_split, direct.physical_split)
    exact = BalancerConfig("eplb-exact", num_slots=1).build().plan(load)
    assert torch.equal(exact.slot_expert, baselines.eplb_exact(load, 1).slot_expert)


def rank_loads_load(rank_loads, experts_per_rank: int = 2) -> torch.Tensor:
    """An int64 [R, R * G] load whose per-rank loads (experts at home) are ``rank_loads``: each
    rank's load split over its G experts and over the R source ranks as evenly as integers allow."""
    R, G = len(rank_loads), experts_per_rank
    per_expert = torch.tensor([[x // G + (j < x % G) for j in range(G)] for x in rank_loads]).view(
        -1
    )
    load = per_expert.unsqueeze(0) // R + (
        torch.arange(R).unsqueeze(1) < (per_expert % R).unsqueeze(0)
    )
    assert load.sum(0).view(R, G).sum(1).tolist() == list(rank_loads)
    return load.to(torch.int64)


def test_trigger_gives_the_identity_plan_below_and_the_usual_plan_above():
    """An explicit trigger X: loads whose rank imbalance (planner.rank_imbalance) is below X get the
    identity plan with the same S slots (no replica, so no transfer at all); the others the planner's
    plan, with the configured floor and domains. eplb-exact ignores it."""
    config = BalancerConfig("ultraep", num_slots=2, min_quota=4, trigger=1.3, domain_size=2)
    balancer = config.build()
    below = rank_loads_load([128, 100, 100, 72])  # max / mean = 1.28
    above = rank_loads_load([132, 100, 100, 68])  # 1.32
    assert planner.rank_imbalance(below) < 1.3 <= planner.rank_imbalance(above)
    assert not balancer.balances(below) and balancer.balances(above)
    skipped = balancer.plan(below)
    identity = baselines.identity_plan(below, 2)
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(skipped, name), getattr(identity, name)), name
    assert skipped.num_slots == 2 and not bool((skipped.slot_expert >= 0).any())
    balanced = balancer.plan(above)
    usual = planner.solve(above, 2, min_quota=4, domain_size=2)
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(balanced, name), getattr(usual, name)), name
    assert bool((balanced.slot_expert >= 0).any()), "the load above the trigger is really balanced"
    assert planner.metrics(above, balanced, domain_size=2)["cross_domain_replicas"] == 0
    # Not ultraep's: the trigger and the floor are ultraep's knobs.
    exact = BalancerConfig("eplb-exact", num_slots=2, trigger=1.3).build()
    assert exact.balances(below) and torch.equal(
        exact.plan(below).slot_expert, baselines.eplb_exact(below, 2).slot_expert
    )


@pytest.mark.parametrize("min_quota", [10, None])
def test_default_trigger_is_the_floor_over_the_mean_rank_load(min_quota):
    """By default a load is balanced iff its busiest rank's excess over the mean reaches the quota
    floor q (given, or 1 % of the mean rank load): excess q - 1 is skipped, q is balanced. (A floor
    derived from ``--moe-balancer-hardware`` reaches the planner as a given one:
    tests/megatron/test_arguments.py.)"""
    mean = 40_000
    q = min_quota if min_quota is not None else default_min_quota(4 * mean, 4)  # 1 %: 400
    balancer = BalancerConfig("ultraep", num_slots=2, min_quota=min_quota).build()
    for excess, balanced in ((q - 1, False), (q, True)):
        load = rank_loads_load([mean + excess, mean, mean, mean - excess])
        assert balancer.balances(load) == balanced, excess
        plan = balancer.plan(load)
        assert bool((plan.slot_expert >= 0).any()) == balanced
    assert not balancer.balances(torch.zeros(4, 8, dtype=torch.int64))  # nothing to balance
    # trigger 1 balances whatever the load
    assert (
        BalancerConfig("ultraep", trigger=1.0).build().balances(rank_loads_load([10, 10, 10, 10]))
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"name": "lplb"},
        {"num_slots": -1},
        {"num_slots": True},
        {"min_quota": 0},
        {"eplb_window": 0},
        {"eplb_interval": 0},
        {"trigger": 0.9},
        {"trigger": "1.2"},
        {"domain_size": 0},
    ],
)
def test_invalid_settings_are_refused_naming_the_setting(changes):
    field = next(iter(changes))
    with pytest.raises(ValueError, match="balancer" if field == "name" else field):
        BalancerConfig(**changes)


@pytest.mark.parametrize("window,interval", [(2, 3), (1, 1), (4, 2)])
def test_eplb_placement_follows_its_history(window, interval):
    """eplb re-plans every `interval` calls from the previous `window` loads (the current one on the
    first call) and spreads the current load round-robin: checked against a re-implementation."""
    loads = [zipf_load(4, 16, 1.5, seed=s) for s in range(9)]
    balancer = BalancerConfig(
        "eplb", num_slots=2, eplb_window=window, eplb_interval=interval
    ).build()
    placement = None
    for call, load in enumerate(loads):
        if call % interval == 0:
            history = loads[max(0, call - window) : call] if call else [load]
            placement = eplb_slots(torch.stack(history).sum((0, 1)), 4, 2)
        plan = balancer.plan(load)
        assert torch.equal(plan.slot_expert, placement), call
        assert torch.equal(
            plan.physical_split, baselines.round_robin(load, placement).physical_split
        )
