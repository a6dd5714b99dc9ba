"""``LayerBalancer``'s steps on the device (``planner/device_balancer.py``): the trigger, the
identity plan and ultraep's plan of one invocation equal the host balancer's, under every trigger
setting, on loads on both sides of the trigger."""

from __future__ import annotations

import pytest
import torch

from planner_helpers import host_balancer_cases
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.device_balancer import solve_or_identity


@pytest.mark.parametrize(
    "trigger,min_quota",
    [(None, None), (None, 1), (None, 10**6), (1.0, None), (1.5, 1), (50.0, None)],
)
def test_device_plan_equals_the_host_balancer(trigger, min_quota):
    config = BalancerConfig("ultraep", num_slots=2, min_quota=min_quota, trigger=trigger)
    seen = set()
    for candidate, balanced, expected in host_balancer_cases(config):
        plan, device_balanced = solve_or_identity(candidate, config)
        seen.add(balanced)
        assert bool(device_balanced) == balanced
        for field in ("slot_expert", "quota", "physical_split"):
            assert torch.equal(getattr(plan, field), getattr(expected, field)), field
        assert int(plan.threshold) == expected.threshold
    if (trigger, min_quota) == (None, None):
        assert seen == {True, False}, "the loads must fall on both sides of the trigger"
