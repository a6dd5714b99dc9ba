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
:class:`~.invocation.Invocation`: the dispatcher produces it from the exact load (one
device-to-host copy: of the load with the host planner, of the plan with the device planner), the
layer and its backward consume it. Nothing here reads device memory, except the device planner's
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ultraep_megatron.dataplane import ReplicaBuffer, TransferHandle
from ultraep_megatron.megatron import device_planning
from ultraep_megatron.megatron.device_planning import PLANNERS, DevicePlanned
from ultraep_megatron.megatron.capabilities import preprocess_graphed
from ultraep_megatron.megatron.expert_slots import ReplicaExperts, build_replica_experts
from ultraep_megatron.megatron.invocation import Invocation, plan_invocation
from ultraep_megatron.megatron.native_torch import native_torch
from ultraep_megatron.megatron.observers import BalancerStats, TraceRecorder
from ultraep_megatron.megatron.ring import VirtualLayerRing, invocations_per_forward, max_inflight_microbatches
from ultraep_megatron.planner import BalancerConfig
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

    def __init__(self, config: BalancerConfig, *, hardware: Optional[str] = None,
                 ring_size: Optional[int] = None, trace_dir: Optional[str] = None, overlap: bool = True,
                 check_plans: bool = False, planner: Optional[str] = None):
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
        self.layers: List[object] = []
        self.buffer: Optional[ReplicaBuffer] = None
        self.replica_experts: Optional[ReplicaExperts] = None  # the redundant slots' module
        self.ring: Optional[VirtualLayerRing] = None
        self.stats = BalancerStats()
        self.trace = TraceRecorder(trace_dir, config, hardware) if trace_dir else None
        self.observers = [self.stats] + ([self.trace] if self.trace else [])
        self.overheads = Overheads()
        self.holder: Optional[Invocation] = None  # whose replicas the weight buffer holds (or receives)
        self._transfer: Optional[TransferHandle] = None  # the latest transfer issued
        self._reductions: Dict[int, Tuple[TransferHandle, list]] = {}  # id(invocation) -> (handle, targets)
        self._unobserved: List[tuple] = []  # (layer, invocation, training) not yet seen by the observers
        self._host_copy_streams: Dict[torch.device, object] = {}

    # -- setup ---------------------------------------------------------------------------------
    def register(self, layer) -> None:
        """Add a balanced MoE layer; the first one sizes the shared buffers."""
        shapes = [shape for _, shape in layer.expert_param_shapes]
        param, layout = layer.main_expert_param_lists()[0][0], layer.expert_weight_layout
        if self.buffer is None:
            # Replica gradients in the parameters' high-precision shapes; weights in the layout
            # of what the main experts hold (bytes of quantized parameters).
            self.buffer = ReplicaBuffer(self.config.num_slots, shapes, layout.dtype, device=param.device,
                                        group=_data_plane_group(layer.token_dispatcher.ep_group),
                                        weight_shapes=layout.shapes)
            if self.config.num_slots > 0:
                # Built now, not at the first forward: by then the training loop has hung
                # process-group handles on the config, which the experts' constructor cannot copy.
                self.replica_experts = build_replica_experts(layer, self.config.num_slots)
        elif self.buffer.expert_shapes != [torch.Size(s) for s in shapes] or \
                self.buffer.weight_shapes != layout.shapes or self.buffer.replica_weights.dtype != layout.dtype:
            raise ValueError("UltraEP shares replica slots across the MoE layers of a model: all must "
                             "have the same expert shapes and dtype")
        if self.plans_on_device and len(self.layers) == 0:
            self._check_device_planner(layer, param.device)
        self.layers.append(layer)
        self.ring = None  # sized lazily, once the model (and the schedule) is known

    @native_torch
    def _check_device_planner(self, layer, device: torch.device) -> None:
        """At the first layer's registration: compile the device planner for this model and check
        it against the host references on probe loads (:func:`device_planning.self_check`; the
        compilation is then not in the first layer's first forward, whose plan time it would be).
        The EP group agrees on the outcome (every rank of it must plan alike: one object gather,
        at startup); on any rank's failure the whole group plans on the host for this model, and
        global rank 0 prints one warning line saying why. Otherwise rank 0 prints the time the
        compilation and the check took, once."""
        dispatcher = layer.token_dispatcher
        check = device_planning.self_check(self.config, dispatcher.ep_size, layer.config.num_moe_experts,
                                           device, dispatcher.ep_rank)
        outcomes = _gather_on(dispatcher.ep_group, check.failure)
        failures = [(rank, failure) for rank, failure in enumerate(outcomes) if failure is not None]
        self.device_planner_check = check
        if failures:
            rank, failure = failures[0]
            where = "" if len(failures) == len(outcomes) else \
                f" on EP rank{'s' if len(failures) > 1 else ''} {', '.join(str(r) for r, _ in failures)}"
            if preprocess_graphed(layer.config):  # the host planner cannot run inside that graph
                raise RuntimeError(f"the device planner failed its self-check{where} ({check.implementation}): "
                                   f"{failure}; --cuda-graph-modules moe_preprocess needs it: leave moe_preprocess "
                                   "out of --cuda-graph-modules to plan on the host")
            self.planner, self.plans_on_device = "host", False
            _print_on_rank_zero(f"ultraep: warning: the device planner failed its self-check{where} "
                                f"({check.implementation}): {failure}; planning on the host for this model "
                                f"(--moe-balancer-planner host skips the check and this warning)")
        else:
            _print_on_rank_zero(f"ultraep: device planner ready in {check.seconds:.2f} s ({check.implementation}; "
                                f"its plans of probe loads at R={dispatcher.ep_size}, "
                                f"E={layer.config.num_moe_experts}, S={self.config.num_slots} "
                                f"({check.replicas} replicas) equal the host's references)")

    def _ensure_ring(self) -> VirtualLayerRing:
        if self.ring is None:
            per_forward = sum(invocations_per_forward(layer) for layer in self.layers)
            overlapped = any(overlapped_schedule(layer.config) for layer in self.layers)
            self.ring = VirtualLayerRing(self.ring_size or per_forward * _schedule_inflight(overlapped))
        return self.ring

    # -- planning ----------------------------------------------------------------------------------
    @native_torch
    def plan(self, layer, load: torch.Tensor, ep_rank: int, *, training: bool,
             grad_enabled: bool) -> Invocation:
        """Plan one invocation on the exact load (host ``[R, E]``) and, in training, park it in the
        ring for its backward."""
        t0 = time.perf_counter()
        balanced = layer.balancer.balances(load)
        plan = layer.balancer.plan(load, balances=balanced)
        plan_seconds = time.perf_counter() - t0
        return self._invocation(layer, load, plan, ep_rank, balanced=balanced, training=training,
                                grad_enabled=grad_enabled, plan_seconds=plan_seconds, t0=t0)

    def host_copy_stream(self, device: torch.device):
        """The CUDA stream the device plans' host halves cross on (``None`` off CUDA)."""
        if device.type != "cuda":
            return None
        if device not in self._host_copy_streams:
            self._host_copy_streams[device] = torch.cuda.Stream(device=device)
        return self._host_copy_streams[device]

    @native_torch
    def plan_on_device(self, layer, load: torch.Tensor, ep_rank: int, *, training: bool,
                       grad_enabled: bool) -> DevicePlanned:
        """Queue one invocation's plan on the device (``--moe-balancer-planner device``): the load
        ``[R, E]`` on the device, nothing read on the host. :meth:`complete_device_plan` makes the
        invocation once its host half has crossed."""
        t0 = time.perf_counter()
        planned = device_planning.plan_on_device(load, self.config, ep_rank, training=training,
                                                 grad_enabled=grad_enabled)
        seconds = time.perf_counter() - t0
        self.overheads.host_seconds += seconds
        return dataclasses.replace(planned, plan_seconds=seconds)

    @native_torch
    def complete_device_plan(self, layer, host_half: torch.Tensor, *, training: bool, grad_enabled: bool,
                             plan_seconds: float) -> Invocation:
        """The invocation of a plan made on the device (:class:`DevicePlanned`), from the host copy
        of its host half; ``training`` / ``grad_enabled``: the layer's mode when it was planned."""
        t0 = time.perf_counter()
        dispatcher = layer.token_dispatcher
        load, plan, balanced = device_planning.unpack_host_half(host_half, dispatcher.ep_size,
                                                                dispatcher.num_logical_experts, self.config.num_slots)
        return self._invocation(layer, load, plan, dispatcher.ep_rank, balanced=balanced, training=training,
                                grad_enabled=grad_enabled, plan_seconds=plan_seconds, t0=t0)

    def _invocation(self, layer, load: torch.Tensor, plan, ep_rank: int, *, balanced: bool, training: bool,
                    grad_enabled: bool, plan_seconds: float, t0: float) -> Invocation:
        """The invocation of a host plan; in training parked in the ring for its backward."""
        replicated = self.config.num_slots > 0 and bool((plan.slot_expert.numpy() >= 0).any())
        schedule_builder = (functools.partial(self.buffer.schedule, plan.slot_expert, plan.num_experts)
                            if replicated else None)
        vid = self._ensure_ring().acquire(layer.layer_number) if training else None
        invocation = plan_invocation(plan, load, ep_rank, layer_number=layer.layer_number, vid=vid,
                                     schedule_builder=schedule_builder, balanced=balanced,
                                     plan_seconds=plan_seconds)
        if training:
            self.ring.store(vid, invocation)
            if not grad_enabled:  # a checkpointed forward: replayed in the backward
                self.ring.park_for_recompute(layer.layer_number, vid, invocations_per_forward(layer))
        self._unobserved.append((layer, invocation, training))
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
        for layer, invocation, training in self._unobserved:
            for observer in self.observers:
                observer.on_invocation(layer, invocation, training)
        self._unobserved.clear()
        self.overheads.observe_seconds += time.perf_counter() - t0

    def replay(self, layer_number: int) -> Invocation:
        """The invocation of a checkpointed forward, for its activation-recompute replay."""
        return self.ring.get(self.ring.pop_for_recompute(layer_number))

    def invocation(self, vid: int) -> Invocation:
        return self.ring.get(vid)

    def release(self, invocation: Invocation) -> None:
        """Free the invocation's ring slot (after its backward)."""
        if invocation.vid is not None:
            self.ring.release(invocation.vid)

    # -- transfers ---------------------------------------------------------------------------------
    def _issued(self, handle: TransferHandle) -> None:
        self._transfer = handle
        if not self.overlap:
            self._wait(handle)

    def _wait(self, handle: Optional[TransferHandle]) -> None:
        if handle is not None and not handle.done():
            handle.wait()
            self.overheads.transfer_seconds += handle.host_seconds
            self.overheads.transfer_blocked_seconds += handle.host_seconds - handle.host_cpu_seconds

    @native_torch
    def start_weights(self, layer, invocation: Invocation) -> None:
        """Start copying the invocation's replicated main experts into the shared weight buffer
        (forward). Collective on the EP group; nothing to do when the buffer already holds them.
        Asynchronous: see :meth:`wait_weights`."""
        if invocation.schedule_builder is None or self.holder is invocation:
            return
        self._wait(self._transfer)
        handle = self.buffer.distribute_weights(invocation.schedule, layer.main_expert_weights(),
                                                async_op=True)
        self.holder = invocation
        self._issued(handle)

    def start_rematerialization(self, layer, invocation: Invocation) -> None:
        """The backward's copy of the invocation's replicas back into the shared weight buffer
        (later layers, or under the overlapped schedule another microbatch's forward, overwrote
        them); nothing to do when the buffer still holds them."""
        self.start_weights(layer, invocation)

    @native_torch
    def wait_weights(self, invocation: Invocation) -> None:
        """Before the replica experts run: their weights must have arrived."""
        if invocation.schedule_builder is None:
            return
        if self.holder is not invocation:
            raise RuntimeError(f"UltraEP: MoE layer {invocation.layer_number} uses the replica weights "
                               "of another invocation (the weight buffer was not re-materialized)")
        self._wait(self._transfer)

    @native_torch
    def start_reduction(self, layer, invocation: Invocation,
                        weight_grads: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """Start reducing the replica gradients into the main experts' (collective on the EP group),
        as soon as the replicas' backward is done; :meth:`finish_reduction` folds them in.

        Args:
            weight_grads: the replica weights' gradients, flat (slot-major, the layer's
                ``expert_param_shapes`` order; ``None`` where unset), or ``None`` where no replica
                backward ran (a rank whose redundant slots received no rows, or replica weights
                that needed no gradient). The reduction copies them into the slots this rank hosts
                (zeros where there are none) on its own stream, and sends those.
        """
        if invocation.schedule_builder is None or id(invocation) in self._reductions:
            return
        self._wait(self._transfer)  # a previous reduction's fold left to wait() reads the slots
        params = layer.main_expert_param_lists()
        use_main_grad = all(getattr(p, "main_grad", None) is not None for ps in params for p in ps)
        if use_main_grad:  # Megatron DDP: straight into the fp32 main_grad buffers
            targets, has_replica = [[p.main_grad for p in ps] for ps in params], None
            # Until finish_reduction nothing touches these main_grads (the experts' gradient
            # accumulation waits for it), unless the main experts' weight-gradient kernels write
            # them directly (gradient-accumulation fusion): only then the fold waits for wait().
            fold_on_stream = not layer.config.gradient_accumulation_fusion
        else:  # fresh fp32 gradients for the experts with a replica; the others get a zero view, never written
            replicated = set(invocation.replicated_local_experts)
            has_replica = [g in replicated for g in range(len(params))]
            zero = torch.zeros((), dtype=torch.float32, device=params[0][0].device)
            targets = [[torch.zeros(p.shape, dtype=torch.float32, device=p.device) if has else zero.expand(p.shape)
                        for p in ps]
                       for ps, has in zip(params, has_replica)]
            fold_on_stream = True
        handle = self.buffer.reduce_gradients(invocation.schedule, targets, async_op=True,
                                              hosted_grads=self._hosted_grads(layer, invocation, weight_grads),
                                              fold_on_stream=fold_on_stream)
        self._reductions[id(invocation)] = (handle, targets, has_replica)
        self._issued(handle)

    @staticmethod
    def _hosted_grads(layer, invocation: Invocation,
                      weight_grads: Optional[Sequence[Optional[torch.Tensor]]]) -> Dict[int, Optional[list]]:
        """What each redundant slot this rank hosts reduces: its replica's weight gradients, or
        zeros (``None``) where it received no rows; an unset gradient is zeros too (an expert kernel
        may leave an empty group's gradient unwritten). The transfer copies them into the shared
        fp32 buffer on its own stream."""
        per_slot, hosted = len(layer.expert_param_shapes), {}
        for s in invocation.schedule.rank_transfers(invocation.ep_rank).hosted_slots:
            hosted[s] = (weight_grads[s * per_slot : (s + 1) * per_slot]
                         if weight_grads is not None and invocation.replica_rows[s] > 0 else None)
        return hosted

    @native_torch
    def finish_reduction(self, layer, invocation: Invocation) -> List[List[Optional[torch.Tensor]]]:
        """Complete the invocation's reduction; return ``[local expert][k]`` the gradient each main
        expert parameter gains from its replicas: ``None`` for an expert without a replica, and for
        every expert where the reduction went into ``main_grad`` (Megatron DDP)."""
        main_params = layer.main_expert_param_lists()
        none = [[None] * len(expert) for expert in main_params]
        if invocation.schedule_builder is None:
            return none
        self.start_reduction(layer, invocation)  # if the replicas' backward did not start it
        handle, targets, has_replica = self._reductions.pop(id(invocation))
        self._wait(handle)
        if has_replica is None:
            return none
        return [[g.to(p.dtype) for p, g in zip(expert, grads)] if has else [None] * len(expert)
                for expert, grads, has in zip(main_params, targets, has_replica)]

    # -- training loop -----------------------------------------------------------------------------
    def end_iteration(self, iteration: int) -> None:
        """Called once per training iteration, when its gradients are final (before the optimizer
        step): through :meth:`ending_iterations`, or by a caller that drives the layers itself."""
        self.observe()
        if self.trace is not None:
            self.trace.end_iteration(iteration)

    def ending_iterations(self, finalize_model_grads: Callable, current_iteration: Callable[[], int]) -> Callable:
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
    return dist.new_group(ranks=dist.get_process_group_ranks(ep_group), backend=dist.get_backend(ep_group),
                          use_local_synchronization=True)


def _schedule_inflight(overlapped: bool = False) -> int:
    """Max in-flight microbatches per MoE layer on this rank, from Megatron's pipeline state
    (``overlapped``: megatron's combined 1F1B schedule)."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return max_inflight_microbatches(
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
            get_num_microbatches(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
            overlapped=overlapped,
        )
    except Exception:  # outside Megatron's training loop (a bare MoE layer): one microbatch
        return 2 if overlapped else 1


def overlapped_schedule(config) -> bool:
    """Whether megatron runs the layer in its overlapped 1F1B schedule
    (``--overlap-moe-expert-parallel-comm``, ``pipeline_parallel/combined_1f1b.py``): each layer cut
    into nodes (attention and pre-dispatch, dispatch, experts, combine) and one microbatch's forward
    interleaved with another's backward, on a computation and a communication stream."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
