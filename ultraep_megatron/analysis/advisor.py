"""The slot advisor: how many redundant slots, which quota floor and which trigger a model's routing
needs.

Replays a trace through ``ultraep`` for every (slots, quota floor, trigger) combination and picks the
smallest slot count past which extra slots stop paying, by the cost model's ESTIMATE (CRAFT's benefit
per replica, applied to real-time balancing). No Megatron import.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry

from .cost import ExpertShape, Hardware, slot_memory_bytes
from .replay import ReplayResult, replay
from .summary import cost_summary, metric_summary

__all__ = ["advise_slots", "slot_sweep"]


def slot_sweep(records: Iterable, slots: Sequence[int], min_quotas: Sequence[Optional[int]],
               shape: ExpertShape, hardware: Hardware, *, triggers: Sequence[Optional[float]] = (None,),
               domain_size: Optional[int] = None, relay: bool = True, include_eplb_exact: bool = False,
               num_layers: Optional[int] = None, plan_seconds: Optional[float] = None,
               progress: Optional[Callable[[int], None]] = None) -> tuple[list[dict], ReplayResult]:
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
        ``speedup_vs_none_excl_plan``, ``total_ms``, ``memory_bytes`` (shared slots, per rank) and
        ``memory_bytes_per_layer_layout``.
    """
    slots = sorted(set(int(s) for s in slots))
    balancers = {registry.NONE: BalancerConfig(registry.NONE), registry.IDEAL: BalancerConfig(registry.IDEAL)}
    for s in slots:
        for q in (dict.fromkeys(min_quotas) if s > 0 else [None]):
            for t in (dict.fromkeys(triggers) if s > 0 else [None]):
                balancers[f"{registry.ULTRAEP}/S={s}/q={q}/t={t}"] = BalancerConfig(
                    registry.ULTRAEP, num_slots=s, min_quota=q, trigger=t, domain_size=domain_size)
        if include_eplb_exact:
            balancers[f"{registry.EPLB_EXACT}/S={s}"] = BalancerConfig(registry.EPLB_EXACT, num_slots=s)
    result = replay(records, balancers, shape=shape, hardware=hardware, relay=relay,
                    plan_seconds=plan_seconds, progress=progress)
    quality = metric_summary(result)
    cost = cost_summary(result)
    layers = num_layers or len(result.layers)
    rows = []
    for label, config in list(balancers.items())[2:]:
        m, c = quality[label], cost[label]
        s = config.num_slots
        rows.append({
            "balancer": config.name, "label": label, "num_slots": s, "min_quota": config.min_quota,
            "trigger": config.trigger, "balanced_share": float(result.metrics[label]["balanced"].mean()),
            "imbalance_mean": m["imbalance_mean"], "imbalance_p95": m["imbalance_p95"],
            "replicas_mean": m["replicas_mean"], "fanout_max": m["fanout_max"], "inflight_mean": m["inflight_mean"],
            "speedup_vs_none": c["speedup_vs_none"], "frac_ideal": c["frac_ideal"], "total_ms": c["total_ms"],
            "speedup_vs_none_excl_plan": c["speedup_vs_none_excl_plan"],
            "memory_bytes": slot_memory_bytes(shape, s),
            "memory_bytes_per_layer_layout": slot_memory_bytes(shape, s, num_layers=layers),
        })
    return rows, result


def advise_slots(rows: Sequence[dict], *, tolerance: float = 0.01, min_gain_per_slot: float = 0.005,
                 memory_budget_bytes: Optional[int] = None) -> dict:
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
    candidates = [r for r in rows if r["balancer"] == registry.ULTRAEP
                  and (memory_budget_bytes is None or r["memory_bytes"] <= memory_budget_bytes)]
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
    row = best[chosen]
    if chosen == 0:
        nxt = order[1] if len(order) > 1 else None
        reason = ("replicas do not pay by this estimate: " + (
            f"{nxt} slot(s) reach {best[nxt]['speedup_vs_none']:.3f}x estimated speedup over none against "
            f"{row['speedup_vs_none']:.3f}x without replicas (less than {min_gain_per_slot:.3f}x per slot, or "
            f"within {tolerance:.0%})" if nxt else "only 0 slots were tried") + "; train without balancing")
        flags = f"--moe-balancer {registry.NONE}"
    else:
        reason = (f"{chosen} slot(s) reach {row['speedup_vs_none']:.3f}x estimated speedup over none "
                  f"({row['frac_ideal']:.1%} of ideal), within {tolerance:.0%} of the best worthwhile "
                  f"({top:.3f}x); more slots gain < {min_gain_per_slot:.3f}x each")
        flags = (f"--moe-balancer {registry.ULTRAEP} --moe-balancer-num-slots {chosen}"
                 + (f" --moe-balancer-min-quota {row['min_quota']}" if row["min_quota"] is not None else "")
                 + (f" --moe-balancer-trigger {row['trigger']:g}" if row.get("trigger") is not None else ""))
    return {"num_slots": chosen, "min_quota": row["min_quota"] if chosen else None,
            "trigger": row.get("trigger") if chosen else None, "row": row,
            "best_per_slots": best, "benefit_per_slot": benefit, "reason": reason, "flags": flags}
