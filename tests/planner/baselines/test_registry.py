"""The registry of every balancer's name (``planner/baselines/registry.py``): each name it lists is
wired to what it promises, checked by running it, not by restating the table."""

from __future__ import annotations

import pytest
import torch

from planner_helpers import check_plan
from ultraep_megatron.analysis import plotting
from ultraep_megatron.analysis.peers import PeerConfig
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import Placement, registry
from ultraep_megatron.traces.synthetic import zipf_load

R, E, S = 4, 16, 2


def plans_after(name: str, history: list[torch.Tensor], load: torch.Tensor):
    """Balancer ``name``'s plan of ``load`` after it planned ``history`` (one MoE layer's loop)."""
    balancer = BalancerConfig(
        name,
        num_slots=S,
        trigger=1.0 if name == registry.ULTRAEP else None,
        eplb_window=2,
        eplb_interval=1,
    ).build()
    for earlier in history:
        balancer.plan(earlier)
    return balancer.plan(load)


def exact_load_balancers(loads: list[torch.Tensor], load: torch.Tensor) -> set[str]:
    """The balancers whose plan of ``load`` is the same whatever loads they planned before."""
    return {
        name
        for name in registry.MOE_BALANCERS
        if all(
            torch.equal(
                getattr(plans_after(name, [], load), field),
                getattr(plans_after(name, loads, load), field),
            )
            for field in ("slot_expert", "quota", "physical_split")
        )
    }


def test_names_and_what_is_compared():
    """Every ``--moe-balancer`` choice builds a layer's balancer that plans a skewed load validly
    (``none`` the identity, the others replicating); the ideal plans nothing; what replay compares
    is the choices and the ideal; ``EXACT_LOAD`` is exactly the set whose plan depends on the
    current load alone (``eplb`` plans from its history), found by planning after other loads; each
    peer balances through its baseline."""
    load = zipf_load(R, E, 3.0, seed=0)
    for name in registry.MOE_BALANCERS:
        plan = plans_after(name, [], load)
        exact = (
            name == registry.ULTRAEP
        )  # the quota floor, locality and no-worse are ultraep's promises
        check_plan(
            load,
            plan,
            plan.slot_expert.shape[1],
            check_min_quota=exact,
            check_locality=exact,
            check_no_worse=exact,
        )
        assert bool((plan.slot_expert >= 0).any()) == (name != registry.NONE), name
        assert registry.describe(name)
    assert BalancerConfig(registry.IDEAL).build().plan(load) is None and registry.describe(
        registry.IDEAL
    )
    assert set(registry.COMPARED) == set(registry.MOE_BALANCERS) | {registry.IDEAL}
    others = [zipf_load(R, E, 3.0, seed=s).flip(1) for s in (1, 2)]  # other hot experts
    assert exact_load_balancers(others, load) == registry.EXACT_LOAD | {registry.NONE}
    # Negative control: with a history equal to the load, eplb cannot be told apart.
    assert registry.EPLB in exact_load_balancers([load, load], load)
    for name in registry.PEERS:
        outcome = PeerConfig(name, num_slots=S).balance(load)
        placement = outcome if isinstance(outcome, Placement) else Placement.from_plan(outcome)
        assert torch.equal(placement.split.sum(2), load), name  # every token placed


def test_every_balancer_has_a_label_a_colour_and_a_description():
    """Every name the registry lists has a display label and a colour of its own in the comparisons'
    look (``analysis/plotting.py``), a colour no other name shares, and a description; a name
    outside the registry gets a fixed colour of the others'."""
    named = {*registry.MOE_BALANCERS, registry.IDEAL, *registry.PEERS}
    assert set(plotting.LABELS) == set(plotting.COLORS) == named
    assert len({plotting.balancer_color(name) for name in named}) == len(named)
    assert all(registry.describe(name) for name in (*registry.MOE_BALANCERS, registry.IDEAL))
    stranger = plotting.balancer_color("lplb/S=2")
    assert stranger not in plotting.COLORS.values() and stranger == plotting.balancer_color("lplb")
    with pytest.raises(KeyError):
        registry.describe("lplb")
