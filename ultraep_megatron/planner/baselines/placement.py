"""How any balancer's outcome is compared: a :class:`Placement` and its metrics.

A balancer that moves main experts (DeepSeek's re-placing EPLB) cannot be written as a ``Plan``
(whose physical slot ``t*P+j`` is main expert ``t*G+j``), so outcomes are compared as ``Placement``s
(``Placement.from_plan`` for the others) with ``placement_metrics``: imbalance, memory spread, weight
copies relative to the home layout (main-expert moves included), cross-domain copies, fan-out,
in-flight pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..metrics import load_imbalance, rank_imbalance
from ..plan import Plan
from ..solve import validate_domain_size, validate_load

__all__ = ["Placement", "weight_copies", "main_moves", "cross_domain_copies", "placement_metrics"]


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a balancer puts the experts and computes the tokens of one layer-microbatch.

    Attributes:
        physical_expert: int64 [R, P] logical expert of each physical expert slot of each rank, -1
            if empty. A rank may hold several copies of one expert (DeepSeek's EPLB allows it).
        split: int64 [R, E, R] tokens of expert e from source rank s computed on rank t.
    """

    physical_expert: torch.Tensor
    split: torch.Tensor

    @classmethod
    def from_plan(cls, plan: Plan) -> "Placement":
        return cls(plan.physical_expert, plan.split)

    @property
    def quota(self) -> torch.Tensor:
        """[E, R] tokens of expert e computed on rank t."""
        return self.split.sum(0)

    @cached_property
    def instances(self) -> torch.Tensor:
        """bool [E, R]: rank t holds expert e's weights (one copy or more)."""
        R, E = self.physical_expert.shape[0], self.split.shape[1]
        out = torch.zeros((E + 1, R), dtype=torch.bool, device=self.split.device)
        ranks = torch.arange(R, device=out.device).view(R, 1).expand_as(self.physical_expert)
        out[self.physical_expert.reshape(-1) % (E + 1), ranks.reshape(-1)] = True  # -1: spare row
        return out[:E]


def _home_mask(num_experts: int, num_ranks: int, device) -> torch.Tensor:
    """bool [E, R]: rank t is expert e's home (e // G)."""
    home = torch.arange(num_experts, device=device) // (num_experts // num_ranks)
    return home.view(-1, 1) == torch.arange(num_ranks, device=device).view(1, -1)


def weight_copies(placement: Placement) -> int:
    """Expert weights sent to reach this placement from the home layout (expert e on rank e // G):
    one per (expert, rank) where the rank holds the expert and is not its home. Replicas and moved
    main experts alike; several copies on one rank count once (one transfer, then a local copy)."""
    inst = placement.instances
    return int((inst & ~_home_mask(*inst.shape, inst.device)).sum())


def main_moves(placement: Placement) -> int:
    """Experts whose home rank no longer holds them (re-placed main experts)."""
    inst = placement.instances
    return int((~inst & _home_mask(*inst.shape, inst.device)).any(1).sum())


def cross_domain_copies(placement: Placement, domain_size: int | None) -> int:
    """Weight copies (``weight_copies``) landing outside the expert's home NVLink domain."""
    inst = placement.instances
    E, R = inst.shape
    N = validate_domain_size(domain_size, R)
    home_domain = torch.arange(E, device=inst.device) // (E // R) // N
    rank_domain = torch.arange(R, device=inst.device) // N
    return int((inst & (home_domain.view(E, 1) != rank_domain.view(1, R))).sum())


def placement_metrics(
    load: torch.Tensor, placement: Placement, *, domain_size: int | None = None
) -> dict:
    """Comparison metrics of any balancer's ``placement`` on ``load`` [R, E] (Python scalars).

    imbalance_before / imbalance_after (max / mean rank load without balancing / computed under
    the placement), memory_spread_before / memory_spread_after (max / mean rows each rank receives;
    equal to the imbalances, see ``planner.metrics``), weight_copies, main_moves,
    cross_domain_copies (``domain_size`` ranks per NVLink domain), max_fanout (most ranks holding
    one expert), inflight_ratio (share of tokens computed off their source rank).
    """
    R, E = validate_load(load)
    split = placement.split
    if tuple(split.shape) != (R, E, R) or placement.physical_expert.shape[0] != R:
        raise ValueError("placement and load have different shapes")
    if not torch.equal(split.sum(2), load):
        raise ValueError("placement does not compute exactly the load")
    total = int(load.sum())
    imbalance_before = rank_imbalance(load)
    return {
        "imbalance_before": imbalance_before,
        "imbalance_after": float(load_imbalance(placement.quota.sum(0))),
        "memory_spread_before": imbalance_before,
        "memory_spread_after": float(load_imbalance(split.sum((0, 1)))),  # rows received [R]
        "weight_copies": weight_copies(placement),
        "main_moves": main_moves(placement),
        "cross_domain_copies": cross_domain_copies(placement, domain_size),
        "max_fanout": int(placement.instances.sum(1).max()),
        "inflight_ratio": 1.0 - int(split.diagonal(dim1=0, dim2=2).sum()) / total if total else 0.0,
    }
