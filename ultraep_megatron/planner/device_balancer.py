"""``LayerBalancer``'s per-invocation steps on the device: the trigger (``LayerBalancer.balances``),
the unbalanced plan (``baselines.identity_plan``) and ultraep's plan of one invocation, solved or
unbalanced as the trigger says (``LayerBalancer.plan``). Torch calls on ``load``'s device only: no
host read, fixed shapes, the same answers (tested equal to the host's). With
``reroute.device_reroute_table`` they are what a balanced layer plans with on the device.

Shapes (docs/glossary.md): R ranks, E experts, G = E // R, S redundant slots per rank, P = G + S.
"""

from __future__ import annotations

import torch

from .balancer import BalancerConfig
from .device_solve import device_min_quota, device_solve
from .plan import Plan

__all__ = ["balances", "identity_plan", "solve_or_identity"]


def balances(load: torch.Tensor, config: BalancerConfig) -> torch.Tensor:
    """``LayerBalancer.balances`` on the device (``load`` int64 [R, E]): a 0-dim bool tensor, the same answer."""
    R, E = load.shape
    rank_load = load.sum(0).view(R, E // R).sum(1)
    total, maximum = rank_load.sum(), rank_load.max()
    if config.trigger is not None:  # float64 max / mean, as on the host; 1.0 for an empty load
        imbalance = torch.where(total > 0, maximum.double() / (total.double() / R), 1.0)
        return imbalance >= config.trigger
    min_quota = device_min_quota(total, R, config.min_quota)
    return (total > 0) & (R * maximum - total >= R * min_quota)


def identity_plan(load: torch.Tensor, num_slots: int) -> Plan:
    """``baselines.identity_plan(load, num_slots)`` on ``load``'s device, with no host read."""
    R, E = load.shape
    G = E // R
    device = load.device
    home = torch.div(torch.arange(E, device=device), G, rounding_mode="floor")
    quota = torch.zeros(E, R, dtype=torch.int64, device=device).scatter_(
        1, home.view(E, 1), load.sum(0).view(E, 1)
    )
    physical = torch.zeros(R, R, G + num_slots, dtype=torch.int64, device=device)
    physical[:, :, :G] = load.view(R, R, G)
    slot_expert = torch.full((R, num_slots), -1, dtype=torch.int64, device=device)
    return Plan(slot_expert, quota, physical.view(R, R * (G + num_slots)), quota.sum(0).max())


def solve_or_identity(load: torch.Tensor, config: BalancerConfig) -> tuple[Plan, torch.Tensor]:
    """ultraep's ``LayerBalancer.plan`` of ``load`` (int64 [R, E]) on its device: (the plan, whether
    the load was balanced, a 0-dim bool tensor). Below the trigger the identity plan, as on the
    host; both are computed and one is selected on the device (no host branch on device data)."""
    balanced = balances(load, config)
    # On the CPU the reference's torch calls, as a device runs them (no host read, fixed step
    # counts): the CPU backend exercises the device path as CUDA takes it.
    solved = device_solve(
        load,
        config.num_slots,
        min_quota=config.min_quota,
        domain_size=config.domain_size,
        implementation="auto" if load.is_cuda else "torch",
    )
    identity = identity_plan(load, config.num_slots)
    chosen = [
        torch.where(balanced, a, b)
        for a, b in (
            (solved.slot_expert, identity.slot_expert),
            (solved.quota, identity.quota),
            (solved.physical_split, identity.physical_split),
            (solved.threshold, identity.threshold),
        )
    ]
    return Plan(*chosen), balanced
