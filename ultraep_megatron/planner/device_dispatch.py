"""Device counterparts of the host planner's per-invocation helpers: the trigger
(``LayerBalancer.balances``), the unbalanced plan (``baselines.identity_plan``) and one rank's
reroute table (``rank_dispatch``). Torch calls on ``load``'s device only: no host read, fixed
shapes, the same answers (tested equal to the host functions). With ``device_solve`` they are what
a balanced layer plans with on the device.

Shapes (docs/glossary.md): R ranks, E experts, G = E // R, S redundant slots per rank, P = G + S.
"""

from __future__ import annotations

import torch

from .balancer import BalancerConfig
from .device_solve import device_min_quota
from .plan import Plan

__all__ = ["balances", "identity_plan", "reroute_table"]

_INT64_MAX = torch.iinfo(torch.int64).max


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
    quota = torch.zeros(E, R, dtype=torch.int64, device=device).scatter_(1, home.view(E, 1),
                                                                          load.sum(0).view(E, 1))
    physical = torch.zeros(R, R, G + num_slots, dtype=torch.int64, device=device)
    physical[:, :, :G] = load.view(R, R, G)
    slot_expert = torch.full((R, num_slots), -1, dtype=torch.int64, device=device)
    return Plan(slot_expert, quota, physical.view(R, R * (G + num_slots)), quota.sum(0).max())


def reroute_table(plan_: Plan, load: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank_dispatch(plan, load, rank).reroute_table`` on ``load``'s device, with no host read: int64
    [4, E * R + 1] (the rows are documented at ``planner.RankDispatch``)."""
    R, E = load.shape
    P = plan_.physical_slots_per_rank
    device = load.device
    instance_slot = plan_.instance_slot  # [E, R], -1 where none
    present = instance_slot >= 0
    slot = torch.where(present, instance_slot, 0).view(-1)  # row 1 (0 where there is no instance)
    sent = plan_.physical_split[rank]  # [R * P] rows this rank sends to each physical slot
    counts = torch.where(present.view(-1), sent.index_select(0, slot), 0)
    running = counts.cumsum(0)
    own = load[rank]
    slot_first_row = sent.cumsum(0) - sent  # the send buffer is physical-slot-major
    tail = lambda value: torch.full((1,), value, dtype=torch.int64, device=device)  # noqa: E731
    return torch.stack([
        torch.cat([running, tail(_INT64_MAX)]),
        torch.cat([slot, tail(R * P)]),
        torch.cat([own.cumsum(0) - own - 1, torch.zeros(E * R + 1 - E, dtype=torch.int64, device=device)]),
        torch.cat([slot_first_row.index_select(0, slot) - (running - counts), own.sum().view(1) + 1]),
    ])
