"""``tools/gpu_check.sh`` keeps working where there is no GPU: it says so, lists every check with
its command and exits 0; every script and test file a check names exists, and the benchmark
options it passes are the scripts' own (so the one call a GPU session makes does not fail on a
renamed file or flag)."""

import re
import subprocess
import sys
from pathlib import Path

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


def _torchless_python3(tmp_path):
    """A directory whose python3 has no torch (the system's, isolated from site-packages)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/bash\nexec {sys.executable} -I -S -c "import sys; sys.exit(1)" "$@"\n')
    fake.chmod(0o755)
    return bin_dir


def _gpu_check(env, *args):
    return subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "gpu_check.sh"), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_it_finds_the_project_s_environment_not_python3_on_path(tmp_path):
    """Issue 52: with a torch-less python3 first on PATH and the project's environment present
    (ULTRAEP_VENV, what tools/ensure_env.sh reuses), the checks are the environment's: never
    "no CUDA device for python3: nothing run" (its exit 0 hid a missing environment on a GPU node)."""
    venv = Path(sys.executable).parent.parent
    env = gloo_env({"CUDA_VISIBLE_DEVICES": "", "ULTRAEP_VENV": str(venv)})
    env.pop("ULTRAEP_PYTHON", None)
    env["PATH"] = f"{_torchless_python3(tmp_path)}:{env['PATH']}"
    done = _gpu_check(env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"gpu_check: no CUDA device for {venv}/bin/python"), done.stdout
    assert "for python3" not in done.stdout


def test_a_python_without_torch_is_refused_with_exit_2(tmp_path):
    bin_dir = _torchless_python3(tmp_path)
    env = gloo_env({"CUDA_VISIBLE_DEVICES": "", "ULTRAEP_PYTHON": str(bin_dir / "python3")})
    done = _gpu_check(env)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "has no torch" in line and "ULTRAEP_PYTHON" in line


def test_help_prints_the_usage_and_runs_nothing(tmp_path):
    env = gloo_env({"ULTRAEP_PYTHON": str(_torchless_python3(tmp_path) / "python3")})
    for flag in ("--help", "-h"):
        done = _gpu_check(env, flag)
        assert done.returncode == 0 and done.stderr == ""
        assert done.stdout.startswith("Every GPU-only check") and "--list" in done.stdout
        assert "gpu_check on" not in done.stdout and "== [" not in done.stdout
    done = _gpu_check(env, "--all")
    assert done.returncode == 2 and "unknown argument --all" in done.stderr
