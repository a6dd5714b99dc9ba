"""The balanced layer's plan made on the device (``--moe-balancer-planner device``).

The gathered load ``[R, E]`` stays on the device: ultraep's trigger, ``planner.device_solve`` and
this rank's reroute table (a torch form of ``planner.rank_dispatch``'s) are queued there, the reroute
and permutation read them there, and the host half of the plan (the load, the plan, whether it was
balanced) crosses in one copy, started on a side stream once the plan is queued and waited for where
megatron's dispatcher waits for its splits anyway (``dispatchers._PhysicalSlotRouting._complete_plan``). Every function here is device work only:
no host read, fixed shapes.

Vocabulary (docs/glossary.md): R EP ranks, E experts, G = E // R main experts per rank, S redundant
slots per rank, P = G + S physical slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import BalancerConfig, Plan
from ultraep_megatron.planner.solve import DEFAULT_MIN_QUOTA_DIVISOR

_INT64_MAX = torch.iinfo(torch.int64).max

#: Where a balanced layer plans (``--moe-balancer-planner``).
PLANNERS = ("host", "device")


@dataclass(frozen=True, eq=False)
class DevicePlanned:
    """One invocation planned on the device, before its host half crossed.

    Attributes:
        plan: the plan (device tensors; ``threshold`` a 0-dim tensor).
        reroute_table: int64 [4, E * R + 1] on the device, ``rank_dispatch``'s table.
        rows_per_source_slot: int64 [R, P] on the device (megatron's fused chunk sort reads it).
        host_half: int64 [R * E + R * S + E * R + R * R * P + 2] on the device: what crosses to the
            host (:func:`unpack_host_half`).
        training / grad_enabled: the layer's mode when it was planned.
        plan_seconds: host time spent queuing the plan.
    """

    plan: Plan
    reroute_table: torch.Tensor
    rows_per_source_slot: torch.Tensor
    host_half: torch.Tensor
    training: bool
    grad_enabled: bool
    plan_seconds: float


def balances(load: torch.Tensor, config: BalancerConfig) -> torch.Tensor:
    """``LayerBalancer.balances`` on the device: a 0-dim bool tensor, the same answer."""
    R, E = load.shape
    rank_load = load.sum(0).view(R, E // R).sum(1)
    total, maximum = rank_load.sum(), rank_load.max()
    if config.trigger is not None:  # float64 max / mean, as on the host; 1.0 for an empty load
        imbalance = torch.where(total > 0, maximum.double() / (total.double() / R), 1.0)
        return imbalance >= config.trigger
    if config.min_quota is not None:
        min_quota = torch.full_like(total, config.min_quota)
    else:  # planner.solve.default_min_quota: max(1, ceil(total / (100 R)))
        divisor = DEFAULT_MIN_QUOTA_DIVISOR * R
        min_quota = torch.clamp(torch.div(total + divisor - 1, divisor, rounding_mode="floor"), min=1)
    return (total > 0) & (R * maximum - total >= R * min_quota)


def identity_plan(load: torch.Tensor, num_slots: int) -> Plan:
    """``planner.baselines.identity_plan(load, num_slots)`` on the device."""
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


def plan(load: torch.Tensor, config: BalancerConfig) -> tuple[Plan, torch.Tensor]:
    """ultraep's ``LayerBalancer.plan`` on the device: (the plan, whether the load was balanced, a
    0-dim bool tensor). Below the trigger the identity plan, as on the host; both are computed and
    one is selected on the device (no host branch on device data)."""
    balanced = balances(load, config)
    # On the CPU the reference's torch calls, as a device runs them (no host read, fixed step
    # counts): the CPU backend exercises the device path as CUDA takes it.
    solved = planner.device_solve(load, config.num_slots, min_quota=config.min_quota,
                                  domain_size=config.domain_size,
                                  implementation="auto" if load.is_cuda else "torch")
    identity = identity_plan(load, config.num_slots)
    chosen = [torch.where(balanced, a, b) for a, b in
              ((solved.slot_expert, identity.slot_expert), (solved.quota, identity.quota),
               (solved.physical_split, identity.physical_split), (solved.threshold, identity.threshold))]
    return Plan(*chosen), balanced


def reroute_table(plan_: Plan, load: torch.Tensor, rank: int) -> torch.Tensor:
    """``planner.rank_dispatch(plan, load, rank).reroute_table`` on the device: int64
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


def plan_on_device(load: torch.Tensor, config: BalancerConfig, rank: int, *, training: bool,
                   grad_enabled: bool, plan_seconds: float = 0.0) -> DevicePlanned:
    """Plan ``load`` (int64 [R, E] on the device) for ``rank``: the plan, its reroute table and the
    host half, all queued on the device."""
    R, E = load.shape
    plan_, balanced = plan(load, config)
    P = plan_.physical_slots_per_rank
    host_half = torch.cat([load.reshape(-1), plan_.slot_expert.reshape(-1), plan_.quota.reshape(-1),
                           plan_.physical_split.reshape(-1), plan_.threshold.reshape(1).to(torch.int64),
                           balanced.reshape(1).to(torch.int64)])
    return DevicePlanned(plan_, reroute_table(plan_, load, rank),
                         plan_.physical_split[:, rank * P:(rank + 1) * P].contiguous(), host_half,
                         training, grad_enabled, plan_seconds)


def unpack_host_half(host: torch.Tensor, num_ranks: int, num_experts: int,
                     num_slots: int) -> tuple[torch.Tensor, Plan, bool]:
    """(load [R, E], the plan, balanced) from the host copy of a :class:`DevicePlanned`'s
    ``host_half`` (views of it; ``threshold`` an int)."""
    R, E, S = num_ranks, num_experts, num_slots
    P = E // R + S
    load, slot_expert, quota, physical_split, tail = torch.split(host, [R * E, R * S, E * R, R * R * P, 2])
    threshold, balanced = tail.tolist()  # host data
    return (load.view(R, E), Plan(slot_expert.view(R, S), quota.view(E, R), physical_split.view(R, R * P),
                                  threshold), bool(balanced))
