"""``tools/gpu_check.sh`` keeps working where there is no GPU: it says so, lists every check with
its command and exits 0; every script and test file a check names exists, and the benchmark
options it passes are the scripts' own (so the one call a GPU session makes does not fail on a
renamed file or flag)."""

import re
import subprocess
import sys

from gloo_launch import REPO_ROOT, gloo_env


def test_without_cuda_it_lists_every_check_and_exits_0():
    env = gloo_env({"ULTRAEP_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    completed = subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "gpu_check.sh")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = completed.stdout
    assert out.startswith("gpu_check: no CUDA device"), out[:500]
    commands = re.findall(r"^      (.+)$", out, re.M)
    assert len(commands) == len(re.findall(r"^  \[\d+\] ", out, re.M)) >= 6, out
    for command in commands:
        for path in re.findall(r"\b((?:tools|tests)/[\w/]+\.py)\b", command):
            assert (REPO_ROOT / path).is_file(), (path, command)
    for script, option in [
        ("tools/bench_planner.py", "self-check"),
        ("tools/bench_critical_path.py", "--tokens"),
    ]:
        usage = subprocess.run(
            [sys.executable, str(REPO_ROOT / script), "--help"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert usage.returncode == 0 and option in usage.stdout, (script, usage.stdout[-1000:])
        assert any(
            script in command and (option.startswith("--") or option in command)
            for command in commands
        )
