"""The ``Plan`` a planner returns, and the per-rank views the runtime reads from it.

Shapes (docs/glossary.md): R ranks (one EP group), E logical experts, G = E // R main experts per
rank, S redundant slots per rank, P = G + S physical slots per rank, R * P physical slots in all.
Physical slot ``t * P + j`` is main expert ``t * G + j`` for ``j < G`` and redundant slot ``j - G``
for ``j >= G``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class Plan:
    """A replication and reroute plan for one MoE layer and one microbatch.

    Tensors are int64 on the device of the load they were planned for.

    Attributes:
        slot_expert: [R, S] logical expert held by each redundant slot, -1 if empty. This is the
            contract with the data plane.
        quota: [E, R] tokens the instance of expert e on rank t carries; 0 where there is none
            (a main instance may also carry 0).
        physical_split: [R, R * P] tokens of source rank s routed to physical slot p. The compact
            form of ``split``; row s is what rank s sends, columns ``t*P:(t+1)*P`` what rank t
            receives (``rank_reroute``).
        threshold: the max per-rank load after reroute, ``quota.sum(0).max()`` (an int).
    """

    slot_expert: torch.Tensor
    quota: torch.Tensor
    physical_split: torch.Tensor
    threshold: int

    @property
    def num_ranks(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def num_experts(self) -> int:
        return self.quota.shape[0]

    @property
    def experts_per_rank(self) -> int:
        """G: main experts per rank."""
        return self.num_experts // self.num_ranks

    @property
    def physical_slots_per_rank(self) -> int:
        """P = G + S."""
        return self.experts_per_rank + self.num_slots

    @cached_property
    def physical_expert(self) -> torch.Tensor:
        """[R, P] logical expert of every physical slot (-1 for an empty redundant slot)."""
        R, G = self.num_ranks, self.experts_per_rank
        mains = torch.arange(R * G, device=self.quota.device).view(R, G)
        return torch.cat([mains, self.slot_expert], dim=1)

    @cached_property
    def instance_slot(self) -> torch.Tensor:
        """[E, R] physical slot of expert e's instance on rank t, -1 where there is none."""
        R, E, P = self.num_ranks, self.num_experts, self.physical_slots_per_rank
        out = torch.full((E + 1, R), -1, dtype=torch.int64, device=self.quota.device)
        experts = self.physical_expert  # [R, P]
        ranks = torch.arange(R, device=experts.device).view(R, 1).expand(R, P)
        slots = torch.arange(R * P, device=experts.device).view(R, P)
        # Empty slots (-1) scatter into the spare last row, which is dropped.
        out[experts.reshape(-1) % (E + 1), ranks.reshape(-1)] = slots.reshape(-1)
        return out[:E]

    @cached_property
    def split(self) -> torch.Tensor:
        """[R, E, R] tokens of expert e from source s to the instance on rank t (dense view)."""
        inst = self.instance_slot  # [E, R]
        dense = self.physical_split[:, inst.clamp(min=0)]  # [R, E, R]
        return dense * (inst >= 0)


def plan_from_split(slot_expert: torch.Tensor, split: torch.Tensor) -> Plan:
    """Build a Plan from a dense split [R, E, R] and its slot layout [R, S] (used by baselines)."""
    quota = split.sum(0)
    R, S = slot_expert.shape
    shell = Plan(slot_expert, quota, torch.empty(0), 0)
    inst = shell.instance_slot  # [E, R]
    P = shell.physical_slots_per_rank
    if bool(((split > 0) & (inst < 0).unsqueeze(0)).any()):
        raise ValueError("split sends tokens to a rank without an instance of the expert")
    physical = torch.zeros((R, R * P), dtype=torch.int64, device=split.device)
    mask = inst >= 0
    physical[:, inst[mask]] = split[:, mask]
    return Plan(slot_expert, quota, physical, int(quota.sum(0).max()) if quota.numel() else 0)
