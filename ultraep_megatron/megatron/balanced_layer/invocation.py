"""One balanced MoE invocation from its routing to the end of its backward
(:class:`BalancedInvocation`), its plan on the way to the host (:class:`PlanHandle`) and as the
host reads it (:class:`HostPlan`). Shapes as in docs/glossary.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane import TransferHandle, TransferSchedule
from ultraep_megatron.megatron.balanced_layer.expert_slots import LayerExperts
from ultraep_megatron.planner.record_layout import PlanRecord


@dataclass(frozen=True, eq=False)
class HostPlan:
    """An invocation's plan as this rank's host reads it (host tensors and arrays only)."""

    record: PlanRecord  # this rank's (a private copy)
    load: Optional[torch.Tensor]  # int64 [R, E] where it crossed, else None
    plan: Optional[planner.Plan]  # the host planner's; None for a device plan
    table: Optional[torch.Tensor]  # the host plan's int32 [4, E + R * S + 1] reroute table, pinned
    schedule_builder: Optional[Callable[[], TransferSchedule]]  # None: no replica transfer
    plan_seconds: float

    @property
    def balanced(self) -> bool:
        """Whether the load reached the balancer's trigger (below it: no replica)."""
        return self.record.balanced

    @cached_property
    def slot_expert(self) -> torch.Tensor:
        """int64 [R, S], the expert each redundant slot holds (-1: none)."""
        return torch.from_numpy(self.record.slot_expert)

    @property
    def input_splits(self) -> np.ndarray:
        """int64 [R], rows this rank sends to each rank."""
        return self.record.input_splits

    @property
    def output_splits(self) -> np.ndarray:
        """int64 [R], rows this rank receives from each rank."""
        return self.record.output_splits

    @cached_property
    def rows_per_source_slot(self) -> torch.Tensor:
        """int64 [R, P], rows each source sends to each of this rank's physical slots (megatron's
        ``num_global_tokens_per_local_expert``)."""
        return torch.from_numpy(self.record.rows_per_source_slot)

    @cached_property
    def rows_per_slot(self) -> torch.Tensor:
        """int64 [P], rows each of this rank's physical slots receives."""
        return self.rows_per_source_slot.sum(0)

    @property
    def main_rows(self) -> int:
        """Rows of this rank's G main experts (the first ``main_rows`` dispatched rows)."""
        return int(self.rows_per_slot[: -self.record.num_slots or None].sum())

    @cached_property
    def replica_rows(self) -> Tuple[int, ...]:
        """Rows of each of this rank's S redundant slots."""
        S = self.record.num_slots
        return tuple(self.rows_per_slot[-S:].tolist()) if S else ()

    def metrics(self) -> dict:
        """``planner.metrics`` of the plan (its record's figures)."""
        return self.record.metrics()

    @cached_property
    def schedule(self) -> Optional[TransferSchedule]:
        """Built on first use, by the weight distribution, after the reroute is queued."""
        return self.schedule_builder() if self.schedule_builder is not None else None


class PinnedPool:
    """Pinned host buffers reused across invocations (pinning is a driver call costing more than
    the copies). A buffer comes back with :meth:`give` and the event of the last copy using it;
    :meth:`take` hands out one whose event has completed, or a new one: it never waits."""

    def __init__(self, per_shape: int = 8):
        self._free: dict = {}
        self._per_shape = per_shape

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype), [])
        for index, (tensor, event) in enumerate(free):
            if event is None or event.query():
                del free[index]
                return tensor
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # no CUDA driver in this process: pageable memory is all there is
            return torch.empty(shape, dtype=dtype)

    def give(self, tensor: torch.Tensor, event=None) -> None:
        free = self._free.setdefault((tuple(tensor.shape), tensor.dtype), [])
        if len(free) < self._per_shape:
            free.append((tensor, event))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``host`` (pinned on CUDA) on ``device``, without blocking: the layer's one
    crossing from the host (a copy on the CPU too: ``host`` goes back to its pool)."""
    return host.to(device, non_blocking=True, copy=True)


class PlanHandle:
    """An invocation's plan on its way to the host: ``crossing`` (int64 on the device: the host
    planner's load [R, E], or a device plan's record) copied to pinned memory behind an event, and
    ``finish`` (host copy -> :class:`HostPlan`). A device plan's ``table`` (int32 reroute table)
    and ``device_rows`` (int64 [R, P]) stay on the device. Not started while graph-captured."""

    def __init__(
        self,
        crossing: torch.Tensor,
        finish: Callable[[torch.Tensor], HostPlan],
        *,
        table: Optional[torch.Tensor] = None,
        device_rows: Optional[torch.Tensor] = None,
    ):
        self.crossing, self.table, self.device_rows = crossing, table, device_rows
        self._finish = finish
        self._host = self._event = self._pool = None
        self._plan: Optional[HostPlan] = None
        self.host_seconds = 0.0  # the host's part once the copy arrived (``finish``)

    def start(self, stream, pool: PinnedPool) -> "PlanHandle":
        """Start the crossing into a buffer of ``pool`` (``stream``: ``None`` off CUDA)."""
        crossing = self.crossing
        self._pool = pool
        self._host = host = pool.take(crossing.shape, crossing.dtype)
        if stream is None:
            host.copy_(crossing, non_blocking=True)
            self._event = _recorded_event()
            return self
        self._event = event = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(crossing, non_blocking=True)
            crossing.record_stream(stream)  # the current stream may free it before the copy ran
            event.record(stream)
        return self

    def wait(self) -> HostPlan:
        """The invocation's one host wait, where megatron's dispatcher waits for its splits; then
        the host's part of the plan. Idempotent."""
        if self._plan is None:
            if self._event is not None:
                self._event.synchronize()
            t0 = time.perf_counter()
            host = self._host.clone()  # the pinned buffer goes back to the pool
            self._pool.give(self._host)
            self._plan = self._finish(host)
            self.host_seconds = time.perf_counter() - t0
        return self._plan


def _recorded_event():
    """An event after the work queued so far on the current stream; ``None`` without CUDA (the
    host ran that work already)."""
    event = torch.cuda.Event()
    try:
        event.record()
    except RuntimeError:  # no CUDA driver in this process (and no CPU backend standing in)
        return None
    return event


@dataclass(eq=False)
class Reduction:
    """The replica-gradient reduction in flight."""

    handle: TransferHandle
    targets: List[List[torch.Tensor]]  # [local expert][k] fp32: main_grad, or fresh ones
    has_replica: Optional[List[bool]]  # per local expert; None for main_grad targets


class BalancedInvocation:
    """One MoE layer on one microbatch: plan, reroute, replica weights and replica gradients.
    ``topk_ids``: int64 [T, k] (reset by a recompute replay); ``plan``, ``reroute_table`` (a host
    plan's) and ``vid`` are set by :meth:`wait`, ``reduction`` by :meth:`start_reduction`."""

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
        handle: PlanHandle,
    ):
        self.layer_number = layer_number
        self.context = context
        self.experts = experts
        self.topk_ids = topk_ids
        self.training = training
        self.grad_enabled = grad_enabled
        self.runs_per_forward = runs_per_forward
        self.handle = handle
        # int32 [4, E + R * S + 1] on the device (``planner.record_layout``): a device plan's now,
        # a host plan's once uploaded at the wait.
        self.reroute_table = handle.table
        self.device_rows = handle.device_rows
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
        context = self.context
        if plan.table is not None:  # a host plan's (a graph's has done its reroute)
            self.reroute_table = upload(plan.table, self.topk_ids.device)
            context.pinned.give(plan.table, _recorded_event())
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
        # One allocation (one launch) for all: the replicated experts' gradients, then one zero
        # element that the others' read-only targets expand.
        sizes = [p.numel() for ps, has in zip(main_params, has_replica) if has for p in ps]
        flat = torch.zeros(sum(sizes) + 1, dtype=torch.float32, device=main_params[0][0].device)
        pieces, zero = iter(flat[:-1].split(sizes)), flat[-1]
        targets = [
            [next(pieces).view(p.shape) if has else zero.expand(p.shape) for p in ps]
            for ps, has in zip(main_params, has_replica)
        ]
        return targets, has_replica, True
