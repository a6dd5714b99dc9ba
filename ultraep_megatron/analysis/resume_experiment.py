"""Checkpoint-resume throughput experiment: one checkpoint, every balancer, same data.

The paper's methodology (§8.1): resume the same late-stage checkpoint under each balancer, run a
short window (~20 iterations) and compare Megatron's TFLOP/s/GPU. For each balancer this driver
runs the launch command once with, appended (later arguments win in Megatron's parser)::

    --load CKPT --ckpt-step S --exit-interval S+N      # resume at S, stop after N iterations
    --train-iters T                                     # the checkpoint's (its LR schedule's)
    --moe-balancer B                                    # ideal: IDEAL_MEGATRON_ARGS
    --log-interval 1 --log-throughput --eval-iters 0 --metrics-jsonl OUT/B/metrics.jsonl
    --wandb-exp-name <prefix>-B --wandb-save-dir OUT/B

and the environment ``RUN_DIR=OUT/B SAVE_CHECKPOINTS=0 CHECKPOINT_DIR=CKPT`` (the recipes' own
conventions), with ``ULTRAEP_PYTHON`` the running interpreter unless it is set. Every run restores
the checkpoint's model, optimizer, RNG and data position, so all balancers see the same batches.
The checkpoint's saved arguments are read first, with the reader the caller passes (the command's:
megatron-core's, ``ultraep_megatron/megatron/run/checkpoint_args.py``): its ``--train-iters`` is passed
on, since Megatron refuses to resume an LR schedule of another length, and a window past it is
refused before anything is launched. The checkpoint is never written: a run that changes it
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

The command line is in ``ultraep_megatron/cli/resume_experiment.py``; one run is
:mod:`.resume_runs`. No Megatron import: runs are subprocesses, and the checkpoint's arguments are
read by the reader passed in.
"""

from __future__ import annotations

import csv
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

from ultraep_megatron.planner.baselines import registry

from . import figures, plotting
from .resume_runs import (
    ExperimentError,
    IterationStat,
    RunResult,
    checkpoint_iteration,
    run_balancer,
)

__all__ = ["Summary", "run_experiment", "summarize", "window_tflops", "write_tables"]


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
            s.imbalance_after_max = max(
                (v for x in stats for v in x.imbalance_after.values()), default=math.nan
            )
            s.lm_loss = stats[-1].lm_loss if stats[-1].lm_loss is not None else math.nan
        summaries.append(s)
    by_name = {s.balancer: s for s in summaries}
    ideal, none = by_name.get(registry.IDEAL), by_name.get(registry.NONE)
    runs = {r.balancer: r for r in results}
    for s in summaries:
        if ideal is not None and ideal.tflops > 0:
            s.fraction_of_ideal = s.tflops / ideal.tflops
        if none is not None and none.tflops > 0:
            s.speedup_vs_none = s.tflops / none.tflops
        if (
            s.balancer not in (registry.NONE, registry.IDEAL)
            and none is not None
            and none.measured
            and s.measured
        ):
            # Same checkpoint, same batches: the first resumed iteration routes identically.
            first, reference = runs[s.balancer].iterations[0], runs[registry.NONE].iterations[0]
            s.same_data_as_none = (
                "yes" if first.imbalance_before == reference.imbalance_before else "NO"
            )
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


def write_tables(
    summaries: Sequence[Summary],
    results: Sequence[RunResult],
    output_dir: Path,
    header: str,
    warmup: int,
) -> tuple[Path, Path]:
    """comparison.md, comparison.csv, per_layer_imbalance.csv, per_iteration.csv."""
    md = output_dir / "comparison.md"
    lines = [
        header,
        "",
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for s in summaries:
        lines.append(
            "| " + " | ".join(_cell(getattr(s, key), fmt) for key, _, fmt in COLUMNS) + " |"
        )
    failed = [r for r in results if not r.ok]
    if failed:
        lines += ["", "Failed runs:"] + [
            f"- `{r.balancer}`: {r.status} (log: `{r.run_dir / 'log.txt'}`)" for r in failed
        ]
    lines += [
        "",
        f"Imbalance = max / mean tokens per EP rank, averaged over MoE layers and the "
        f"measured iterations (the first {warmup} after the resume are left out); "
        "'before' is the router's, 'after' what the ranks computed.",
    ]
    md.write_text("\n".join(lines) + "\n")
    csv_path = output_dir / "comparison.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([key for key, _, _ in COLUMNS])
        for s in summaries:
            writer.writerow(
                [
                    ""
                    if isinstance(getattr(s, k), float) and math.isnan(getattr(s, k))
                    else getattr(s, k)
                    for k, _, _ in COLUMNS
                ]
            )
    with open(output_dir / "per_layer_imbalance.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["balancer", "layer", "imbalance_before", "imbalance_after"])
        for r in results:
            stats = measured_iterations(r, warmup)
            layers = sorted({layer for x in stats for layer in x.imbalance_before})
            for layer in layers:
                writer.writerow(
                    [
                        r.balancer,
                        layer,
                        _mean([x.imbalance_before.get(layer) for x in stats]),
                        _mean([x.imbalance_after.get(layer) for x in stats]),
                    ]
                )
    with open(output_dir / "per_iteration.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "balancer",
                "iteration",
                "time_ms",
                "tflops",
                "tflops_logged",
                "lm_loss",
                "imbalance_before_mean",
                "imbalance_after_mean",
            ]
        )
        for r in results:
            for x in r.iterations:
                writer.writerow(
                    [
                        r.balancer,
                        x.iteration,
                        x.time_ms,
                        window_tflops([x]),
                        "" if x.tflops_logged is None else x.tflops_logged,
                        "" if x.lm_loss is None else x.lm_loss,
                        _mean(list(x.imbalance_before.values())),
                        _mean(list(x.imbalance_after.values())),
                    ]
                )
    return md, csv_path


def plot(
    summaries: Sequence[Summary],
    results: Sequence[RunResult],
    output_dir: Path,
    warmup: int,
    title: str,
) -> Path:
    """comparison.png: TFLOP/s/GPU per balancer, per iteration, and per-layer imbalance, each
    balancer in its colour (``plotting.COLORS``); a failed run is a hatched grey bar."""
    plt = figures.pyplot()
    fig, (bars, lines, layers) = plt.subplots(1, 3, figsize=(16, 4.8), layout="constrained")
    for i, s in enumerate(summaries):
        ok = s.status == "ok" and not math.isnan(s.tflops)
        bars.bar(
            i,
            s.tflops if ok else 0.0,
            color=plotting.balancer_color(s.balancer) if ok else "0.85",
            hatch=None if ok else "//",
            edgecolor="0.5" if not ok else None,
            label=s.balancer if ok else f"_{s.balancer} failed",
        )
        label = (
            "failed"
            if not ok
            else (
                f"{s.fraction_of_ideal:.0%} of ideal"
                if not math.isnan(s.fraction_of_ideal)
                else f"{s.tflops:.3g}"
            )
        )
        bars.annotate(label, (i, s.tflops if ok else 0.0), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(summaries)), [s.balancer for s in summaries])
    bars.margins(y=0.12)
    bars.set_ylabel("TFLOP/s/GPU (Megatron's formula)")
    bars.set_title("throughput over the window", fontsize=10)
    for r in results:
        stats = measured_iterations(r, warmup)
        if stats:
            color = plotting.balancer_color(r.balancer)
            lines.plot(
                [x.iteration for x in stats],
                [window_tflops([x]) for x in stats],
                marker="o",
                color=color,
                label=r.balancer,
            )
            layer_ids = sorted(stats[0].imbalance_after)
            layers.plot(
                layer_ids,
                [_mean([x.imbalance_after.get(l) for x in stats]) for l in layer_ids],
                marker=".",
                color=color,
                label=r.balancer,
            )
    lines.set_xlabel("iteration")
    lines.set_ylabel("TFLOP/s/GPU")
    lines.set_title("per iteration", fontsize=10)
    layers.set_xlabel("MoE layer")
    layers.set_ylabel("max / mean tokens per EP rank")
    layers.set_title("imbalance the ranks computed (after balancing)", fontsize=10)
    for ax in (lines, layers):
        figures.integer_ticks(ax.xaxis)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return figures.save_figure(fig, output_dir / "comparison.png", dpi=100)


# ----------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------


def run_experiment(
    launch: Sequence[str],
    checkpoint: Path,
    balancers: Sequence[str],
    iterations: int,
    output_dir: Path,
    *,
    warmup: Optional[int] = None,
    ckpt_step: Optional[int] = None,
    ideal_args: Sequence[str] = (),
    exp_prefix: str = "resume",
    timeout_s: Optional[float] = None,
    progress: Optional[TextIO] = None,
    read_args: Optional[Callable[[Path, int], object]] = None,
) -> tuple[list[RunResult], list[Summary]]:
    """Run every balancer, write tables and plot; returns (runs, summaries).

    ``warmup``: iterations left out of the figures; default 1, or 0 for a one-iteration window
    (whose figures then include the start-up, as the report says). ``read_args(checkpoint, step)``:
    the arguments the checkpoint's run was launched with (``None`` when the directory holds no files
    it reads; a ValueError when it cannot read them), whose ``train_iters`` is checked and passed on;
    without it they are not.
    """
    progress = progress or sys.stdout
    if warmup is None:
        warmup = 1 if iterations > 1 else 0
    unknown = [b for b in balancers if b not in registry.COMPARED]
    if unknown:
        raise ExperimentError(
            f"unknown balancer(s) {unknown}; choose from {list(registry.COMPARED)}"
        )
    if len(set(balancers)) != len(balancers):
        raise ExperimentError(f"balancers repeat: {list(balancers)}")
    if iterations < 1 or warmup < 0 or warmup >= iterations:
        raise ExperimentError(
            f"need iterations >= 1 and 0 <= warmup < iterations, got {iterations}, {warmup}"
        )
    if not launch:
        raise ExperimentError("no launch command (give it after --)")
    checkpoint = checkpoint.resolve()
    start = ckpt_step if ckpt_step is not None else checkpoint_iteration(checkpoint)
    if not (checkpoint / f"iter_{start:07d}").is_dir():
        raise ExperimentError(f"{checkpoint}: no iter_{start:07d}")
    try:
        saved = read_args(checkpoint, start) if read_args is not None else None
    except ValueError as error:
        raise ExperimentError(str(error)) from None
    train_iters = getattr(saved, "train_iters", None)
    if saved is None and read_args is None:
        print(
            "note: no reader of the checkpoint's arguments given: its --train-iters is not checked",
            file=progress,
            flush=True,
        )
    elif saved is None:
        print(
            f"note: {checkpoint}/iter_{start:07d} holds no checkpoint files this reads (torch_dist or "
            "torch format): its --train-iters is not checked",
            file=progress,
            flush=True,
        )
    elif train_iters is not None and start + iterations > train_iters:
        raise ExperimentError(
            f"the checkpoint's run trains {train_iters} iterations (--train-iters {train_iters}, which sets "
            f"its LR schedule): resuming iteration {start} leaves {max(train_iters - start, 0)}, fewer than "
            f"--iterations {iterations}"
        )
    if warmup == 0:
        print(
            "note: no warm-up iteration is left out: the figures include the resume's start-up",
            file=progress,
            flush=True,
        )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExperimentError(f"--output-dir {output_dir}: {error.strerror or error}") from None
    results = []
    for i, balancer in enumerate(balancers):
        results.append(
            run_balancer(
                balancer,
                launch,
                checkpoint,
                start,
                iterations,
                output_dir,
                ideal_args=ideal_args,
                exp_prefix=exp_prefix,
                timeout_s=timeout_s,
                progress=progress,
                index=f"{i + 1}/{len(balancers)} ",
                train_iters=train_iters,
            )
        )
    summaries = summarize(results, warmup)
    header = (
        f"# Resume experiment: {checkpoint} at iteration {start}, {iterations} iterations "
        f"per balancer\n\nLaunch: `{shlex.join(launch)}`"
    )
    md, _ = write_tables(summaries, results, output_dir, header, warmup)
    try:
        plot(
            summaries,
            results,
            output_dir,
            warmup,
            f"resume of iteration {start}, {iterations} iterations ({warmup} warm-up)",
        )
    except Exception as error:  # the tables are the result; a plot failure is reported
        print(f"plot failed: {error!r}", file=progress, flush=True)
    ideal = next((s for s in summaries if s.balancer == registry.IDEAL and s.status == "ok"), None)
    none = next((s for s in summaries if s.balancer == registry.NONE and s.status == "ok"), None)
    if ideal and none and ideal.imbalance_before >= none.imbalance_before:
        print(
            f"WARNING: the ideal run's router imbalance ({ideal.imbalance_before:.3f}) is not "
            f"below none's ({none.imbalance_before:.3f}); does the launcher force a skew "
            "(--moe-router-force-biased)? Neutralize it with --ideal-args.",
            file=progress,
        )
    print(md.read_text(), file=progress, flush=True)
    return results, summaries
