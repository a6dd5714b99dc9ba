"""The peers in the replay harness: DeepSeek's re-placing EPLB (global and hierarchical) and LLEP
replayed next to the registry's balancers, on synthetic loads and on the shipped KJV trace, with the
weight copies each implies (main-expert moves included), fan-out, cross-domain copies and bytes,
memory spread and the cost model's estimate; ``ultraep replay`` printing the peer table; and
``ultraep advise`` recommending the trigger with the floor and the slots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ultraep_megatron import planner, traces
from ultraep_megatron.analysis import cost as cm
from ultraep_megatron.analysis.replay import DEEPSEEK_EPLB, LLEP, PeerConfig, peer_summary, replay
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE
from ultraep_megatron.planner import peers, policy
from ultraep_megatron.planner.policy import BalancerConfig
from ultraep_megatron.planner.synthetic import zipf_load

KJV = Path(__file__).parent / "data" / "kjv_tiny.uetrace"
R, E, S, N = 8, 32, 2, 4
SHAPE = cm.ExpertShape(256, 128)
HARDWARE = cm.Hardware(scale_up_domain=N)


@pytest.fixture(scope="module")
def synthetic():
    """Skewed loads of 8 ranks in NVLink domains of 4, replayed through ultraep without and with
    the domain constraint and the peers (DeepSeek global and hierarchical, LLEP)."""
    loads = [zipf_load(R, E, imbalance, seed=seed) for seed, imbalance in enumerate((1.3, 1.8, 2.5, 3.5))]
    records = [(0, 1, 0, layer, load) for layer, load in enumerate(loads, start=1)]
    balancers = {"ultraep": BalancerConfig(policy.ULTRAEP, num_slots=S),
                 "ultraep-domains": BalancerConfig(policy.ULTRAEP, num_slots=S, domain_size=N),
                 "none": BalancerConfig(policy.NONE)}
    peer_configs = [PeerConfig(DEEPSEEK_EPLB, num_slots=S), PeerConfig(DEEPSEEK_EPLB, num_slots=S, node_size=N),
                    PeerConfig(LLEP)]
    result = replay(records, balancers, peers=peer_configs, shape=SHAPE, hardware=HARDWARE, plan_seconds=0.0)
    return loads, peer_configs, result


def test_peer_metrics_and_costs_are_those_of_their_placements(synthetic):
    loads, peer_configs, result = synthetic
    assert result.ranks_per_domain == N
    assert result.labels == ["ultraep", "ultraep-domains", "none", *[p.label for p in peer_configs]]
    global_, hierarchical, llep = peer_configs
    for i, load in enumerate(loads):
        for peer, outcome in ((global_, peers.deepseek_eplb(load, S)),
                              (hierarchical, peers.deepseek_eplb(load, S, num_groups=R // N, num_nodes=R // N)),
                              (llep, peers.Placement.from_plan(peers.llep(load)))):
            expected = peers.placement_metrics(load, outcome, domain_size=N)
            got = {k: v[i] for k, v in result.metrics[peer.label].items()}
            for key in ("imbalance_after", "weight_copies", "main_moves", "cross_domain_copies", "max_fanout",
                        "memory_spread_after", "inflight_ratio"):
                assert got[key] == pytest.approx(expected[key]), (peer.label, key)
            total = cm.layer_cost(load, outcome, SHAPE, HARDWARE)["total"] - cm.layer_cost(
                load, outcome, SHAPE, HARDWARE)["plan"]
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
    assert np.array_equal(result.metrics["ultraep"]["weight_copies"], result.metrics["ultraep"]["replicas"])
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
        assert row["xdom_mib_mean"] == pytest.approx(result.costs[label]["xdom_bytes"].mean() / 2**20)
    # UltraEP balances these loads tighter than LLEP with fewer copies than DeepSeek's EPLB.
    deepseek, llep = peer_configs[0].label, peer_configs[2].label
    assert table["ultraep"]["imbalance_mean"] < table[llep]["imbalance_mean"]
    assert table["ultraep"]["weight_copies_mean"] < table[deepseek]["weight_copies_mean"]
    assert table["none"]["speedup_vs_none_excl_plan"] == pytest.approx(1.0)


def run_cli(capsys, *argv):
    code = main(["replay", *map(str, argv), "--no-progress"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    return captured.out


def test_replay_of_the_kjv_trace_prints_the_peer_table(capsys):
    """The shipped real trace (R=4), projected onto a production expert, in NVLink domains of 2."""
    args = [KJV, "--max-records", 48, "--no-staleness", "--hidden-size", 4096, "--moe-ffn-hidden-size", 1536,
            "--load-scale", 16, "--moe-balancer-domain-size", 2, "--plan-time-us", 100]
    out = run_cli(capsys, *args)
    table = out[out.index("Peers ("):]
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines()[3:] if line.strip()}
    assert set(rows) == {"none", policy.LABELS[policy.EPLB], policy.LABELS[policy.EPLB_EXACT],
                         "ultraep (replicas in domains of 2)", "ideal", "deepseek-eplb (global, S=2)",
                         "deepseek-eplb (hierarchical, nodes of 2, S=2)",
                         "llep (alpha=1.1, m=1024, lambda=1.3)"}
    assert "NVLink domains of 2 ranks" in table and "ESTIMATE" in table
    report = json.loads(run_cli(capsys, *args, "--json"))
    peer_table = report["peer_table"]
    assert peer_table["ultraep"]["cross_domain_copies_mean"] == 0 == peer_table["ultraep"]["xdom_mib_mean"]
    assert peer_table["deepseek-eplb (global, S=2)"]["main_moves_mean"] > 0
    assert peer_table["deepseek-eplb (global, S=2)"]["xdom_mib_mean"] > 0
    assert peer_table["ultraep"]["imbalance_mean"] < peer_table["none"]["imbalance_mean"]
    # The table's figures are those of the records replayed, recomputed here for LLEP.
    trace = traces.read_trace(KJV)
    loads = [trace.load[i] * 16 for i in range(48)]
    llep = [peers.placement_metrics(load, peers.Placement.from_plan(peers.llep(load)), domain_size=2)
            for load in loads]
    row = peer_table["llep (alpha=1.1, m=1024, lambda=1.3)"]
    assert row["weight_copies_mean"] == pytest.approx(np.mean([m["weight_copies"] for m in llep]))
    assert row["imbalance_mean"] == pytest.approx(np.mean([m["imbalance_after"] for m in llep]))
    assert row["balanced_share"] == pytest.approx(np.mean([planner.rank_imbalance(x) >= 1.3 for x in loads]))


def test_replay_of_synthetic_loads_prints_the_peer_table(tmp_path, capsys):
    path = traces.write_synthetic_trace(traces.trace_path(tmp_path, 0), num_iterations=2, num_microbatches=1,
                                        num_layers=2, num_ranks=8, num_experts=32, tokens_per_rank=512, topk=4,
                                        skew=1.2, seed=5)
    out = run_cli(capsys, path, "--no-staleness", "--scale-up-domain", 4, "--llep-trigger", 0,
                  "--llep-min-tokens-per-gemm", 64, "--peers", "llep,deepseek-eplb")
    table = out[out.index("Peers ("):]
    for label in ("ultraep", "llep (alpha=1.1, m=64, lambda=off)", "deepseek-eplb (global, S=2)",
                  "deepseek-eplb (hierarchical, nodes of 4, S=2)"):
        assert f"\n{label} " in table, label
    report = json.loads(run_cli(capsys, path, "--no-staleness", "--no-peers", "--json"))
    assert set(report["peer_table"]) == set(policy.COMPARED)
    # Domains that do not divide the EP group are refused, naming what is wrong.
    assert main(["replay", str(path), "--moe-balancer-domain-size", "3", "--no-progress"]) == EXIT_USAGE
    assert "--moe-balancer-domain-size 3 must divide the trace's 8 EP ranks" in capsys.readouterr().err
    assert main(["replay", str(path), "--scale-up-domain", "3", "--no-progress"]) == EXIT_USAGE
    assert "does not split into scale-up domains of 3" in capsys.readouterr().err


def test_advise_recommends_trigger_floor_and_slots(capsys):
    args = ["advise", KJV, "--max-records", 32, "--hidden-size", 4096, "--moe-ffn-hidden-size", 1536,
            "--load-scale", 16, "--slots", "0,1,2", "--min-quotas", "default,hw", "--triggers", "default,1.0,3.0",
            "--moe-balancer-hardware", "h100-hgx", "--moe-balancer-domain-size", 2, "--plan-time-us", 100,
            "--no-progress", "--json"]
    assert main(list(map(str, args))) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"]["scale_up_gbps"] == 450 and report["hardware_min_quota"] == 833
    rows = [r for r in report["rows"] if r["balancer"] == policy.ULTRAEP]
    assert {(r["min_quota"], r["trigger"]) for r in rows} == {(q, t) for q in (None, 833) for t in (None, 1.0, 3.0)}
    # A trigger above every load's imbalance skips them all: no replica, no speedup from balancing.
    never = [r for r in rows if r["trigger"] == 3.0 and r["num_slots"] > 0]
    assert all(r["balanced_share"] == 0 and r["replicas_mean"] == 0 for r in never)
    advice = report["recommendation"]
    best = max((r for r in rows if r["num_slots"] == advice["num_slots"]), key=lambda r: r["speedup_vs_none"])
    assert advice["row"]["speedup_vs_none"] == best["speedup_vs_none"] and advice["trigger"] != 3.0
    flags = report["flags"]
    assert f"--moe-balancer-num-slots {advice['num_slots']}" in flags and "--moe-balancer-domain-size 2" in flags
    assert ("--moe-balancer-trigger" in flags) == (advice["trigger"] is not None)
