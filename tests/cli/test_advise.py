"""``ultraep advise`` (``cli/advise.py``): the recommendation as training flags and its outputs, the
statement instead of an estimate for a tiny model's trace, the trigger recommended with the floor and
the slots, and the advice on the shipped real trace (refused as traced, acted on when projected)."""

from __future__ import annotations

import argparse
import csv
import json

from cli_helpers import assert_png
from traces_helpers import KJV_TRACE

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_FAILED, EXIT_OK
from ultraep_megatron.megatron.run import arguments as balancer_flags
from ultraep_megatron.planner.baselines import registry


def test_advise_recommends_flags_and_writes_outputs(trace_dir, tmp_path, capsys):
    # 256 tokens x top-2 per rank: a 36 MiB expert's transfer outweighs what a replica saves.
    assert (
        main(
            ["advise", str(trace_dir), "--slots", "0,1,2", "--plan-time-us", "100", "--no-progress"]
        )
        == EXIT_OK
    )
    assert (
        "Recommendation (ESTIMATE): --moe-balancer none\n  replicas do not pay"
        in capsys.readouterr().out
    )
    # 16x the microbatch: replicas pay.
    code = main(
        [
            "advise",
            str(trace_dir),
            "--slots",
            "0,1,2",
            "--min-quotas",
            "default,hw,8",
            "--plan-time-us",
            "100",
            "--load-scale",
            "16",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "Quota floor from the hardware (training" in out and "=> a replica pays from q =" in out
    assert "Recommendation (ESTIMATE): --moe-balancer ultraep --moe-balancer-num-slots" in out
    assert "Per-layer imbalance (mean) vs slots" in out
    payload = json.loads((tmp_path / "advise.json").read_text())
    assert len(payload["rows"]) == 7  # 0 slots (no floor to vary), then 2 slot counts x 3 floors
    assert [(r["num_slots"], r["min_quota"]) for r in payload["rows"]][:2] == [(0, None), (1, None)]
    assert payload["recommendation"]["num_slots"] in (0, 1, 2)
    assert payload["hardware_min_quota"] > 1
    assert len(list(csv.DictReader(open(tmp_path / "advise.csv")))) == 7
    assert_png(tmp_path / "advisor.png")
    # No slot count fits the memory budget: no recommendation, exit status 1.
    assert (
        main(
            ["advise", str(trace_dir), "--slots", "1,2", "--memory-budget-gb", "0", "--no-progress"]
        )
        == EXIT_FAILED
    )
    assert "no recommendation" in capsys.readouterr().out


def test_a_tiny_models_trace_gets_a_statement_not_an_estimate(tmp_path, capsys):
    """h = f = 64 and 128 pairs per rank: the cost model's layer is a fraction of a microsecond,
    under the latencies it leaves out. replay keeps the balance figures and says why it shows no
    estimate; advise refuses before its sweep, saying what to pass."""
    trace = traces.write_synthetic_trace(
        tmp_path / "tiny.uetrace",
        num_iterations=4,
        num_microbatches=2,
        num_layers=2,
        num_ranks=4,
        num_experts=16,
        tokens_per_rank=64,
        topk=2,
        meta={"hidden_size": 64, "moe_ffn_hidden_size": 64, "swiglu": True},
    )
    assert (
        main(
            [
                "replay",
                str(trace),
                "--no-staleness",
                "--output-dir",
                str(tmp_path / "replay"),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    out = capsys.readouterr().out
    assert "Balancing quality over all loads" in out
    assert (
        "ESTIMATE not shown" in out
        and "below the ~10 us" in out
        and "ESTIMATE: time per MoE layer" not in out
    )
    payload = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert (
        "h=64, f=64" in payload["estimate_problem"]
        and payload["estimated_cost"]["none"]["total_ms"] < 0.01
    )
    assert not (tmp_path / "replay" / "estimated_layer_time.png").exists()
    assert (
        main(["advise", str(trace), "--output-dir", str(tmp_path / "advise"), "--no-progress"])
        == EXIT_FAILED
    )
    out = capsys.readouterr().out
    assert "no recommendation: this trace cannot support one" in out and "--load-scale" in out
    assert "Recommendation" not in out and "Sweep over" not in out
    assert json.loads((tmp_path / "advise" / "advise.json").read_text())["rows"] == []
    # Projected onto a production expert and microbatch, the same trace is sized.
    assert (
        main(
            [
                "advise",
                str(trace),
                "--hidden-size",
                "4096",
                "--moe-ffn-hidden-size",
                "1536",
                "--load-scale",
                "16",
                "--slots",
                "0,1",
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    assert "Recommendation (ESTIMATE): --moe-balancer" in capsys.readouterr().out


def test_advise_recommends_trigger_floor_and_slots(capsys):
    args = [
        "advise",
        KJV_TRACE,
        "--max-records",
        32,
        "--hidden-size",
        4096,
        "--moe-ffn-hidden-size",
        1536,
        "--load-scale",
        16,
        "--slots",
        "0,1,2",
        "--min-quotas",
        "default,hw",
        "--triggers",
        "default,1.0,3.0",
        "--moe-balancer-hardware",
        "h100-hgx",
        "--moe-balancer-domain-size",
        2,
        "--plan-time-us",
        100,
        "--no-progress",
        "--json",
    ]
    assert main(list(map(str, args))) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"]["scale_up_gbps"] == 450 and report["hardware_min_quota"] == 833
    rows = [r for r in report["rows"] if r["balancer"] == registry.ULTRAEP]
    assert {(r["min_quota"], r["trigger"]) for r in rows} == {
        (q, t) for q in (None, 833) for t in (None, 1.0, 3.0)
    }
    # A trigger above every load's imbalance skips them all: no replica, no speedup from balancing.
    never = [r for r in rows if r["trigger"] == 3.0 and r["num_slots"] > 0]
    assert all(r["balanced_share"] == 0 and r["replicas_mean"] == 0 for r in never)
    advice = report["recommendation"]
    best = max(
        (r for r in rows if r["num_slots"] == advice["num_slots"]),
        key=lambda r: r["speedup_vs_none"],
    )
    assert advice["row"]["speedup_vs_none"] == best["speedup_vs_none"] and advice["trigger"] != 3.0
    flags = report["flags"]
    assert (
        f"--moe-balancer-num-slots {advice['num_slots']}" in flags
        and "--moe-balancer-domain-size 2" in flags
    )
    assert ("--moe-balancer-trigger" in flags) == (advice["trigger"] is not None)


# The projection docs/traces.md documents: a Qwen3-235B-A22B expert, 16x the traced microbatch.
PROJECTION = ["--hidden-size", "4096", "--moe-ffn-hidden-size", "1536", "--load-scale", "16"]


def test_advisor_on_the_shipped_trace(capsys):
    """As traced (h = f = 64), the cost model's MoE layer is a fraction of a microsecond: a clear
    statement that the trace cannot support a recommendation, naming the projection flags.
    Projected, a recommendation a user can act on: flags the training parser accepts, with
    replicas (at least one slot) and a balance near 1."""
    assert main(["advise", str(KJV_TRACE), "--json", "--no-progress"]) == EXIT_FAILED
    refused = json.loads(capsys.readouterr().out)
    assert refused["recommendation"] is None and refused["rows"] == []
    assert refused["no_recommendation"].startswith("this trace cannot support one")
    assert all(
        flag in refused["no_recommendation"]
        for flag in ("--hidden-size", "--moe-ffn-hidden-size", "--load-scale")
    )
    # The sweep is cut to 0-2 slots (the full default sweep recommends the same: docs/traces.md).
    assert (
        main(["advise", str(KJV_TRACE), *PROJECTION, "--slots", "0,1,2", "--json", "--no-progress"])
        == EXIT_OK
    )
    report = json.loads(capsys.readouterr().out)
    advice = report["recommendation"]
    assert advice["num_slots"] >= 1 and advice["row"]["imbalance_mean"] < 1.05
    assert advice["row"]["speedup_vs_none"] > 1.0
    parser = argparse.ArgumentParser()
    balancer_flags.add_balancer_arguments(parser)
    flags = parser.parse_args(report["flags"].split())
    config = balancer_flags.balancer_config_from_args(
        flags
    )  # validated: names a real balancer, slots, floor
    assert (config.name, config.num_slots, config.min_quota) == (
        "ultraep",
        advice["num_slots"],
        advice["min_quota"],
    )


def test_memory_budget_lists_no_slot_count_over_it_and_floors_are_in_pairs(trace_dir, capsys):
    """--memory-budget-gb: slot counts whose slots take more memory per rank are neither swept nor
    listed, only named as over the budget; when no slot count with replicas fits, no recommendation,
    saying so. The quota floor and the loads are (token, expert) pairs (docs/glossary.md), never
    "tokens"."""
    common = [
        str(trace_dir),
        "--hidden-size",
        "4096",
        "--moe-ffn-hidden-size",
        "1536",
        "--load-scale",
        "16",
        "--plan-time-us",
        "100",
        "--no-progress",
    ]
    # One slot of a 36 MiB expert: 108 MiB per rank (bf16 weights + fp32 gradients).
    assert (
        main(["advise", *common, "--slots", "0,1,2,4", "--memory-budget-gb", "0.25", "--json"])
        == EXIT_OK
    )
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] and all(r["memory_bytes"] <= 0.25 * 2**30 for r in report["rows"])
    assert {r["num_slots"] for r in report["rows"]} == {0, 1, 2}
    assert list(report["over_budget_slots"]) == ["4"] and report["recommendation"]["num_slots"] in (
        0,
        1,
        2,
    )
    assert main(["advise", *common, "--memory-budget-gb", "0.001"]) == EXIT_FAILED
    out = capsys.readouterr().out
    sweep = out[out.index("Sweep over") :].split("\n\n")[0].splitlines()[3:]
    assert [line.split()[:2] for line in sweep] == [["ultraep", "0"]]  # only 0 slots fit
    assert "slot counts 1 (108 MiB), 2 (216 MiB)" in out and "are over it, not swept" in out
    assert (
        "no recommendation: no slot count with replicas fits the memory budget of 1 MiB per rank"
        in out
    )
    assert "Recommendation" not in out
    floor = out[out.index("Quota floor from the hardware") : out.index("Memory budget")]
    assert "token" not in floor.replace("(token, expert) pair", "")
    assert f"= {report['hardware_min_quota']} pairs" in floor and "pairs per microbatch" in floor


def test_advise_sees_loads_two_slots_cannot_balance(tmp_path, capsys):
    """Issue 45's slot rule on a trace: EP32, E=256, top-8, half the experts receive no tokens (the
    routing of the other half sampled per load). The advisor reports the capacity bound, about 1.5
    at two slots and 1.0 at four (what the real planner reaches: tests/analysis/test_advisor.py),
    recommends four, and names the recipes' rule for this shape, the same four."""
    import torch

    from ultraep_megatron.analysis.advisor import half_cold_load

    generator = torch.Generator().manual_seed(5)
    hot = (half_cold_load(32, 256).sum(0) > 0).nonzero().flatten()
    with traces.TraceWriter(
        traces.trace_path(tmp_path, 0), num_ranks=32, num_experts=256, meta={"topk": 8}
    ) as writer:
        for iteration in (1, 2):
            load = torch.stack(
                [
                    torch.bincount(
                        hot[torch.randint(0, len(hot), (4096 * 8,), generator=generator)],
                        minlength=256,
                    )
                    for _ in range(32)
                ]
            )
            writer.append(iteration, 0, 1, load)
            writer.flush_iteration(iteration)
    assert (
        main(
            [
                "advise",
                str(tmp_path),
                "--slots",
                "0,1,2,4",
                "--min-quotas",
                "default",
                "--json",
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    report = json.loads(capsys.readouterr().out)
    bound = {r["num_slots"]: r["capacity_bound_p95"] for r in report["rows"]}
    assert abs(bound[2] - 1.5) < 0.03 and bound[4] == 1.0 and bound[0] > 1.95, bound
    assert report["recommendation"]["num_slots"] == 4 == report["recipe_slots"]
    assert report["recommendation"]["capacity_need"] == 4
    assert (
        main(
            [
                "advise",
                str(tmp_path),
                "--slots",
                "0,1,2,4",
                "--min-quotas",
                "default",
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    out = capsys.readouterr().out
    assert "slot rule, capacity: a rank's S slots carry at most S expert loads" in out
    assert "the fewest slots reaching 1.05 on 95% of the loads: 4" in out
    assert (
        "a recipe without a trace takes max(2, ceil(E / 2R)) = 4 slot(s) for E=256 over R=32" in out
    )
