"""The peers in the replay harness (``analysis/peers.py``): DeepSeek's re-placing EPLB (global and
hierarchical) and LLEP replayed next to the registry's balancers on synthetic loads, with the weight
copies each implies (main-expert moves included), fan-out, cross-domain copies and bytes, memory
spread and the cost model's estimate, and the peer table over them (``summary.peer_summary``)."""

from __future__ import annotations

import numpy as np
import pytest

from ultraep_megatron.analysis import cost as cm
from ultraep_megatron.analysis.peers import PeerConfig
from ultraep_megatron.analysis.replay import replay
from ultraep_megatron.analysis.summary import peer_summary
from ultraep_megatron.planner import BalancerConfig, baselines
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.planner.baselines.registry import DEEPSEEK_EPLB, LLEP
from ultraep_megatron.settings import hardware as settings_hw
from ultraep_megatron.traces.synthetic import zipf_load

R, E, S, N = 8, 32, 2, 4
SHAPE = settings_hw.ExpertShape(256, 128)
HARDWARE = settings_hw.Hardware(scale_up_domain=N)


@pytest.fixture(scope="module")
def synthetic():
    """Skewed loads of 8 ranks in NVLink domains of 4, replayed through ultraep without and with
    the domain constraint and the peers (DeepSeek global and hierarchical, LLEP)."""
    loads = [
        zipf_load(R, E, imbalance, seed=seed) for seed, imbalance in enumerate((1.3, 1.8, 2.5, 3.5))
    ]
    records = [(0, 1, 0, layer, load) for layer, load in enumerate(loads, start=1)]
    balancers = {
        "ultraep": BalancerConfig(registry.ULTRAEP, num_slots=S),
        "ultraep-domains": BalancerConfig(registry.ULTRAEP, num_slots=S, domain_size=N),
        "none": BalancerConfig(registry.NONE),
    }
    peer_configs = [
        PeerConfig(DEEPSEEK_EPLB, num_slots=S),
        PeerConfig(DEEPSEEK_EPLB, num_slots=S, node_size=N),
        PeerConfig(LLEP),
    ]
    result = replay(
        records, balancers, peers=peer_configs, shape=SHAPE, hardware=HARDWARE, plan_seconds=0.0
    )
    return loads, peer_configs, result


def test_peer_metrics_and_costs_are_those_of_their_placements(synthetic):
    loads, peer_configs, result = synthetic
    assert result.ranks_per_domain == N
    assert result.labels == ["ultraep", "ultraep-domains", "none", *[p.label for p in peer_configs]]
    global_, hierarchical, llep = peer_configs
    for i, load in enumerate(loads):
        for peer, outcome in (
            (global_, baselines.deepseek_eplb(load, S)),
            (hierarchical, baselines.deepseek_eplb(load, S, num_groups=R // N, num_nodes=R // N)),
            (llep, baselines.Placement.from_plan(baselines.llep(load))),
        ):
            expected = baselines.placement_metrics(load, outcome, domain_size=N)
            got = {k: v[i] for k, v in result.metrics[peer.label].items()}
            for key in (
                "imbalance_after",
                "weight_copies",
                "main_moves",
                "cross_domain_copies",
                "max_fanout",
                "memory_spread_after",
                "inflight_ratio",
            ):
                assert got[key] == pytest.approx(expected[key]), (peer.label, key)
            total = (
                cm.layer_cost(load, outcome, SHAPE, HARDWARE)["total"]
                - cm.layer_cost(load, outcome, SHAPE, HARDWARE)["plan"]
            )
            assert result.costs[peer.label]["total"][i] == pytest.approx(total), peer.label
        # DeepSeek re-places main experts; its hierarchical policy keeps every copy in the home domain.
        assert result.metrics[global_.label]["main_moves"][i] > 0
        assert result.metrics[hierarchical.label]["cross_domain_copies"][i] == 0
        assert result.metrics["ultraep-domains"]["cross_domain_copies"][i] == 0
        assert result.costs["ultraep-domains"]["xdom_bytes"][i] == 0
    # Without the constraint the same loads send weights across domains, and those bytes are charged.
    assert result.metrics["ultraep"]["cross_domain_copies"].sum() > 0
    assert (result.costs["ultraep"]["xdom_bytes"] > 0).any()
    # A plan's weight copies are its replicas; mains never move.
    assert np.array_equal(
        result.metrics["ultraep"]["weight_copies"], result.metrics["ultraep"]["replicas"]
    )
    assert not result.metrics["ultraep"]["main_moves"].any()


def test_peer_summary_means_the_records(synthetic):
    _, peer_configs, result = synthetic
    table = peer_summary(result)
    assert list(table) == result.labels
    for label, row in table.items():
        m = result.metrics[label]
        assert row["weight_copies_mean"] == pytest.approx(m["weight_copies"].mean())
        assert row["imbalance_max"] == m["imbalance_after"].max()
        assert row["memory_spread_after_max"] == m["memory_spread_after"].max()
        assert row["xdom_mib_mean"] == pytest.approx(
            result.costs[label]["xdom_bytes"].mean() / 2**20
        )
    # UltraEP balances these loads tighter than LLEP with fewer copies than DeepSeek's EPLB.
    deepseek, llep = peer_configs[0].label, peer_configs[2].label
    assert table["ultraep"]["imbalance_mean"] < table[llep]["imbalance_mean"]
    assert table["ultraep"]["weight_copies_mean"] < table[deepseek]["weight_copies_mean"]
    assert table["none"]["speedup_vs_none_excl_plan"] == pytest.approx(1.0)
