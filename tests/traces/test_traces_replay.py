"""Replay: per-record metrics against direct planner calls and hand computations, EPLB's history
bookkeeping against an independent re-implementation, staleness on a drifting trace, EP groups, and
trace selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultraep_megatron import planner, traces
from ultraep_megatron.analysis import advisor, cost
from ultraep_megatron.analysis import replay as rp
from ultraep_megatron.planner import baselines
from ultraep_megatron.planner.policy import BalancerConfig

R, E = 4, 16


def drifting_records(iterations=12, microbatches=2, layers=2, drift=0.6, seed=0, group=0):
    return [(group, *rec) for rec in traces.synthetic_loads(
        num_iterations=iterations, num_microbatches=microbatches, num_layers=layers, num_ranks=R, num_experts=E,
        tokens_per_rank=512, topk=2, drift=drift, seed=seed)]


def rank_imbalance(load: torch.Tensor) -> float:
    """max/mean of per-rank main-expert load, by numpy."""
    a = load.numpy()
    per_rank = a.sum(0).reshape(R, E // R).sum(1)
    return float(per_rank.max() / per_rank.mean())


def test_metrics_per_record_match_direct_computation():
    records = drifting_records(iterations=3)
    specs = {"none": BalancerConfig("none"), "ultraep": BalancerConfig("ultraep", num_slots=1, min_quota=8),
             "eplb-exact": BalancerConfig("eplb-exact", num_slots=1), "ideal": BalancerConfig("ideal")}
    result = rp.replay(records, specs)
    assert result.num_records == len(records) and result.costs is None
    for i, (_, it, mb, layer, load) in enumerate(records):
        assert (result.keys["iteration"][i], result.keys["microbatch"][i], result.keys["layer"][i]) == (it, mb, layer)
        assert result.metrics["none"]["imbalance_after"][i] == pytest.approx(rank_imbalance(load))
        assert result.metrics["none"]["replicas"][i] == 0
        local = sum(int(load[s, s * (E // R):(s + 1) * (E // R)].sum()) for s in range(R))
        assert result.metrics["none"]["inflight_ratio"][i] == pytest.approx(1 - local / int(load.sum()))
        direct = planner.metrics(load, planner.solve(load, 1, min_quota=8))
        for key in ("imbalance_after", "replicas", "max_fanout", "inflight_ratio", "threshold"):
            assert result.metrics["ultraep"][key][i] == pytest.approx(direct[key])
        exact = planner.metrics(load, baselines.eplb_exact(load, 1))
        assert result.metrics["eplb-exact"]["imbalance_after"][i] == pytest.approx(exact["imbalance_after"])
        assert result.metrics["ideal"]["imbalance_after"][i] == 1.0
        assert result.metrics["ultraep"]["imbalance_after"][i] <= rank_imbalance(load) + 1e-12
        per_expert = load.numpy().sum(0)
        assert result.load["routed"][i] == per_expert.sum()
        assert result.load["expert_imbalance"][i] == pytest.approx(per_expert.max() / per_expert.mean())
    summary = rp.metric_summary(result)
    assert summary["none"]["imbalance_mean"] == pytest.approx(np.mean([rank_imbalance(r[4]) for r in records]))
    assert summary["none"]["worse_than_none"] == 0.0
    assert summary["ultraep"]["imbalance_mean"] < summary["eplb-exact"]["imbalance_mean"] < summary["none"]["imbalance_mean"]


def test_identity_plan_is_the_unbalanced_routing():
    load = drifting_records(iterations=1)[0][4]
    plan = baselines.identity_plan(load)
    assert plan.num_slots == 0
    # every token of expert e goes to rank e // G
    split = plan.split
    G = E // R
    for e in range(E):
        assert torch.equal(split[:, e, e // G], load[:, e])
        assert int(split[:, e, :].sum()) == int(load[:, e].sum())
    assert plan.threshold == int(load.sum(0).view(R, G).sum(1).max())


@pytest.mark.parametrize("window,interval", [(2, 3), (1, 1), (4, 2)])
def test_eplb_history_bookkeeping(window, interval):
    """Placement re-planned every `interval` calls of a (group, layer) from the previous `window`
    loads (the current one on the first call); the current load goes round-robin over it."""
    records = drifting_records(iterations=5, microbatches=2, layers=2, seed=1)
    spec = {"eplb": BalancerConfig("eplb", num_slots=2, eplb_window=window, eplb_interval=interval)}
    result = rp.replay(records, spec)
    for layer in (1, 2):
        loads = [r[4] for r in records if r[3] == layer]
        idx = np.flatnonzero(result.keys["layer"] == layer)
        placement = None
        for call, (i, load) in enumerate(zip(idx, loads)):
            if call % interval == 0:
                history = loads[max(0, call - window):call] if call else [load]
                placement = baselines.eplb(torch.stack(history).sum(0), 2).slot_expert
            expected = planner.metrics(load, baselines.round_robin(load, placement))
            assert result.metrics["eplb"]["imbalance_after"][i] == pytest.approx(expected["imbalance_after"])
            assert result.metrics["eplb"]["inflight_ratio"][i] == pytest.approx(expected["inflight_ratio"])


def test_stale_history_hurts_eplb_on_a_drifting_trace():
    records = drifting_records(iterations=24, microbatches=2, layers=2, drift=0.8, seed=4)
    specs = {f"eplb/{i}": BalancerConfig("eplb", num_slots=1, eplb_window=i, eplb_interval=i) for i in (1, 16)}
    specs["eplb-exact"] = BalancerConfig("eplb-exact", num_slots=1)
    result = rp.replay(records, specs)
    stale = rp.staleness_summary(result)
    assert [r["interval"] for r in stale] == [1, 16]
    fresh, old = stale
    exact = rp.metric_summary(result)["eplb-exact"]
    assert exact["imbalance_mean"] < fresh["imbalance_mean"] < old["imbalance_mean"]
    assert old["worse_than_none"] >= fresh["worse_than_none"]


def test_eplb_keeps_history_per_ep_group(tmp_path):
    records = drifting_records(iterations=4, layers=1, seed=6)
    paths = []
    for g in range(2):
        path = traces.trace_path(tmp_path, g)
        with traces.TraceWriter(path, num_ranks=R, num_experts=E, meta={"group": g}, fsync=False) as w:
            for _, it, mb, layer, load in records:
                w.append(it, mb, layer, load)
                if mb == 1:
                    w.flush_iteration(it)
        paths.append(path)
    spec = {"eplb": BalancerConfig("eplb", num_slots=1, eplb_window=2, eplb_interval=2)}
    result = rp.replay(traces.TraceRecords(traces.find_trace_files(tmp_path)), spec)
    n = len(records)
    assert result.keys["group"].tolist() == [0] * n + [1] * n
    after = result.metrics["eplb"]["imbalance_after"]
    # Identical loads in both groups and separate histories: identical results.
    assert np.array_equal(after[:n], after[n:])
    single = rp.replay(records, spec).metrics["eplb"]["imbalance_after"]
    assert np.array_equal(after[:n], single)
    assert result.meta == {"group": 0}
    other = tmp_path / "other.uetrace"
    traces.TraceWriter(other, num_ranks=2, num_experts=E, fsync=False).close()
    with pytest.raises(ValueError, match="disagree"):
        traces.TraceRecords([paths[0], other])


def test_trace_selection_and_load_scale(tmp_path):
    records = drifting_records(iterations=3, layers=2, seed=7)
    path = tmp_path / "t.uetrace"
    with traces.TraceWriter(path, num_ranks=R, num_experts=E, fsync=False) as w:
        for _, it, mb, layer, load in records:
            w.append(it, mb, layer, load)
            if mb == 1 and layer == 2:
                w.flush_iteration(it)
    spec = {"none": BalancerConfig("none")}
    seen = []
    selected = traces.TraceRecords([path], layers=[2], max_records=4)
    result = rp.replay(selected, spec, progress=seen.append)
    assert result.keys["layer"].tolist() == [2, 2, 2, 2]
    assert seen[-1] == selected.total == 4
    doubled = rp.replay(traces.TraceRecords([path], load_scale=2.0), spec)
    plain = rp.replay(traces.TraceRecords([path]), spec)
    assert np.allclose(doubled.metrics["none"]["imbalance_after"], plain.metrics["none"]["imbalance_after"])
    assert np.array_equal(doubled.metrics["none"]["threshold"], 2 * plain.metrics["none"]["threshold"])
    records_stream = traces.TraceRecords([path])
    assert records_stream.total == len(records)
    with pytest.raises(ValueError, match="load_scale"):
        traces.TraceRecords([path], load_scale=0)


def test_replay_rejects_bad_input():
    records = drifting_records(iterations=1)
    none = {"none": BalancerConfig("none")}
    with pytest.raises(ValueError, match="no balancer"):
        rp.replay(records, {})
    with pytest.raises(ValueError, match="both shape and hardware"):
        rp.replay(records, none, shape=cost.DEFAULT_SHAPE)
    with pytest.raises(ValueError, match="no records"):
        rp.replay([], none)


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


def _row(slots: int, quota, speedup: float) -> dict:
    return {"balancer": "ultraep", "num_slots": slots, "min_quota": quota, "speedup_vs_none": speedup,
            "frac_ideal": speedup / 2, "memory_bytes": slots * 100}


def test_advice_without_slots_is_no_balancing_never_a_quota():
    """When replicas do not pay (each slot buys less than the minimum gain), the advice is
    --moe-balancer none: no slot count 0 with a quota floor. When they pay, slots and floor."""
    rows = [_row(0, None, 0.99), _row(1, None, 0.992), _row(1, 834, 0.993), _row(2, 834, 0.994)]
    advice = advisor.advise_slots(rows)
    assert (advice["num_slots"], advice["min_quota"], advice["flags"]) == (0, None, "--moe-balancer none")
    assert "replicas do not pay" in advice["reason"] and "train without balancing" in advice["reason"]
    rows = [_row(0, None, 0.99), _row(1, None, 1.40), _row(1, 834, 1.45), _row(2, 834, 1.452)]
    advice = advisor.advise_slots(rows)
    assert advice["flags"] == "--moe-balancer ultraep --moe-balancer-num-slots 1 --moe-balancer-min-quota 834"
