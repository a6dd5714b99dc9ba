"""``tools/bench_control_path.py`` and ``tools/invocation_footprint.py`` keep measuring what they say,
on the CPU at small shapes: every planner's figures are in the JSON, the host planner's bytes to the
host are at least the ``[R, E]`` int64 load it plans on (which the crossing counter must see), and
megatron's own wait for its splits is counted for every planner, the backward's launches per op add
up to its count, and the data plane's transfers (on the CPU on its own thread) are counted in both
passes of the balanced layer, none for megatron's."""

import json

from gloo_launch import REPO_ROOT, gloo_env, run_python

R, E = 8, 32


def test_the_benchmark_reports_every_planner(tmp_path):
    out = tmp_path / "figures.json"
    completed = run_python(
        REPO_ROOT / "tools" / "bench_control_path.py",
        ["--ep-size", str(R), "--num-experts", str(E), "--tokens", "128", "--repeats", "1"]
        + ["--json", str(out)],
        env=gloo_env(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(out.read_text())["planners"]
    keys = {
        "preprocess_launches",
        "forward_launches",
        "backward_launches_non_gemm",
        "h2d_bytes",
        "d2h_bytes",
        "host_waits",
        "preprocess_issue_us",
    }
    assert set(figures) == {"none", "host", "device"}
    for planner, row in figures.items():
        assert keys <= set(row), planner
        assert row["host_waits"] >= 1, planner  # megatron's own wait for its splits
        assert row["forward_launches"] >= row["preprocess_launches"] > 0, planner
        assert sum(row["backward_ops"].values()) == row["backward_launches_non_gemm"], planner
    assert figures["host"]["d2h_bytes"] >= R * E * 8  # the load the host plans on
    assert figures["none"]["transfer_launches"] == {"forward": 0, "backward": 0}
    for planner in ("host", "device"):  # distribution; re-materialization and reduction
        transfers = figures[planner]["transfer_launches"]
        assert transfers["forward"] > 0 and transfers["backward"] > 0, (planner, transfers)
    assert "| preprocess launches |" in completed.stdout


def test_the_footprint_names_the_invocation_s_files():
    completed = run_python(
        REPO_ROOT / "tools" / "invocation_footprint.py", ["--list"], env=gloo_env()
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    for name in (
        "megatron/balanced_layer/balanced_moe.py",
        "megatron/balanced_layer/invocation.py:BalancedInvocation",
        "dataplane/buffer.py:ReplicaBuffer",
    ):
        assert name in out, out
    assert "megatron/cpu/" not in out  # the emulation is left out
