"""The `ultraep` command on small traces: every --help, exit codes, the replay and advisor reports,
their JSON / CSV / PNG outputs against the library's figures, truncated and foreign inputs, and the
trace subcommands (info, synth, merge)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ultraep_megatron import traces
from ultraep_megatron.analysis import replay as rp
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ultraep_megatron.planner.policy import COMPARED, DEFAULT_NUM_SLOTS, BalancerConfig

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUBCOMMANDS = (["replay"], ["advise"], ["check-recipe"], ["resume-experiment"], ["trace"], ["trace", "info"],
               ["trace", "convert"], ["trace", "merge"], ["trace", "synth"])


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("traces")
    traces.write_synthetic_trace(traces.trace_path(directory, 0), num_iterations=6, num_microbatches=2, num_layers=2,
                                 num_ranks=4, num_experts=16, tokens_per_rank=256, topk=2, drift=0.6, seed=3,
                                 meta={"hidden_size": 4096, "moe_ffn_hidden_size": 1536, "swiglu": True})
    return directory


def assert_png(path: Path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_help_of_the_console_command_and_every_subcommand(capsys):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    top = subprocess.run([sys.executable, "-m", "ultraep_megatron.cli", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    for name in ("replay", "advise", "check-recipe", "resume-experiment", "trace", "exit status"):
        assert name in top.stdout
    for words in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([*words, "--help"])
        assert exc.value.code == 0, words
        assert "usage: ultraep " + " ".join(words) in capsys.readouterr().out
    # The balancer flags and their defaults are the training ones, from the registry.
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = capsys.readouterr().out
    assert "--moe-balancer-num-slots S" in text and f"Default: {DEFAULT_NUM_SLOTS}." in text
    with pytest.raises(SystemExit) as exc:
        main(["replay"])  # no trace: argparse's usage error
    assert exc.value.code == EXIT_USAGE


def test_replay_report_json_csv_and_plots(trace_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code = main(["replay", str(trace_dir), "--moe-balancer-num-slots", "1", "--moe-balancer-eplb-window", "4",
                 "--moe-balancer-eplb-interval", "4", "--staleness-intervals", "1,4", "--output-dir", str(out_dir),
                 "--heatmap-layers", "2", "--plan-time-us", "50"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    for text in ("24 loads in 6 iterations, closed cleanly", "What the router sent, per layer",
                 "Balancing quality over all loads", "Per layer:", "Stale history (paper Fig. 6)",
                 "eplb interval=1 window=1", "ESTIMATE — cost model, not a measurement",
                 "h=4096, f=1536, SwiGLU (trace meta)", "900 GB/s scale-up, 2250 TFLOP/s, 8 TB/s HBM",
                 "Plan time: fixed 50 us", "--moe-balancer-num-slots 1"):
        assert text in captured.out, text
    assert "[replay]" in captured.err  # progress on stderr
    # The per-layer table: mean/max with the same three decimals, never a mean above its max.
    table = captured.out[captured.out.index("Per layer: imbalance mean/max"):].split("\n\n")[0]
    cells = re.findall(r"(\d+\.\d+)/(\d+\.\d+)", table)
    assert len(cells) == 2 * len(COMPARED)  # 2 layers
    assert all(len(m.split(".")[1]) == len(x.split(".")[1]) == 3 and float(m) <= float(x) for m, x in cells)
    payload = json.loads((out_dir / "replay.json").read_text())
    assert payload["num_records"] == 24 and payload["layers"] == [1, 2]
    assert set(payload["quality"]) == set(COMPARED) | {"eplb/i=1/w=1", "eplb/i=4/w=4"}
    assert payload["estimated_cost"]["ideal"]["frac_ideal"] == pytest.approx(1.0)
    assert payload["estimated_cost"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert [r["interval"] for r in payload["staleness"]] == [1, 4]
    # The figures are the library's, on the same records.
    direct = rp.replay(traces.TraceRecords(traces.find_trace_files(trace_dir)),
                       {"ultraep": BalancerConfig("ultraep", num_slots=1)})
    summary = rp.metric_summary(direct)["ultraep"]
    for key in ("imbalance_mean", "imbalance_max", "replicas_mean", "fanout_max", "inflight_mean"):
        assert payload["quality"]["ultraep"][key] == pytest.approx(summary[key]), key
    rows = list(csv.DictReader(open(out_dir / "replay_per_layer.csv")))
    assert {(r["layer"], r["balancer"]) for r in rows} >= {("1", "ultraep"), ("2", "none")}
    row = next(r for r in rows if r["layer"] == "2" and r["balancer"] == "ultraep")
    assert float(row["imbalance_mean"]) == pytest.approx(payload["quality_per_layer"]["2"]["ultraep"]["imbalance_mean"])
    assert payload["estimate_problem"] is None
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert pngs == ["eplb_staleness.png", "estimated_layer_time.png", "imbalance_heatmap.png",
                    "imbalance_over_time.png", "load_heatmap_layer2.png"]
    for name in pngs:
        assert_png(out_dir / name)

    # --json: one document on stdout, nothing else there.
    assert main(["replay", str(trace_dir), "--balancers", "none,ultraep", "--no-staleness", "--no-cost",
                 "--json", "--no-progress"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["quality"]) == {"none", "ultraep"} and "estimated_cost" not in doc


def test_advise_recommends_flags_and_writes_outputs(trace_dir, tmp_path, capsys):
    # 256 tokens x top-2 per rank: a 36 MiB expert's transfer outweighs what a replica saves.
    assert main(["advise", str(trace_dir), "--slots", "0,1,2", "--plan-time-us", "100", "--no-progress"]) == EXIT_OK
    assert "Recommendation (ESTIMATE): --moe-balancer none\n  replicas do not pay" in capsys.readouterr().out
    # 16x the microbatch: replicas pay.
    code = main(["advise", str(trace_dir), "--slots", "0,1,2", "--min-quotas", "default,hw,8", "--plan-time-us", "100",
                 "--load-scale", "16", "--output-dir", str(tmp_path), "--no-progress"])
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
    assert main(["advise", str(trace_dir), "--slots", "1,2", "--memory-budget-gb", "0", "--no-progress"]) == EXIT_FAILED
    assert "no recommendation" in capsys.readouterr().out


def test_a_tiny_models_trace_gets_a_statement_not_an_estimate(tmp_path, capsys):
    """h = f = 64 and 128 pairs per rank: the cost model's layer is a fraction of a microsecond,
    under the latencies it leaves out. replay keeps the balance figures and says why it shows no
    estimate; advise refuses before its sweep, saying what to pass."""
    trace = traces.write_synthetic_trace(tmp_path / "tiny.uetrace", num_iterations=4, num_microbatches=2,
                                         num_layers=2, num_ranks=4, num_experts=16, tokens_per_rank=64, topk=2,
                                         meta={"hidden_size": 64, "moe_ffn_hidden_size": 64, "swiglu": True})
    assert main(["replay", str(trace), "--no-staleness", "--output-dir", str(tmp_path / "replay"),
                 "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Balancing quality over all loads" in out
    assert "ESTIMATE not shown" in out and "below the ~10 us" in out and "ESTIMATE: time per MoE layer" not in out
    payload = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert "h=64, f=64" in payload["estimate_problem"] and payload["estimated_cost"]["none"]["total_ms"] < 0.01
    assert not (tmp_path / "replay" / "estimated_layer_time.png").exists()
    assert main(["advise", str(trace), "--output-dir", str(tmp_path / "advise"), "--no-progress"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "no recommendation: this trace cannot support one" in out and "--load-scale" in out
    assert "Recommendation" not in out and "Sweep over" not in out
    assert json.loads((tmp_path / "advise" / "advise.json").read_text())["rows"] == []
    # Projected onto a production expert and microbatch, the same trace is sized.
    assert main(["advise", str(trace), "--hidden-size", "4096", "--moe-ffn-hidden-size", "1536",
                 "--load-scale", "16", "--slots", "0,1", "--no-progress"]) == EXIT_OK
    assert "Recommendation (ESTIMATE): --moe-balancer" in capsys.readouterr().out


def test_exit_codes_on_truncated_foreign_and_bad_input(trace_dir, tmp_path, capsys):
    blob = traces.trace_path(trace_dir, 0).read_bytes()
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(blob[:-45])
    with pytest.warns(traces.TraceTruncatedWarning):
        code = main(["replay", str(torn), "--balancers", "none,ultraep", "--no-staleness", "--no-cost", "--no-progress"])
    assert code == EXIT_OK
    assert "TRUNCATED tail of" in capsys.readouterr().out
    assert main(["replay", str(torn), "--strict", "--no-cost", "--no-progress"]) == EXIT_USAGE
    assert "is truncated" in capsys.readouterr().err
    foreign = tmp_path / "notes.uetrace"
    foreign.write_text("hello\n")
    for command in ("replay", "advise"):
        assert main([command, str(foreign), "--no-progress"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.startswith(f"ultraep {command}: error:") and "not an UltraEP trace" in err
        assert len(err.strip().splitlines()) == 1  # one line, no traceback
    assert main(["replay", str(tmp_path / "missing")]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_dir), "--balancers", "none,lplb"])
    assert exc.value.code == EXIT_USAGE and "unknown" in capsys.readouterr().err
    assert main(["replay", str(trace_dir), "--moe-balancer-num-slots", "-1", "--no-progress"]) == EXIT_USAGE
    assert "--moe-balancer-num-slots must be >= 0" in capsys.readouterr().err
    assert main(["replay", str(trace_dir), "--num-experts", "8", "--no-progress"]) == EXIT_USAGE
    assert "--num-experts 8 contradicts the trace (16)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["trace", "info", str(trace_dir), "--", "extra"])
    assert exc.value.code == EXIT_USAGE and "takes no arguments after --" in capsys.readouterr().err


def test_output_dir_is_made_and_checked_before_the_work(trace_dir, tmp_path, capsys):
    """A missing --output-dir is created and reported; one that cannot be (under a file) fails at
    once, before the replay, in one line; a corrupt trace fails `trace info` in one line."""
    deep = tmp_path / "new" / "plots"
    assert main(["replay", str(trace_dir), "--balancers", "none,ultraep", "--no-staleness", "--no-cost",
                 "--output-dir", str(deep), "--no-progress"]) == EXIT_OK
    assert f"created --output-dir {deep}" in capsys.readouterr().err
    assert (deep / "replay.json").is_file()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "iter_0000002").mkdir()
    for command in (["replay", str(trace_dir)], ["advise", str(trace_dir)],
                    ["resume-experiment", "--load", str(tmp_path), "--iterations", "1"]):
        launch = ["--", "touch", str(tmp_path / "launched")] if command[0] == "resume-experiment" else []
        assert main([*command, "--output-dir", str(blocker / "plots"), *launch]) == EXIT_USAGE
        printed = capsys.readouterr()
        assert printed.err.strip() == f"ultraep {command[0]}: error: --output-dir {blocker / 'plots'}: Not a directory"
        assert "[replay]" not in printed.err and "Sweep" not in printed.out  # nothing ran
    assert not (tmp_path / "launched").exists()
    corrupt = tmp_path / "corrupt.uetrace"
    data = bytearray(traces.trace_path(trace_dir, 0).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a record inside the file, not its tail
    corrupt.write_bytes(bytes(data))
    assert main(["trace", "info", str(corrupt)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("ultraep trace: error:") and "checksum" in err and len(err.strip().splitlines()) == 1


def test_trace_synth_info_and_merge(tmp_path, capsys):
    out = tmp_path / "s.uetrace"
    assert main(["trace", "synth", str(out), "--num-iterations", "4", "--num-layers", "2", "--num-ranks", "2",
                 "--num-experts", "4"]) == EXIT_OK
    assert main(["trace", "info", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "R=2, E=4, status=closed" in printed and "16 loads (0 uncommitted), 4 iterations, layers [1, 2]" in printed
    assert main(["trace", "info", str(out), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)["traces"][0]
    assert (info["loads"], info["iterations"], info["status"]) == (16, 4, "closed")

    # A run traced in two pieces (a resume into a new directory) merges back into the whole.
    whole = traces.read_trace(out)
    pieces = []
    for n, its in enumerate(((1, 2), (3, 4))):
        path = traces.trace_path(tmp_path / f"piece{n}", 0)
        with traces.TraceWriter(path, num_ranks=2, num_experts=4, fsync=False) as writer:
            for it in its:
                for i in np.flatnonzero(whole.iteration.numpy() == it):
                    writer.append(it, int(whole.microbatch[i]), int(whole.layer[i]), whole.load[i])
                writer.flush_iteration(it)
        pieces.append(path.parent)
    assert main(["trace", "merge", str(tmp_path / "merged"), str(pieces[1]), str(pieces[0]), "--no-progress"]) == EXIT_OK
    merged = traces.read_trace(traces.trace_path(tmp_path / "merged", 0))
    assert merged.iteration.tolist() == whole.iteration.tolist() and bool((merged.load == whole.load).all())
    assert main(["trace", "merge", str(tmp_path / "again"), str(pieces[0]), str(pieces[0] / "ep_group_0000.uetrace"),
                 "--no-progress"]) == EXIT_USAGE
    assert "not after iteration" in capsys.readouterr().err


def test_no_test_imports_tools_through_sys_path():
    """The tools users run are the package's `ultraep` command; tools/ keeps benchmarks and
    environment scripts, which no test imports."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ("sys.path" in line or "import_module" in line) and "tools" in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
