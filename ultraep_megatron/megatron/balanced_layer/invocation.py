"""One balanced MoE invocation (a layer on a microbatch): its plan on the host (:class:`Invocation`)
and the record that carries it through megatron's stages (:class:`InvocationState`).

* :class:`Invocation`: immutable, every tensor in it a host tensor. The context makes it from the
  exact load (:func:`plan_invocation`, through ``BalancingContext.plan_on_host``, or from a plan made
  on the device once it crossed, through ``BalancingContext.complete_device_plan``).
* :class:`InvocationState`: what one stage of the layer hands the next (megatron's ``route``,
  ``preprocess``, ``dispatch``, ``routed_experts_compute``, ``combine``, ``postprocess``, and the
  backward or ``backward_dw``): the routed pairs, the plan (on its way from the device, or on the
  host), the reroute table on the device, and in the backward the replica-gradient reduction in
  flight with its gradient targets (:class:`Reduction`). The dispatcher holds the current one, as
  megatron's dispatchers hold their per-call metadata; the virtual-layer ring carries it from the
  forward to the backward. Nothing here reads device memory.

Vocabulary (docs/glossary.md): R EP ranks, E experts, G = E // R main experts per rank, S redundant
slots per rank, P = G + S *physical* slots per rank (its main experts, then its redundant slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane import TransferHandle, TransferSchedule
from ultraep_megatron.megatron.balanced_layer.device_planning import DevicePlanned


@dataclass(frozen=True, eq=False)
class Invocation:
    """One balanced MoE invocation, planned on the host (every tensor here is a host tensor).

    Attributes:
        layer_number: the MoE layer's global layer number.
        vid: its virtual layer id in the ring; ``None`` when no backward follows (evaluation).
        ep_rank: this rank's index in the EP group.
        load: int64 ``[R, E]``, the exact load it was planned on.
        plan: the planner's plan for ``load``.
        schedule_builder: builds the data plane's transfer schedule of the plan's replicas;
            ``None`` when the plan has none (then no transfer runs, identically on every rank).
        input_splits / output_splits: int64 ``[R]`` (token, expert) rows this rank sends to / receives
            from each EP rank (the all-to-all's splits).
        rows_per_source_slot: int64 ``[R, P]`` rows each source rank sends to each of this rank's
            physical slots (megatron's ``num_global_tokens_per_local_expert``; pinned on CUDA: the
            fused chunk sort reads it on the device).
        rows_per_slot: int64 ``[P]`` rows each of this rank's physical slots receives.
        main_rows: rows its G main experts receive (the first ``main_rows`` dispatched rows).
        replica_rows: rows each of its S redundant slots receives.
        balanced: whether the load reached the balancer's trigger (``LayerBalancer.balances``;
            below it ultraep plans no replica).
        reroute_table: int64 ``[4, E * R + 1]``, ``planner.RankReroute.reroute_table`` (the
            reroute's spare column is its last physical slot + 1). Pinned on CUDA, so its upload is
            non-blocking.
        plan_seconds: host time of the planner.
    """

    layer_number: int
    vid: Optional[int]
    ep_rank: int
    load: torch.Tensor
    plan: planner.Plan
    schedule_builder: Optional[Callable[[], TransferSchedule]]
    input_splits: np.ndarray
    output_splits: np.ndarray
    rows_per_source_slot: torch.Tensor
    rows_per_slot: torch.Tensor
    main_rows: int
    replica_rows: Tuple[int, ...]
    balanced: bool
    reroute_table: torch.Tensor
    plan_seconds: float

    @cached_property
    def replicated_local_experts(self) -> Tuple[int, ...]:
        """Local indices of this rank's main experts that have a replica (ascending): the only
        experts whose gradients the replica-gradient reduction changes here."""
        G = self.load.shape[1] // self.load.shape[0]
        first = self.ep_rank * G
        replicated = set(self.plan.slot_expert.reshape(-1).tolist())  # host plan
        return tuple(g for g in range(G) if first + g in replicated)

    @cached_property
    def schedule(self) -> Optional[TransferSchedule]:
        """The transfer schedule, built on first use: by the weight distribution, once the reroute
        is queued, not between the wait for the load and the reroute."""
        return self.schedule_builder() if self.schedule_builder is not None else None


def plan_invocation(
    plan: planner.Plan,
    load: torch.Tensor,
    ep_rank: int,
    *,
    layer_number: int,
    vid: Optional[int],
    schedule_builder: Optional[Callable[[], TransferSchedule]],
    balanced: bool,
    plan_seconds: float,
) -> Invocation:
    """Derive everything one rank needs from a plan, on the host (``planner.rank_reroute``: one
    compiled pass, into pinned memory on CUDA, from which its two device tables upload).

    Args:
        plan: solved for ``load`` (host tensors).
        load: int64 ``[R, E]``.
        ep_rank: this rank.
    """
    R, E = load.shape
    G, P = E // R, plan.physical_slots_per_rank
    pinned = torch.cuda.is_available()  # what is uploaded is pinned: a non-blocking upload
    rows_per_source_slot = torch.empty(R, P, dtype=torch.int64, pin_memory=pinned)
    table = torch.empty(4, E * R + 1, dtype=torch.int64, pin_memory=pinned)
    reroute = planner.rank_reroute(
        plan,
        load,
        ep_rank,
        rows_per_source_slot=rows_per_source_slot.numpy(),
        reroute_table=table.numpy(),
    )
    rows_per_slot = reroute.rows_per_slot
    return Invocation(
        layer_number=layer_number,
        vid=vid,
        ep_rank=ep_rank,
        load=load,
        plan=plan,
        schedule_builder=schedule_builder,
        input_splits=reroute.input_splits,
        output_splits=reroute.output_splits,
        rows_per_source_slot=rows_per_source_slot,
        rows_per_slot=torch.from_numpy(rows_per_slot),
        main_rows=int(rows_per_slot[:G].sum()),
        replica_rows=tuple(rows_per_slot[G:].tolist()),
        balanced=balanced,
        reroute_table=table,
        plan_seconds=plan_seconds,
    )


@dataclass(eq=False)
class Reduction:
    """One invocation's replica-gradient reduction in flight (the backward's part of its record).

    Attributes:
        handle: the data plane's handle of the collective reduction.
        targets: ``[local expert][k]`` fp32 tensors the reduction folds the replica gradients into:
            the main experts' ``main_grad`` (Megatron DDP), or fresh ones (a zero view where the
            expert has no replica, never written).
        has_replica: per local expert whether it has a replica; ``None`` where the targets are the
            ``main_grad`` buffers (nothing to hand back).
    """

    handle: TransferHandle
    targets: List[List[torch.Tensor]]
    has_replica: Optional[List[bool]]


@dataclass(eq=False)
class InvocationState:
    """One balanced invocation as it passes megatron's stages: the record each stage reads and
    fills (module docstring). One per layer and microbatch; mutable.

    Attributes:
        layer_number: the MoE layer's id (``layer_ids.moe_layer_id``).
        runs_per_forward: how many times one model forward runs the layer
            (``ring.invocations_per_forward``: the MTP block's shared layer, once per depth).
        training / grad_enabled: the layer's mode when it was planned (a checkpointed forward
            plans without grad and is replayed in the backward).
        topk_ids: int64 ``[T, k]`` the routed pairs' logical experts (route).
        invocation: the plan on the host; ``None`` while it is still on the device, or while the
            load crosses (a plan deferred to the dispatch node).
        reroute_table: int64 ``[4, E * R + 1]`` on the device: the reroute's table.
        device_plan: a plan made on the device whose host half has not crossed yet.
        crossing: ``(pinned host tensor, event)`` of what is crossing to the host: the load of a
            deferred host plan, or a device plan's host half.
        deferred: under megatron's overlapped schedule, what the dispatch node completes
            (``"host"``: the load is crossing, ``"device"``: the device plan's host half,
            ``"graph"``: the host half a replayed graph produced), or ``None``.
        routing_map: a deferred host plan's ``[T, E]`` routing (its check, its reroute).
        expert_major: a deferred host plan's pairs in expert-major order (``[N]``).
        reduction: the replica-gradient reduction in flight (backward), or ``None``.
    """

    layer_number: int
    runs_per_forward: int
    training: bool
    grad_enabled: bool
    topk_ids: torch.Tensor
    invocation: Optional[Invocation] = None
    reroute_table: Optional[torch.Tensor] = None
    device_plan: Optional[DevicePlanned] = None
    crossing: Optional[tuple] = None
    deferred: Optional[str] = None
    routing_map: Optional[torch.Tensor] = None
    expert_major: Optional[torch.Tensor] = None
    reduction: Optional[Reduction] = None
