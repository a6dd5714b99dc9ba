"""The slot advisor (``analysis/advisor.py``): the sweep's rows against the replayed plans, and the
recommendation rule (diminishing returns per slot, tolerance, memory budget, the floor and trigger
kept with the slots, no balancing when replicas do not pay)."""

from __future__ import annotations

import numpy as np
import pytest

from traces_helpers import drifting_records

from ultraep_megatron import planner
from ultraep_megatron.analysis import advisor, cost
from ultraep_megatron.analysis.advisor import advise_slots


def test_slot_sweep_rows_follow_the_replayed_plans():
    records = drifting_records(iterations=4, layers=2, seed=8)
    shape, hw = cost.ExpertShape(64, 32), cost.Hardware()
    rows, result = advisor.slot_sweep(records, [0, 1, 2], [None, 16], shape, hw, include_eplb_exact=True, plan_seconds=0.0)
    assert [(r["balancer"], r["num_slots"], r["min_quota"]) for r in rows] == [
        ("ultraep", 0, None), ("eplb-exact", 0, None),  # no slots: no quota floor to vary
        ("ultraep", 1, None), ("ultraep", 1, 16), ("eplb-exact", 1, None),
        ("ultraep", 2, None), ("ultraep", 2, 16), ("eplb-exact", 2, None)]
    for row in rows:
        if row["balancer"] == "ultraep":
            expected = np.mean([planner.metrics(r[4], planner.solve(r[4], row["num_slots"], min_quota=row["min_quota"]))
                                ["imbalance_after"] for r in records])
            assert row["imbalance_mean"] == pytest.approx(expected)
        assert row["memory_bytes"] == cost.slot_memory_bytes(shape, row["num_slots"])
        assert row["memory_bytes_per_layer_layout"] == 2 * row["memory_bytes"]  # two layers traced
    zero = [r for r in rows if r["num_slots"] == 0]
    assert all(r["speedup_vs_none"] == pytest.approx(1.0) for r in zero)  # no slot, no plan cost: == none
    assert result.num_records == len(records)


def _quota_row(slots: int, quota, speedup: float) -> dict:
    return {"balancer": "ultraep", "num_slots": slots, "min_quota": quota, "speedup_vs_none": speedup,
            "frac_ideal": speedup / 2, "memory_bytes": slots * 100}


def test_advice_without_slots_is_no_balancing_never_a_quota():
    """When replicas do not pay (each slot buys less than the minimum gain), the advice is
    --moe-balancer none: no slot count 0 with a quota floor. When they pay, slots and floor."""
    rows = [_quota_row(0, None, 0.99), _quota_row(1, None, 0.992), _quota_row(1, 834, 0.993), _quota_row(2, 834, 0.994)]
    advice = advisor.advise_slots(rows)
    assert (advice["num_slots"], advice["min_quota"], advice["flags"]) == (0, None, "--moe-balancer none")
    assert "replicas do not pay" in advice["reason"] and "train without balancing" in advice["reason"]
    rows = [_quota_row(0, None, 0.99), _quota_row(1, None, 1.40), _quota_row(1, 834, 1.45), _quota_row(2, 834, 1.452)]
    advice = advisor.advise_slots(rows)
    assert advice["flags"] == "--moe-balancer ultraep --moe-balancer-num-slots 1 --moe-balancer-min-quota 834"


def _row(slots, speedup, quota=None, memory=None, balancer="ultraep"):
    return {"balancer": balancer, "num_slots": slots, "min_quota": quota, "speedup_vs_none": speedup,
            "frac_ideal": speedup / 2, "memory_bytes": memory if memory is not None else slots * 100,
            "imbalance_mean": 1.0}


def test_advise_slots_rule():
    rows = [_row(0, 1.0), _row(1, 1.5), _row(1, 1.45, quota=64), _row(2, 1.6), _row(2, 1.6, quota=128),
            _row(3, 1.603), _row(4, 1.9), _row(2, 9.9, balancer="eplb-exact")]
    advice = advise_slots(rows, tolerance=0.01, min_gain_per_slot=0.005)
    # 0->1 (+0.5/slot), 1->2 (+0.1), 2->3 (+0.003 < 0.005): stop; best worthwhile 1.6 -> 2 slots,
    # and of the two equal floors at 2 slots the larger one (fewer replicas).
    assert (advice["num_slots"], advice["min_quota"]) == (2, 128)
    assert advice["benefit_per_slot"] == pytest.approx({1: 0.5, 2: 0.3, 3: 0.603 / 3, 4: 0.9 / 4})
    assert advise_slots(rows, tolerance=0.1)["num_slots"] == 1  # 1.5 is within 10 % of 1.6
    assert advise_slots(rows, min_gain_per_slot=0.001)["num_slots"] == 4  # the later jump counts
    assert advise_slots(rows, memory_budget_bytes=150)["num_slots"] == 1
    with pytest.raises(ValueError, match="no ultraep row"):
        advise_slots(rows, memory_budget_bytes=-1)


def test_advise_slots_picks_the_trigger_with_the_floor():
    rows = [_row(0, 1.0), {**_row(1, 1.5, quota=64), "trigger": 1.3}, {**_row(1, 1.5, quota=64), "trigger": None},
            {**_row(2, 1.7, quota=64), "trigger": 1.1}, {**_row(2, 1.6, quota=64), "trigger": None}]
    advice = advise_slots(rows, tolerance=0.0)
    # 2 slots win with trigger 1.1; at 1 slot the tie goes to the default trigger.
    assert (advice["num_slots"], advice["min_quota"], advice["trigger"]) == (2, 64, 1.1)
    assert advice["best_per_slots"][1]["trigger"] is None
