"""Replay (``analysis/replay.py``): per-record metrics against direct planner calls and hand
computations, EPLB's history bookkeeping against an independent re-implementation, staleness on a
drifting trace, EP groups, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from traces_helpers import drifting_records

from ultraep_megatron import planner, traces
from ultraep_megatron.analysis import replay as rp
from ultraep_megatron.analysis.summary import metric_summary, staleness_summary
from ultraep_megatron.planner import BalancerConfig, baselines
from ultraep_megatron.settings import hardware

R, E = 4, 16


def rank_imbalance(load: torch.Tensor) -> float:
    """max/mean of per-rank main-expert load, by numpy."""
    a = load.numpy()
    per_rank = a.sum(0).reshape(R, E // R).sum(1)
    return float(per_rank.max() / per_rank.mean())


def test_metrics_per_record_match_direct_computation():
    records = drifting_records(iterations=3)
    specs = {
        "none": BalancerConfig("none"),
        "ultraep": BalancerConfig("ultraep", num_slots=1, min_quota=8),
        "eplb-exact": BalancerConfig("eplb-exact", num_slots=1),
        "ideal": BalancerConfig("ideal"),
    }
    result = rp.replay(records, specs)
    assert result.num_records == len(records) and result.costs is None
    for i, (_, it, mb, layer, load) in enumerate(records):
        assert (
            result.keys["iteration"][i],
            result.keys["microbatch"][i],
            result.keys["layer"][i],
        ) == (it, mb, layer)
        assert result.metrics["none"]["imbalance_after"][i] == pytest.approx(rank_imbalance(load))
        assert result.metrics["none"]["replicas"][i] == 0
        local = sum(int(load[s, s * (E // R) : (s + 1) * (E // R)].sum()) for s in range(R))
        assert result.metrics["none"]["inflight_ratio"][i] == pytest.approx(
            1 - local / int(load.sum())
        )
        direct = planner.metrics(load, planner.solve(load, 1, min_quota=8))
        for key in ("imbalance_after", "replicas", "max_fanout", "inflight_ratio", "threshold"):
            assert result.metrics["ultraep"][key][i] == pytest.approx(direct[key])
        exact = planner.metrics(load, baselines.eplb_exact(load, 1))
        assert result.metrics["eplb-exact"]["imbalance_after"][i] == pytest.approx(
            exact["imbalance_after"]
        )
        assert result.metrics["ideal"]["imbalance_after"][i] == 1.0
        assert result.metrics["ultraep"]["imbalance_after"][i] <= rank_imbalance(load) + 1e-12
        per_expert = load.numpy().sum(0)
        assert result.load["routed"][i] == per_expert.sum()
        assert result.load["expert_imbalance"][i] == pytest.approx(
            per_expert.max() / per_expert.mean()
        )
    summary = metric_summary(result)
    assert summary["none"]["imbalance_mean"] == pytest.approx(
        np.mean([rank_imbalance(r[4]) for r in records])
    )
    assert summary["none"]["worse_than_none"] == 0.0
    assert (
        summary["ultraep"]["imbalance_mean"]
        < summary["eplb-exact"]["imbalance_mean"]
        < summary["none"]["imbalance_mean"]
    )


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
                history = loads[max(0, call - window) : call] if call else [load]
                placement = baselines.eplb(torch.stack(history).sum(0), 2).slot_expert
            expected = planner.metrics(load, baselines.round_robin(load, placement))
            assert result.metrics["eplb"]["imbalance_after"][i] == pytest.approx(
                expected["imbalance_after"]
            )
            assert result.metrics["eplb"]["inflight_ratio"][i] == pytest.approx(
                expected["inflight_ratio"]
            )


def test_stale_history_hurts_eplb_on_a_drifting_trace():
    records = drifting_records(iterations=24, microbatches=2, layers=2, drift=0.8, seed=4)
    specs = {
        f"eplb/{i}": BalancerConfig("eplb", num_slots=1, eplb_window=i, eplb_interval=i)
        for i in (1, 16)
    }
    specs["eplb-exact"] = BalancerConfig("eplb-exact", num_slots=1)
    result = rp.replay(records, specs)
    stale = staleness_summary(result)
    assert [r["interval"] for r in stale] == [1, 16]
    fresh, old = stale
    exact = metric_summary(result)["eplb-exact"]
    assert exact["imbalance_mean"] < fresh["imbalance_mean"] < old["imbalance_mean"]
    assert old["worse_than_none"] >= fresh["worse_than_none"]


def test_eplb_keeps_history_per_ep_group(tmp_path):
    records = drifting_records(iterations=4, layers=1, seed=6)
    paths = []
    for g in range(2):
        path = traces.trace_path(tmp_path, g)
        with traces.TraceWriter(
            path, num_ranks=R, num_experts=E, meta={"group": g}, fsync=False
        ) as w:
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


def test_replay_rejects_bad_input():
    records = drifting_records(iterations=1)
    none = {"none": BalancerConfig("none")}
    with pytest.raises(ValueError, match="no balancer"):
        rp.replay(records, {})
    with pytest.raises(ValueError, match="both shape and hardware"):
        rp.replay(records, none, shape=hardware.DEFAULT_SHAPE)
    with pytest.raises(ValueError, match="no records"):
        rp.replay([], none)
