"""The peers: balancers of other systems replayed next to the training ones, on the same loads and
costed by the same model (their plan time, of Python re-implementations, is not charged): DeepSeek's
re-placing EPLB and LLEP, re-implemented from their public code in ``planner.baselines``.
:class:`PeerConfig` names one with its parameters; :func:`.replay.replay` takes a list of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import Plan, baselines
from ultraep_megatron.planner.balancer import DEFAULT_NUM_SLOTS
from ultraep_megatron.planner.baselines import Placement, least_loaded, registry

__all__ = ["PeerConfig"]

DEEPSEEK_EPLB, LLEP = registry.DEEPSEEK_EPLB, registry.LLEP


@dataclass(frozen=True)
class PeerConfig:
    """A peer balancer replayed next to the registry's, with its parameters.

    Attributes:
        name: ``deepseek-eplb`` (``baselines.deepseek_eplb``: every expert re-placed, G + S physical
            experts per rank) or ``llep`` (``baselines.llep``).
        num_slots: deepseek-eplb's S.
        node_size: deepseek-eplb: its hierarchical policy over nodes (NVLink domains) of this many
            ranks (groups = nodes = R / node_size); ``None``: its global policy.
        capacity_factor, min_tokens_per_gemm, imbalance_trigger: LLEP's alpha, m and lambda.
    """

    name: str
    num_slots: int = DEFAULT_NUM_SLOTS
    node_size: Optional[int] = None
    capacity_factor: float = least_loaded.LLEP_CAPACITY_FACTOR
    min_tokens_per_gemm: int = least_loaded.LLEP_MIN_TOKENS_PER_GEMM
    imbalance_trigger: Optional[float] = least_loaded.LLEP_TRIGGER

    def __post_init__(self):
        if self.name not in registry.PEERS:
            raise ValueError(f"unknown peer {self.name!r}; choose from {', '.join(registry.PEERS)}")

    @property
    def label(self) -> str:
        """Its name with the parameters that shape its result."""
        if self.name == LLEP:
            trigger = self.imbalance_trigger
            return (
                f"{LLEP} (alpha={self.capacity_factor:g}, m={self.min_tokens_per_gemm}, "
                f"lambda={'off' if trigger is None else format(trigger, 'g')})"
            )
        policy_name = (
            "global" if self.node_size is None else f"hierarchical, nodes of {self.node_size}"
        )
        return f"{DEEPSEEK_EPLB} ({policy_name}, S={self.num_slots})"

    def balance(self, load: torch.Tensor) -> Plan | Placement:
        """Its outcome on ``load`` int64 [R, E]."""
        if self.name == LLEP:
            return baselines.llep(
                load,
                capacity_factor=self.capacity_factor,
                min_tokens_per_gemm=self.min_tokens_per_gemm,
                trigger=self.imbalance_trigger,
            )
        if self.node_size is None:
            return baselines.deepseek_eplb(load, self.num_slots)
        nodes = load.shape[0] // self.node_size
        return baselines.deepseek_eplb(load, self.num_slots, num_groups=nodes, num_nodes=nodes)

    def balances(self, load: torch.Tensor) -> bool:
        """Whether it balances ``load`` at all (LLEP's trigger)."""
        trigger = self.imbalance_trigger
        return not (
            self.name == LLEP
            and trigger is not None
            and trigger > 0
            and planner.rank_imbalance(load) < trigger
        )
