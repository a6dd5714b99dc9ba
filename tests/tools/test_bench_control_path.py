"""``tools/bench_control_path.py`` and ``tools/invocation_footprint.py`` keep measuring what they say.

The launch counter is checked on ops of known cost (with a negative control: a host-only op counted
as a launch must fail it), then both tools run on the CPU at small shapes: every planner's figures
are in the JSON, and the host planner's bytes to the host are at least the ``[R, E]`` int64 load it
plans on, which the counter must see."""

import json
import sys

import torch

from gloo_launch import REPO_ROOT, gloo_env, run_python

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_control_path  # noqa: E402

R, E = 8, 32


def count(fn, device_tensors):
    counter = bench_control_path.Counter(device_tensors)
    with counter:
        fn()
    return counter.launches.get("other", 0)


def test_the_counter_counts_kernels_on_device_tensors_only():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    host = torch.randn(4)
    assert count(lambda: a + b, [a, b]) == 1
    assert count(lambda: (a + b).mul(2).sum(), [a, b]) == 3  # results are device tensors too
    assert count(lambda: (a.view(16), a.t(), torch.empty_like(a)), [a]) == 0  # no kernel
    assert count(lambda: a[:0] + 1, [a]) == 0  # empty: CUDA returns before launching
    assert count(lambda: host * 2, [a]) == 0  # the host's numbers: no launch


def test_a_host_op_counted_as_a_launch_fails_the_counter():
    """Negative control: everything a device tensor (what the counter would do if it ignored
    where tensors live) makes the host-only op count."""
    host = torch.randn(4)
    assert count(lambda: host * 2, [host]) == 1


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
    assert figures["host"]["d2h_bytes"] >= R * E * 8  # the load the host plans on
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
