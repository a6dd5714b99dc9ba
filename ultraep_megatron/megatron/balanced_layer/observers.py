"""Observers of every balanced invocation's :class:`~.invocation.HostPlan`, fed by
``BalancingContext.observe``: :class:`BalancerStats` (per-layer figures for the log and dashboards)
and :class:`TraceRecorder` (every training invocation's load, ``--moe-balancer-trace-dir``).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional

from ultraep_megatron.megatron.balanced_layer.invocation import HostPlan
from ultraep_megatron.planner import BalancerConfig


class BalancerStats:
    """Observer: per-layer balancing figures (``planner.metrics`` on each plan, with the model's
    NVLink domains; whether the load reached the balancer's trigger; plan time) of the training
    invocations, averaged over the microbatches since the last :meth:`pop`. Evaluation is balanced
    too, but does not mix into the training iteration's figures."""

    METRICS = (
        "imbalance_before",
        "imbalance_after",
        "replicas",
        "max_fanout",
        "inflight_ratio",
        "cross_domain_replicas",
        "memory_spread_before",
        "memory_spread_after",
    )
    #: Every figure :meth:`pop` returns: ``planner.metrics``' above, plus the balancer's own.
    RECORDED = METRICS + ("balanced_fraction", "plan_ms")

    def __init__(self, domain_size: Optional[int] = None):
        self.domain_size = (
            domain_size  # the model's NVLink domains (``--moe-balancer-domain-size``)
        )
        self._sums: Dict[int, Dict[str, float]] = {}

    def on_invocation(self, layer_number: int, plan: HostPlan, training: bool) -> None:
        if not training:
            return
        m = plan.metrics()  # the plan record's figures: planner.metrics with the model's domains
        entry = self._sums.setdefault(layer_number, {"count": 0})
        entry["count"] += 1
        for key in self.METRICS:
            entry[key] = entry.get(key, 0.0) + float(m[key])
        # Share of the microbatches balanced at all (ultraep's trigger skips the others).
        entry["balanced_fraction"] = entry.get("balanced_fraction", 0.0) + float(plan.balanced)
        entry["plan_ms"] = entry.get("plan_ms", 0.0) + plan.plan_seconds * 1e3

    def pop(self) -> Dict[int, Dict[str, float]]:
        """{layer: {metric: mean}} since the last call."""
        out = {
            layer: {k: v / s["count"] for k, v in s.items() if k != "count"}
            for layer, s in sorted(self._sums.items())
        }
        self._sums = {}
        return out


class TraceRecorder:
    """Observer: appends the exact ``[R, E]`` load of every training invocation to the trace file of
    its EP group (written by EP rank 0 of each group; ``--moe-balancer-trace-dir``).

    Records are numbered by the training loop's iterations: the model's iteration hook tells the
    recorder how its loop numbers the running iteration (:meth:`follow`: megatron's
    ``curr_iteration + 1`` under ``pretrain_gpt.py``, Bridge's ``train_state.step + 1``), which
    numbers the first iteration recorded (a resumed run's too); each :meth:`end_iteration` numbers
    the next. Without a hook (a caller driving the layers itself) the first iteration is 1."""

    def __init__(self, trace_dir: str, balancer_config: BalancerConfig, hardware: Optional[str]):
        self.trace_dir, self.balancer_config, self.hardware = trace_dir, balancer_config, hardware
        self.iteration: Optional[int] = None
        self._current_iteration: Optional[Callable[[], int]] = None
        self._microbatch: Dict[int, int] = {}
        self._writer = None
        self._ep_group = self._model_config = None

    def follow(self, current_iteration: Callable[[], int]) -> None:
        """Number the iterations as the training loop does: ``current_iteration()`` is the number
        of the iteration running (read at the first invocation recorded)."""
        self._current_iteration = current_iteration

    def describe(self, ep_group, model_config) -> None:
        """The model the trace records: its EP group (whose rank 0 writes) and megatron's
        ``TransformerConfig`` (the trace's metadata)."""
        self._ep_group, self._model_config = ep_group, model_config

    def on_invocation(
        self, layer_number: int, plan: HostPlan, training: bool, ep_rank: int
    ) -> None:
        if not training:
            return
        if self.iteration is None:
            self.iteration = (
                int(self._current_iteration()) if self._current_iteration is not None else 1
            )
        microbatch = self._microbatch.get(layer_number, 0)
        self._microbatch[layer_number] = microbatch + 1
        if ep_rank != 0:
            return
        if self._writer is None:
            self._writer = self._open(plan.load.shape)
        self._writer.append(self.iteration, microbatch, layer_number, plan.load)

    def _open(self, shape):
        import torch.distributed as dist

        from ultraep_megatron.traces import TraceWriter, trace_path

        group = self._ep_group
        first_global_rank = dist.get_global_rank(group, 0) if dist.is_initialized() else 0
        cfg = self._model_config
        config = self.balancer_config
        meta = {
            "balancer": config.name,
            "num_slots": config.num_slots,
            "min_quota": config.min_quota,
            "trigger": config.trigger,
            "domain_size": config.domain_size,
            "hardware": self.hardware,
            "hidden_size": cfg.hidden_size,
            "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size,
            "swiglu": bool(cfg.gated_linear_unit),
            "topk": cfg.moe_router_topk,
            "num_layers": cfg.num_layers,  # MTP layers have ids num_layers + 1, ...
            "mtp_num_layers": cfg.mtp_num_layers or 0,
            # One shared MTP layer (id num_layers + 1) whose depths are recorded as microbatches.
            "mtp_use_repeated_layer": bool(getattr(cfg, "mtp_use_repeated_layer", False)),
            "first_global_rank": first_global_rank,
        }
        path = trace_path(self.trace_dir, first_global_rank)
        writer = TraceWriter(path, num_ranks=shape[0], num_experts=shape[1], meta=meta)
        weakref.finalize(self, writer.close)  # commit the last records on a clean exit
        return writer

    def end_iteration(self, iteration: int) -> None:
        if self._writer is not None:
            self._writer.flush_iteration(
                self.iteration if self.iteration is not None else iteration
            )
        self.iteration = iteration + 1
        self._microbatch.clear()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
