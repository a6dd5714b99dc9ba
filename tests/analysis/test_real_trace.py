"""A real routing trace: the tiny CPU MoE model trained 300 iterations on the King James Bible
(tests/traces/data/README.md says how it was recorded). The file reads back whole, the router's
expert popularity visibly shifts over training (while staying stable within a short window), and
replaying it through every balancer gives what the paper reports on real routing: exact-load UltraEP
never makes a microbatch worse and beats history-based EPLB, which stale history makes worse than
no balancing on some microbatches. (``ultraep advise`` on it: ``tests/cli/test_advise.py``.)"""

from __future__ import annotations

import numpy as np
import pytest

from traces_helpers import KJV_TRACE

from ultraep_megatron import traces
from ultraep_megatron.analysis.replay import ReplayResult, replay
from ultraep_megatron.planner import BalancerConfig

# The recording run (recipes/record_trace_kjv.sh): EP=4 ranks, 16 experts, 4 MoE layers (Megatron's
# 1-based layer numbers), 300 iterations of global batch 16 = 2 microbatches per rank of
# 2 sequences x 128 tokens, top-2 routing: every source rank routes 2 * 128 * 2 pairs per microbatch.
R, E = 4, 16
ITERATIONS = range(1, 301)
MICROBATCHES = (0, 1)
LAYERS = (1, 2, 3, 4)
PAIRS_PER_RANK = 2 * 128 * 2
TENTH = 30  # iterations


@pytest.fixture(scope="module")
def trace() -> traces.Trace:
    return traces.read_trace(KJV_TRACE, on_truncated="error")


def rank_imbalance(load: np.ndarray) -> np.ndarray:
    """max/mean per-rank load of the main experts (expert e lives on rank e // (E/R)), by numpy.

    load: [N, R, E] -> [N].
    """
    per_rank = load.sum(axis=1).reshape(len(load), R, E // R).sum(axis=2)
    return per_rank.max(axis=1) / per_rank.mean(axis=1)


def expert_share(trace: traces.Trace, mask: np.ndarray) -> np.ndarray:
    """Share of all (token, expert) pairs in the selected records that went to each expert: [E]."""
    pairs = trace.load.numpy()[mask].sum(axis=(0, 1)).astype(np.float64)
    return pairs / pairs.sum()


def test_trace_reads_back_whole(trace):
    assert KJV_TRACE.stat().st_size < 1 << 20  # small enough to ship as test data
    assert (
        trace.status == "closed" and trace.truncated_bytes == 0 and trace.uncommitted_records == 0
    )
    assert (trace.header.num_ranks, trace.header.num_experts) == (R, E)
    meta = trace.header.meta
    assert (meta["hidden_size"], meta["moe_ffn_hidden_size"], meta["topk"], meta["num_layers"]) == (
        64,
        64,
        2,
        4,
    )
    # Every (iteration, microbatch, layer) exactly once, in training order.
    keys = list(zip(trace.iteration.tolist(), trace.microbatch.tolist(), trace.layer.tolist()))
    assert sorted(keys) == [(i, m, l) for i in ITERATIONS for m in MICROBATCHES for l in LAYERS]
    assert np.all(np.diff(trace.iteration.numpy()) >= 0)
    # No token dropped: every source rank routed all of its pairs in every record.
    assert trace.load.shape == (len(keys), R, E)
    assert np.all(trace.load.numpy().sum(axis=2) == PAIRS_PER_RANK)


def test_router_load_shifts_over_training(trace):
    iteration, layer = trace.iteration.numpy(), trace.layer.numpy()
    first, last = iteration <= TENTH, iteration > ITERATIONS[-1] - TENTH
    even = iteration % 2 == 0
    for l in LAYERS:
        at = layer == l
        early, late = expert_share(trace, at & first), expert_share(trace, at & last)
        # Across training the popularity moved: a share of the pairs sits on other experts (the
        # measured correlations and distances: docs/traces.md, "A real routing trace").
        assert np.corrcoef(early, late)[0, 1] < 0.85, l
        assert 0.5 * np.abs(early - late).sum() > 0.2, l
        # Within one tenth it is stable: the change above is drift, not sampling noise.
        for window in (first, last):
            assert (
                np.corrcoef(
                    expert_share(trace, at & window & even),
                    expert_share(trace, at & window & ~even),
                )[0, 1]
                > 0.95
            ), l


SPECS = {
    "none": BalancerConfig("none"),
    "eplb-16": BalancerConfig("eplb", eplb_window=16, eplb_interval=16),
    "eplb-4": BalancerConfig("eplb", eplb_window=4, eplb_interval=4),
    "eplb-exact": BalancerConfig("eplb-exact"),
    "ultraep": BalancerConfig("ultraep"),
    "ideal": BalancerConfig("ideal"),
}


@pytest.fixture(scope="module")
def replayed() -> ReplayResult:
    return replay(traces.TraceRecords([KJV_TRACE]), SPECS, keep_loads=True)


def test_replay_runs_every_balancer(trace, replayed):
    load = trace.load.numpy()
    assert replayed.num_records == len(load) and (replayed.num_ranks, replayed.num_experts) == (
        R,
        E,
    )
    assert np.array_equal(replayed.keys["iteration"], trace.iteration.numpy())
    assert np.array_equal(replayed.keys["layer"], trace.layer.numpy())
    before = rank_imbalance(load)
    np.testing.assert_allclose(replayed.metrics["none"]["imbalance_after"], before)
    total = load.sum(axis=(1, 2))
    for label in SPECS:
        metrics = replayed.metrics[label]
        np.testing.assert_allclose(metrics["imbalance_before"], before)
        rank_load = replayed.rank_load[label]  # [N, R] after balancing
        assert np.array_equal(rank_load.sum(axis=1), total), label  # every pair lands somewhere
        np.testing.assert_allclose(
            metrics["imbalance_after"], rank_load.max(axis=1) / rank_load.mean(axis=1)
        )
    np.testing.assert_array_equal(replayed.metrics["ideal"]["imbalance_after"], 1.0)


def test_ultraep_never_worse_than_none_and_beats_eplb(replayed):
    none = replayed.metrics["none"]["imbalance_after"]
    ultraep = replayed.metrics["ultraep"]["imbalance_after"]
    assert np.all(ultraep <= none + 1e-12)
    assert ultraep.max() < 1.02  # near-perfect balance on every microbatch (docs/traces.md)
    mean = {label: replayed.metrics[label]["imbalance_after"].mean() for label in SPECS}
    # The order of the means docs/traces.md tabulates: fresher information balances better.
    assert mean["ultraep"] < mean["eplb-exact"] < mean["eplb-4"] < mean["eplb-16"] < mean["none"]
    # Stale history: on the drifting routing, EPLB's placement from past microbatches makes some
    # microbatches worse than no balancing at all (their share: docs/traces.md).
    assert np.count_nonzero(replayed.metrics["eplb-16"]["imbalance_after"] > none + 1e-12) > 0
