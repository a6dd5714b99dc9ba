"""Balance metrics: the one imbalance formula (max / mean rank load) and the metrics of a plan.

Shapes as in docs/glossary.md: a load is int64 [R, E], a rank load [R].
"""

from __future__ import annotations

import numpy as np
import torch

from . import _compiled_metrics as _compiled
from .plan import Plan
from .solve import host_array, validate_domain_size, validate_load

__all__ = [
    "load_imbalance",
    "rank_imbalance",
    "host_rank_load",
    "host_imbalance",
    "max_over_mean",
    "metrics",
]


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """The rank imbalance: ``max / mean`` of ``load`` [..., R] over its last dimension.

    Returns float64 [...], >= 1, and 1.0 where nothing was routed. The one imbalance formula of
    the project: planner metrics, triggers, replay and the training telemetry all use it.
    """
    load = load.double()
    mean = load.mean(dim=-1)
    return torch.where(
        mean > 0, load.max(dim=-1).values / mean.clamp_min(1e-30), torch.ones_like(mean)
    )


def rank_imbalance(load: torch.Tensor) -> float:
    """:func:`load_imbalance` of the per-rank load of ``load`` int64 [R, E] with every expert at
    home: the imbalance before balancing, what a trigger compares with."""
    validate_load(load)
    return host_imbalance(host_rank_load(load))


def host_rank_load(load: torch.Tensor) -> np.ndarray:
    """Per-rank load [R] of a host load int64 [R, E] with every expert at home, in numpy (per layer
    and microbatch: microseconds)."""
    R, E = load.shape
    return load.cpu().numpy().sum(0).reshape(R, E // R).sum(1)


def host_imbalance(rank_load: np.ndarray) -> float:
    """:func:`load_imbalance` of one integer [R] host array, in numpy: it runs per layer and
    microbatch (triggers, telemetry), where numpy costs microseconds and torch calls tens. Integer
    sums are exact, so the float64 max / mean is the same number."""
    return max_over_mean(int(rank_load.max()), int(rank_load.sum()), rank_load.size)


def max_over_mean(maximum: int, total: int, num_ranks: int) -> float:
    """:func:`host_imbalance` from integer figures a caller already has: the largest of
    ``num_ranks`` rank loads over their mean, 1.0 if they sum to zero."""
    return maximum / (total / num_ranks) if total > 0 else 1.0


def metrics(load: torch.Tensor, plan: Plan, *, domain_size: int | None = None) -> dict:
    """Balancing metrics of ``plan`` on ``load`` [R, E].

    Returns a dict of Python scalars:
        imbalance_before / imbalance_after: max / mean per-rank load before and after reroute
            (1.0 for an all-zero load);
        memory_spread_before / memory_spread_after: max / mean of the (token, expert) rows each
            rank receives in the dispatch all-to-all and keeps as expert activations, without
            balancing and under the plan. A rank receives exactly the rows it computes (the
            columns of ``physical_split`` realize the quotas), so these equal the imbalances:
            balancing the compute evens out activation memory too (UltraEP Fig. 14);
        threshold: the plan's max rank load; lower_bound: ceil(total / R);
        replicas: filled redundant slots; max_fanout: most instances of one expert (main
            included); max_replicas_per_home: most replicas of one rank's main experts (what that
            rank must send in weight distribution, UltraEP eq. 5);
        cross_domain_replicas: replicas hosted outside their home's NVLink domain of
            ``domain_size`` ranks (None: one domain, so 0);
        inflight_ratio: share of tokens whose destination rank is not their source rank;
        min_replica_quota: smallest quota of a replica (None without replicas).
    """
    R, E = validate_load(load)
    if plan.num_ranks != R or plan.num_experts != E:
        raise ValueError("plan and load have different shapes")
    N = validate_domain_size(domain_size, R)
    # One compiled pass over the host arrays: the training telemetry computes this for every layer
    # and microbatch (a dozen torch calls on [R, E] tensors cost ~0.4 ms, numpy ~40 us, this ~10 us).
    (
        max_before,
        max_after,
        total,
        total_quota,
        replicas,
        max_per_expert,
        max_per_home,
        cross,
        local,
        min_replica_quota,
    ) = _compiled.metric_arrays(
        host_array(load),
        host_array(plan.quota),
        host_array(plan.slot_expert),
        host_array(plan.physical_split),
        N,
    ).tolist()
    imbalance_before = max_over_mean(max_before, total, R)
    imbalance_after = max_over_mean(max_after, total_quota, R)
    return {
        "imbalance_before": imbalance_before,
        "imbalance_after": imbalance_after,
        "memory_spread_before": imbalance_before,
        "memory_spread_after": imbalance_after,
        "threshold": int(plan.threshold),
        "lower_bound": -(-total // R),
        "replicas": replicas,
        "max_fanout": 1 + max_per_expert,
        "max_replicas_per_home": max_per_home,
        "cross_domain_replicas": 0 if N == R else cross,
        "inflight_ratio": 1.0 - local / total if total else 0.0,
        "min_replica_quota": min_replica_quota if replicas else None,
    }
