"""The balancing policy a balanced MoE layer applies: ``BalancerConfig`` (what ``--moe-balancer*``
selected) and ``LayerBalancer`` (one layer's exact load -> plan, with EPLB's history).

No megatron import. The per-model state (buffers, ring, transfers, observers) is
``context.BalancingContext``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import baselines

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
