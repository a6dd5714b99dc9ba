"""The balanced layer's plan made on the device (``--moe-balancer-planner device``).

The gathered load ``[R, E]`` stays on the device: ultraep's trigger, ``planner.device_solve`` and
this rank's reroute table (``planner.device_dispatch``) are queued there, the reroute
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
from ultraep_megatron.planner.device_dispatch import balances, identity_plan, reroute_table

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
