"""``tools/bench_moe_layer.py`` keeps running, calibrates the replica overhead it plans with, and
reports the paper's planner beside it. A dry run on the CPU (EP=2, small shapes, few iterations):
its figures mean nothing at this size; the benchmark's own runs are in docs/integration.md."""

import re
import subprocess
import sys

from gloo_launch import REPO_ROOT, gloo_env

BENCH = REPO_ROOT / "tools" / "bench_moe_layer.py"
SMALL = ["--hidden-size", "32", "--ffn-hidden-size", "64", "--tokens-per-rank", "128", "--iters", "2",
         "--warmup", "1", "--repeats", "1"]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *SMALL, *args], capture_output=True, text=True,
                          timeout=600, env=gloo_env(), cwd=REPO_ROOT)


def test_moe_layer_benchmark_calibrates_the_replica_overhead_and_runs_every_layer():
    completed = run_bench()
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    number = r"(-?\d+(?:\.\d+)?(?:e[-+]\d+)?)"
    measured = re.search(rf"replica overhead .*: (\d+) rows, measured here: one expert call .* costs "
                         rf"{number} ms \+ {number} us per row", out)
    assert measured, out
    overhead, fixed_ms, per_row_us = int(measured.group(1)), float(measured.group(2)), float(measured.group(3))
    assert per_row_us > 0
    # The fit, in rows of the same call. Tolerance: the rounding to whole rows (0.5), and the two
    # figures' own to 4 significant digits (up to 5e-4 each, relative).
    fit = max(0.0, fixed_ms * 1e3 / per_row_us)
    assert abs(overhead - fit) <= 0.5 + 1e-3 * fit, out
    # The balanced layers plan with it (their own configurations), but the paper's planner's row.
    assert (f"Planned with: ultraep {overhead}, ultraep no overhead 0, ultraep no-overlap {overhead}, "
            f"ultraep no transfers {overhead}") in out, out
    for label in ("none", "ultraep", "ultraep no overhead", "ultraep no-overlap", "ultraep no transfers",
                  "eplb-exact", "force-balanced", "force-balanced again"):
        assert re.search(rf"^\| {re.escape(label)} +\| +\d+\.\d \|", out, re.M), (label, out)


def test_moe_layer_benchmark_takes_a_given_replica_overhead_and_refuses_a_bad_one():
    given = run_bench("--replica-overhead", "7")
    assert given.returncode == 0, given.stderr[-3000:]
    assert re.search(r"replica overhead .*: 7 rows; 'ultraep no overhead' plans without it", given.stdout), \
        given.stdout
    assert "Planned with: ultraep 7, ultraep no overhead 0, ultraep no-overlap 7, ultraep no transfers 7" \
        in given.stdout, given.stdout
    bad = subprocess.run([sys.executable, str(BENCH), "--replica-overhead", "-3"], capture_output=True,
                         text=True, timeout=120, env=gloo_env(), cwd=REPO_ROOT)
    assert bad.returncode == 2 and "--replica-overhead takes a number of rows >= 0 or auto" in bad.stderr
