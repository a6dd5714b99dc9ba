"""The slot advisor: how many redundant slots, which quota floor and which trigger a model's routing
needs.

The slot rule (docs/recipes.md, "Choosing the slot count") has two parts:

* **Capacity.** A rank's S redundant slots can host at most S experts, and a replica carries at
  most its expert's whole load, so a rank can end with at most its own experts' load plus the S
  largest loads of other experts (of its NVLink domain). Given those caps, no plan brings the
  busiest rank below :func:`slot_capacity_bound`. When half the experts receive no tokens and
  their owners sit idle, the busy ranks hold twice the mean; an idle rank's S slots take S expert
  loads of ``2 R / E`` of the mean each, so the rank imbalance stays at least ``2 - 2 S R / E``:
  at EP32, E=256 (8 experts per rank), two slots stop at 1.5 and four reach 1.0. The slot count
  must let this bound reach :data:`CAPACITY_TARGET` on all but :data:`CAPACITY_TAIL` of the loads.
* **Cost.** Replaying the trace through ``ultraep`` for every (slots, quota floor, trigger), slots
  are added while each buys at least a minimum speedup by the cost model's ESTIMATE (CRAFT's
  benefit per replica, applied to real-time balancing).

The advice is the larger of the two (unless replicas do not pay at all: then no balancing). A
recipe, with no trace yet, applies the capacity part to the half-cold load above:
:func:`recipe_slots`. No Megatron import.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.hardware import ExpertShape, Hardware

from .cost import slot_memory_bytes
from .replay import ReplayResult, replay
from .summary import cost_summary, metric_summary

__all__ = [
    "CAPACITY_TAIL",
    "CAPACITY_TARGET",
    "advise_slots",
    "half_cold_load",
    "recipe_slots",
    "slot_capacity_bound",
    "slot_sweep",
]

#: Rank imbalance the capacity bound must reach on a load for a slot count to be enough there.
CAPACITY_TARGET = 1.05
#: Share of the loads a slot count may leave above :data:`CAPACITY_TARGET` (the tail it gives up).
CAPACITY_TAIL = 0.05


def _smallest_max(caps: torch.Tensor, total: float) -> float:
    """The smallest M with ``sum(min(M, cap)) >= total``: the lowest busiest-rank load ranks capped
    at ``caps`` (float64 [D]) can share ``total`` with."""
    caps = torch.sort(caps).values
    n = caps.numel()
    before = torch.cumsum(caps, 0) - caps  # sum of the caps below each
    reach = before + caps * torch.arange(
        n, 0, -1, dtype=caps.dtype
    )  # sum(min(cap_i, c)) at c = cap_i
    i = int(torch.searchsorted(reach, torch.tensor([total], dtype=caps.dtype)).item())
    if i >= n:  # only when the caps do not hold the total, which they always do (own loads)
        return float(caps[-1])
    return float((total - before[i]) / (n - i))


def slot_capacity_bound(
    load: torch.Tensor, num_slots: int, domain_size: Optional[int] = None
) -> float:
    """A lower bound on the rank imbalance (max / mean tokens per EP rank) that any plan with
    ``num_slots`` redundant slots per rank reaches on ``load`` (int64 [R, E]).

    A rank can end with at most its own experts' load plus the ``num_slots`` largest loads of the
    other experts of its domain (``domain_size`` consecutive ranks; replicas stay in their home
    domain): each slot hosts one expert, no expert twice on a rank, a replica carries at most its
    expert's load. Each domain's load stays in the domain. With those caps, the busiest rank of a
    domain holds at least the smallest M with ``sum(min(M, cap_r)) >= the domain's load``. At 0
    slots this is the imbalance before balancing; it never exceeds it.
    """
    R, E = load.shape
    per = E // R
    D = domain_size or R
    expert = load.sum(0).to(torch.float64)
    total = float(expert.sum())
    if total == 0:
        return 1.0
    own = expert.view(R, per).sum(1)
    busiest = 0.0
    for d in range(R // D):
        weights = expert[d * D * per : (d + 1) * D * per]
        order = torch.argsort(weights, descending=True, stable=True)
        foreign = (order // per).unsqueeze(0) != torch.arange(D).unsqueeze(
            1
        )  # [D ranks, experts by load]
        taken = foreign & (torch.cumsum(foreign.to(torch.int64), 1) <= num_slots)
        caps = own[d * D : (d + 1) * D] + (weights[order].unsqueeze(0) * taken).sum(1)
        busiest = max(busiest, _smallest_max(caps, float(weights.sum())))
    return max(busiest * R / total, 1.0)


def half_cold_load(
    num_ranks: int,
    num_experts: int,
    *,
    domain_size: Optional[int] = None,
    pairs_per_rank: int = 32768,
) -> torch.Tensor:
    """The slot rule's design load, int64 [R, E]: in every NVLink domain (``domain_size`` ranks;
    default one domain) the experts of the first half of the ranks receive every (token, expert)
    pair, evenly, and the other half's receive none (their owners sit idle); every rank routes
    ``pairs_per_rank``."""
    per = num_experts // num_ranks
    D = domain_size or num_ranks
    hot = torch.zeros(num_experts, dtype=torch.bool)
    for d in range(num_ranks // D):
        hot[d * D * per : (d * D + D // 2) * per] = True
    load = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    load[:, hot] = pairs_per_rank // int(hot.sum())
    return load


def recipe_slots(num_experts: int, ep_size: int) -> int:
    """The slot count of a recipe, before any trace: the capacity part of the rule on the load where
    half the experts receive no tokens and their owners sit idle, ``ceil(E / (2 R))`` slots (an idle
    rank fills its share from experts at twice the mean load), and at least 2 (so that an idle rank
    can fill it from two experts where no single one carries twice the mean; the UltraEP paper's
    smallest, Table 3)."""
    return max(2, math.ceil(num_experts / (2 * ep_size)))


def _capacity_bounds(
    records: Iterable,
    slots: Sequence[int],
    domain_size: Optional[int],
    bounds: dict[int, list[float]],
) -> Iterator:
    """``records`` passed through, each load's :func:`slot_capacity_bound` for every slot count
    appended to ``bounds``."""
    for record in records:
        for s in slots:
            bounds[s].append(slot_capacity_bound(record[4], s, domain_size))
        yield record


def slot_sweep(
    records: Iterable,
    slots: Sequence[int],
    min_quotas: Sequence[Optional[int]],
    shape: ExpertShape,
    hardware: Hardware,
    *,
    triggers: Sequence[Optional[float]] = (None,),
    domain_size: Optional[int] = None,
    relay: bool = True,
    include_eplb_exact: bool = False,
    num_layers: Optional[int] = None,
    plan_seconds: Optional[float] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> tuple[list[dict], ReplayResult]:
    """Balance and estimated speedup of ultraep as a function of redundant slots, quota floor and
    trigger.

    Args:
        records: replay records (see :func:`replay`), read once.
        slots: redundant slots per rank to try (e.g. 0, 1, 2, 4).
        min_quotas: quota floors to try (None: the planner's 1 % default).
        triggers: triggers to try (None: the default, ``1 + floor / mean rank load``).
        domain_size: ultraep keeps replicas inside NVLink domains of this many EP ranks.
        include_eplb_exact: also sweep EPLB's rule on the exact load, for comparison.
        num_layers: MoE layers of the model, for the per-layer-replica memory column (default:
            the layers seen in the trace).

    Without redundant slots there are no replicas and a quota floor means nothing: slot count 0
    gets one row (``min_quota`` None).

    Returns:
        (rows, replay result). One row per (balancer, slots, min_quota, trigger): ``balancer``,
        ``label`` (its label in the result), ``num_slots``, ``min_quota``, ``trigger``,
        ``imbalance_mean``/``_p95``, ``replicas_mean``, ``fanout_max``, ``inflight_mean``,
        ``balanced_share`` (loads the trigger let through), ``speedup_vs_none``, ``frac_ideal``,
        ``speedup_vs_none_excl_plan``, ``total_ms``, ``memory_bytes`` (shared slots, per rank),
        ``memory_bytes_per_layer_layout``, and the slot count's capacity bound over the loads
        (:func:`capacity_figures`).
    """
    slots = sorted(set(int(s) for s in slots))
    balancers = {
        registry.NONE: BalancerConfig(registry.NONE),
        registry.IDEAL: BalancerConfig(registry.IDEAL),
    }
    for s in slots:
        for q in dict.fromkeys(min_quotas) if s > 0 else [None]:
            for t in dict.fromkeys(triggers) if s > 0 else [None]:
                balancers[f"{registry.ULTRAEP}/S={s}/q={q}/t={t}"] = BalancerConfig(
                    registry.ULTRAEP, num_slots=s, min_quota=q, trigger=t, domain_size=domain_size
                )
        if include_eplb_exact:
            balancers[f"{registry.EPLB_EXACT}/S={s}"] = BalancerConfig(
                registry.EPLB_EXACT, num_slots=s
            )
    bounds: dict[int, list[float]] = {s: [] for s in slots}
    result = replay(
        _capacity_bounds(records, slots, domain_size, bounds),
        balancers,
        shape=shape,
        hardware=hardware,
        relay=relay,
        plan_seconds=plan_seconds,
        progress=progress,
    )
    quality = metric_summary(result)
    cost = cost_summary(result)
    layers = num_layers or len(result.layers)
    rows = []
    for label, config in list(balancers.items())[2:]:
        m, c = quality[label], cost[label]
        s = config.num_slots
        rows.append(
            {
                "balancer": config.name,
                "label": label,
                "num_slots": s,
                "min_quota": config.min_quota,
                "trigger": config.trigger,
                "balanced_share": float(result.metrics[label]["balanced"].mean()),
                "imbalance_mean": m["imbalance_mean"],
                "imbalance_p95": m["imbalance_p95"],
                "replicas_mean": m["replicas_mean"],
                "fanout_max": m["fanout_max"],
                "inflight_mean": m["inflight_mean"],
                "speedup_vs_none": c["speedup_vs_none"],
                "frac_ideal": c["frac_ideal"],
                "total_ms": c["total_ms"],
                "speedup_vs_none_excl_plan": c["speedup_vs_none_excl_plan"],
                "memory_bytes": slot_memory_bytes(shape, s),
                "memory_bytes_per_layer_layout": slot_memory_bytes(shape, s, num_layers=layers),
                **capacity_figures(bounds[s]),
            }
        )
    return rows, result


def capacity_figures(bounds: Sequence[float]) -> dict:
    """A slot count's :func:`slot_capacity_bound` over the loads: ``capacity_bound_mean``,
    ``capacity_bound_p95``, ``capacity_bound_max`` and ``capacity_short_share``, the share of the
    loads it leaves above :data:`CAPACITY_TARGET`."""
    values = np.asarray(bounds, dtype=np.float64)
    if not values.size:
        return {}
    return {
        "capacity_bound_mean": float(values.mean()),
        "capacity_bound_p95": float(np.percentile(values, 95)),
        "capacity_bound_max": float(values.max()),
        "capacity_short_share": float((values > CAPACITY_TARGET).mean()),
    }


def capacity_need(rows: Sequence[dict]) -> Optional[int]:
    """The capacity part of the slot rule on swept ``rows``: the fewest slots whose capacity bound
    reaches :data:`CAPACITY_TARGET` on all but :data:`CAPACITY_TAIL` of the loads (``None``: no swept
    slot count does, or the rows carry no bound)."""
    short = {
        r["num_slots"]: r["capacity_short_share"]
        for r in rows
        if r["balancer"] == registry.ULTRAEP and "capacity_short_share" in r
    }
    return next((s for s in sorted(short) if short[s] <= CAPACITY_TAIL), None)


def advise_slots(
    rows: Sequence[dict],
    *,
    tolerance: float = 0.01,
    min_gain_per_slot: float = 0.005,
    memory_budget_bytes: Optional[int] = None,
) -> dict:
    """Pick redundant slots, a quota floor and a trigger from :func:`slot_sweep` rows (ultraep rows
    only).

    For every slot count the best (floor, trigger) pair (highest estimated speedup; ties: the larger
    floor, fewer replicas, then the default trigger, then the larger one, fewer transfers) is kept.
    Walking slot counts upward, a slot count is taken while each added slot still buys at least
    ``min_gain_per_slot`` of speedup per slot (CRAFT's benefit per replica, diminishing returns);
    among those, the smallest one within ``tolerance`` of the best speedup is recommended. Slot counts over ``memory_budget_bytes`` are skipped. When 0 slots win, the
    advice is not to balance (``--moe-balancer none``; a quota floor without slots means nothing).

    Returns:
        {``num_slots``, ``min_quota`` and ``trigger`` (None with 0 slots), ``row`` (the chosen
        row), ``best_per_slots`` (slot count -> row), ``benefit_per_slot`` (slot count -> speedup
        gained per slot over 0 slots), ``reason``, ``flags`` (the training flags to use)}.
    """
    candidates = [
        r
        for r in rows
        if r["balancer"] == registry.ULTRAEP
        and (memory_budget_bytes is None or r["memory_bytes"] <= memory_budget_bytes)
    ]
    if not candidates:
        raise ValueError("no ultraep row fits (check slots and the memory budget)")

    def rank(r):  # speedup, then the larger floor, then the default trigger, then the larger one
        q, t = r["min_quota"], r.get("trigger")
        return (r["speedup_vs_none"], -1 if q is None else q, t is None, -1.0 if t is None else t)

    best: dict[int, dict] = {}
    for r in candidates:
        cur = best.get(r["num_slots"])
        if cur is None or rank(r) > rank(cur):
            best[r["num_slots"]] = r
    order = sorted(best)
    base = best[order[0]]["speedup_vs_none"] if order[0] == 0 else 1.0
    benefit = {s: (best[s]["speedup_vs_none"] - base) / s for s in order if s > 0}
    worthwhile = [order[0]]
    for prev, s in zip(order, order[1:]):
        gain = (best[s]["speedup_vs_none"] - best[prev]["speedup_vs_none"]) / (s - prev)
        if gain < min_gain_per_slot:
            break
        worthwhile.append(s)
    top = max(best[s]["speedup_vs_none"] for s in worthwhile)
    chosen = next(s for s in worthwhile if best[s]["speedup_vs_none"] >= top * (1 - tolerance))
    by_cost, need = chosen, capacity_need(candidates)
    if chosen and need is not None and need > chosen:
        chosen = need  # the cost model's knee would leave loads the slots cannot balance
    row = best[chosen]
    if chosen == 0:
        nxt = order[1] if len(order) > 1 else None
        reason = (
            "replicas do not pay by this estimate: "
            + (
                f"{nxt} slot(s) reach {best[nxt]['speedup_vs_none']:.3f}x estimated speedup over none against "
                f"{row['speedup_vs_none']:.3f}x without replicas (less than {min_gain_per_slot:.3f}x per slot, or "
                f"within {tolerance:.0%})"
                if nxt
                else "only 0 slots were tried"
            )
            + "; train without balancing"
        )
        flags = f"--moe-balancer {registry.NONE}"
    elif chosen != by_cost:
        short = best[by_cost]
        reason = (
            f"{by_cost} slot(s) cannot balance {short['capacity_short_share']:.0%} of the loads: a rank's "
            f"{by_cost} slot(s) carry at most {by_cost} expert load(s), so no plan gets the rank imbalance "
            f"below {short['capacity_bound_p95']:.3f} there (capacity bound, 95th percentile); {chosen} "
            f"slot(s) reach {row['capacity_bound_p95']:.3f} and {row['speedup_vs_none']:.3f}x estimated "
            f"speedup over none ({row['frac_ideal']:.1%} of ideal), against {short['speedup_vs_none']:.3f}x "
            f"with {by_cost}"
        )
    else:
        reason = (
            f"{chosen} slot(s) reach {row['speedup_vs_none']:.3f}x estimated speedup over none "
            f"({row['frac_ideal']:.1%} of ideal), within {tolerance:.0%} of the best worthwhile "
            f"({top:.3f}x); more slots gain < {min_gain_per_slot:.3f}x each"
            + (
                f"; their capacity bound reaches {row['capacity_bound_p95']:.3f} (95th percentile)"
                if "capacity_bound_p95" in row
                else ""
            )
        )
    if chosen:
        flags = (
            f"--moe-balancer {registry.ULTRAEP} --moe-balancer-num-slots {chosen}"
            + (
                f" --moe-balancer-min-quota {row['min_quota']}"
                if row["min_quota"] is not None
                else ""
            )
            + (
                f" --moe-balancer-trigger {row['trigger']:g}"
                if row.get("trigger") is not None
                else ""
            )
        )
    return {
        "num_slots": chosen,
        "min_quota": row["min_quota"] if chosen else None,
        "trigger": row.get("trigger") if chosen else None,
        "row": row,
        "by_cost": by_cost,
        "capacity_need": need,
        "best_per_slots": best,
        "benefit_per_slot": benefit,
        "reason": reason,
        "flags": flags,
    }
