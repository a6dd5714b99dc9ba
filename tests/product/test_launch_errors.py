"""Errors under torchrun (issue 52): a refusal is its one line and exit status 2.

* ``bash recipes/tiny_cpu.sh --moe-expert-capacity-factor 1.0``: at most 3 lines (the CPU
  backend's one line, the refusal naming the flag), exit status 2, no ``ChildFailedError``;
* the recipes' torchrun (``python -m ultraep_megatron.megatron.run.torchrun``), cold (real
  torchrun's agent, not the tests' warm launcher): a worker's exit 2 is its line and status 2; any
  other failure keeps torchrun's report and that worker's status; negative control: plain
  ``torch.distributed.run`` on the same worker prints the traceback and exits 1;
* the CPU backend's banner is one line unless ``ULTRAEP_CPU_PATCHES=1`` lists its patches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from product_runs import TINY_RECIPE, recipe_env

REPO = Path(__file__).resolve().parents[2]


def test_the_tiny_recipe_s_refusal_is_at_most_3_lines_and_exit_2(tmp_path):
    env = recipe_env(RUN_DIR=str(tmp_path))
    env.pop("PYTHONWARNINGS")  # the recipe's own default, as a user runs it
    done = subprocess.run(
        ["bash", str(TINY_RECIPE), "--moe-expert-capacity-factor", "1.0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, lines
    assert len(lines) <= 3, lines
    assert any(
        line.startswith("pretrain_gpt.py: error: --moe-balancer ultraep: token dropping")
        for line in lines
    ), lines
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr


WORKER = """import os, sys
rank = int(os.environ["RANK"])
code = int(os.environ["FAIL_WITH"])
if rank == 1:
    print(f"worker.py: error: rank {rank} refuses", file=sys.stderr)
    sys.exit(code)
import time
time.sleep(30)
"""


def cold_launch(tmp_path: Path, module: str, code: int) -> subprocess.CompletedProcess:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "FAIL_WITH": str(code), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", str(worker)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_recipes_torchrun_ends_a_refusal_in_one_line_and_keeps_other_failures(tmp_path):
    ours = "ultraep_megatron.megatron.run.torchrun"
    refused = cold_launch(tmp_path, ours, 2)
    assert refused.returncode == 2, refused.stderr
    lines = [ln for ln in refused.stderr.splitlines() if "OMP_NUM_THREADS" not in ln]
    assert lines == ["worker.py: error: rank 1 refuses"], refused.stderr
    crashed = cold_launch(tmp_path, ours, 3)
    assert crashed.returncode == 3
    assert "exitcode  : 3" in crashed.stderr and "rank      : 1 (local_rank: 1)" in crashed.stderr
    assert "closing signal" in crashed.stderr  # the agent's lines, held back, then shown
    # Negative control: torchrun itself wraps the same refusal in its traceback and exits 1.
    plain = cold_launch(tmp_path, "torch.distributed.run", 2)
    assert plain.returncode == 1 and "ChildFailedError" in plain.stderr


def banner_lines(**env: str) -> list[str]:
    code = "from ultraep_megatron.megatron.cpu import backend; backend.activate()"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RANK": "0", "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).splitlines()
    return [ln for ln in said if "CPU backend" in ln or ln.startswith("  - ")]


def test_the_cpu_backend_banner_is_one_line_unless_asked_for():
    (line,) = banner_lines(ULTRAEP_CPU_PATCHES="0")
    assert "CPU backend active" in line and "ULTRAEP_CPU_PATCHES=1 lists them" in line
    listed = banner_lines(ULTRAEP_CPU_PATCHES="1")
    count = int(listed[0].split(": ")[-1].split()[0])
    assert (
        count > 10 and len(listed) == 1 + count and all(ln.startswith("  - ") for ln in listed[1:])
    )


def test_a_python_without_torch_gets_one_line_naming_ultraep_python():
    """The recipes' launcher under a python that lacks the project's environment (``python3`` on
    ``PATH``, where ULTRAEP_PYTHON is unset): one line naming ULTRAEP_PYTHON, exit 2, no
    traceback. torch is made unimportable in the child (``sys.modules["torch"] = None``)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from ultraep_megatron.megatron.run import torchrun\n"
        "sys.exit(torchrun.main(['--nproc-per-node', '1', 'x.py']))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no torch" in lines[0] and "ULTRAEP_PYTHON" in lines[0], lines
