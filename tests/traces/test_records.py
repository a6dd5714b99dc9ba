"""Replay records (``traces/records.py``): selecting layers, capping records per EP group and
scaling loads, as the replay sees them, and the record count for progress."""

from __future__ import annotations

import numpy as np
import pytest

from traces_helpers import drifting_records

from ultraep_megatron import traces
from ultraep_megatron.analysis import replay as rp
from ultraep_megatron.planner import BalancerConfig

R, E = 4, 16


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
    assert np.allclose(
        doubled.metrics["none"]["imbalance_after"], plain.metrics["none"]["imbalance_after"]
    )
    assert np.array_equal(
        doubled.metrics["none"]["threshold"], 2 * plain.metrics["none"]["threshold"]
    )
    records_stream = traces.TraceRecords([path])
    assert records_stream.total == len(records)
    with pytest.raises(ValueError, match="load_scale"):
        traces.TraceRecords([path], load_scale=0)
