"""One balanced MoE invocation (a layer on a microbatch) from its routing to the end of its
backward: :class:`BalancedInvocation`; its plan on the way to the host, :class:`PlanHandle`; the
plan as the host reads it, :class:`HostPlan`.

Shapes (docs/glossary.md): R EP ranks, E experts, G = E // R, S redundant slots per rank,
P = G + S physical slots per rank; T tokens, k experts per token.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane import TransferHandle, TransferSchedule
from ultraep_megatron.megatron.balanced_layer.expert_slots import LayerExperts
from ultraep_megatron.planner.fused_plan import host_parts
from ultraep_megatron.planner.record_layout import record_length, table_columns, unpack_record
from ultraep_megatron.planner.solve import host_array


@dataclass(frozen=True, eq=False)
class HostPlan:
    """An invocation's plan as this rank's host reads it. Every tensor is a host tensor.

    Attributes:
        load: int64 [R, E], the exact load it was planned on.
        plan: the balancer's plan of ``load``.
        balanced: whether the load reached the balancer's trigger (below it: no replica).
        input_splits / output_splits: int64 [R], rows this rank sends to / receives from each rank.
        rows_per_source_slot: int64 [R, P], rows each source sends to each of this rank's
            physical slots (megatron's ``num_global_tokens_per_local_expert``; pinned on CUDA).
        rows_per_slot: int64 [P], rows each of this rank's physical slots receives.
        reroute_table: int32 [4, E + R * S + 1], the compact table of ``planner.record_layout``
            (pinned on CUDA, uploaded without blocking), or ``None`` where the plan was made on the
            device, which has it (there the int64 [4, E * R + 1] of ``planner.RankReroute``).
        schedule_builder: the data plane's transfer schedule of the replicas, or ``None``: the
            plan has none (no transfer runs, identically on every rank).
        plan_seconds: host time of the planner.
    """

    load: torch.Tensor
    plan: planner.Plan
    balanced: bool
    input_splits: np.ndarray
    output_splits: np.ndarray
    rows_per_source_slot: torch.Tensor
    rows_per_slot: torch.Tensor
    reroute_table: Optional[torch.Tensor]
    schedule_builder: Optional[Callable[[], TransferSchedule]]
    plan_seconds: float

    @property
    def slot_expert(self) -> torch.Tensor:
        """int64 [R, S], the expert each redundant slot holds (-1: none)."""
        return self.plan.slot_expert

    @property
    def main_rows(self) -> int:
        """Rows of this rank's G main experts (the first ``main_rows`` dispatched rows)."""
        G = self.load.shape[1] // self.load.shape[0]
        return int(self.rows_per_slot[:G].sum())

    @cached_property
    def replica_rows(self) -> Tuple[int, ...]:
        """Rows of each of this rank's S redundant slots."""
        G = self.load.shape[1] // self.load.shape[0]
        return tuple(self.rows_per_slot[G:].tolist())

    @cached_property
    def schedule(self) -> Optional[TransferSchedule]:
        """Built on first use, by the weight distribution, after the reroute is queued."""
        return self.schedule_builder() if self.schedule_builder is not None else None


def host_plan(
    plan: planner.Plan,
    load: torch.Tensor,
    ep_rank: int,
    *,
    balanced: bool,
    plan_seconds: float,
    schedule_builder: Optional[Callable[[], TransferSchedule]],
    with_table: bool,
) -> HostPlan:
    """``ep_rank``'s :class:`HostPlan` of ``plan`` (host tensors) solved for ``load`` (host int64
    [R, E]): one compiled pass (``planner.fused_plan.host_parts``), into pinned memory on CUDA.
    ``with_table``: keep the reroute table (the host planner uploads it)."""
    R, E = load.shape
    S = plan.num_slots
    pinned = torch.cuda.is_available()
    # One compiled pass packs this rank's record (splits, rows per source slot) and the compact
    # int32 reroute table (6 KB at EP64, E=256, S=2: what the host planner uploads).
    record = torch.empty(record_length(R, E, S), dtype=torch.int64, pin_memory=pinned)
    table = torch.empty(4, table_columns(R, E, S), dtype=torch.int32, pin_memory=pinned)
    host_parts(
        host_array(load),
        plan,
        ep_rank,
        balanced=balanced,
        min_quota=0,
        domain_size=R,
        record=record.numpy(),
        table=table.numpy(),
    )
    view = unpack_record(record.numpy(), R, E, S)
    rows_per_source_slot = torch.from_numpy(view.rows_per_source_slot)
    reroute = SimpleNamespace(
        input_splits=view.input_splits,
        output_splits=view.output_splits,
        rows_per_slot=view.rows_per_source_slot.sum(0),
    )
    return HostPlan(
        load=load,
        plan=plan,
        balanced=balanced,
        input_splits=reroute.input_splits,
        output_splits=reroute.output_splits,
        rows_per_source_slot=rows_per_source_slot,
        rows_per_slot=torch.from_numpy(reroute.rows_per_slot),
        reroute_table=table if with_table else None,
        schedule_builder=schedule_builder,
        plan_seconds=plan_seconds,
    )


def to_host(tensor: torch.Tensor, stream) -> Tuple[torch.Tensor, torch.cuda.Event]:
    """Start copying ``tensor`` to pinned host memory (on CUDA on ``stream``, after what the
    current stream queued): ``(host tensor, event to wait on)``. The layer's one crossing to the
    host."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    event = torch.cuda.Event()
    if stream is None:
        host.copy_(tensor, non_blocking=True)
        event.record()
        return host, event
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the current stream may free it before the copy ran
        event.record(stream)
    return host, event


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned on CUDA) on ``device``, without blocking: the layer's one crossing from
    the host."""
    return host.to(device, non_blocking=True)


class PlanHandle:
    """An invocation's plan on its way to the host, in DeepEP's manner: a device tensor copied to
    pinned host memory behind an event, and what the host makes of it.

    ``crossing``: int64 on the device, queued (the gathered load of a host plan, or a device plan's
    host half). ``finish(host_copy)`` turns the copy into the :class:`HostPlan` once it has
    arrived. On CUDA the copy runs on ``stream`` after what the current stream queued so far, so
    the wait ends when ``crossing`` is ready, not when work queued after it is done (megatron
    copies its token counts on a side stream the same way).
    """

    def __init__(self, crossing: torch.Tensor, finish: Callable[[torch.Tensor], HostPlan], stream):
        self._host, self._event = to_host(crossing, stream)
        self._finish = finish
        self._plan: Optional[HostPlan] = None
        self.host_seconds = 0.0  # the host's part once the copy arrived (``finish``)

    def wait(self) -> HostPlan:
        """The invocation's one host wait, where megatron's dispatcher waits for its splits; then
        the host's part of the plan. Idempotent."""
        if self._plan is None:
            self._event.synchronize()
            t0 = time.perf_counter()
            self._plan = self._finish(self._host)
            self.host_seconds = time.perf_counter() - t0
        return self._plan


@dataclass(eq=False)
class Reduction:
    """The replica-gradient reduction in flight.

    Attributes:
        handle: the data plane's handle.
        targets: ``[local expert][k]`` fp32 tensors the replica gradients are folded into: the
            ``main_grad`` buffers (Megatron DDP), or fresh ones (a zero view where the expert has
            no replica, never written).
        has_replica: per local expert whether it has a replica; ``None`` for ``main_grad`` targets.
    """

    handle: TransferHandle
    targets: List[List[torch.Tensor]]
    has_replica: Optional[List[bool]]


class BalancedInvocation:
    """One MoE layer on one microbatch: plan, reroute, replica weights and replica gradients.

    Made by the layer in ``preprocess`` (``BalancedMoELayer._begin``), handed to its dispatcher
    and to the autograd functions of its forward; the ring keeps it from a checkpointed forward to
    its recompute replay. Set at construction: ``layer_number``, ``context``, ``experts`` (the
    layer's :class:`LayerExperts`), ``topk_ids``, ``training``, ``grad_enabled``,
    ``runs_per_forward``, ``handle`` and, for a plan made on the device, ``reroute_table`` and
    ``device_rows`` (``topk_ids`` again by an activation-recompute replay: its own routing). Set by
    one stage each: ``plan`` (:meth:`wait`; and the host plan's ``reroute_table``), ``main_params``
    (the forward, :meth:`take_main_params`), ``vid`` (:meth:`wait`, in training), ``reduction``
    (:meth:`start_reduction`).

    Args:
        topk_ids: int64 [T, k], the routed pairs' logical experts.
        handle: the plan on its way (``None``: a plan captured into a CUDA graph, completed after
            each replay by another invocation).
        reroute_table: int64 [4, E * R + 1] on the device, for a plan made there.
        device_rows: int64 [R, P] rows each source sends to each of this rank's physical slots, on
            the device, for a plan made there (megatron's fused chunk sort reads them).
    """

    def __init__(
        self,
        *,
        layer_number: int,
        context,
        experts: LayerExperts,
        topk_ids: torch.Tensor,
        training: bool,
        grad_enabled: bool,
        runs_per_forward: int,
        handle: Optional[PlanHandle],
        reroute_table: Optional[torch.Tensor] = None,
        device_rows: Optional[torch.Tensor] = None,
    ):
        self.layer_number = layer_number
        self.context = context
        self.experts = experts
        self.topk_ids = topk_ids
        self.training = training
        self.grad_enabled = grad_enabled
        self.runs_per_forward = runs_per_forward
        self.handle = handle
        self.reroute_table = reroute_table
        self.device_rows = device_rows
        self.plan: Optional[HostPlan] = None
        self.main_params: Optional[List[List[torch.Tensor]]] = None
        self.vid: Optional[int] = None
        self.reduction: Optional[Reduction] = None

    def wait(self) -> HostPlan:
        """The one host wait (idempotent): the plan on the host; a host plan's reroute table starts
        uploading (non-blocking, pinned); in training the invocation takes a ring slot for its
        backward (and, planned without grad, is parked for its recompute replay)."""
        if self.plan is not None:
            return self.plan
        self.plan = plan = self.handle.wait()
        if plan.reroute_table is not None:  # a host plan's (a graph's has done its reroute)
            self.reroute_table = upload(plan.reroute_table, self.topk_ids.device)
        context = self.context
        if self.training:
            self.vid = context.ring.acquire(self.layer_number)
            context.ring.store(self.vid, self)
            if not self.grad_enabled:
                context.ring.park_for_recompute(self.layer_number, self.vid, self.runs_per_forward)
        context.planned(self, self.handle.host_seconds)
        return plan

    def take_main_params(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` the main experts' parameters, looked up once per forward: its four
        transfers see the same tensors (a checkpoint load may replace them between iterations)."""
        if self.main_params is None:
            self.main_params = self.experts.lookup()
        return self.main_params

    # -- weights ---------------------------------------------------------------------------------
    def start_weights(self) -> None:
        """Start copying the replicated main experts into the redundant slots of their hosts (the
        forward), or back into them (the backward's re-materialization: later layers overwrote
        them). Collective on the EP group; nothing to do where the buffer holds them already."""
        self.context.slots.fill(self, self.experts.main_weights(self.take_main_params()))

    def replica_weights(self) -> List[List[torch.Tensor]]:
        """``[redundant slot][k]`` the replicas' weights over the shared buffer, once they arrived:
        views not tracked by autograd, or quantized parameters rebuilt over the slot's bytes."""
        slots = self.context.slots
        slots.wait_filled(self)
        layout = self.experts.layout
        like = self.take_main_params()[0] if layout.quantized else None
        return [
            layout.replica_weights(slots.buffer.weight_views(s), like)
            for s in range(slots.buffer.num_slots)
        ]

    # -- gradients -------------------------------------------------------------------------------
    def start_reduction(self, weight_grads: Optional[Sequence[Optional[torch.Tensor]]] = None):
        """Start reducing the replicas' gradients into their main experts (collective on the EP
        group; once). ``weight_grads``: flat, slot-major, the experts' parameter order; ``None``
        where no replica backward ran on this rank (its slots received no rows)."""
        plan = self.plan
        if plan.schedule_builder is None or self.reduction is not None:
            return
        main_params = self.take_main_params()
        targets, has_replica, fold_on_stream = self._gradient_targets(main_params)
        per_slot = len(main_params[0])
        hosted = {
            s: weight_grads[s * per_slot : (s + 1) * per_slot]
            if weight_grads is not None and plan.replica_rows[s] > 0
            else None
            for s in plan.schedule.rank_transfers(self.context.ep_rank).hosted_slots
        }
        handle = self.context.slots.reduce(self, targets, hosted, fold_on_stream)
        self.reduction = Reduction(handle, targets, has_replica)

    def finish_reduction(self) -> List[List[Optional[torch.Tensor]]]:
        """Complete the reduction (starting it first where no replica backward did) and release
        the ring slot. Returns ``[local expert][k]`` the gradient each main parameter gains:
        ``None`` without a replica, and wherever the reduction went into ``main_grad``."""
        main_params = self.take_main_params()
        none = [[None] * len(expert) for expert in main_params]
        if self.vid is not None:
            self.context.ring.release(self.vid)
        if self.plan.schedule_builder is None:
            return none
        self.start_reduction()
        reduction, self.reduction = self.reduction, None
        self.context.slots.wait(reduction.handle)
        if reduction.has_replica is None:
            return none
        return [
            [g.to(p.dtype) for p, g in zip(expert, grads)] if has else [None] * len(expert)
            for expert, grads, has in zip(main_params, reduction.targets, reduction.has_replica)
        ]

    def _gradient_targets(self, main_params):
        """(targets, has_replica, fold_on_stream). Under Megatron DDP the fp32 ``main_grad``
        buffers, which nothing touches before the completion unless the experts' weight-gradient
        kernels write them directly (gradient-accumulation fusion): only then the fold waits for
        the completion instead of running on the transfer's stream. Without DDP fresh fp32
        gradients for the experts with a replica."""
        if all(getattr(p, "main_grad", None) is not None for ps in main_params for p in ps):
            fused = self.experts.gradient_accumulation_fusion
            return [[p.main_grad for p in ps] for ps in main_params], None, not fused
        first = self.context.ep_rank * len(main_params)
        replicated = set(self.plan.slot_expert.reshape(-1).tolist())
        has_replica = [first + g in replicated for g in range(len(main_params))]
        zero = torch.zeros((), dtype=torch.float32, device=main_params[0][0].device)
        targets = [
            [
                torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                if has
                else zero.expand(p.shape)
                for p in ps
            ]
            for ps, has in zip(main_params, has_replica)
        ]
        return targets, has_replica, True
