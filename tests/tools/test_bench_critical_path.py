"""``tools/bench_critical_path.py`` keeps running: it drives the balanced dispatcher's permutation on a
stand-in for the dispatcher's state, with the host and the device planner, and (``--overlapped``)
the two halves of a plan deferred to megatron's dispatch node, so a change to what those methods
read must show here, not on the next GPU machine. A dry run on the CPU, small shapes."""

import re

from gloo_launch import REPO_ROOT, gloo_env, run_python


def test_critical_path_benchmark_runs_on_the_cpu():
    completed = run_python(
        REPO_ROOT / "tools" / "bench_critical_path.py",
        [
            "--device",
            "cpu",
            "--ep-size",
            "8",
            "--num-experts",
            "32",
            "--tokens",
            "256",
            "--hidden-size",
            "32",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--sweep-experts",
            "16,64",
            "--overlapped",
            "--moe-ffn-hidden-size",
            "32",
        ],
        env=gloo_env(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "one rank of EP=8, E=32, S=2, T=256" in out, out
    for path in ("megatron", "ultraep host planner", "ultraep device planner"):
        assert re.search(rf"^  {path} .*: +\d+\.\d us( \[.*\])?$", out, re.M), out
    for experts in (16, 64):  # the permutation alone against E
        assert re.search(rf"^  {experts} +\d+\.\d us +\d+\.\d us$", out, re.M), out
    replicas = int(re.search(r"(\d+) replicas in the last plan", out).group(1))
    assert replicas > 0, out
    # --overlapped: the paths as megatron's overlapped 1F1B schedule runs them (the deferred plan's
    # two halves, the other microbatch's experts backward between them)
    assert "Overlapped 1F1B schedule (--overlap-moe-expert-parallel-comm)" in out, out
    for step in (
        "experts backward alone",
        "megatron step",
        "ultraep host step",
        "ultraep device step",
    ):
        assert re.search(rf"^  {step}: +\d+\.\d us$", out, re.M), out
    assert re.search(
        r"added by balancing per layer under the overlapped schedule: host planner +-?\d+\.\d us, "
        r"device planner +-?\d+\.\d us",
        out,
    ), out
