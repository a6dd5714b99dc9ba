"""Per-process UltraEP state shared by every balanced MoE layer: the balancer choice, the redundant
slot buffers (shared across layers, §4.1), the virtual-layer ring (§7), the weight/gradient movement
and the per-layer telemetry of the current iteration.

This module holds no megatron import at module level: layers hand it plain tensors and process groups.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane import ReplicaBuffer, TransferSchedule, expert_views
from ultraep_megatron.planner import baselines
from ultraep_megatron.megatron.ring import VirtualLayerRing

BALANCERS = ("none", "ultraep", "eplb", "eplb-exact")


@dataclass(frozen=True)
class BalancerConfig:
    """What ``--moe-balancer*`` selected.

    Attributes:
        name: ``ultraep`` (exact-load quota planner), ``eplb-exact`` (EPLB's replication rule on the
            exact load, the paper's EPLB++), ``eplb`` (EPLB's rule on historical load, re-planned every
            ``eplb_interval`` microbatches from the last ``eplb_window`` microbatches of the layer).
        num_slots: redundant expert slots per EP rank.
        min_quota: smallest token quota a replica may carry (planner's ``min_quota``; ``None``: 1 % of
            the mean rank load).
        eplb_window / eplb_interval: EPLB history, in microbatches of the layer.
        ring_size: override of the virtual-layer ring capacity (default: from the pipeline schedule).
        trace_dir: if set, EP rank 0 of every EP group appends each microbatch's exact load
            ``[R, E]`` per MoE layer to ``ultraep_megatron.traces`` files there.
    """

    name: str = "ultraep"
    num_slots: int = 1
    min_quota: Optional[int] = None
    eplb_window: int = 16
    eplb_interval: int = 16
    ring_size: Optional[int] = None
    trace_dir: Optional[str] = None

    def __post_init__(self):
        if self.name not in BALANCERS[1:]:
            raise ValueError(f"--moe-balancer: unknown balancer {self.name!r}; choose from {BALANCERS}")
        if self.num_slots < 0:
            raise ValueError(f"--moe-balancer-num-slots must be >= 0, got {self.num_slots}")
        if self.min_quota is not None and self.min_quota < 1:
            raise ValueError(f"--moe-balancer-min-quota must be >= 1, got {self.min_quota}")
        if self.eplb_window < 1 or self.eplb_interval < 1:
            raise ValueError("--moe-balancer-eplb-window and --moe-balancer-eplb-interval must be >= 1")
        if self.ring_size is not None and self.ring_size < 1:
            raise ValueError(f"--moe-balancer-ring-size must be >= 1, got {self.ring_size}")

    def build(self, num_experts: int, ep_size: int) -> "LayerBalancer":
        """A fresh per-layer balancer (EPLB keeps per-layer history)."""
        return LayerBalancer(self, num_experts, ep_size)


class LayerBalancer:
    """Turns one microbatch's exact load ``[R, E]`` into a ``planner.Plan`` for one MoE layer."""

    def __init__(self, config: BalancerConfig, num_experts: int, ep_size: int):
        self.config = config
        self.num_experts, self.ep_size = num_experts, ep_size
        self._history: List[torch.Tensor] = []
        self._placement: Optional[torch.Tensor] = None  # EPLB: slot_expert [R, S] in force
        self._calls = 0

    def plan(self, load: torch.Tensor) -> "planner.Plan":
        """load: int64 [R, E] -> Plan (deterministic: every EP rank gets the same)."""
        cfg = self.config
        if cfg.name == "ultraep":
            return planner.solve(load, cfg.num_slots, min_quota=cfg.min_quota)
        if cfg.name == "eplb-exact":
            return baselines.eplb_exact(load, cfg.num_slots)
        # eplb: placement from history, refreshed every `eplb_interval` microbatches; the current
        # load is spread round-robin over the instances of that placement.
        if self._placement is None or self._calls % cfg.eplb_interval == 0:
            history = torch.stack(self._history[-cfg.eplb_window :]) if self._history else load.unsqueeze(0)
            self._placement = baselines.eplb(history, cfg.num_slots).slot_expert
        self._calls += 1
        self._history.append(load.clone())
        del self._history[: -cfg.eplb_window]
        return baselines.round_robin(load, self._placement)


@dataclass
class InvocationState:
    """One MoE invocation's plan and the all-to-all metadata derived from it.

    Attributes:
        plan: the balancing plan.
        load: int64 [R, E], the exact load it was solved on.
        main_tokens: (token, expert) rows this rank's main experts receive.
        replica_tokens_per_slot: rows this rank's redundant slots receive, length ``num_slots``.
        schedule: the data plane's transfer schedule for the plan's replicas (forward distribution,
            backward re-materialization and gradient reduction all use it).
        vid: virtual layer id in the ring, ``None`` when no backward will follow (eval).
    """

    plan: "planner.Plan"
    load: torch.Tensor
    main_tokens: int
    replica_tokens_per_slot: List[int]
    schedule: Optional[TransferSchedule] = None
    vid: Optional[int] = None


class Runtime:
    """Process-wide UltraEP state; one per training process (see ``get_runtime``)."""

    def __init__(self):
        self.layers: List[object] = []  # balanced MoE layers built in this process
        self.slots: Optional[ReplicaSlots] = None  # shared by every MoE layer of this process
        self.ring: Optional[VirtualLayerRing] = None
        # (experts module, parameter names) that computes the redundant slots; built on first use.
        self._replica_experts = None
        self.stats: Dict[int, Dict[str, float]] = {}
        # Load-trace recording (--moe-balancer-trace-dir): iteration being recorded, microbatch
        # counters per layer within it, and the writer (EP rank 0 of each group only).
        self.iteration: Optional[int] = None
        self._microbatch: Dict[int, int] = {}
        self._trace = None
        # Cumulative wall time of the balancing overheads, for benchmarks and the training log.
        self.transfer_seconds = 0.0
        self.plan_seconds = 0.0
        self.reroute_seconds = 0.0

    # -- setup ---------------------------------------------------------------------------------
    def register_layer(self, layer) -> None:
        self.layers.append(layer)
        param = layer.main_expert_param_lists()[0][0]
        shapes, num_slots = layer.expert_param_shapes, layer.balancer_config.num_slots
        if self.slots is None:
            self.slots = ReplicaSlots(num_slots, shapes, param.dtype, param.device,
                                      group=layer.token_dispatcher.ep_group)
        elif self.slots.param_shapes != shapes or self.slots.num_slots != num_slots:
            raise ValueError("UltraEP shares replica slots across MoE layers: all must have the same expert shape")
        self.ring = None  # sized lazily, once the model (and the schedule) is known

    def replica_experts(self, layer):
        """The storage-less experts module of ``layer``'s class that runs the redundant slots, and
        its per-slot parameter names (one for all layers, like the buffers)."""
        if self._replica_experts is None and self.slots.num_slots > 0:
            from ultraep_megatron.megatron.expert_slots import build_replica_experts

            self._replica_experts = build_replica_experts(layer, self.slots.num_slots)
        return self._replica_experts

    def _ensure_ring(self, layer) -> VirtualLayerRing:
        if self.ring is None:
            size = layer.balancer_config.ring_size or len(self.layers) * _schedule_inflight()
            self.ring = VirtualLayerRing(size)
        return self.ring

    # -- forward -------------------------------------------------------------------------------
    def plan(self, layer, load: torch.Tensor, *, training: bool, grad_enabled: bool) -> InvocationState:
        """Solve the plan of one invocation and, in training, park it in the ring."""
        t0 = time.perf_counter()
        plan = layer.balancer.plan(load)
        plan_time = time.perf_counter() - t0
        self.plan_seconds += plan_time
        state = self._state(layer, plan, load)
        if training:
            ring = self._ensure_ring(layer)
            state.vid = ring.acquire(layer.layer_number, state)
            if not grad_enabled:  # checkpointed forward: replayed in the backward
                ring.park_for_recompute(layer.layer_number, state.vid)
        if training:  # evaluation is balanced too, but only training is logged and traced
            self._record(layer, load, plan, plan_time)
            if layer.balancer_config.trace_dir:
                self._trace_append(layer, load)
        return state

    # -- load traces -----------------------------------------------------------------------------
    def _trace_append(self, layer, load: torch.Tensor) -> None:
        dispatcher = layer.token_dispatcher
        if self.iteration is None:
            self.iteration = _megatron_iteration() + 1
        microbatch = self._microbatch.get(layer.layer_number, 0)
        self._microbatch[layer.layer_number] = microbatch + 1
        if dispatcher.ep_rank != 0:
            return
        if self._trace is None:
            import torch.distributed as dist

            from ultraep_megatron.traces import TraceWriter, trace_path

            group_id = dist.get_global_rank(dispatcher.ep_group, 0) if dist.is_initialized() else 0
            cfg = layer.config
            meta = {
                "balancer": layer.balancer_config.name,
                "num_slots": layer.balancer_config.num_slots,
                "hidden_size": cfg.hidden_size,
                "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size,
                "swiglu": bool(cfg.gated_linear_unit),
                "topk": cfg.moe_router_topk,
                "num_layers": cfg.num_layers,  # MTP layers have ids num_layers + 1, ...
                "mtp_num_layers": cfg.mtp_num_layers or 0,
                "first_global_rank": group_id,
            }
            path = trace_path(layer.balancer_config.trace_dir, group_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._trace = TraceWriter(path, num_ranks=load.shape[0], num_experts=load.shape[1], meta=meta)
        self._trace.append(self.iteration, microbatch, layer.layer_number, load)

    def end_iteration(self, iteration: int) -> None:
        """Called once per training iteration (after the optimizer step): commit the trace."""
        if self._trace is not None:
            self._trace.flush_iteration(self.iteration if self.iteration is not None else iteration)
        self.iteration = iteration + 1
        self._microbatch.clear()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def replay_state(self, layer_number: int, local_load: torch.Tensor, ep_rank: int) -> InvocationState:
        """The stored state of a checkpointed forward, for its activation-recompute replay."""
        vid = self.ring.pop_for_recompute(layer_number)
        state: InvocationState = self.ring.get(vid)
        if not torch.equal(state.load[ep_rank], local_load):
            raise RuntimeError(
                f"MoE layer {layer_number}: recomputed routing differs from the checkpointed forward; "
                "recompute must be deterministic (same RNG state, same inputs)"
            )
        return state

    def _state(self, layer, plan, load) -> InvocationState:
        L = layer.num_local_experts
        rank, P = layer.token_dispatcher.ep_rank, layer.token_dispatcher.slots_per_rank
        # plan.physical_split [R_src, R * P]: tokens each source sends to each physical slot.
        received = plan.physical_split[:, rank * P : (rank + 1) * P].sum(dim=0)
        schedule = self.slots.schedule(plan.slot_expert, plan.num_experts) if self.slots.num_slots else None
        return InvocationState(plan=plan, load=load, main_tokens=int(received[:L].sum()),
                               replica_tokens_per_slot=received[L:].tolist(), schedule=schedule)

    def state(self, vid: int) -> InvocationState:
        return self.ring.get(vid)

    def release(self, vid: Optional[int]) -> None:
        if vid is not None:
            self.ring.release(vid)

    # -- weights and gradients ------------------------------------------------------------------
    def materialize(self, layer, state: InvocationState) -> None:
        """Copy every replicated main expert into its hosts' redundant slots (skip if already there).

        Every EP rank runs the same sequence of MoE invocations, so they all skip or all transfer.
        """
        if self.slots.holder is state or state.schedule is None:
            return
        t0 = time.perf_counter()
        self.slots.distribute_weights(state.schedule, layer.main_expert_param_lists())
        self.transfer_seconds += time.perf_counter() - t0
        self.slots.holder = state

    def reduce_replica_grads(self, layer, state: InvocationState) -> List[Optional[torch.Tensor]]:
        """Reduce the replica gradient buffer into the main experts; return grads for main params.

        Under Megatron DDP the sums go straight into ``param.main_grad`` (fp32) and ``None`` is
        returned for that parameter; otherwise they are returned as the parameter's gradient.
        """
        params = layer.main_expert_param_lists()
        if state.schedule is None:
            return [None] * sum(len(p) for p in params)
        t0 = time.perf_counter()
        use_main_grad = all(getattr(p, "main_grad", None) is not None for ps in params for p in ps)
        if use_main_grad:
            targets = [[p.main_grad for p in ps] for ps in params]
        else:
            targets = [[torch.zeros_like(p, dtype=torch.float32) for p in ps] for ps in params]
        self.slots.reduce_gradients(state.schedule, targets)
        self.transfer_seconds += time.perf_counter() - t0
        if use_main_grad:
            return [None] * sum(len(p) for p in params)
        return [g.to(p.dtype) for ps, gs in zip(params, targets) for p, g in zip(ps, gs)]

    # -- telemetry --------------------------------------------------------------------------------
    def _record(self, layer, load, plan, plan_time) -> None:
        m = planner.metrics(load, plan)
        entry = self.stats.setdefault(layer.layer_number, {"count": 0})
        entry["count"] += 1
        for key in ("imbalance_before", "imbalance_after", "replicas", "max_fanout", "inflight_ratio"):
            entry[key] = entry.get(key, 0.0) + float(m[key])
        entry["plan_ms"] = entry.get("plan_ms", 0.0) + plan_time * 1e3

    def pop_stats(self) -> Dict[int, Dict[str, float]]:
        """Per-layer averages over the microbatches since the last call."""
        out = {
            layer: {k: v / s["count"] for k, v in s.items() if k != "count"}
            for layer, s in sorted(self.stats.items())
        }
        self.stats = {}
        return out


def _megatron_iteration() -> int:
    """The iteration Megatron's training loop starts from (0, or the resumed checkpoint's)."""
    try:
        from megatron.training.global_vars import get_args

        return int(get_args().iteration)
    except Exception:
        return 0


def _schedule_inflight() -> int:
    """Max in-flight microbatches per MoE layer on this rank, from Megatron's pipeline state."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        from ultraep_megatron.megatron.ring import max_inflight_microbatches

        return max_inflight_microbatches(
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
            get_num_microbatches(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
        )
    except Exception:  # outside Megatron's training loop (a bare MoE layer): one microbatch
        return 1


class ReplicaSlots(ReplicaBuffer):
    """The data plane's replica buffer, with the views the expert compute needs.

    ``replica_weights`` [num_slots, expert_numel] (expert dtype) and ``replica_grads`` [num_slots,
    expert_numel] (fp32): plain tensors, never ``nn.Parameter`` (not in DDP buckets, the optimizer or
    checkpoints), one pair per process whatever the number of MoE layers (§4.1). ``holder`` is the
    invocation whose replicas ``replica_weights`` holds now.
    """

    def __init__(self, num_slots, param_shapes, dtype, device, *, group):
        super().__init__(num_slots, [shape for _, shape in param_shapes], dtype, device=device, group=group)
        self.param_shapes = list(param_shapes)
        self.holder: Optional[object] = None

    def weight_views(self) -> List[List[torch.Tensor]]:
        """Per slot, the expert's parameters as views into ``replica_weights``."""
        return [expert_views(self.replica_weights[s], self.expert_shapes) for s in range(self.num_slots)]

    def accumulate_grad(self, slot: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Add one replica's weight gradients into its row of ``replica_grads``."""
        for view, g in zip(expert_views(self.replica_grads[slot], self.expert_shapes), grads):
            if g is not None:
                view.add_(g.float())


_RUNTIME: Optional[Runtime] = None


def get_runtime() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime()
        atexit.register(_RUNTIME.close)  # commit a trace's last records on a clean exit
    return _RUNTIME


def reset_runtime() -> None:
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.close()
    _RUNTIME = None
