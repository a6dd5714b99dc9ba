"""Checkpoint-resume throughput experiment: one checkpoint, every balancer, same data.

The paper's methodology (§8.1): resume the same late-stage checkpoint under each balancer, run a
short window (~20 iterations) and compare Megatron's TFLOP/s/GPU. For each balancer this driver
runs the launch command once with, appended (later arguments win in Megatron's parser)::

    --load CKPT --ckpt-step S --exit-interval S+N      # resume at S, stop after N iterations
    --train-iters T                                     # the checkpoint's (its LR schedule's)
    --moe-balancer B                                    # ideal: policy.IDEAL_MEGATRON_ARGS
    --log-interval 1 --log-throughput --eval-iters 0 --metrics-jsonl OUT/B/metrics.jsonl
    --wandb-exp-name <prefix>-B --wandb-save-dir OUT/B

and the environment ``RUN_DIR=OUT/B SAVE_CHECKPOINTS=0 CHECKPOINT_DIR=CKPT`` (the recipes' own
conventions), with ``ULTRAEP_PYTHON`` the running interpreter unless it is set. Every run restores
the checkpoint's model, optimizer, RNG and data position, so all balancers see the same batches.
The checkpoint's saved arguments are read first (megatron-core's own reader): its ``--train-iters``
is passed on, since Megatron refuses to resume an LR schedule of another length, and a window past
it is refused before anything is launched. The checkpoint is never written: a run that changes it
is reported as failed.

Per run it reads Megatron's log lines (``elapsed time per iteration (ms)``, ``throughput per GPU
(TFLOP/s/GPU)``) and the ``--metrics-jsonl`` records (per-layer imbalance before/after balancing,
loss, and the iteration's model FLOPs by Megatron's formula), and writes to OUT:

* ``comparison.md`` / ``comparison.csv``: per balancer TFLOP/s/GPU, iteration time, fraction of
  the ideal, speedup over ``none``, imbalance before/after balancing, final loss;
* ``per_layer_imbalance.csv``, ``per_iteration.csv``; ``comparison.png`` (a plot);
* ``<balancer>/log.txt`` and ``<balancer>/metrics.jsonl`` of every run.

TFLOP/s/GPU = model FLOPs per iteration x measured iterations / (their summed Megatron iteration
time x 1e12 x world size), i.e. Megatron's own figure over the window (the first
``--warmup-iterations`` after the resume are left out: they include start-up).

    ultraep resume-experiment --load /ckpt/qwen3 --iterations 20 \\
        --output-dir results/qwen3 -- bash recipes/qwen3_235b_a22b_ep64_dp4.sh

The command line is in ``ultraep_megatron/cli/resume_experiment.py``. No Megatron import: runs are
subprocesses (the checkpoint's arguments are read with megatron-core's checkpoint reader).
"""

from __future__ import annotations

import csv
import json
import math
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

from ultraep_megatron.planner import policy

#: Megatron's tracker file of the latest saved iteration.
TRACKER = "latest_checkpointed_iteration.txt"

_ITERATION_LINE = re.compile(
    r"iteration\s+(?P<iteration>\d+)/\s*(?P<total>\d+)\s*\|.*?"
    r"elapsed time per iteration \(ms\):\s*(?P<ms>[0-9.]+)"
    r"(?:.*?throughput per GPU \(TFLOP/s/GPU\):\s*(?P<tflops>[0-9.]+))?")


class ExperimentError(Exception):
    """The experiment cannot start (bad checkpoint, options)."""


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

@dataclass
class IterationStat:
    iteration: int
    time_ms: float                       # Megatron's elapsed time per iteration
    tflops_logged: Optional[float]       # Megatron's printed TFLOP/s/GPU (1 decimal)
    lm_loss: Optional[float] = None
    flops: Optional[float] = None        # model FLOPs of the iteration (Megatron's formula)
    world_size: Optional[int] = None
    imbalance_before: dict[int, float] = field(default_factory=dict)   # router, per layer
    imbalance_after: dict[int, float] = field(default_factory=dict)    # after balancing


@dataclass
class RunResult:
    balancer: str
    status: str                          # "ok" or "failed: ..."
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
        raise ExperimentError(f"{tracker}: {text!r} is not an iteration (release checkpoints "
                              "have no data position to resume)")
    return int(text)


def checkpoint_args(checkpoint: Path, step: int):
    """The arguments the run that saved ``checkpoint``'s iteration ``step`` was launched with
    (Megatron's ``args`` in its common state), or ``None`` when the directory holds no checkpoint
    files this knows (``torch_dist``: ``metadata.json``; ``torch``: ``mp_rank_*/model_optim_rng.pt``).

    Raises:
        ExperimentError: the files are there but cannot be read.
    """
    directory = checkpoint / f"iter_{step:07d}"
    torch_format = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    try:
        if (directory / "metadata.json").is_file():
            import warnings

            with warnings.catch_warnings():  # Megatron's import-time notes (no TE, no Apex)
                warnings.simplefilter("ignore")
                from megatron.core.dist_checkpointing.serialization import load_common_state_dict

                return load_common_state_dict(str(directory))["args"]
        if torch_format:
            import torch

            # mmap: the arguments without reading the weights.
            return torch.load(torch_format[0], map_location="cpu", mmap=True, weights_only=False)["args"]
    except Exception as error:
        raise ExperimentError(f"{directory}: cannot read the checkpoint's arguments ({error!r})") from None
    return None


def _checkpoint_state(checkpoint: Path) -> tuple[str, tuple[str, ...]]:
    """What a run must leave unchanged: the tracker file and the saved iterations."""
    tracker = checkpoint / TRACKER
    return (tracker.read_text() if tracker.exists() else "",
            tuple(sorted(p.name for p in checkpoint.glob("iter_*"))))


def balancer_args(balancer: str, ideal_args: Sequence[str]) -> list[str]:
    if balancer == policy.IDEAL:
        return [*policy.IDEAL_MEGATRON_ARGS, *ideal_args]
    return ["--moe-balancer", balancer]


def run_balancer(balancer: str, launch: Sequence[str], checkpoint: Path, start: int,
                 iterations: int, output_dir: Path, *, ideal_args: Sequence[str] = (),
                 exp_prefix: str = "resume", timeout_s: Optional[float] = None,
                 progress: Optional[TextIO] = None, index: str = "",
                 train_iters: Optional[int] = None) -> RunResult:
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
        "--load", str(checkpoint), "--ckpt-step", str(start),
        "--exit-interval", str(start + iterations),
        *(["--train-iters", str(train_iters)] if train_iters is not None else []),
        *balancer_args(balancer, ideal_args),
        "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
        "--metrics-jsonl", str(metrics),
        "--wandb-exp-name", f"{exp_prefix}-{start}-{balancer}", "--wandb-save-dir", str(run_dir),
    ]
    env = {"ULTRAEP_PYTHON": sys.executable, **os.environ, "RUN_DIR": str(run_dir), "SAVE_CHECKPOINTS": "0",
           "CHECKPOINT_DIR": str(checkpoint), "PYTHONUNBUFFERED": "1"}
    before = _checkpoint_state(checkpoint)
    result = RunResult(balancer, "ok", run_dir, command)
    seen: dict[int, re.Match] = {}
    started = time.perf_counter()
    tag = f"[{index}{balancer}]"
    print(f"{tag} resuming iteration {start} for {iterations} iterations: "
          f"{shlex.join(command[:6])} ...", file=progress, flush=True)
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        try:
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, errors="replace",
                                       start_new_session=True)
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
                    print(f"{tag} iteration {it} ({it - start}/{iterations}): "
                          f"{float(match['ms']):.1f} ms{tflops}", file=progress, flush=True)
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
        result.status = (f"failed: logged {len(seen)} of {iterations} iterations "
                         f"(is --log-interval 1 honoured?)")
    elif _checkpoint_state(checkpoint) != before:
        result.status = ("failed: the run wrote to the checkpoint directory (the launcher "
                         "passes --save; honour SAVE_CHECKPOINTS=0)")
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
        iteration=iteration, time_ms=float(match["ms"]),
        tflops_logged=float(match["tflops"]) if match["tflops"] else None,
        lm_loss=losses.get("lm loss"), flops=record.get("flops_per_iteration"),
        world_size=record.get("world_size"), imbalance_before=before, imbalance_after=after)


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------

@dataclass
class Summary:
    balancer: str
    status: str
    measured: int = 0
    time_ms: float = math.nan
    tflops: float = math.nan
    tflops_logged: float = math.nan
    fraction_of_ideal: float = math.nan
    speedup_vs_none: float = math.nan
    imbalance_before: float = math.nan
    imbalance_after: float = math.nan
    imbalance_after_max: float = math.nan
    lm_loss: float = math.nan
    same_data_as_none: str = "-"


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def measured_iterations(result: RunResult, warmup: int) -> list[IterationStat]:
    """The iterations after the first ``warmup`` of the window."""
    return result.iterations[warmup:]


def window_tflops(stats: Sequence[IterationStat]) -> float:
    """Megatron's TFLOP/s/GPU over a window: FLOPs / (time x 1e12 x world size)."""
    if not stats or any(s.flops is None or not s.world_size for s in stats):
        return _mean([s.tflops_logged for s in stats]) if stats else math.nan
    seconds = sum(s.time_ms for s in stats) / 1e3
    return sum(s.flops for s in stats) / (seconds * 1e12 * stats[0].world_size)


def summarize(results: Sequence[RunResult], warmup: int) -> list[Summary]:
    """One :class:`Summary` per run, with the cross-run ratios filled in."""
    summaries = []
    for r in results:
        s = Summary(r.balancer, r.status)
        stats = measured_iterations(r, warmup) if r.ok else []
        if stats:
            s.measured = len(stats)
            s.time_ms = _mean([x.time_ms for x in stats])
            s.tflops = window_tflops(stats)
            s.tflops_logged = _mean([x.tflops_logged for x in stats])
            s.imbalance_before = _mean([v for x in stats for v in x.imbalance_before.values()])
            s.imbalance_after = _mean([v for x in stats for v in x.imbalance_after.values()])
            s.imbalance_after_max = max((v for x in stats for v in x.imbalance_after.values()),
                                        default=math.nan)
            s.lm_loss = stats[-1].lm_loss if stats[-1].lm_loss is not None else math.nan
        summaries.append(s)
    by_name = {s.balancer: s for s in summaries}
    ideal, none = by_name.get(policy.IDEAL), by_name.get(policy.NONE)
    runs = {r.balancer: r for r in results}
    for s in summaries:
        if ideal is not None and ideal.tflops > 0:
            s.fraction_of_ideal = s.tflops / ideal.tflops
        if none is not None and none.tflops > 0:
            s.speedup_vs_none = s.tflops / none.tflops
        if s.balancer not in (policy.NONE, policy.IDEAL) and none is not None and none.measured \
                and s.measured:
            # Same checkpoint, same batches: the first resumed iteration routes identically.
            first, reference = runs[s.balancer].iterations[0], runs[policy.NONE].iterations[0]
            s.same_data_as_none = "yes" if first.imbalance_before == reference.imbalance_before else "NO"
    return summaries


COLUMNS = [
    ("balancer", "balancer", "{}"),
    ("status", "status", "{}"),
    ("measured", "iterations", "{}"),
    ("time_ms", "iteration time (ms)", "{:.1f}"),
    ("tflops", "TFLOP/s/GPU", "{:.4g}"),
    ("fraction_of_ideal", "fraction of ideal", "{:.1%}"),
    ("speedup_vs_none", "speedup vs none", "{:.3f}x"),
    ("imbalance_before", "imbalance before (mean)", "{:.3f}"),
    ("imbalance_after", "imbalance after (mean)", "{:.3f}"),
    ("imbalance_after_max", "imbalance after (max)", "{:.3f}"),
    ("lm_loss", "lm loss (last)", "{:.6f}"),
    ("same_data_as_none", "same routing as none", "{}"),
]


def _cell(value, fmt: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def write_tables(summaries: Sequence[Summary], results: Sequence[RunResult], output_dir: Path,
                 header: str, warmup: int) -> tuple[Path, Path]:
    """comparison.md, comparison.csv, per_layer_imbalance.csv, per_iteration.csv."""
    md = output_dir / "comparison.md"
    lines = [header, "",
             "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for s in summaries:
        lines.append("| " + " | ".join(_cell(getattr(s, key), fmt) for key, _, fmt in COLUMNS) + " |")
    failed = [r for r in results if not r.ok]
    if failed:
        lines += ["", "Failed runs:"] + [f"- `{r.balancer}`: {r.status} (log: `{r.run_dir / 'log.txt'}`)"
                                          for r in failed]
    lines += ["", f"Imbalance = max / mean tokens per EP rank, averaged over MoE layers and the "
                  f"measured iterations (the first {warmup} after the resume are left out); "
                  "'before' is the router's, 'after' what the ranks computed."]
    md.write_text("\n".join(lines) + "\n")
    csv_path = output_dir / "comparison.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([key for key, _, _ in COLUMNS])
        for s in summaries:
            writer.writerow(["" if isinstance(getattr(s, k), float) and math.isnan(getattr(s, k))
                             else getattr(s, k) for k, _, _ in COLUMNS])
    with open(output_dir / "per_layer_imbalance.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["balancer", "layer", "imbalance_before", "imbalance_after"])
        for r in results:
            stats = measured_iterations(r, warmup)
            layers = sorted({layer for x in stats for layer in x.imbalance_before})
            for layer in layers:
                writer.writerow([r.balancer, layer,
                                 _mean([x.imbalance_before.get(layer) for x in stats]),
                                 _mean([x.imbalance_after.get(layer) for x in stats])])
    with open(output_dir / "per_iteration.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["balancer", "iteration", "time_ms", "tflops", "tflops_logged", "lm_loss",
                         "imbalance_before_mean", "imbalance_after_mean"])
        for r in results:
            for x in r.iterations:
                writer.writerow([r.balancer, x.iteration, x.time_ms, window_tflops([x]),
                                 "" if x.tflops_logged is None else x.tflops_logged,
                                 "" if x.lm_loss is None else x.lm_loss,
                                 _mean(list(x.imbalance_before.values())),
                                 _mean(list(x.imbalance_after.values()))])
    return md, csv_path


def plot(summaries: Sequence[Summary], results: Sequence[RunResult], output_dir: Path,
         warmup: int, title: str) -> Path:
    """comparison.png: TFLOP/s/GPU per balancer, per iteration, and per-layer imbalance, each
    balancer in its colour (``plotting.BALANCER_COLORS``); a failed run is a hatched grey bar."""
    from ultraep_megatron import plotting

    plt = plotting.pyplot()
    fig, (bars, lines, layers) = plt.subplots(1, 3, figsize=(16, 4.8), layout="constrained")
    for i, s in enumerate(summaries):
        ok = s.status == "ok" and not math.isnan(s.tflops)
        bars.bar(i, s.tflops if ok else 0.0, color=plotting.balancer_color(s.balancer) if ok else "0.85",
                 hatch=None if ok else "//", edgecolor="0.5" if not ok else None,
                 label=s.balancer if ok else f"_{s.balancer} failed")
        label = ("failed" if not ok else
                 (f"{s.fraction_of_ideal:.0%} of ideal" if not math.isnan(s.fraction_of_ideal)
                  else f"{s.tflops:.3g}"))
        bars.annotate(label, (i, s.tflops if ok else 0.0), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(summaries)), [s.balancer for s in summaries])
    bars.margins(y=0.12)
    bars.set_ylabel("TFLOP/s/GPU (Megatron's formula)")
    bars.set_title("throughput over the window", fontsize=10)
    for r in results:
        stats = measured_iterations(r, warmup)
        if stats:
            color = plotting.balancer_color(r.balancer)
            lines.plot([x.iteration for x in stats], [window_tflops([x]) for x in stats],
                       marker="o", color=color, label=r.balancer)
            layer_ids = sorted(stats[0].imbalance_after)
            layers.plot(layer_ids, [_mean([x.imbalance_after.get(l) for x in stats]) for l in layer_ids],
                        marker=".", color=color, label=r.balancer)
    lines.set_xlabel("iteration")
    lines.set_ylabel("TFLOP/s/GPU")
    lines.set_title("per iteration", fontsize=10)
    layers.set_xlabel("MoE layer")
    layers.set_ylabel("max / mean tokens per EP rank")
    layers.set_title("imbalance the ranks computed (after balancing)", fontsize=10)
    for ax in (lines, layers):
        plotting.integer_ticks(ax.xaxis)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return plotting.save_figure(fig, output_dir / "comparison.png", dpi=100)


# ----------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------

def run_experiment(launch: Sequence[str], checkpoint: Path, balancers: Sequence[str],
                   iterations: int, output_dir: Path, *, warmup: Optional[int] = None,
                   ckpt_step: Optional[int] = None, ideal_args: Sequence[str] = (),
                   exp_prefix: str = "resume", timeout_s: Optional[float] = None,
                   progress: Optional[TextIO] = None) -> tuple[list[RunResult], list[Summary]]:
    """Run every balancer, write tables and plot; returns (runs, summaries).

    ``warmup``: iterations left out of the figures; default 1, or 0 for a one-iteration window
    (whose figures then include the start-up, as the report says).
    """
    progress = progress or sys.stdout
    if warmup is None:
        warmup = 1 if iterations > 1 else 0
    unknown = [b for b in balancers if b not in policy.COMPARED]
    if unknown:
        raise ExperimentError(f"unknown balancer(s) {unknown}; choose from {list(policy.COMPARED)}")
    if len(set(balancers)) != len(balancers):
        raise ExperimentError(f"balancers repeat: {list(balancers)}")
    if iterations < 1 or warmup < 0 or warmup >= iterations:
        raise ExperimentError(f"need iterations >= 1 and 0 <= warmup < iterations, got "
                              f"{iterations}, {warmup}")
    if not launch:
        raise ExperimentError("no launch command (give it after --)")
    checkpoint = checkpoint.resolve()
    start = ckpt_step if ckpt_step is not None else checkpoint_iteration(checkpoint)
    if not (checkpoint / f"iter_{start:07d}").is_dir():
        raise ExperimentError(f"{checkpoint}: no iter_{start:07d}")
    saved = checkpoint_args(checkpoint, start)
    train_iters = getattr(saved, "train_iters", None)
    if saved is None:
        print(f"note: {checkpoint}/iter_{start:07d} holds no checkpoint files this reads (torch_dist or "
              "torch format): its --train-iters is not checked", file=progress, flush=True)
    elif train_iters is not None and start + iterations > train_iters:
        raise ExperimentError(
            f"the checkpoint's run trains {train_iters} iterations (--train-iters {train_iters}, which sets "
            f"its LR schedule): resuming iteration {start} leaves {max(train_iters - start, 0)}, fewer than "
            f"--iterations {iterations}")
    if warmup == 0:
        print("note: no warm-up iteration is left out: the figures include the resume's start-up",
              file=progress, flush=True)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExperimentError(f"--output-dir {output_dir}: {error.strerror or error}") from None
    results = []
    for i, balancer in enumerate(balancers):
        results.append(run_balancer(
            balancer, launch, checkpoint, start, iterations, output_dir, ideal_args=ideal_args,
            exp_prefix=exp_prefix, timeout_s=timeout_s, progress=progress,
            index=f"{i + 1}/{len(balancers)} ", train_iters=train_iters))
    summaries = summarize(results, warmup)
    header = (f"# Resume experiment: {checkpoint} at iteration {start}, {iterations} iterations "
              f"per balancer\n\nLaunch: `{shlex.join(launch)}`")
    md, _ = write_tables(summaries, results, output_dir, header, warmup)
    try:
        plot(summaries, results, output_dir, warmup,
             f"resume of iteration {start}, {iterations} iterations ({warmup} warm-up)")
    except Exception as error:  # the tables are the result; a plot failure is reported
        print(f"plot failed: {error!r}", file=progress, flush=True)
    ideal = next((s for s in summaries if s.balancer == policy.IDEAL and s.status == "ok"), None)
    none = next((s for s in summaries if s.balancer == policy.NONE and s.status == "ok"), None)
    if ideal and none and ideal.imbalance_before >= none.imbalance_before:
        print(f"WARNING: the ideal run's router imbalance ({ideal.imbalance_before:.3f}) is not "
              f"below none's ({none.imbalance_before:.3f}); does the launcher force a skew "
              "(--moe-router-force-biased)? Neutralize it with --ideal-args.", file=progress)
    print(md.read_text(), file=progress, flush=True)
    return results, summaries
