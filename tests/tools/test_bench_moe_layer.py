"""``tools/bench_moe_layer.py`` keeps running: every layer of its table (megatron's, the balanced
ones, the controls) builds, runs interleaved and is reported. A dry run on the CPU (EP=2, small
shapes, few iterations): its figures mean nothing at this size; the benchmark's own runs are in
docs/integration.md."""

import re
import subprocess
import sys

from gloo_launch import REPO_ROOT, gloo_env


def test_moe_layer_benchmark_runs_every_layer_on_the_cpu():
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bench_moe_layer.py"), "--hidden-size", "32",
         "--ffn-hidden-size", "64", "--tokens-per-rank", "128", "--iters", "2", "--warmup", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, env=gloo_env(), cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "MoE layer fwd+bwd, EP=2" in out and "hidden 32, ffn 64, 128 tokens/rank" in out, out
    rows = dict(re.findall(r"^\| ([a-z][a-z +-]*?) +\| +\d+\.\d \|.*?\| +(\d\.\d{3}) \(", out, re.M))
    for label in ("none", "ultraep", "ultraep no-overlap", "ultraep no transfers", "eplb-exact",
                  "force-balanced", "force-balanced again", "ultraep experts only", "force-balanced experts only"):
        assert label in rows, (label, out)
    assert float(rows["force-balanced"]) == 1.0  # the reference of every ratio
    # The balanced layers report their overheads per iteration.
    assert re.search(r"^ultraep: transfers \d+\.\d\d ms per iteration when waited where issued", out, re.M), out
