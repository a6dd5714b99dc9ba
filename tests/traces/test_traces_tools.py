"""tools/replay_trace.py and tools/slot_advisor.py end to end on a small trace: exit codes, the
report's sections, PNG plots, JSON, truncated and foreign inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ultraep_megatron import traces

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
sys.path.insert(0, str(REPO / "tools"))

import replay_trace  # noqa: E402
import slot_advisor  # noqa: E402


def run_tool(script: str, *args, timeout=240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("traces")
    traces.write_synthetic_trace(traces.trace_path(directory, 0), num_iterations=6, num_microbatches=2, num_layers=2,
                                 num_ranks=4, num_experts=16, tokens_per_rank=256, topk=2, drift=0.6, seed=3,
                                 meta={"hidden_size": 256, "moe_ffn_hidden_size": 128, "swiglu": True})
    return directory


def assert_png(path: Path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_replay_tool_report_plots_and_json(trace_dir, tmp_path):
    proc = run_tool("replay_trace.py", trace_dir, "--moe-balancer-num-slots", 1, "--moe-balancer-eplb-window", 4,
                    "--moe-balancer-eplb-interval", 4, "--staleness-intervals", "1,4", "--plot-dir", tmp_path / "plots",
                    "--json-out", tmp_path / "out.json", "--heatmap-layers", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ("24 loads in 6 iterations, closed cleanly", "Balancing quality over all records", "Per layer:",
                 "Stale history (paper Fig. 6)", "eplb interval=1 window=1", "ESTIMATE — cost model, not a measurement",
                 "h=256, f=128, SwiGLU (trace meta)", "900 GB/s scale-up, 2250 TFLOP/s, 8 TB/s HBM"):
        assert text in out, text
    assert "[replay]" in proc.stderr  # progress on stderr
    payload = json.loads((tmp_path / "out.json").read_text())
    assert payload["num_records"] == 24 and payload["layers"] == [1, 2]
    assert set(payload["quality"]) == {"none", "eplb", "eplb-exact", "ultraep", "ideal", "eplb/i=1/w=1", "eplb/i=4/w=4"}
    assert payload["quality"]["ultraep"]["imbalance_mean"] <= payload["quality"]["none"]["imbalance_mean"]
    assert payload["estimated_cost"]["ideal"]["frac_ideal"] == pytest.approx(1.0)
    assert payload["estimated_cost"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert [r["interval"] for r in payload["staleness"]] == [1, 4]
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["eplb_staleness.png", "estimated_layer_time.png", "imbalance_over_time.png",
                     "load_heatmap_layer2.png"]
    for name in names:
        assert_png(tmp_path / "plots" / name)


def test_slot_advisor_tool(trace_dir, tmp_path, capsys):
    code = slot_advisor.main([str(trace_dir), "--slots", "0,1,2", "--min-quotas", "auto,hw,8", "--plan-time-us", "100",
                              "--plot-dir", str(tmp_path), "--json-out", str(tmp_path / "adv.json"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Quota floor from the hardware (training" in out and "=> a replica pays from q =" in out
    assert "Recommendation (ESTIMATE): --moe-balancer-num-slots" in out
    assert "Per-layer imbalance (mean) vs slots" in out
    payload = json.loads((tmp_path / "adv.json").read_text())
    assert len(payload["rows"]) == 9  # 3 slot counts x 3 floors
    assert payload["recommendation"]["num_slots"] in (0, 1, 2)
    assert payload["hardware_min_quota"] > 1
    assert_png(tmp_path / "slot_advisor.png")


def test_tools_on_truncated_and_foreign_files(trace_dir, tmp_path, capsys):
    blob = traces.trace_path(trace_dir, 0).read_bytes()
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(blob[:-45])
    with pytest.warns(traces.TraceTruncatedWarning):
        code = replay_trace.main([str(torn), "--balancers", "none,ultraep", "--no-staleness", "--no-cost",
                                  "--no-progress"])
    assert code == 0
    assert "TRUNCATED tail of" in capsys.readouterr().out
    foreign = tmp_path / "notes.uetrace"
    foreign.write_text("hello\n")
    assert replay_trace.main([str(foreign), "--no-progress"]) == 2
    assert "not an UltraEP trace" in capsys.readouterr().err
    assert slot_advisor.main([str(foreign), "--no-progress"]) == 2
    assert "not an UltraEP trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        replay_trace.main([str(trace_dir), "--balancers", "none,lplb"])
    assert exc.value.code == 2 and "unknown" in capsys.readouterr().err
