"""Running the recipes from product tests: the environment, and the shared tiny balanced run.

``bash recipes/tiny_cpu.sh --moe-balancer ultraep`` on 4 gloo ranks for 2 iterations, saving a
checkpoint at iteration 2, with wandb offline and ``--metrics-jsonl``, recording its routing twice:
the project's ``--moe-balancer-trace-dir`` and megatron's own ``--moe-routing-trace-path``. The
dashboard test reads its wandb run and heatmap back, the resume-experiment test resumes its
checkpoint, the routing-trace test replays both traces.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import rank_launcher
from processes import run_process_group

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "recipes" / "tiny_cpu.sh"
CHECKPOINT_ITERATION = 2


def recipe_env(**extra: str) -> dict[str, str]:
    """Environment for running a CPU recipe from a test: this interpreter (its torchrun launches
    through the session's warm rank launcher: ``rank_launcher.shim_python``), wandb offline."""
    python = rank_launcher.shim_python()  # starts the launcher, whose variables the shim reads
    env = dict(os.environ)
    env.update(
        ULTRAEP_PYTHON=python,
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


@dataclass
class TinyRun:
    run_dir: Path
    checkpoint: Path
    trace_dir: Path  # --moe-balancer-trace-dir
    megatron_trace_dir: Path  # megatron's --moe-routing-trace-path
    records: dict[int, dict]  # --metrics-jsonl records by iteration
    log: str


def run_tiny_balanced(run_dir: Path) -> TinyRun:
    """Train the tiny recipe 2 iterations with ultraep, checkpointing at the last one."""
    checkpoint = run_dir / "ckpt"
    trace_dir, megatron_trace_dir = run_dir / "trace", run_dir / "megatron_trace"
    completed = run_process_group(
        [
            "bash",
            str(TINY_RECIPE),
            "--moe-balancer",
            "ultraep",
            "--save",
            str(checkpoint),
            "--save-interval",
            str(CHECKPOINT_ITERATION),
            "--exit-interval",
            str(CHECKPOINT_ITERATION),
            "--moe-balancer-trace-dir",
            str(trace_dir),
            "--moe-routing-trace-path",
            str(megatron_trace_dir),
        ],
        env=recipe_env(RUN_DIR=str(run_dir)),
        timeout_s=600,
    )
    log = completed.stdout + completed.stderr
    (run_dir / "log.txt").write_text(log)
    assert completed.returncode == 0, log[-6000:]
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["iteration"]] = record
    return TinyRun(run_dir, checkpoint, trace_dir, megatron_trace_dir, records, log)
