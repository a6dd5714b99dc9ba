"""The balancing context of one model: what its balanced MoE layers share.

One :class:`BalancingContext` per model (all its pipeline chunks), built where the layer spec is
applied (``pretrain_gpt.py``) and handed to every ``BalancedMoELayer`` through the spec. It owns

* the redundant-slot buffers (one weight and one fp32 gradient buffer for all MoE layers, §4.1 of
  the paper) and the process group their transfers use;
* the virtual-layer ring that carries each invocation's plan to its backward (§7);
* the transfer in flight (at most one at a time: every transfer reads or writes the shared
  buffers, and all EP ranks issue them in the same order);
* the observers of every invocation (:mod:`.observers`: per-layer statistics for the training log,
  and the load trace).

Each balanced MoE invocation (a layer on a microbatch) is planned once into an immutable
:class:`~.invocation.Invocation`, kept in the invocation's record
(:class:`~.invocation.InvocationState`): the dispatcher asks for it with the exact load (one
device-to-host copy: of the load with the host planner, of the plan with the device planner), the
layer's later stages and its backward consume it.

The context never sees a layer: a layer registers with its data (:class:`LayerRegistration`), and
every call takes data (the invocation's record, the load, the main experts' weights, the gradient
targets, the replicas' gradients). Nothing above the context reaches into it by attribute: it has a
method for what its callers need. Nothing here reads device memory, except the device planner's
self-check, once, when the first layer registers.

Vocabulary (docs/glossary.md): R EP ranks, E experts, G = E // R main experts per rank, S redundant
slots per rank, P = G + S *physical* slots per rank (its main experts, then its redundant slots); a
*ring* slot is an entry of the virtual-layer ring.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ultraep_megatron.dataplane import ReplicaBuffer, TransferHandle
from ultraep_megatron.megatron.balanced_layer import device_planning
from ultraep_megatron.megatron.balanced_layer.device_planning import PLANNERS, DevicePlanned
from ultraep_megatron.megatron.balanced_layer.expert_slots import ExpertWeightLayout, ReplicaExperts
from ultraep_megatron.megatron.balanced_layer.invocation import (
    Invocation,
    InvocationState,
    plan_invocation,
)
from ultraep_megatron.megatron.balanced_layer.native_torch import native_torch
from ultraep_megatron.megatron.balanced_layer.observers import BalancerStats, TraceRecorder
from ultraep_megatron.megatron.balanced_layer.ring import (
    VirtualLayerRing,
    schedule_inflight_microbatches,
)
from ultraep_megatron.planner import BalancerConfig, LayerBalancer
from ultraep_megatron.planner.baselines.registry import ULTRAEP


@dataclass
class Overheads:
    """Cumulative host time of the balancing work (benchmarks and the training log).

    Attributes:
        plan_seconds: planner time.
        host_seconds: all host work between the load's arrival and the reroute (planner,
            split metadata and reroute table; the transfer schedule is built later, by the weight
            distribution).
        observe_seconds: the observers' host time (statistics, trace), off that critical stretch.
        transfer_seconds: host time spent issuing and waiting for transfers (on the CPU: the
            transfer time not hidden behind compute).
        transfer_blocked_seconds: the part of it the host was blocked (not computing).
        reroute_seconds: host time of the device reroute (on a GPU: its launch cost only).
        invocations: invocations planned.
    """

    plan_seconds: float = 0.0
    host_seconds: float = 0.0
    observe_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_blocked_seconds: float = 0.0
    reroute_seconds: float = 0.0
    invocations: int = 0

    def reset(self) -> None:
        self.plan_seconds = self.host_seconds = self.observe_seconds = self.reroute_seconds = 0.0
        self.transfer_seconds = self.transfer_blocked_seconds = 0.0
        self.invocations = 0


@dataclass(frozen=True, eq=False)
class LayerRegistration:
    """What a balanced MoE layer tells its model's context when it registers: data, not the layer object.

    Attributes:
        expert_shapes: ``[k]`` one expert's parameter shapes, high precision (the replica
            gradients' layout).
        weight_layout: how one expert's weights lie in a redundant slot (the weight buffer's
            shapes and dtype).
        device: where the experts' parameters are.
        ep_group / ep_rank / ep_size: the layer's expert-parallel group and this rank in it.
        num_experts: E, the layer's logical experts.
        model_config: megatron's ``TransformerConfig`` of the layer (the trace's metadata).
        runs_per_forward: how many times one model forward runs the layer
            (:func:`~.ring.invocations_per_forward`).
        overlapped: megatron runs the layer in its overlapped 1F1B schedule
            (:func:`~.ring.overlapped_schedule`).
        preprocess_graphed: ``--cuda-graph-modules moe_preprocess`` (the host planner cannot run
            inside that graph).
        build_replica_experts: builds the redundant slots' experts module for ``S`` slots
            (called once, by the first layer's registration).
    """

    expert_shapes: Sequence[tuple]
    weight_layout: ExpertWeightLayout
    device: torch.device
    ep_group: Any
    ep_rank: int
    ep_size: int
    num_experts: int
    model_config: Any
    runs_per_forward: int
    overlapped: bool
    preprocess_graphed: bool
    build_replica_experts: Callable[[int], ReplicaExperts]


class BalancingContext:
    """UltraEP state of one model. See the module docstring.

    Args:
        config: the planner's numbers ``--moe-balancer*`` selected.
        hardware: the ``--moe-balancer-hardware`` preset the min quota came from (trace metadata).
        ring_size: virtual-layer ring capacity (``None``: MoE layers on the rank x the schedule's
            in-flight microbatches).
        trace_dir: where to record every training invocation's load (``None``: not recorded).
        overlap: transfers asynchronous, overlapped with the layer's other work
            (``--moe-balancer-no-overlap`` waits for each where it is issued).
        check_plans: compare every plan with the routing it is applied to (device reads in every
            layer, for debugging).
        planner: ``"host"`` (the load crosses to the host, the plan is made there) or ``"device"``
            (the plan and the reroute are made on the device, the plan crosses afterwards; ultraep
            only); ``None``: device on CUDA for ultraep, else host (:func:`resolve_planner`). The
            device planner checks itself when the first layer registers and hands over to the host
            planner if it fails (:meth:`_check_device_planner`).
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
        # The planner's kernels now, not in the first layer of the first iteration, whose plan time
        # (ultraep/plan_ms) they would be.
        config.build().warm_up()
        self.config = config
        self.ring_size = ring_size
        self.overlap = overlap
        self.check_plans = check_plans
        self.planner = resolve_planner(planner, config.name)
        self.plans_on_device = self.planner == "device"
        # The device planner's self-check at the first layer's registration (None before it, and
        # with the host planner); a failed one left the model planning on the host.
        self.device_planner_check: Optional[device_planning.SelfCheck] = None
        self.registrations: List[LayerRegistration] = []
        self.buffer: Optional[ReplicaBuffer] = None
        self.replica_experts: Optional[ReplicaExperts] = None  # the redundant slots' module
        self.ring: Optional[VirtualLayerRing] = None
        self.stats = BalancerStats(config.domain_size)
        self.trace = TraceRecorder(trace_dir, config, hardware) if trace_dir else None
        self.observers = [self.stats] + ([self.trace] if self.trace else [])
        self.overheads = Overheads()
        self.holder: Optional[Invocation] = (
            None  # whose replicas the weight buffer holds (or receives)
        )
        self._transfer: Optional[TransferHandle] = None  # the latest transfer issued
        self._unobserved: List[tuple] = []  # (invocation, training) not yet seen by the observers
        self._host_copy_streams: Dict[torch.device, object] = {}

    # -- setup ---------------------------------------------------------------------------------
    def register(self, registration: LayerRegistration) -> None:
        """Add a balanced MoE layer (its data); the first one sizes the shared buffers."""
        shapes, layout = list(registration.expert_shapes), registration.weight_layout
        if self.buffer is None:
            # Replica gradients in the parameters' high-precision shapes; weights in the layout
            # of what the main experts hold (bytes of quantized parameters).
            self.buffer = ReplicaBuffer(
                self.config.num_slots,
                shapes,
                layout.dtype,
                device=registration.device,
                group=_data_plane_group(registration.ep_group),
                weight_shapes=layout.shapes,
            )
            if self.config.num_slots > 0:
                # Built now, not at the first forward: by then the training loop has hung
                # process-group handles on the config, which the experts' constructor cannot copy.
                self.replica_experts = registration.build_replica_experts(self.config.num_slots)
            if self.trace is not None:
                self.trace.describe(registration.ep_group, registration.model_config)
        elif (
            self.buffer.expert_shapes != [torch.Size(s) for s in shapes]
            or self.buffer.weight_shapes != layout.shapes
            or self.buffer.replica_weights.dtype != layout.dtype
        ):
            raise ValueError(
                "UltraEP shares replica slots across the MoE layers of a model: all must "
                "have the same expert shapes and dtype"
            )
        if self.plans_on_device and len(self.registrations) == 0:
            self._check_device_planner(registration)
        self.registrations.append(registration)
        self.ring = None  # sized lazily, once the model (and the schedule) is known

    @native_torch
    def _check_device_planner(self, registration: LayerRegistration) -> None:
        """At the first layer's registration: compile the device planner for this model and check
        it against the host references on probe loads (:func:`device_planning.self_check`; the
        compilation is then not in the first layer's first forward, whose plan time it would be).
        The EP group agrees on the outcome (every rank of it must plan alike: one object gather,
        at startup); on any rank's failure the whole group plans on the host for this model, and
        global rank 0 prints one warning line saying why. Otherwise rank 0 prints the time the
        compilation and the check took, once."""
        check = device_planning.self_check(
            self.config,
            registration.ep_size,
            registration.num_experts,
            registration.device,
            registration.ep_rank,
        )
        outcomes = _gather_on(registration.ep_group, check.failure)
        failures = [(rank, failure) for rank, failure in enumerate(outcomes) if failure is not None]
        self.device_planner_check = check
        if failures:
            rank, failure = failures[0]
            where = (
                ""
                if len(failures) == len(outcomes)
                else f" on EP rank{'s' if len(failures) > 1 else ''} {', '.join(str(r) for r, _ in failures)}"
            )
            if registration.preprocess_graphed:  # the host planner cannot run inside that graph
                raise RuntimeError(
                    f"the device planner failed its self-check{where} ({check.implementation}): "
                    f"{failure}; --cuda-graph-modules moe_preprocess needs it: leave moe_preprocess "
                    "out of --cuda-graph-modules to plan on the host"
                )
            self.planner, self.plans_on_device = "host", False
            _print_on_rank_zero(
                f"ultraep: warning: the device planner failed its self-check{where} "
                f"({check.implementation}): {failure}; planning on the host for this model "
                f"(--moe-balancer-planner host skips the check and this warning)"
            )
        else:
            _print_on_rank_zero(
                f"ultraep: device planner ready in {check.seconds:.2f} s ({check.implementation}; "
                f"its plans of probe loads at R={registration.ep_size}, "
                f"E={registration.num_experts}, S={self.config.num_slots} "
                f"({check.replicas} replicas) equal the host's references)"
            )

    def _ensure_ring(self) -> VirtualLayerRing:
        if self.ring is None:
            per_forward = sum(registered.runs_per_forward for registered in self.registrations)
            overlapped = any(registered.overlapped for registered in self.registrations)
            self.ring = VirtualLayerRing(
                self.ring_size or per_forward * schedule_inflight_microbatches(overlapped)
            )
        return self.ring

    # -- planning ----------------------------------------------------------------------------------
    @native_torch
    def plan_on_host(
        self, state: InvocationState, balancer: LayerBalancer, load: torch.Tensor, ep_rank: int
    ) -> Invocation:
        """Plan one invocation with the layer's ``balancer`` on the exact load (host ``[R, E]``)
        into ``state`` and, in training, park it in the ring for its backward."""
        t0 = time.perf_counter()
        balanced = balancer.balances(load)
        plan = balancer.plan(load, balances=balanced)
        plan_seconds = time.perf_counter() - t0
        return self._invocation(
            state, load, plan, ep_rank, balanced=balanced, plan_seconds=plan_seconds, t0=t0
        )

    def host_copy_stream(self, device: torch.device):
        """The CUDA stream the device plans' host halves cross on (``None`` off CUDA)."""
        if device.type != "cuda":
            return None
        if device not in self._host_copy_streams:
            self._host_copy_streams[device] = torch.cuda.Stream(device=device)
        return self._host_copy_streams[device]

    @native_torch
    def plan_on_device(
        self, state: InvocationState, load: torch.Tensor, ep_rank: int
    ) -> DevicePlanned:
        """Queue one invocation's plan on the device (``--moe-balancer-planner device``): the load
        ``[R, E]`` on the device, nothing read on the host. :meth:`complete_device_plan` makes the
        invocation once its host half has crossed."""
        t0 = time.perf_counter()
        planned = device_planning.plan_on_device(
            load, self.config, ep_rank, training=state.training, grad_enabled=state.grad_enabled
        )
        seconds = time.perf_counter() - t0
        self.overheads.host_seconds += seconds
        return dataclasses.replace(planned, plan_seconds=seconds)

    @native_torch
    def complete_device_plan(
        self,
        state: InvocationState,
        host_half: torch.Tensor,
        *,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        plan_seconds: float,
    ) -> Invocation:
        """The invocation of a plan made on the device (:class:`DevicePlanned`), from the host copy
        of its host half, into ``state`` (planned in ``state``'s mode)."""
        t0 = time.perf_counter()
        load, plan, balanced = device_planning.unpack_host_half(
            host_half, ep_size, num_experts, self.config.num_slots
        )
        return self._invocation(
            state, load, plan, ep_rank, balanced=balanced, plan_seconds=plan_seconds, t0=t0
        )

    def _invocation(
        self,
        state: InvocationState,
        load: torch.Tensor,
        plan,
        ep_rank: int,
        *,
        balanced: bool,
        plan_seconds: float,
        t0: float,
    ) -> Invocation:
        """The invocation of a host plan, into ``state``; in training ``state`` is parked in the
        ring for its backward."""
        replicated = self.config.num_slots > 0 and bool((plan.slot_expert.numpy() >= 0).any())
        schedule_builder = (
            functools.partial(self.buffer.schedule, plan.slot_expert, plan.num_experts)
            if replicated
            else None
        )
        vid = self._ensure_ring().acquire(state.layer_number) if state.training else None
        invocation = plan_invocation(
            plan,
            load,
            ep_rank,
            layer_number=state.layer_number,
            vid=vid,
            schedule_builder=schedule_builder,
            balanced=balanced,
            plan_seconds=plan_seconds,
        )
        state.invocation = invocation
        if state.training:
            self.ring.store(vid, state)
            if not state.grad_enabled:  # a checkpointed forward: replayed in the backward
                self.ring.park_for_recompute(state.layer_number, vid, state.runs_per_forward)
        self._unobserved.append((invocation, state.training))
        self.overheads.plan_seconds += plan_seconds
        self.overheads.host_seconds += time.perf_counter() - t0
        self.overheads.invocations += 1
        return invocation

    @native_torch
    def observe(self) -> None:
        """Hand the invocations planned since the last call to the observers (statistics, trace).

        Called by the layer once its forward has queued its work, not between the wait for the load
        and the reroute, where every microsecond of host work is a microsecond the device idles.
        """
        t0 = time.perf_counter()
        for invocation, training in self._unobserved:
            for observer in self.observers:
                observer.on_invocation(invocation, training)
        self._unobserved.clear()
        self.overheads.observe_seconds += time.perf_counter() - t0

    def replay(self, layer_number: int) -> InvocationState:
        """The record of a checkpointed forward, for its activation-recompute replay."""
        return self.ring.get(self.ring.pop_for_recompute(layer_number))

    def record(self, vid: int) -> InvocationState:
        """The record the ring carries for virtual layer id ``vid``."""
        return self.ring.get(vid)

    def release(self, invocation: Invocation) -> None:
        """Free the invocation's ring slot (after its backward)."""
        if invocation.vid is not None:
            self.ring.release(invocation.vid)

    def add_reroute_seconds(self, seconds: float) -> None:
        """Host time of a device reroute (:attr:`Overheads.reroute_seconds`)."""
        self.overheads.reroute_seconds += seconds

    # -- transfers ---------------------------------------------------------------------------------
    def _issued(self, handle: TransferHandle) -> None:
        self._transfer = handle
        if not self.overlap:
            self.wait(handle)

    def wait(self, handle: Optional[TransferHandle]) -> None:
        """Complete a transfer (counted in :class:`Overheads`); nothing to do once it is done."""
        if handle is not None and not handle.done():
            handle.wait()
            self.overheads.transfer_seconds += handle.host_seconds
            self.overheads.transfer_blocked_seconds += handle.host_seconds - handle.host_cpu_seconds

    def needs_weights(self, invocation: Invocation) -> bool:
        """Whether :meth:`start_weights` has anything to copy for ``invocation``: it has replicas and
        the buffer does not hold (or receive) them already."""
        return invocation.schedule_builder is not None and self.holder is not invocation

    @native_torch
    def start_weights(self, invocation: Invocation, main_weights: List[List[torch.Tensor]]) -> None:
        """Start copying the invocation's replicated main experts (``main_weights``: ``[local
        expert][part]``, what the distribution moves) into the shared weight buffer (forward).
        Collective on the EP group; nothing to do when the buffer already holds them.
        Asynchronous: see :meth:`wait_weights`."""
        if not self.needs_weights(invocation):
            return
        self.wait(self._transfer)
        handle = self.buffer.distribute_weights(invocation.schedule, main_weights, async_op=True)
        self.holder = invocation
        self._issued(handle)

    def start_rematerialization(
        self, invocation: Invocation, main_weights: List[List[torch.Tensor]]
    ) -> None:
        """The backward's copy of the invocation's replicas back into the shared weight buffer
        (later layers, or under the overlapped schedule another microbatch's forward, overwrote
        them); nothing to do when the buffer still holds them."""
        self.start_weights(invocation, main_weights)

    @native_torch
    def wait_weights(self, invocation: Invocation) -> None:
        """Before the replica experts run: their weights must have arrived."""
        if invocation.schedule_builder is None:
            return
        if self.holder is not invocation:
            raise RuntimeError(
                f"UltraEP: MoE layer {invocation.layer_number} uses the replica weights "
                "of another invocation (the weight buffer was not re-materialized)"
            )
        self.wait(self._transfer)

    @native_torch
    def start_reduction(
        self,
        invocation: Invocation,
        targets: List[List[torch.Tensor]],
        hosted_grads: Dict[int, Optional[list]],
        *,
        fold_on_stream: bool,
    ) -> TransferHandle:
        """Start reducing the replica gradients into the main experts' (collective on the EP group),
        as soon as the replicas' backward is done; :meth:`wait` on the handle folds them in.

        Args:
            targets: ``[local expert][k]`` fp32 tensors the reduction adds the replica gradients to.
            hosted_grads: per redundant slot this rank hosts, its replica's weight gradients
                (``None``: zeros); the reduction copies them into the shared fp32 buffer on its own
                stream and sends those.
            fold_on_stream: fold into ``targets`` on the transfer's stream (else at :meth:`wait`).
        """
        self.wait(self._transfer)  # a previous reduction's fold left to wait() reads the slots
        handle = self.buffer.reduce_gradients(
            invocation.schedule,
            targets,
            async_op=True,
            hosted_grads=hosted_grads,
            fold_on_stream=fold_on_stream,
        )
        self._issued(handle)
        return handle

    def replica_weight_views(self, slot: int) -> List[torch.Tensor]:
        """``[part]`` the shared weight buffer's views of redundant slot ``slot``."""
        return self.buffer.weight_views(slot)

    def weight_buffer(self) -> torch.Tensor:
        """The shared replica weight buffer (flat): the storage the replica experts' saved weights
        are views of."""
        return self.buffer.replica_weights

    def holds(self, invocation: Invocation) -> bool:
        """Whether the weight buffer holds (or receives) ``invocation``'s replicas."""
        return self.holder is invocation

    def replica_delayed_weight_grads(self) -> list:
        """The replica experts' delayed weight gradients (``--delay-wgrad-compute``), flat."""
        return self.replica_experts.delayed_weight_grads()

    def run_replicas(
        self, slot_weights, tokens: torch.Tensor, rows_per_slot: Sequence[int], probs: torch.Tensor
    ) -> torch.Tensor:
        """The redundant slots' experts on ``tokens`` (sorted by slot) with ``slot_weights``."""
        return self.replica_experts(slot_weights, tokens, rows_per_slot, probs)

    # -- training loop -----------------------------------------------------------------------------
    def end_iteration(self, iteration: int) -> None:
        """Called once per training iteration, when its gradients are final (before the optimizer
        step): through :meth:`ending_iterations`, or by a caller that drives the layers itself."""
        self.observe()
        if self.trace is not None:
            self.trace.end_iteration(iteration)

    def ending_iterations(
        self, finalize_model_grads: Callable, current_iteration: Callable[[], int]
    ) -> Callable:
        """The model's ``finalize_model_grads_func`` followed by the end of this context's iteration.

        Megatron's schedules call a model config's ``finalize_model_grads_func`` once per training
        iteration, after the last backward, and never in evaluation; ending the iteration there makes
        the boundary the model's own (two models in one process each end theirs).

        Args:
            finalize_model_grads: the function megatron (or a model builder) installed.
            current_iteration: the number of the iteration that ends, as megatron's log gives it.
        """

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
    """``--moe-balancer-planner``: ``planner`` as given, else ``host``
    (``balancing_context_from_args`` passes ``device`` where the preprocessing is captured:
    ``capabilities.default_planner``)."""
    if planner is None:
        return "host"
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
    if planner == "device" and balancer != ULTRAEP:
        raise ValueError(f"the device planner plans {ULTRAEP} only, not {balancer}")
    return planner


def _gather_on(group, value) -> list:
    """``value`` of every rank of ``group``, in group-rank order (startup only: a blocking object
    gather); ``[value]`` without torch.distributed."""
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
    """A process group of the EP ranks for the replica transfers alone.

    Its own communicator lets NCCL run the transfers concurrently with the token all-to-all on the
    EP group (one communicator serializes its operations), and keeps gloo's point-to-point tags apart
    from the EP group's collectives. Only the EP group's ranks take part in creating it.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(ep_group) == 1:
        return ep_group
    return dist.new_group(
        ranks=dist.get_process_group_ranks(ep_group),
        backend=dist.get_backend(ep_group),
        use_local_synchronization=True,
    )
