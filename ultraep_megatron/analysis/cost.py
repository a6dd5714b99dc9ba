"""The MoE-layer cost model. Every time here is an ESTIMATE.

It turns a plan into per-layer forward/backward times from a model shape and a hardware
description (``settings/hardware.py``: presets, expert shape, quota floor), following the UltraEP
objective (paper eq. 1-5):

* expert compute: the busiest rank's instances, each one GEMM of ``max((tokens + M0) * flops / F,
  weights / HBM)``: a roofline whose compute side carries a fixed cost of ``M0 =
  Hardware.gemm_overhead_tokens`` tokens per GEMM (small-M efficiency, see ``Hardware``); backward =
  2 x forward (dgrad + wgrad);
* token all-to-all: the busiest sender or receiver of remote tokens, dispatch + combine, forward and
  backward alike;
* replica transfers: the busiest sender or receiver of replica weights, over the data plane's
  transfer schedule with and without relay trees (``ultraep_megatron.dataplane.schedule``); the
  gradient reduction moves the same edges in the gradient dtype;
* scale-up domains (``Hardware.scale_up_domain``): tokens and weights between ranks of one domain move
  at ``scale_up_gbps``, across domains at ``inter_domain_gbps``; the two links run side by side, so
  a rank's traffic takes the longer of its two link times;
* where the transfers overlap, as the runtime schedules them (``megatron/balanced_layer/context.py``,
  docs/integration.md): the forward weight distribution runs while the tokens are dispatched and
  the main experts compute, and a rank's replica experts wait for it; the backward
  re-materialization runs during the combine's backward and the replicas' backward waits for it;
  the gradient reduction runs during the main experts' backward and the layer's backward ends when
  it has arrived. ``Hardware.transfer_overlap`` is the fraction of each such window a transfer
  really hides (1: the device runs the transfer concurrently with that work; 0: it runs after it,
  ``--moe-balancer-no-overlap``), computed per rank: only ranks that host replicas wait;
* plan time: given by the caller (the replay charges the measured or a fixed one to the
  exact-load balancers).

Not modelled: attention and other non-MoE work, kernel launch and latency terms, overlap of
all-to-all with compute, contention between transfers and the work they overlap, DeepEP
deduplication. Ratios between balancers are the useful output.

A balancer's outcome is a ``planner.Plan`` or, for a peer that moves main experts (DeepSeek's
EPLB), a ``planner.baselines.Placement``: both are costed the same way (instances away from their
expert's home are replicas, fed from the home).

No Megatron import; pure functions on load tensors and plans.
"""

from __future__ import annotations

from typing import Optional

import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane.schedule import ScheduleCache, build_schedule
from ultraep_megatron.planner import Plan
from ultraep_megatron.planner.baselines import Placement
from ultraep_megatron.settings.hardware import ExpertShape, Hardware

__all__ = ["ideal_cost", "layer_cost", "slot_memory_bytes"]


def slot_memory_bytes(shape: ExpertShape, num_slots: int, *, num_layers: int = 1) -> int:
    """Bytes per rank for ``num_slots`` redundant slots: weights + fp32 gradient buffers, no
    optimizer state. UltraEP shares them across layers (``num_layers=1``, paper §4.1); a layout
    with per-layer replicas (EPLB/CRAFT style) pays ``num_layers`` times as much."""
    return int(num_slots) * shape.numel * (shape.param_bytes + shape.grad_bytes) * int(num_layers)


# ---------------------------------------------------------------------------------------------
# Cost model (seconds; estimates)
# ---------------------------------------------------------------------------------------------


def _compute_seconds(
    tokens_per_instance: torch.Tensor, shape: ExpertShape, hw: Hardware
) -> torch.Tensor:
    """Forward expert compute of every instance, float64 like ``tokens_per_instance`` ([E, R] tokens
    of every instance): ``max((tokens + M0) * flops / F, weights / HBM)`` (a roofline whose compute
    side carries the GEMM's fixed cost of M0 tokens); an instance with no token costs nothing
    (grouped GEMM skips it)."""
    tokens = tokens_per_instance.to(torch.float64)
    per_token = shape.fwd_flops_per_token / hw.flops_per_s
    weight_read = shape.weight_bytes / hw.hbm_bytes_per_s
    compute = (tokens + hw.gemm_overhead_tokens) * per_token
    return torch.where(tokens > 0, torch.clamp(compute, min=weight_read), torch.zeros_like(tokens))


def _assemble(
    main: torch.Tensor,
    replica: torch.Tensor,
    a2a_one_way: float,
    wdist_direct: float,
    wdist_relay: float,
    plan_seconds: float,
    shape: ExpertShape,
    hw: Hardware,
    relay: bool,
) -> dict:
    """Layer times from each rank's forward compute of its main instances and of its replicas
    (float64 [R]), the busiest one-way token all-to-all and the weight distribution's time."""
    wdist = wdist_relay if relay else wdist_direct
    wred = wdist * shape.grad_bytes / shape.param_bytes  # the same edges, in the gradient dtype
    alpha = hw.transfer_overlap
    hosts = replica > 0  # only ranks that compute replicas wait for the transfers

    def after(window: torch.Tensor, transfer: float) -> torch.Tensor:
        """When a rank can go on: its work of ``window`` seconds has run next to a transfer of
        ``transfer`` seconds started with it, a fraction ``alpha`` of the window hiding it."""
        return torch.where(hosts, torch.maximum(window, transfer + (1.0 - alpha) * window), window)

    zero = torch.zeros_like(main)
    # Forward: dispatch + main experts next to the weight distribution, then the replicas, combine.
    fwd_experts = float((after(a2a_one_way + main, wdist) + replica).max()) if main.numel() else 0.0
    fwd = plan_seconds + fwd_experts + a2a_one_way
    # Backward: combine backward next to the re-materialization, the replicas' backward, the main
    # experts' backward next to the gradient reduction, then the dispatch backward.
    replicas_done = after(zero + a2a_one_way, wdist) + 2.0 * replica
    bwd = (
        float((replicas_done + after(2.0 * main, wred)).max()) + a2a_one_way
        if main.numel()
        else 0.0
    )
    moe_fwd = float((main + replica).max()) if main.numel() else 0.0
    moe_bwd = 2.0 * moe_fwd
    bare_fwd = plan_seconds + 2.0 * a2a_one_way + moe_fwd  # with transfers that cost nothing
    bare_bwd = 2.0 * a2a_one_way + moe_bwd
    return {
        "plan": plan_seconds,
        "wdist_direct": wdist_direct,
        "wdist_relay": wdist_relay,
        "wdist": wdist,
        "a2a_fwd": 2.0 * a2a_one_way,
        "a2a_bwd": 2.0 * a2a_one_way,
        "moe_fwd": moe_fwd,
        "moe_bwd": moe_bwd,
        "bwd_replica": wdist + wred,
        "fwd_exposed": max(0.0, fwd - bare_fwd),
        "bwd_exposed": max(0.0, bwd - bare_bwd),
        "fwd": fwd,
        "bwd": bwd,
        "total": fwd + bwd,
        "total_excl_plan": fwd + bwd - plan_seconds,
        "transfer_overlap": alpha,
    }


def _main_and_replica(
    per_instance: torch.Tensor, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R] per-instance seconds -> per-rank seconds of its main instances and of its replicas."""
    E, R = per_instance.shape
    home = torch.arange(E) // experts_per_rank
    is_main = home.unsqueeze(1) == torch.arange(R).unsqueeze(0)  # [E, R]
    return (per_instance * is_main).sum(0), (per_instance * ~is_main).sum(0)


def _busiest_link_seconds(traffic: torch.Tensor, unit_bytes: float, N: int, hw: Hardware) -> float:
    """Time of the busiest rank's remote traffic ``traffic`` [src, dst] (in units of ``unit_bytes``):
    per rank the longer of its intra-domain (``scale_up_gbps``) and inter-domain
    (``inter_domain_gbps``) link time, sending or receiving; the max over ranks."""
    R = traffic.shape[0]
    traffic = traffic.to(torch.float64) * (1 - torch.eye(R, dtype=torch.float64))
    domain = torch.arange(R) // N
    inside = domain.unsqueeze(1) == domain.unsqueeze(0)
    seconds = 0.0
    for mask, rate in ((inside, hw.link_bytes_per_s), (~inside, hw.inter_domain_bytes_per_s)):
        part = traffic * mask
        busiest = max(float(part.sum(1).max()), float(part.sum(0).max())) if R else 0.0
        seconds = max(seconds, busiest * unit_bytes / rate)
    return seconds


def _replica_edges(
    slot_expert: torch.Tensor, num_experts: int, N: int, schedules: Optional[ScheduleCache]
) -> list[tuple[torch.Tensor, int]]:
    """For the direct and the relayed schedule of a replica layout: its edges as a [src, dst] count
    matrix (what the busiest link carries follows from it) and how many cross a domain of N ranks."""
    R = slot_expert.shape[0]
    out = []
    for mode in ("off", "adaptive"):
        build = schedules.get if schedules is not None else build_schedule
        s = build(slot_expert.cpu(), num_experts, 1, relay=mode)
        counts = torch.zeros((R, R), dtype=torch.int64)
        counts.index_put_((s.edge_src, s.edge_dst), torch.ones_like(s.edge_src), accumulate=True)
        out.append((counts, int((s.edge_src // N != s.edge_dst // N).sum())))
    return out


def remote_slot_table(placement: Placement) -> torch.Tensor:
    """int64 [R, W]: the experts each rank holds away from their home, packed left (-1 padding): the
    replicas a placement needs fed from the homes, as a redundant-slot table for the data plane's schedule."""
    inst = placement.instances  # [E, R]
    E, R = inst.shape
    home = torch.arange(E) // (E // R)
    remote = (inst.cpu() & (home.unsqueeze(1) != torch.arange(R).unsqueeze(0))).T  # [R, E]
    width = int(remote.sum(1).max()) if remote.numel() else 0
    order = torch.argsort((~remote).to(torch.int8), dim=1, stable=True)[
        :, :width
    ]  # remote experts first
    table = torch.where(torch.gather(remote, 1, order), order, torch.full_like(order, -1))
    return table


def layer_cost(
    load: torch.Tensor,
    plan: Plan | Placement,
    shape: ExpertShape,
    hardware: Hardware,
    *,
    plan_seconds: float = 0.0,
    relay: bool = True,
    schedules: Optional[ScheduleCache] = None,
) -> dict:
    """Estimated seconds of one MoE layer invocation (one microbatch) under ``plan``.

    Args:
        load: int64 [R, E], the load the plan serves.
        plan: a planner Plan (``identity_plan`` for ``none``) or a peer's ``Placement`` (instances
            away from their home are replicas, fed from the home: a moved main expert is one).
        plan_seconds: time to solve the plan (forward critical path).
        relay: charge weight distribution with relay trees (else direct fan-out).
        schedules: the data plane's schedules of recurring replica layouts, kept by the caller (a
            replay keeps one for its run); ``None``: built anew.

    Returns:
        dict of seconds: ``moe_fwd``/``moe_bwd`` (busiest rank's expert compute), ``a2a_fwd``/
        ``a2a_bwd`` (token dispatch + combine of the busiest remote sender/receiver),
        ``wdist_direct``/``wdist_relay``/``wdist`` (weight distribution; busiest sender/receiver),
        ``bwd_replica`` (backward replica traffic: re-materialization + gradient reduction),
        ``fwd_exposed``/``bwd_exposed`` (what the transfers add to the forward / backward under
        ``hardware.transfer_overlap``), ``plan``, ``fwd``, ``bwd``, ``total``; ``transfer_overlap``,
        the overlap assumed; and ``xdom_bytes``, the replica weight and gradient bytes that cross a
        scale-up domain (forward distribution, backward re-materialization and reduction), a byte
        count, not seconds.
    """
    R, E = planner.validate_load(load)
    if isinstance(plan, Placement):
        if tuple(plan.split.shape) != (R, E, R):
            raise ValueError("placement and load have different shapes")
        quota, traffic, slots = plan.quota, plan.split.sum(1), remote_slot_table(plan)
    else:
        if plan.num_ranks != R or plan.num_experts != E:
            raise ValueError("plan and load have different shapes")
        P = plan.physical_slots_per_rank
        quota, traffic, slots = (
            plan.quota,
            plan.physical_split.view(R, R, P).sum(2),
            plan.slot_expert,
        )
    N = hardware.ranks_per_domain(R)
    main, replica = _main_and_replica(_compute_seconds(quota.cpu(), shape, hardware), E // R)
    a2a = _busiest_link_seconds(traffic.cpu(), shape.token_bytes, N, hardware)
    wdist, crossing = [0.0, 0.0], 0
    if slots.numel() and bool((slots >= 0).any()):
        for i, (edges, cross) in enumerate(_replica_edges(slots, E, N, schedules)):
            wdist[i] = _busiest_link_seconds(edges, shape.weight_bytes, N, hardware)
            if (i == 1) == relay:
                crossing = cross
    cost = _assemble(
        main, replica, a2a, wdist[0], wdist[1], float(plan_seconds), shape, hardware, relay
    )
    cost["xdom_bytes"] = float(crossing * shape.numel * (2 * shape.param_bytes + shape.grad_bytes))
    return cost


def ideal_cost(load: torch.Tensor, shape: ExpertShape, hardware: Hardware) -> dict:
    """Estimated seconds of one MoE layer under force-balanced dispatch (the paper's ideal): every
    expert gets total/E pairs, every source sends its pairs to uniformly spread destinations;
    no plan, no replicas. load int64 [R, E]; keys as :func:`layer_cost`."""
    R, E = planner.validate_load(load)
    total = float(load.sum())
    per_instance = torch.full((E // R, R), total / E, dtype=torch.float64)
    main = _compute_seconds(per_instance, shape, hardware).sum(0)
    # Source s spreads its pairs evenly over the R ranks; rank t receives total / R.
    traffic = load.sum(1).to(torch.float64).unsqueeze(1).expand(R, R) / R
    a2a = _busiest_link_seconds(traffic, shape.token_bytes, hardware.ranks_per_domain(R), hardware)
    cost = _assemble(main, torch.zeros_like(main), a2a, 0.0, 0.0, 0.0, shape, hardware, True)
    cost["xdom_bytes"] = 0.0
    return cost
