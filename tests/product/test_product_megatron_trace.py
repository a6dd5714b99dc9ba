"""Megatron's own routing trace as input: the 4-rank CPU run of the product tests records its routing
with megatron-core's --moe-routing-trace-path (which needs the CPU backend's stand-in for
torch.cuda.is_current_stream_capturing) and with the project's --moe-balancer-trace-dir. Grouped
by EP group, microbatch and layer, megatron's per-rank records are the project's [R, E] loads bit
for bit, and `ultraep replay` on either directory prints the same per-layer loads and balancer
figures. A wrong EP size (the negative control) changes them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.traces.router import RouterTraceRecords
from ultraep_megatron.traces.router_layout import RouterTraceLayout, read_run_args

from product_runs import CHECKPOINT_ITERATION, REPO

PER_LAYER_SECTIONS = (
    "What the router sent, per layer",
    "Per layer: imbalance mean/max",
    "ESTIMATE: fwd+bwd ms per layer",
)


def replay_report(capsys, trace_dir, *extra) -> tuple[str, dict]:
    """`ultraep replay` on a trace: (the printed report, the JSON of the same run's figures)."""
    fixed = [
        "--plan-time-us",
        "100",
        "--no-progress",
        "--moe-balancer-num-slots",
        "1",  # no measured time
        "--hidden-size",
        "4096",
        "--moe-ffn-hidden-size",
        "1536",
    ]  # an expert the cost model can time
    assert main(["replay", str(trace_dir), *fixed, *extra]) == 0
    text = capsys.readouterr().out
    assert main(["replay", str(trace_dir), *fixed, *extra, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def section(text: str, title: str) -> str:
    """A table of the report, from its title to the next blank line."""
    start = text.index(title)
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else None]


def comparable(report: dict) -> dict:
    """The report's figures without what names the input or was measured on this host."""
    out = {k: v for k, v in report.items() if k not in ("inputs", "meta")}
    out["quality"] = {
        b: {k: v for k, v in q.items() if k != "plan_ms_mean"} for b, q in report["quality"].items()
    }
    out["quality_per_layer"] = {
        layer: {b: {k: v for k, v in q.items() if k != "plan_ms_mean"} for b, q in per.items()}
        for layer, per in report["quality_per_layer"].items()
    }
    out["staleness"] = [
        {k: v for k, v in r.items() if k != "plan_ms_mean"} for r in report["staleness"]
    ]
    return out


@pytest.mark.slow
def test_megatrons_records_are_the_projects_loads(tiny_balanced_run):
    files = sorted(p.name for p in tiny_balanced_run.megatron_trace_dir.iterdir())
    assert files == [f"router_trace_rank{r}.jsonl" for r in range(4)]
    run_args = read_run_args(tiny_balanced_run.run_dir / "log.txt")  # Megatron's own argument dump
    layout = RouterTraceLayout.resolve(run_args=run_args)
    assert (layout.ep_size, layout.num_experts, layout.num_microbatches, layout.world_size) == (
        4,
        16,
        2,
        4,
    )
    megatron = list(
        RouterTraceRecords(tiny_balanced_run.megatron_trace_dir, layout, on_truncated="error")
    )
    ours = list(
        traces.TraceRecords(
            traces.find_trace_files(tiny_balanced_run.trace_dir), on_truncated="error"
        )
    )
    assert (
        len(megatron) == len(ours) == CHECKPOINT_ITERATION * 2 * 4
    )  # iterations x microbatches x layers
    for mine, theirs in zip(ours, megatron):
        assert mine[:4] == theirs[:4]
        assert torch.equal(mine[4], theirs[4]), mine[:4]
    assert {r[1] for r in megatron} == set(range(1, CHECKPOINT_ITERATION + 1))


@pytest.mark.slow
def test_replay_prints_the_same_figures_on_both_traces(tiny_balanced_run, capsys, tmp_path):
    run_args = ["--run-args", str(tiny_balanced_run.run_dir / "log.txt")]
    ours_text, ours = replay_report(capsys, tiny_balanced_run.trace_dir)
    theirs_text, theirs = replay_report(capsys, tiny_balanced_run.megatron_trace_dir, *run_args)
    assert "Megatron routing trace" in theirs_text and "4 rank files" in theirs_text
    for title in PER_LAYER_SECTIONS:
        assert section(ours_text, title) == section(theirs_text, title), title
    assert comparable(ours) == comparable(theirs)
    assert ours["num_records"] == 16 and ours["layers"] == [1, 2, 3, 4]
    # Layers are skewed by the recipe's forced router bias; ultraep balances them (not a trivial match).
    assert (
        ours["load"]["rank_imbalance_mean"] > 1.2
        and ours["quality"]["ultraep"]["imbalance_mean"] < 1.05
    )

    # The same layout from flags instead of the run's log; convert gives the project's format.
    flags = ["--expert-model-parallel-size", "4", "--num-experts", "16"]
    assert (
        main(
            [
                "trace",
                "convert",
                str(tiny_balanced_run.megatron_trace_dir),
                str(tmp_path / "converted"),
                *flags,
                "--no-progress",
            ]
        )
        == 0
    )
    assert "converted 16 loads of 1 EP group(s) (complete)" in capsys.readouterr().out
    converted_text, converted = replay_report(capsys, tmp_path / "converted")
    assert comparable(converted)["quality_per_layer"] == comparable(ours)["quality_per_layer"]

    # Negative control: read as two EP groups of 2 ranks, the loads and figures differ.
    wrong_text, wrong = replay_report(
        capsys,
        tiny_balanced_run.megatron_trace_dir,
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "16",
    )
    assert wrong["num_records"] == 32
    assert section(wrong_text, PER_LAYER_SECTIONS[0]) != section(ours_text, PER_LAYER_SECTIONS[0])
    # A layout that contradicts the run's own arguments is refused, naming the flag.
    assert (
        main(
            [
                "replay",
                str(tiny_balanced_run.megatron_trace_dir),
                *run_args,
                "--expert-model-parallel-size",
                "2",
                "--no-progress",
            ]
        )
        == 2
    )
    assert (
        "--expert-model-parallel-size 2 contradicts the run's arguments" in capsys.readouterr().err
    )


def documented_meta_keys() -> dict[str, set[str]]:
    """{writer: meta keys} from the table of docs/traces.md."""
    text = (REPO / "docs" / "traces.md").read_text()
    table = text[text.index("| key | written by | meaning |") :]
    keys: dict[str, set[str]] = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, writers = line.split("|")[1:3]
        for writer in writers.split(","):
            keys.setdefault(writer.strip(), set()).update(re.findall(r"`(\w+)`", names))
    return keys


@pytest.mark.slow
def test_the_trace_meta_keys_written_are_the_documented_ones(tiny_balanced_run, tmp_path, capsys):
    documented = documented_meta_keys()
    (ours,) = traces.find_trace_files(tiny_balanced_run.trace_dir)
    meta = traces.TraceReader(ours).meta
    assert set(meta) == documented["training"]
    assert (meta["hidden_size"], meta["moe_ffn_hidden_size"], meta["topk"], meta["num_layers"]) == (
        64,
        64,
        2,
        4,
    )
    assert (
        main(
            [
                "trace",
                "convert",
                str(tiny_balanced_run.megatron_trace_dir),
                str(tmp_path),
                "--run-args",
                str(tiny_balanced_run.run_dir / "log.txt"),
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    (converted,) = traces.find_trace_files(tmp_path)
    assert set(traces.TraceReader(converted).meta) == documented["convert"]
    synthetic = traces.write_synthetic_trace(
        tmp_path / "s.uetrace",
        num_iterations=1,
        num_microbatches=1,
        num_layers=1,
        num_ranks=2,
        num_experts=4,
        tokens_per_rank=8,
        topk=1,
    )
    assert documented["synth"] <= set(traces.TraceReader(synthetic).meta)
