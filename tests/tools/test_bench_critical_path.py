"""``tools/bench_critical_path.py`` keeps running: it drives the fused ops (``plan_invocation``,
``host_plan``, ``reroute_permute``), the plan's crossing (``PlanHandle``) and the balanced
dispatcher's ``planned_inputs`` on a stand-in for its state, with the host and the device planner,
(``--overlapped``) the plan deferred to megatron's dispatch node, and (``--profile``) the per-phase
table from ``torch.profiler``, so a change to what those read must show here, not on the next GPU
machine. A dry run on the CPU, small shapes."""

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
            "--profile",
            "--profile-iters",
            "1",
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
    # --profile: one row per path, a "CPU / device" cell per phase it has (record_function ranges)
    assert "Per-phase breakdown (torch.profiler record_function ranges" in out, out
    header = re.search(r"^\| path \| (.+) \| total \|$", out, re.M)
    assert header, out
    phases = header.group(1).split(" | ")
    assert phases[:4] == ["load gather", "plan", "crossing", "table upload"], phases
    cell = r"\d+\.\d / \d+\.\d"
    rows = {}
    for path in ("megatron", "ultraep host", "ultraep device"):
        row = re.search(rf"^\| {path} \| (.+) \| ({cell}) \|$", out, re.M)
        assert row, (path, out)
        rows[path] = dict(zip(phases, row.group(1).split(" | ")))
    for path, present in [
        ("megatron", ("load gather", "crossing", "permute")),
        ("ultraep host", ("load gather", "crossing", "plan", "table upload", "reroute + permute")),
        ("ultraep device", ("load gather", "plan", "crossing", "reroute + permute")),
    ]:
        for name, value in rows[path].items():
            assert re.fullmatch(cell, value) if name in present else value == "-", (path, name)
        # the profiled ranges saw host work: a phase missing its range would read "-" or 0
        assert float(rows[path]["load gather"].split(" / ")[0]) > 0, rows[path]
