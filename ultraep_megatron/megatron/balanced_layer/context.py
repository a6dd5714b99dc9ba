"""What the balanced MoE layers of one model share: :class:`BalancingContext` (the redundant
slots and their transfers, the ring, the replica experts, the planner, the observers).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from ultraep_megatron.dataplane import ReplicaBuffer, TransferHandle
from ultraep_megatron.megatron.balanced_layer.expert_slots import ExpertWeightLayout, ReplicaExperts
from ultraep_megatron.megatron.balanced_layer.invocation import (
    BalancedInvocation,
    HostPlan,
    PinnedPool,
    PlanHandle,
)
from ultraep_megatron.megatron.balanced_layer.observers import BalancerStats, TraceRecorder
from ultraep_megatron.megatron.balanced_layer.ring import (
    VirtualLayerRing,
    schedule_inflight_microbatches,
)
from ultraep_megatron.planner import BalancerConfig, LayerBalancer
from ultraep_megatron.planner.fused_plan import host_parts, plan_invocation
from ultraep_megatron.planner.record_layout import (
    STATUS_MEANING,
    STATUS_OK,
    record_length,
    table_columns,
    unpack_record,
)
from ultraep_megatron.planner.self_check import checked as self_check_done
from ultraep_megatron.planner.self_check import self_check
from ultraep_megatron.planner.solve import default_min_quota, host_array
from ultraep_megatron.planner.baselines.registry import ULTRAEP
from ultraep_megatron.settings.knobs import PLANNERS


@dataclass
class Overheads:
    """Cumulative host time of the balancing work (benchmarks and the training log)."""

    plan_seconds: float = 0.0  # planner
    host_seconds: float = 0.0  # from the plan's wait to the invocation's metadata
    observe_seconds: float = 0.0  # the observers
    transfer_seconds: float = 0.0  # issuing and waiting for transfers
    transfer_blocked_seconds: float = 0.0  # the part of it the host was blocked
    reroute_seconds: float = 0.0  # issuing the reroute and permutation
    invocations: int = 0  # planned

    def reset(self) -> None:
        self.__init__()


@dataclass(frozen=True, eq=False)
class LayerRegistration:
    """What a balanced MoE layer tells its model's context: data, not the layer."""

    expert_shapes: Sequence[tuple]  # [k] one expert's parameter shapes, high precision
    weight_layout: ExpertWeightLayout
    device: torch.device  # the experts' parameters'
    ep_group: Any
    ep_rank: int
    ep_size: int
    num_experts: int
    model_config: Any  # megatron's TransformerConfig (the trace's metadata)
    runs_per_forward: int  # ring.invocations_per_forward
    overlapped: bool  # megatron's overlapped 1F1B schedule
    preprocess_graphed: bool  # --cuda-graph-modules moe_preprocess
    build_replica_experts: Callable[[int], ReplicaExperts]  # for S slots


class ReplicaSlots:
    """The redundant slots every MoE layer of the model shares, and the transfers through them:
    issued in the same order on every EP rank, one in flight at a time. ``holder``: the invocation
    whose replicas the weight buffer holds or receives."""

    def __init__(self, buffer: ReplicaBuffer, overlap: bool, overheads: Overheads):
        self.buffer = buffer
        self.holder: Optional[BalancedInvocation] = None
        self._latest: Optional[TransferHandle] = None
        self._overlap = overlap
        self._overheads = overheads

    def fill(self, invocation: BalancedInvocation, main_weights: List[List[torch.Tensor]]) -> None:
        """Start copying ``invocation``'s replicated main experts (``[local expert][part]``) into
        their slots, unless the buffer holds them already or the plan has no replica."""
        plan = invocation.plan
        if plan.schedule_builder is None or self.holder is invocation:
            return
        self.wait(self._latest)
        handle = self.buffer.distribute_weights(plan.schedule, main_weights, async_op=True)
        self.holder = invocation
        self._issued(handle)

    def wait_filled(self, invocation: BalancedInvocation) -> None:
        """Before ``invocation``'s replicas compute: their weights must have arrived."""
        if invocation.plan.schedule_builder is None:
            return
        if self.holder is not invocation:
            raise RuntimeError(
                f"UltraEP: MoE layer {invocation.layer_number} uses the replica weights "
                "of another invocation (the weight buffer was not re-materialized)"
            )
        self.wait(self._latest)

    def reduce(self, invocation, targets, hosted_grads, fold_on_stream: bool) -> TransferHandle:
        """Start reducing ``invocation``'s replica gradients into ``targets`` (``[local
        expert][k]`` fp32); ``hosted_grads``: ``{hosted slot: its gradients or None}``, copied
        into the fp32 buffer on the transfer's stream. Fold on that stream, or at :meth:`wait`."""
        self.wait(self._latest)  # a previous reduction whose fold was left to wait() reads slots
        handle = self.buffer.reduce_gradients(
            invocation.plan.schedule,
            targets,
            async_op=True,
            hosted_grads=hosted_grads,
            fold_on_stream=fold_on_stream,
        )
        self._issued(handle)
        return handle

    def wait(self, handle: Optional[TransferHandle]) -> None:
        """Complete a transfer (counted in the overheads); nothing to do once it is done."""
        if handle is not None and not handle.done():
            handle.wait()
            self._overheads.transfer_seconds += handle.host_seconds
            self._overheads.transfer_blocked_seconds += (
                handle.host_seconds - handle.host_cpu_seconds
            )

    def _issued(self, handle: TransferHandle) -> None:
        self._latest = handle
        if not self._overlap:
            self.wait(handle)


class BalancingContext:
    """UltraEP's state of one model, built from the ``--moe-balancer*`` flags.

    Args:
        ring_size: ring slots (``None``: sized from the schedule at the first forward).
        trace_dir: where to record every training invocation's load (``None``: not recorded).
        overlap: transfers asynchronous (``--moe-balancer-no-overlap``: each waited where issued).
        check_plans: compare every plan with the routing it is applied to (device reads).
        planner: ``"host"`` or ``"device"`` (``None``: host); a device planner that fails its
            self-check anywhere in the EP group falls back to the host, with one line on rank 0.
    """

    def __init__(
        self,
        config: BalancerConfig,
        *,
        hardware: Optional[str] = None,
        ring_size: Optional[int] = None,
        trace_dir: Optional[str] = None,
        overlap: bool = True,
        check_plans: bool = False,
        planner: Optional[str] = None,
    ):
        # The planner's kernels now, not in the first layer's first plan (its plan time).
        config.build().warm_up()
        self.config = config
        self.overlap = overlap
        self.check_plans = check_plans
        self.planner = resolve_planner(planner, config.name)
        self.pinned = PinnedPool()  # the host buffers of the plans' crossings
        self.registrations: List[LayerRegistration] = []
        self.slots: Optional[ReplicaSlots] = None  # once the first layer registered
        self.replica_experts: Optional[ReplicaExperts] = None
        self.ep_rank = 0
        self.stats = BalancerStats(config.domain_size)
        self.trace = TraceRecorder(trace_dir, config, hardware) if trace_dir else None
        self.overheads = Overheads()
        self._ring_size = ring_size
        self._ring: Optional[VirtualLayerRing] = None
        self._unobserved: List[BalancedInvocation] = []
        self._copy_streams: Dict[torch.device, Any] = {}

    @property
    def plans_on_device(self) -> bool:
        return self.planner == "device"

    @property
    def ring(self) -> VirtualLayerRing:
        """Sized at its first use, once every layer registered and the schedule is known."""
        if self._ring is None:
            per_forward = sum(r.runs_per_forward for r in self.registrations)
            overlapped = any(r.overlapped for r in self.registrations)
            self._ring = VirtualLayerRing(
                self._ring_size or per_forward * schedule_inflight_microbatches(overlapped)
            )
        return self._ring

    def register(self, registration: LayerRegistration) -> None:
        """Add a balanced MoE layer; the first one makes the shared slots (all MoE layers of a
        model share them, so they must have the same expert shapes and dtype)."""
        shapes, layout = list(registration.expert_shapes), registration.weight_layout
        if self.slots is None:
            # Gradients in the parameters' high-precision shapes; weights as the main experts hold
            # them (the bytes of quantized parameters).
            buffer = ReplicaBuffer(
                self.config.num_slots,
                shapes,
                layout.dtype,
                device=registration.device,
                group=_data_plane_group(registration.ep_group),
                weight_shapes=layout.shapes,
            )
            self.slots = ReplicaSlots(buffer, self.overlap, self.overheads)
            self.ep_rank = registration.ep_rank
            if self.config.num_slots > 0:
                # Now, not at the first forward: by then megatron has hung process-group handles
                # on the config, which the experts' constructor cannot copy.
                self.replica_experts = registration.build_replica_experts(self.config.num_slots)
            if self.trace is not None:
                self.trace.describe(registration.ep_group, registration.model_config)
        else:
            buffer = self.slots.buffer
            if (
                buffer.expert_shapes != [torch.Size(s) for s in shapes]
                or buffer.weight_shapes != layout.shapes
                or buffer.replica_weights.dtype != layout.dtype
            ):
                raise ValueError(
                    "UltraEP shares replica slots across the MoE layers of a model: all must "
                    "have the same expert shapes and dtype"
                )
        if self.plans_on_device and not self.registrations:
            self._check_device_planner(registration)
        self.registrations.append(registration)
        self._ring = None

    def _check_device_planner(self, registration: LayerRegistration) -> None:
        """The device planner's self-check (once per device, setting and shape); the EP group
        agrees on the outcome and plans on the host for this model if any rank failed."""
        t0 = time.perf_counter()
        shape = (registration.ep_size, registration.num_experts)
        fresh = not self_check_done(registration.device, self.config, shape=shape)
        try:
            problems = self_check(registration.device, self.config, shape=shape)
        except Exception as error:  # noqa: BLE001 - a compilation or launch failure: plan on host
            lines = str(error).strip().splitlines()
            problems = [f"{type(error).__name__}{': ' + lines[0][:300] if lines else ''}"]
        outcomes = _gather_on(registration.ep_group, problems[0] if problems else None)
        failures = [(rank, failure) for rank, failure in enumerate(outcomes) if failure]
        if not failures:
            if not fresh:  # a model of the same shape printed it
                return
            _print_on_rank_zero(
                f"ultraep: device planner ready in {time.perf_counter() - t0:.2f} s (its plans "
                f"of probe loads, R={shape[0]} E={shape[1]} among them, equal the host's)"
            )
            return
        where = (
            ""
            if len(failures) == len(outcomes)
            else f" on EP rank{'s' if len(failures) > 1 else ''} "
            + ", ".join(str(rank) for rank, _ in failures)
        )
        why = f"the device planner failed its self-check{where}: {failures[0][1]}"
        if registration.preprocess_graphed:  # the host planner cannot run inside that graph
            raise RuntimeError(
                f"{why}; --cuda-graph-modules moe_preprocess needs it: leave moe_preprocess out "
                "of --cuda-graph-modules to plan on the host"
            )
        self.planner = "host"
        _print_on_rank_zero(
            f"ultraep: warning: {why}; planning on the host for this model "
            "(--moe-balancer-planner host skips the check and this warning)"
        )

    # -- planning --------------------------------------------------------------------------------
    def start_plan(
        self, load: torch.Tensor, balancer: LayerBalancer, *, captured: bool = False
    ) -> PlanHandle:
        """Start planning on the gathered load (int64 [R, E] on the device); the handle's
        ``wait()`` gives the :class:`HostPlan`. Host planner: the load crosses and is planned at
        the wait. Device planner: the record and reroute table are queued on the device and the
        record crosses, unless ``captured`` into a CUDA graph (then the handle is not started)."""
        if not self.plans_on_device:

            def plan_on_host(host_load: torch.Tensor) -> HostPlan:
                t0 = time.perf_counter()
                balanced = balancer.balances(host_load)
                plan = balancer.plan(host_load, balances=balanced)
                return self._host_plan(plan, host_load, balanced, time.perf_counter() - t0)

            return PlanHandle(load, plan_on_host).start(self._copy_stream(load), self.pinned)
        t0 = time.perf_counter()
        fused = plan_invocation(load, self.config, self.ep_rank)
        R, E = load.shape
        P = E // R + self.config.num_slots
        # Where the observers need the exact load (the trace, the plan checks) it crosses too.
        crossing = torch.cat([fused.record, load.reshape(-1)]) if self.needs_load else fused.record
        handle = PlanHandle(
            crossing,
            functools.partial(self._unpack_record, R, E, time.perf_counter() - t0),
            table=fused.table,
            device_rows=fused.record[-R * P :].view(R, P),
        )
        return handle if captured else handle.start(self._copy_stream(load), self.pinned)

    def unpack_graphed_plan(self, crossing: torch.Tensor) -> PlanHandle:
        """The handle of a plan a replayed CUDA graph of the preprocessing made (its record, a
        graph output on the device)."""
        R, E = self.registrations[0].ep_size, self.registrations[0].num_experts
        finish = functools.partial(self._unpack_record, R, E, 0.0)
        return PlanHandle(crossing, finish).start(self._copy_stream(crossing), self.pinned)

    @property
    def needs_load(self) -> bool:
        """Whether every plan's exact load must reach the host (the trace, the plan checks)."""
        return self.trace is not None or self.check_plans

    def _unpack_record(self, R: int, E: int, plan_seconds: float, host: torch.Tensor) -> HostPlan:
        S = self.config.num_slots
        L = record_length(R, E, S)
        record = unpack_record(host[:L].numpy(), R, E, S)
        if record.status != STATUS_OK:
            raise RuntimeError(
                f"UltraEP: the device planner could not plan a load (record status "
                f"{record.status}: {STATUS_MEANING.get(record.status, 'unknown')})"
            )
        load = host[L:].view(R, E) if host.numel() > L else None
        return self._finish_plan(record, load, None, None, plan_seconds)

    def _host_plan(self, plan, load, balanced, plan_seconds) -> HostPlan:
        """The host planner's :class:`HostPlan`: ``plan`` packed into this rank's record and its
        reroute table (pinned, from the pool) by one compiled pass."""
        R, E = load.shape
        S = plan.num_slots
        record = np.empty(record_length(R, E, S), np.int64)
        table = self.pinned.take((4, table_columns(R, E, S)), torch.int32)
        array = host_array(load)
        # The header as the device planner writes it (the floor ultraep solved with).
        floor = 0
        if self.config.name == ULTRAEP:
            floor = self.config.min_quota or default_min_quota(int(array.sum()), R)
        host_parts(
            array,
            plan,
            self.ep_rank,
            balanced=balanced,
            min_quota=floor,
            domain_size=self.config.domain_size or R,
            record=record,
            table=table.numpy(),
        )
        record = unpack_record(record, R, E, S)  # the same record as a device plan's
        return self._finish_plan(record, load, plan, table, plan_seconds)

    def _finish_plan(self, record, load, plan, table, plan_seconds) -> HostPlan:
        replicated = self.config.num_slots > 0 and bool((record.slot_expert >= 0).any())
        builder = (
            functools.partial(
                self.slots.buffer.schedule,
                torch.from_numpy(record.slot_expert),
                record.num_experts,
            )
            if replicated
            else None
        )
        return HostPlan(record, load, plan, table, builder, plan_seconds)

    def planned(self, invocation: BalancedInvocation, host_seconds: float) -> None:
        """``invocation``'s plan arrived (its wait): counted, and queued for the observers."""
        self._unobserved.append(invocation)
        overheads = self.overheads
        overheads.plan_seconds += invocation.plan.plan_seconds
        overheads.host_seconds += host_seconds
        overheads.invocations += 1

    def _copy_stream(self, tensor: torch.Tensor):
        """The CUDA stream plans cross to the host on (``None`` off CUDA)."""
        device = tensor.device
        if device.type != "cuda":
            return None
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device=device)
        return self._copy_streams[device]

    # -- observers and the training loop -------------------------------------------------------
    def observe(self) -> None:
        """Hand the invocations planned since the last call to the observers; called once a
        layer's work is queued, not between the plan's wait and the reroute."""
        t0 = time.perf_counter()
        for invocation in self._unobserved:
            self.stats.on_invocation(invocation.layer_number, invocation.plan, invocation.training)
            if self.trace is not None:
                self.trace.on_invocation(
                    invocation.layer_number, invocation.plan, invocation.training, self.ep_rank
                )
        self._unobserved.clear()
        self.overheads.observe_seconds += time.perf_counter() - t0

    def end_iteration(self, iteration: int) -> None:
        """Called once per training iteration, when its gradients are final (before the optimizer
        step): through :meth:`ending_iterations`, or by a caller that drives the layers itself."""
        self.observe()
        if self.trace is not None:
            self.trace.end_iteration(iteration)

    def ending_iterations(
        self, finalize_model_grads: Callable, current_iteration: Callable[[], int]
    ) -> Callable:
        """The model's ``finalize_model_grads_func`` followed by :meth:`end_iteration` (once per
        training iteration, after the last backward, never in evaluation); ``current_iteration``
        gives the ending iteration's number as megatron's log does."""

        @functools.wraps(finalize_model_grads)
        def finalize_then_end_iteration(*args, **kwargs):
            result = finalize_model_grads(*args, **kwargs)
            self.end_iteration(current_iteration())
            return result

        finalize_then_end_iteration.ends_iterations_of = self
        return finalize_then_end_iteration

    def pop_stats(self) -> Dict[int, Dict[str, float]]:
        self.observe()
        return self.stats.pop()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def resolve_planner(planner: Optional[str], balancer: str) -> str:
    """``--moe-balancer-planner``: ``planner`` as given, else ``host`` (``run/arguments.py``
    passes ``device`` where the preprocessing is captured: ``capabilities.default_planner``)."""
    if planner is None:
        return "host"
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
    if planner == "device" and balancer != ULTRAEP:
        raise ValueError(f"the device planner plans {ULTRAEP} only, not {balancer}")
    return planner


def _gather_on(group, value) -> list:
    """``value`` of every rank of ``group`` (startup only: a blocking object gather)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _print_on_rank_zero(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _data_plane_group(ep_group):
    """A process group of the EP ranks for the replica transfers alone: its own communicator lets
    NCCL run them concurrently with the token all-to-all on the EP group (one communicator
    serializes its operations). Only the EP group's ranks take part in creating it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(ep_group) == 1:
        return ep_group
    return dist.new_group(
        ranks=dist.get_process_group_ranks(ep_group),
        backend=dist.get_backend(ep_group),
        use_local_synchronization=True,
    )
