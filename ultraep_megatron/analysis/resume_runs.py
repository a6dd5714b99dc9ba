"""One run of the resume experiment (:mod:`.resume_experiment`): resume a Megatron checkpoint under
one balancer for a window of iterations with the user's launch command, as a subprocess, and read
back what it logged (Megatron's iteration lines and the ``--metrics-jsonl`` records). No Megatron
import."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

from ultraep_megatron.planner.baselines import registry

__all__ = [
    "ExperimentError",
    "IDEAL_MEGATRON_ARGS",
    "IterationStat",
    "RunResult",
    "checkpoint_iteration",
    "run_balancer",
]

#: Megatron arguments that run the ideal (the force-balanced router).
IDEAL_MEGATRON_ARGS: tuple[str, ...] = (
    "--moe-balancer",
    registry.NONE,
    "--moe-router-force-load-balancing",
)

#: Megatron's tracker file of the latest saved iteration.
TRACKER = "latest_checkpointed_iteration.txt"

_ITERATION_LINE = re.compile(
    r"iteration\s+(?P<iteration>\d+)/\s*(?P<total>\d+)\s*\|.*?"
    r"elapsed time per iteration \(ms\):\s*(?P<ms>[0-9.]+)"
    r"(?:.*?throughput per GPU \(TFLOP/s/GPU\):\s*(?P<tflops>[0-9.]+))?"
)


class ExperimentError(Exception):
    """The experiment cannot start (bad checkpoint, options)."""


@dataclass
class IterationStat:
    iteration: int
    time_ms: float  # Megatron's elapsed time per iteration
    tflops_logged: Optional[float]  # Megatron's printed TFLOP/s/GPU (1 decimal)
    lm_loss: Optional[float] = None
    flops: Optional[float] = None  # model FLOPs of the iteration (Megatron's formula)
    world_size: Optional[int] = None
    imbalance_before: dict[int, float] = field(default_factory=dict)  # router, per layer
    imbalance_after: dict[int, float] = field(default_factory=dict)  # after balancing


@dataclass
class RunResult:
    balancer: str
    status: str  # "ok" or "failed: ..."
    run_dir: Path
    command: list[str]
    iterations: list[IterationStat] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def checkpoint_iteration(checkpoint: Path) -> int:
    """The iteration of Megatron's latest checkpoint in ``checkpoint``."""
    tracker = checkpoint / TRACKER
    if not tracker.is_file():
        raise ExperimentError(f"{checkpoint}: no {TRACKER}; not a Megatron checkpoint directory")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ExperimentError(
            f"{tracker}: {text!r} is not an iteration (release checkpoints "
            "have no data position to resume)"
        )
    return int(text)


def _checkpoint_state(checkpoint: Path) -> tuple[str, tuple[str, ...]]:
    """What a run must leave unchanged: the tracker file and the saved iterations."""
    tracker = checkpoint / TRACKER
    return (
        tracker.read_text() if tracker.exists() else "",
        tuple(sorted(p.name for p in checkpoint.glob("iter_*"))),
    )


def balancer_args(balancer: str, ideal_args: Sequence[str]) -> list[str]:
    if balancer == registry.IDEAL:
        return [*IDEAL_MEGATRON_ARGS, *ideal_args]
    return ["--moe-balancer", balancer]


def run_balancer(
    balancer: str,
    launch: Sequence[str],
    checkpoint: Path,
    start: int,
    iterations: int,
    output_dir: Path,
    *,
    ideal_args: Sequence[str] = (),
    exp_prefix: str = "resume",
    timeout_s: Optional[float] = None,
    progress: Optional[TextIO] = None,
    index: str = "",
    train_iters: Optional[int] = None,
) -> RunResult:
    """Resume ``checkpoint`` at ``start`` under ``balancer`` for ``iterations`` iterations
    (``train_iters``: the checkpoint's ``--train-iters``, passed on).

    The combined output goes to ``output_dir/<balancer>/log.txt``; progress (one line per
    iteration) to ``progress``. A failure (non-zero exit, timeout, missing iterations, changed
    checkpoint) is returned as a failed :class:`RunResult`, never raised.
    """
    progress = progress or sys.stdout
    run_dir = output_dir / balancer
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log_path = run_dir / "log.txt"
    command = [
        *launch,
        "--load",
        str(checkpoint),
        "--ckpt-step",
        str(start),
        "--exit-interval",
        str(start + iterations),
        *(["--train-iters", str(train_iters)] if train_iters is not None else []),
        *balancer_args(balancer, ideal_args),
        "--log-interval",
        "1",
        "--log-throughput",
        "--eval-iters",
        "0",
        "--metrics-jsonl",
        str(metrics),
        "--wandb-exp-name",
        f"{exp_prefix}-{start}-{balancer}",
        "--wandb-save-dir",
        str(run_dir),
    ]
    env = {
        "ULTRAEP_PYTHON": sys.executable,
        **os.environ,
        "RUN_DIR": str(run_dir),
        "SAVE_CHECKPOINTS": "0",
        "CHECKPOINT_DIR": str(checkpoint),
        "PYTHONUNBUFFERED": "1",
    }
    before = _checkpoint_state(checkpoint)
    result = RunResult(balancer, "ok", run_dir, command)
    seen: dict[int, re.Match] = {}
    started = time.perf_counter()
    tag = f"[{index}{balancer}]"
    print(
        f"{tag} resuming iteration {start} for {iterations} iterations: "
        f"{shlex.join(command[:6])} ...",
        file=progress,
        flush=True,
    )
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        try:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as error:
            result.status = f"failed: cannot start ({error})"
            print(f"{tag} FAILED: {result.status}", file=progress, flush=True)
            return result
        # A watchdog, so that a run that hangs without output is still stopped.
        killed = threading.Event()

        def on_timeout():
            killed.set()
            _kill(process)

        watchdog = threading.Timer(timeout_s, on_timeout) if timeout_s else None
        if watchdog:
            watchdog.start()
        tail: list[str] = []
        assert process.stdout is not None
        try:
            for line in process.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-20:]
                match = _ITERATION_LINE.search(line)
                if match and int(match["iteration"]) > start:
                    it = int(match["iteration"])
                    seen[it] = match
                    tflops = f", Megatron {match['tflops']} TFLOP/s/GPU" if match["tflops"] else ""
                    print(
                        f"{tag} iteration {it} ({it - start}/{iterations}): "
                        f"{float(match['ms']):.1f} ms{tflops}",
                        file=progress,
                        flush=True,
                    )
        except KeyboardInterrupt:  # the job runs in its own session: stop it too
            _kill(process)
            raise
        code = process.wait()
        if watchdog:
            watchdog.cancel()
        timed_out = killed.is_set()
    result.wall_s = time.perf_counter() - started
    expected = list(range(start + 1, start + iterations + 1))
    if timed_out:
        result.status = f"failed: timed out after {timeout_s:.0f} s"
    elif code != 0:
        result.status = f"failed: exit code {code}"
    elif sorted(seen) != expected:
        result.status = (
            f"failed: logged {len(seen)} of {iterations} iterations (is --log-interval 1 honoured?)"
        )
    elif _checkpoint_state(checkpoint) != before:
        result.status = (
            "failed: the run wrote to the checkpoint directory (the launcher "
            "passes --save; honour SAVE_CHECKPOINTS=0)"
        )
    records = _read_jsonl(metrics)
    if result.ok and not all(it in records for it in expected):
        result.status = f"failed: {metrics} lacks iterations {sorted(set(expected) - set(records))}"
    for it in sorted(seen):
        m, rec = seen[it], records.get(it, {})
        result.iterations.append(_iteration_stat(it, m, rec))
    if not result.ok:
        print(f"{tag} FAILED ({result.status}); last lines of {log_path}:", file=progress)
        for line in tail[-12:]:
            print(f"    {line}", file=progress)
        progress.flush()
    else:
        print(f"{tag} done in {result.wall_s:.0f} s", file=progress, flush=True)
    return result


def _kill(process: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_jsonl(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[int(record["iteration"])] = record
    return out


def _iteration_stat(iteration: int, match: re.Match, record: dict) -> IterationStat:
    before = {int(k): float(v) for k, v in record.get("load_imbalance", {}).items()}
    balancer = record.get("balancer") or {}
    after = {int(k): float(v["imbalance_after"]) for k, v in balancer.items()}
    if not after:  # unbalanced: what the router sent is what the ranks compute
        after = dict(before)
    losses = record.get("losses", {})
    return IterationStat(
        iteration=iteration,
        time_ms=float(match["ms"]),
        tflops_logged=float(match["tflops"]) if match["tflops"] else None,
        lm_loss=losses.get("lm loss"),
        flops=record.get("flops_per_iteration"),
        world_size=record.get("world_size"),
        imbalance_before=before,
        imbalance_after=after,
    )
