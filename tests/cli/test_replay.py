"""``ultraep replay`` (``cli/replay.py``): the report, its JSON / CSV / PNG outputs against the
library's figures, and the peer table on the shipped KJV trace and on synthetic loads (and none with
--no-peers)."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
import torch

from cli_helpers import assert_png, run_replay
from traces_helpers import KJV_TRACE

from ultraep_megatron import planner, traces
from ultraep_megatron.analysis import plotting
from ultraep_megatron.analysis import replay as rp
from ultraep_megatron.analysis.summary import metric_summary
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE
from ultraep_megatron.planner import BalancerConfig, baselines
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.planner.baselines.registry import COMPARED


def test_replay_report_json_csv_and_plots(trace_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code = main(
        [
            "replay",
            str(trace_dir),
            "--moe-balancer-num-slots",
            "1",
            "--moe-balancer-eplb-window",
            "4",
            "--moe-balancer-eplb-interval",
            "4",
            "--staleness-intervals",
            "1,4",
            "--output-dir",
            str(out_dir),
            "--heatmap-layers",
            "2",
            "--plan-time-us",
            "50",
        ]
    )
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    for text in (
        "24 loads in 6 iterations, closed cleanly",
        "What the router sent, per layer",
        "Balancing quality over all loads",
        "Per layer:",
        "Stale history (paper Fig. 6)",
        "eplb interval=1 window=1",
        "ESTIMATE — cost model, not a measurement",
        "h=4096, f=1536, SwiGLU (trace meta)",
        "900 GB/s scale-up, 2250 TFLOP/s, 8 TB/s HBM",
        "Plan time: fixed 50 us",
        "--moe-balancer-num-slots 1",
    ):
        assert text in captured.out, text
    assert "[replay]" in captured.err  # progress on stderr
    # The per-layer table: mean/max with the same three decimals, never a mean above its max.
    table = captured.out[captured.out.index("Per layer: imbalance mean/max") :].split("\n\n")[0]
    cells = re.findall(r"(\d+\.\d+)/(\d+\.\d+)", table)
    assert len(cells) == 2 * len(COMPARED)  # 2 layers
    assert all(
        len(m.split(".")[1]) == len(x.split(".")[1]) == 3 and float(m) <= float(x) for m, x in cells
    )
    payload = json.loads((out_dir / "replay.json").read_text())
    assert payload["num_records"] == 24 and payload["layers"] == [1, 2]
    assert set(payload["quality"]) == set(COMPARED) | {"eplb/i=1/w=1", "eplb/i=4/w=4"}
    assert payload["estimated_cost"]["ideal"]["frac_ideal"] == pytest.approx(1.0)
    assert payload["estimated_cost"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert [r["interval"] for r in payload["staleness"]] == [1, 4]
    # The figures are the library's, on the same records.
    direct = rp.replay(
        traces.TraceRecords(traces.find_trace_files(trace_dir)),
        {"ultraep": BalancerConfig("ultraep", num_slots=1)},
    )
    summary = metric_summary(direct)["ultraep"]
    for key in ("imbalance_mean", "imbalance_max", "replicas_mean", "fanout_max", "inflight_mean"):
        assert payload["quality"]["ultraep"][key] == pytest.approx(summary[key]), key
    rows = list(csv.DictReader(open(out_dir / "replay_per_layer.csv")))
    assert {(r["layer"], r["balancer"]) for r in rows} >= {("1", "ultraep"), ("2", "none")}
    row = next(r for r in rows if r["layer"] == "2" and r["balancer"] == "ultraep")
    assert float(row["imbalance_mean"]) == pytest.approx(
        payload["quality_per_layer"]["2"]["ultraep"]["imbalance_mean"]
    )
    assert payload["estimate_problem"] is None
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert pngs == [
        "eplb_staleness.png",
        "estimated_layer_time.png",
        "imbalance_heatmap.png",
        "imbalance_over_time.png",
        "load_heatmap_layer2.png",
    ]
    for name in pngs:
        assert_png(out_dir / name)

    # --json: one document on stdout, nothing else there.
    assert (
        main(
            [
                "replay",
                str(trace_dir),
                "--balancers",
                "none,ultraep",
                "--no-staleness",
                "--no-cost",
                "--json",
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["quality"]) == {"none", "ultraep"} and "estimated_cost" not in doc


def test_replay_of_the_kjv_trace_prints_the_peer_table(capsys):
    """The shipped real trace (R=4), projected onto a production expert, in NVLink domains of 2."""
    args = [
        KJV_TRACE,
        "--max-records",
        48,
        "--no-staleness",
        "--hidden-size",
        4096,
        "--moe-ffn-hidden-size",
        1536,
        "--load-scale",
        16,
        "--moe-balancer-domain-size",
        2,
        "--plan-time-us",
        100,
    ]
    out = run_replay(capsys, *args)
    table = out[out.index("Peers (") :]
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines()[3:] if line.strip()}
    assert set(rows) == {
        "none",
        plotting.LABELS[registry.EPLB],
        plotting.LABELS[registry.EPLB_EXACT],
        "ultraep (replicas in domains of 2)",
        "ideal",
        "deepseek-eplb (global, S=2)",
        "deepseek-eplb (hierarchical, nodes of 2, S=2)",
        "llep (alpha=1.1, m=1024, lambda=1.3)",
    }
    assert "NVLink domains of 2 ranks" in table and "ESTIMATE" in table
    report = json.loads(run_replay(capsys, *args, "--json"))
    peer_table = report["peer_table"]
    assert (
        peer_table["ultraep"]["cross_domain_copies_mean"]
        == 0
        == peer_table["ultraep"]["xdom_mib_mean"]
    )
    assert peer_table["deepseek-eplb (global, S=2)"]["main_moves_mean"] > 0
    assert peer_table["deepseek-eplb (global, S=2)"]["xdom_mib_mean"] > 0
    assert peer_table["ultraep"]["imbalance_mean"] < peer_table["none"]["imbalance_mean"]
    # The table's figures are those of the records replayed, recomputed here for LLEP.
    trace = traces.read_trace(KJV_TRACE)
    loads = [trace.load[i] * 16 for i in range(48)]
    llep = [
        baselines.placement_metrics(
            load, baselines.Placement.from_plan(baselines.llep(load)), domain_size=2
        )
        for load in loads
    ]
    row = peer_table["llep (alpha=1.1, m=1024, lambda=1.3)"]
    assert row["weight_copies_mean"] == pytest.approx(np.mean([m["weight_copies"] for m in llep]))
    assert row["imbalance_mean"] == pytest.approx(np.mean([m["imbalance_after"] for m in llep]))
    assert row["balanced_share"] == pytest.approx(
        np.mean([planner.rank_imbalance(x) >= 1.3 for x in loads])
    )


def test_replay_of_synthetic_loads_prints_the_peer_table(tmp_path, capsys):
    path = traces.write_synthetic_trace(
        traces.trace_path(tmp_path, 0),
        num_iterations=2,
        num_microbatches=1,
        num_layers=2,
        num_ranks=8,
        num_experts=32,
        tokens_per_rank=512,
        topk=4,
        skew=1.2,
        seed=5,
    )
    out = run_replay(
        capsys,
        path,
        "--no-staleness",
        "--scale-up-domain",
        4,
        "--llep-trigger",
        0,
        "--llep-min-tokens-per-gemm",
        64,
        "--peers",
        "llep,deepseek-eplb",
    )
    table = out[out.index("Peers (") :]
    for label in (
        "ultraep",
        "llep (alpha=1.1, m=64, lambda=off)",
        "deepseek-eplb (global, S=2)",
        "deepseek-eplb (hierarchical, nodes of 4, S=2)",
    ):
        assert f"\n{label} " in table, label
    # Domains that do not divide the EP group are refused, naming what is wrong.
    assert (
        main(["replay", str(path), "--moe-balancer-domain-size", "3", "--no-progress"])
        == EXIT_USAGE
    )
    assert (
        "--moe-balancer-domain-size 3 must divide the trace's 8 EP ranks" in capsys.readouterr().err
    )
    assert main(["replay", str(path), "--scale-up-domain", "3", "--no-progress"]) == EXIT_USAGE
    assert "does not split into scale-up domains of 3" in capsys.readouterr().err


def test_no_peers_prints_no_peer_table(trace_dir, capsys):
    """--no-peers: no peer table, neither printed (not even the balancers' rows of it) nor in the
    JSON; the rest of the report stays."""
    out = run_replay(capsys, trace_dir, "--no-staleness", "--no-peers")
    assert "Balancing quality over all loads" in out and "ESTIMATE" in out
    assert "Peers (" not in out and "deepseek-eplb" not in out and "llep" not in out
    report = json.loads(run_replay(capsys, trace_dir, "--no-staleness", "--no-peers", "--json"))
    assert report["peer_table"] == {} and set(report["quality"]) == set(registry.COMPARED)
    with_peers = json.loads(run_replay(capsys, trace_dir, "--no-staleness", "--json"))
    assert set(with_peers["peer_table"]) > set(registry.COMPARED)


@pytest.fixture
def megatron_trace(tmp_path):
    """A two-rank Megatron --moe-routing-trace-path directory (4 decoder layers, 8 experts)."""
    from megatron.core.transformer.moe.router_trace import RouterTracer

    directory = tmp_path / "megatron_trace"
    for rank in range(2):
        tracer = RouterTracer(str(directory), max_steps=10, rank=rank, training_mode=True)
        for layer in range(4):
            tracer.record_indices(
                [torch.tensor([[rank, layer + 2], [layer, 7]])], layer_ids=[layer]
            )
        tracer.advance_step(0)
        tracer.flush()
    return directory


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--run-args", "nope.log"],
            "--run-args nope.log: no such file; give the run's log (Megatron prints its arguments at start-up), its "
            "wandb config.yaml or a JSON/YAML mapping of them",
        ),
        (
            [
                "--expert-model-parallel-size",
                "1",
                "--num-experts",
                "8",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "27",
            ],
            "--num-layers 27 does not split evenly over --pipeline-model-parallel-size 2 stages, so the run must have "
            "split them otherwise: give its --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
            "(or --run-args with its log or config)",
        ),
    ],
)
def test_a_megatron_trace_layout_mistake_is_one_line_naming_the_flag(
    megatron_trace, capsys, argv, message
):
    """Issue 45, item 6-7: replay of a Megatron trace whose --run-args file is missing names the
    flag (not a raw [Errno 2]); a pipeline split that cannot be says so (not "need --num-layers")."""
    assert main(["replay", str(megatron_trace), *argv, "--no-progress"]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == f"ultraep replay: error: {message}"


def test_the_traced_runs_hgx_hardware_is_the_default(tmp_path, capsys):
    """Issue 45, item 8: a trace recorded with --moe-balancer-hardware h100-hgx replays on that
    hardware (the H100's figures, its quota floor, replicas inside its 8-GPU NVLink domains) without
    the flag; a trace that names none is costed on the paper's rack, and the report says so."""
    for name, meta in (("hgx", {"hardware": "h100-hgx"}), ("plain", {})):
        traces.write_synthetic_trace(
            tmp_path / f"{name}.uetrace",
            num_iterations=2,
            num_microbatches=1,
            num_layers=2,
            num_ranks=16,
            num_experts=64,
            tokens_per_rank=256,
            topk=4,
            seed=1,
            meta=meta,
        )
    out = run_replay(
        capsys, tmp_path / "hgx.uetrace", "--balancers", "none,ultraep", "--no-staleness", "--json"
    )
    report = json.loads(out)
    assert report["hardware"]["scale_up_gbps"] == 450 and report["hardware"]["peak_tflops"] == 989
    assert report["hardware"]["named"] == (
        "h100-hgx (the traced run's --moe-balancer-hardware); "
        "--moe-balancer-domain-size 8, its NVLink domain"
    )
    ultraep = report["balancers"]["ultraep"]
    assert (ultraep["domain_size"], ultraep["min_quota"]) == (
        8,
        833,
    )  # docs/traces.md's h100-hgx floor
    plain = run_replay(
        capsys, tmp_path / "plain.uetrace", "--balancers", "none,ultraep", "--no-staleness"
    )
    assert (
        "Hardware: none named, the default: the UltraEP paper's GB200-class rack (Table 2); name yours with "
        "--moe-balancer-hardware h100-hgx, h200-hgx or paper-rack: 900 GB/s scale-up" in plain
    )
    # The flag wins over the trace.
    report = json.loads(
        run_replay(
            capsys,
            tmp_path / "hgx.uetrace",
            "--moe-balancer-hardware",
            "h200-hgx",
            "--balancers",
            "none,ultraep",
            "--no-staleness",
            "--json",
        )
    )
    assert report["hardware"]["hbm_tbps"] == 4.8 and report["hardware"]["named"].startswith(
        "h200-hgx (--moe"
    )


def test_a_gpu_estimate_never_charges_the_plan_time_measured_here(trace_dir, capsys):
    """Issue 52: without --plan-time-us the estimate leaves the plan term out and says so (header
    and figure title); the quality tables keep the time measured on this CPU. With it, exactly that
    time is charged to the exact-load balancers."""
    from ultraep_megatron.analysis.replay_plots import _plan_term

    base = [trace_dir, "--no-staleness", "--no-peers", "--json"]
    left_out = json.loads(run_replay(capsys, *base))
    charged = json.loads(run_replay(capsys, *base, "--plan-time-us", "250"))
    for label in (registry.ULTRAEP, registry.EPLB_EXACT):
        assert left_out["estimated_cost"][label]["plan_ms"] == 0.0
        assert charged["estimated_cost"][label]["plan_ms"] == pytest.approx(0.25)
        assert charged["estimated_cost"][label]["total_ms"] == pytest.approx(
            left_out["estimated_cost"][label]["total_ms"] + 0.25
        )
        # Negative control of the default: this host did take time to plan.
        assert left_out["quality"][label]["plan_ms_mean"] > 0
    text = run_replay(capsys, trace_dir, "--no-staleness", "--no-peers")
    assert "Plan time: left out (measured here, on this CPU" in text
    assert "--plan-time-us US" in text
    from ultraep_megatron.settings import hardware as settings_hw

    records = traces.TraceRecords(traces.find_trace_files(trace_dir))
    for plan_s, said in ((0.0, "plan time left out"), (250e-6, "plan time 250 us charged")):
        result = rp.replay(
            records,
            {registry.ULTRAEP: BalancerConfig(registry.ULTRAEP, 1)},
            shape=settings_hw.ExpertShape(256, 128),
            hardware=settings_hw.HARDWARE_PRESETS["h100-hgx"],
            plan_seconds=plan_s,
        )
        assert _plan_term(result) == said
