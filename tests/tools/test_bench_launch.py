"""``tools/bench_launch.py`` keeps running: one cold and one warm launch of a small run, both
trained, their times printed (its figures mean nothing at this size; docs/architecture.md has a
real run's)."""

import re
import subprocess
import sys

from gloo_launch import REPO_ROOT, gloo_env


def test_launch_benchmark_times_a_cold_and_a_warm_launch():
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "bench_launch.py"),
            "--nproc",
            "2",
            "--ep",
            "2",
            "--iters",
            "1",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=gloo_env(),
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    cold = float(re.search(r"cold \(torchrun\) +(\d+\.\d) s", out).group(1))
    warm = float(re.search(r"warm \(forked ranks\) +(\d+\.\d) s", out).group(1))
    assert cold > 0 and warm > 0, out
    assert re.search(r"saved per launch +-?\d+\.\d s \(\d+\.\d\dx the cold time\)", out), out
