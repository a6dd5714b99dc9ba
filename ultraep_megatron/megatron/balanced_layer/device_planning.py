"""The balanced layer's plan made on the device (``--moe-balancer-planner device``).

The gathered load ``[R, E]`` stays on the device: ultraep's trigger and plan
(``planner.device_balancer.solve_or_identity``) and this rank's reroute table
(``planner.reroute.device_reroute_table``) are queued there, the reroute and permutation read them
there, and the host half of the plan (the load, the plan, whether it was balanced) crosses in one
copy, started on a side stream once the plan is queued and read at the invocation's one wait
(``PlanHandle.wait``). Every function here is device work only: no host read, fixed shapes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import BalancerConfig, Plan
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.device_balancer import solve_or_identity
from ultraep_megatron.planner.device_solve import triton_available
from ultraep_megatron.planner.reroute import device_reroute_table


@dataclass(frozen=True, eq=False)
class DevicePlanned:
    """One invocation planned on the device, before its host half crossed.

    Attributes:
        plan: the plan (device tensors; ``threshold`` a 0-dim tensor).
        reroute_table: int64 [4, E * R + 1] on the device, ``rank_reroute``'s table.
        rows_per_source_slot: int64 [R, P] on the device (megatron's fused chunk sort reads it).
        host_half: int64 [R * E + R * S + E * R + R * R * P + 2] on the device: what crosses to the
            host (:func:`unpack_host_half`).
    """

    plan: Plan
    reroute_table: torch.Tensor
    rows_per_source_slot: torch.Tensor
    host_half: torch.Tensor


def plan_on_device(load: torch.Tensor, config: BalancerConfig, rank: int) -> DevicePlanned:
    """Plan ``load`` (int64 [R, E] on the device) for ``rank``: the plan, its reroute table and the
    host half, all queued on the device."""
    plan_, balanced = solve_or_identity(load, config)
    host_half = torch.cat(
        [
            load.reshape(-1),
            plan_.slot_expert.reshape(-1),
            plan_.quota.reshape(-1),
            plan_.physical_split.reshape(-1),
            plan_.threshold.reshape(1).to(torch.int64),
            balanced.reshape(1).to(torch.int64),
        ]
    )
    P = plan_.physical_slots_per_rank
    rows = plan_.physical_split[:, rank * P : (rank + 1) * P].contiguous()
    return DevicePlanned(plan_, device_reroute_table(plan_, load, rank), rows, host_half)


def unpack_host_half(
    host: torch.Tensor, num_ranks: int, num_experts: int, num_slots: int
) -> tuple[torch.Tensor, Plan, bool]:
    """(load [R, E], the plan, balanced) from the host copy of a :class:`DevicePlanned`'s
    ``host_half`` (views of it; ``threshold`` an int)."""
    R, E, S = num_ranks, num_experts, num_slots
    P = E // R + S
    load, slot_expert, quota, physical_split, tail = torch.split(
        host, [R * E, R * S, E * R, R * R * P, 2]
    )
    threshold, balanced = tail.tolist()  # host data
    return (
        load.view(R, E),
        Plan(slot_expert.view(R, S), quota.view(E, R), physical_split.view(R, R * P), threshold),
        bool(balanced),
    )


# ---- the self-check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SelfCheck:
    """The device planner's self-check on this rank (:func:`self_check`).

    Attributes:
        failure: why it failed (one line), ``None`` if it passed.
        seconds: wall time of the compilation and the check (synchronized).
        replicas: replicas in the reference plans of the probe loads (0 where R, S or the NVLink
            domains leave nothing to replicate).
        implementation: what planned on the device: ``triton`` (CUDA with Triton), ``torch`` (the
            lockstep torch calls: the CPU, or CUDA without Triton).
        fresh: run by this call of :func:`checked` (not its earlier outcome).
    """

    failure: Optional[str]
    seconds: float
    replicas: int
    implementation: str
    fresh: bool = True


def probe_loads(num_ranks: int, num_experts: int, config: BalancerConfig) -> List[torch.Tensor]:
    """Host int64 ``[R, E]`` loads the self-check plans, built from the model's sizes and the
    planner's settings alone (every rank builds the same):

    * a skewed load past the trigger, with what the greedy's branches depend on in every NVLink
      domain: its first rank far over the mean and its second over it (two ranks shed, the first
      into several hosts), its last idle (the largest host), the others light; within a rank
      the experts' loads fall with their index (the hottest replicated first, and topped up); every
      source routes its own mix (the reroute tables differ by rank). Tokens come in units of 64
      times the quota floor, so replicas clear it; the skew doubles until the host trigger fires;
    * the uniform load, below every trigger: the device must select the unbalanced plan.
    """
    R, E = num_ranks, num_experts
    G, N = E // R, config.domain_size or num_ranks
    unit = 64 * (config.min_quota or 1)
    position = torch.arange(R) % N  # a rank's place in its NVLink domain
    rank_weight = torch.ones(R, dtype=torch.int64)
    rank_weight[position == N - 1] = 0 if N > 2 else 1
    rank_weight[position == 1] = 3
    experts = torch.arange(E)
    expert_weight = G - experts % G
    source_mix = 1 + (torch.arange(R).view(R, 1) + experts.view(1, E)) % 3
    host = config.build()
    for hot in (8, 16, 32, 64, 128):
        rank_weight[position == 0] = hot
        skewed = unit * rank_weight[experts // G].view(1, E) * expert_weight.view(1, E) * source_mix
        if host.balances(skewed):
            break
    return [skewed, torch.full((R, E), unit, dtype=torch.int64)]


def _same(name: str, device_tensor: torch.Tensor, reference: torch.Tensor) -> Optional[str]:
    device_tensor = device_tensor.cpu()
    if device_tensor.shape != reference.shape or not torch.equal(device_tensor, reference):
        return name
    return None


def _compare(
    load: torch.Tensor, config: BalancerConfig, rank: int, device: torch.device
) -> tuple[list, int]:
    """(what the device planner got wrong on ``load``, replicas in the reference plan)."""
    R, E = load.shape
    S = config.num_slots
    planned = plan_on_device(load.to(device), config, rank)
    host = config.build()
    balanced = host.balances(load)
    # The reference: the device planner's search with the greedy's specification (the same plan
    # bit for bit), or the unbalanced plan below the trigger.
    reference = (
        planner.device_solve(
            load,
            S,
            min_quota=config.min_quota,
            domain_size=config.domain_size,
            implementation="reference",
        )
        if balanced
        else baselines.identity_plan(load, S)
    )
    half_load, half_plan, half_balanced = unpack_host_half(planned.host_half.cpu(), R, E, S)
    differing = [
        None if half_balanced == balanced else "whether it balances",
        *(
            _same(field, getattr(planned.plan, field), getattr(reference, field))
            for field in ("slot_expert", "quota", "physical_split")
        ),
        None if int(planned.plan.threshold) == int(reference.threshold) else "threshold",
        _same(
            "reroute table",
            planned.reroute_table,
            torch.from_numpy(planner.rank_reroute(reference, load, rank).reroute_table),
        ),
        _same("host half (load)", half_load, load),
        *(
            _same(f"host half ({field})", getattr(half_plan, field), getattr(reference, field))
            for field in ("slot_expert", "quota", "physical_split")
        ),
    ]
    if balanced:  # and as good as the host planner's, to its threshold search's resolution
        host_max = int(host.plan(load, balances=True).threshold)
        resolution = max(1, planner.domain_lower_bound(load, config.domain_size) >> 10)
        if int(reference.threshold) > host_max + resolution:
            differing.append(
                f"max rank load {int(reference.threshold)} where the host planner's is {host_max}"
            )
    return [d for d in differing if d], int((reference.slot_expert >= 0).sum())


def self_check(
    config: BalancerConfig, num_ranks: int, num_experts: int, device: torch.device, rank: int
) -> SelfCheck:
    """Compile the device planner for this model and check it against the references on the host.

    Plans each :func:`probe_loads` load as a balanced layer does (:func:`plan_on_device`: the
    trigger, the solve, the reroute table of ``rank``, the host half, on ``device``; on CUDA the
    Triton kernels compile here) and compares, bit for bit: the plan with the device planner's
    algorithm run by the greedy's specification (``device_solve(..., implementation="reference")``),
    or the unbalanced plan below the trigger; whether it balances with the host trigger
    (``LayerBalancer.balances``); the reroute table with the host's ``rank_reroute``; the host half
    with what it packs. And the plan's max rank load must be the host planner's (``solve``) to its
    search resolution. Reads device memory: for startup only.

    Any exception (a compilation error, a launch failure) is a failure too: its type and message.
    """
    implementation = "triton" if device.type == "cuda" and triton_available() else "torch"
    t0 = time.perf_counter()
    replicas, failure = 0, None
    try:
        for load in probe_loads(num_ranks, num_experts, config):
            differing, replicated = _compare(load, config, rank, device)
            replicas += replicated
            if differing:
                failure = (
                    f"its plan of a probe load (R={num_ranks}, E={num_experts}, "
                    f"S={config.num_slots}"
                    f"{f', NVLink domains of {config.domain_size}' if config.domain_size else ''}) "
                    f"differs from the reference in: {', '.join(differing)}"
                )
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # noqa: BLE001 - any failure means: plan on the host
        message = str(error).strip().splitlines()
        failure = f"{type(error).__name__}{': ' + message[0][:300] if message else ''}"
    return SelfCheck(failure, time.perf_counter() - t0, replicas, implementation)


_CHECKED: dict = {}


def checked(
    config: BalancerConfig, num_ranks: int, num_experts: int, device: torch.device, rank: int
) -> SelfCheck:
    """:func:`self_check`, once per process for each model shape and planner setting: later
    models of the same shape get its outcome (``fresh`` False) at no cost."""
    key = (config, num_ranks, num_experts, device.type, rank)
    if key in _CHECKED:
        return dataclasses.replace(_CHECKED[key], fresh=False)
    _CHECKED[key] = check = self_check(config, num_ranks, num_experts, device, rank)
    return check
