"""wandb dashboards of a balanced run, read back from the offline run file: Megatron's loss,
learning rate, grad norm, iteration time and throughput are there next to every per-layer,
per-iteration balancing metric, each under one name and equal to what the run computed (its
--metrics-jsonl records and Megatron's console log); the all-layer summaries equal their
recomputation, and the layer x iteration heatmap is logged to wandb and written next to the
checkpoint with the run's values."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil

import numpy as np
import pytest

from ultraep_megatron.megatron.run import dashboards
from ultraep_megatron.megatron.run.dashboards import HEATMAP_METRIC, Dashboard, ImbalanceHistory
from ultraep_megatron.megatron.run.telemetry import (
    LOGGED_BALANCER_METRICS,
    keep_earlier_records,
    megatron_owned_scalars,
    megatron_scalars,
)

from product_runs import CHECKPOINT_ITERATION
from wandb_runs import iter_wandb_records, read_wandb_history, wandb_run_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def history(tiny_balanced_run):
    return {row["_step"]: row for row in read_wandb_history(tiny_balanced_run.run_dir / "wandb")}


@pytest.mark.slow
def test_offline_wandb_run_holds_every_layer_metric_the_run_computed(tiny_balanced_run, history):
    records = tiny_balanced_run.records
    assert sorted(records) == list(range(1, CHECKPOINT_ITERATION + 1))
    for iteration, record in records.items():
        row = history[iteration]
        assert len(record["load_imbalance"]) == 4 and len(record["balancer"]) == 4
        for layer, value in record["load_imbalance"].items():
            assert row[f"moe/load_imbalance/layer_{int(layer):02d}"] == value
        for layer, stats in record["balancer"].items():
            for metric in LOGGED_BALANCER_METRICS:
                assert row[f"ultraep/{metric}/layer_{int(layer):02d}"] == stats[metric], metric
        # One name per quantity: the load before balancing is the router's figure only, and the
        # memory spread, which equals the imbalance, gets no second chart.
        assert not [
            key
            for key in row
            if key.startswith(
                (
                    "ultraep/imbalance_before/",
                    "ultraep/memory_spread",
                    "ultraep/summary/memory_spread",
                )
            )
        ]
        before = list(record["load_imbalance"].values())
        after = [stats["imbalance_after"] for stats in record["balancer"].values()]
        assert row["ultraep/summary/imbalance_before_mean"] == pytest.approx(
            sum(before) / 4, rel=1e-12
        )
        assert row["ultraep/summary/imbalance_before_max"] == max(before)
        assert row["ultraep/summary/imbalance_after_mean"] == pytest.approx(
            sum(after) / 4, rel=1e-12
        )
        assert row["ultraep/summary/imbalance_after_max"] == max(after)
        stats = record["balancer"].values()
        assert row["ultraep/summary/balanced_fraction_mean"] == pytest.approx(
            sum(v["balanced_fraction"] for v in stats) / 4, rel=1e-12
        )
        # The recipe's skewed router, balanced: the figures are not trivially equal.
        assert max(after) < 1.05 < max(before)


@pytest.mark.slow
def test_offline_wandb_run_holds_megatrons_training_figures(tiny_balanced_run, history):
    """The main job logs to wandb only (no --tensorboard-dir), where megatron-core 0.19 writes no
    loss: the run still holds `lm loss`, `learning-rate` and `grad-norm` every iteration, and
    `iteration-time` and `throughput` (TFLOP/s/GPU, Megatron's formula) after the first, equal to
    the run's records and to Megatron's console lines (printed to 7 significant digits; its loss
    there is the mean since the last reset, and the first iteration does not reset)."""
    records = tiny_balanced_run.records
    console = {
        int(m[1]): (float(m[2]), float(m[3]))
        for m in re.finditer(
            r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+) .*?lm loss: ([0-9.E+-]+) ",
            tiny_balanced_run.log,
        )
    }
    assert sorted(console) == sorted(records) == [1, 2]
    for iteration, record in records.items():
        row = history[iteration]
        assert row["lm loss"] == record["losses"]["lm loss"]
        assert row["grad-norm"] == record["grad_norm"]
        assert row["learning-rate"] == record["learning_rate"]
        assert row["learning-rate"] == pytest.approx(console[iteration][0], rel=1e-6)
    assert history[1]["lm loss"] == pytest.approx(console[1][1], rel=1e-6)
    assert (history[1]["lm loss"] + history[2]["lm loss"]) / 2 == pytest.approx(
        console[2][1], rel=1e-6
    )
    # The recipe's schedule: --lr 3e-3 warmed up linearly over 4 iterations.
    assert [history[i]["learning-rate"] for i in sorted(records)] == pytest.approx(
        [3e-3 * i / 4 for i in sorted(records)], rel=1e-6
    )
    first, *later = sorted(records)
    assert "iteration-time" not in history[first] and "throughput" not in history[first]  # start-up
    for iteration in later:
        record = records[iteration]
        assert history[iteration]["iteration-time"] == record["iteration_time_s"]
        assert history[iteration]["throughput"] == pytest.approx(
            record["flops_per_iteration"]
            / (record["iteration_time_s"] * 1e12 * record["world_size"]),
            rel=1e-12,
        )


@pytest.mark.slow
def test_first_iteration_plan_time_holds_no_compilation(tiny_balanced_run):
    """The planner's kernels are loaded before training: the first layer's plan time in the
    first iteration is of the order of the others (loading them there took 0.2-0.5 s, ~1000x)."""
    records = tiny_balanced_run.records
    first = records[1]["balancer"]["1"]["plan_ms"]
    others = [
        stats["plan_ms"]
        for i, r in records.items()
        for layer, stats in r["balancer"].items()
        if (i, layer) != (1, "1")
    ]
    assert first < 10 * max(others), (first, others)


@pytest.mark.slow
def test_heatmap_is_logged_and_written_next_to_the_checkpoint(tiny_balanced_run, history):
    records = tiny_balanced_run.records
    png = tiny_balanced_run.checkpoint / f"{dashboards.HEATMAP_STEM}{CHECKPOINT_ITERATION:07d}.png"
    assert (tiny_balanced_run.checkpoint / f"iter_{CHECKPOINT_ITERATION:07d}").is_dir()
    assert png.read_bytes().startswith(PNG_MAGIC)
    data = np.load(png.with_suffix(".npz"))
    assert data["iterations"].tolist() == sorted(records)
    assert data["layers"].tolist() == [1, 2, 3, 4]
    for t, iteration in enumerate(sorted(records)):
        record = records[iteration]
        for layer in range(1, 5):
            assert data["imbalance_before"][layer - 1, t] == record["load_imbalance"][str(layer)]
            assert (
                data["imbalance_after"][layer - 1, t]
                == record["balancer"][str(layer)]["imbalance_after"]
            )
    image = history[CHECKPOINT_ITERATION][HEATMAP_METRIC]
    assert image["_type"] == "image-file"
    assert image["sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
    logged = wandb_run_file(tiny_balanced_run.run_dir / "wandb").parent / "files" / image["path"]
    assert logged.read_bytes() == png.read_bytes()
    # Only at the checkpoint / last iteration.
    assert all(
        HEATMAP_METRIC not in row for step, row in history.items() if step != CHECKPOINT_ITERATION
    )


@pytest.mark.slow
def test_wandb_reader_rejects_a_corrupted_run_file(tiny_balanced_run, tmp_path):
    source = wandb_run_file(tiny_balanced_run.run_dir / "wandb")
    assert source.stat().st_size > 32 * 1024  # the history spans more than one 32 KiB block
    broken = tmp_path / source.name
    shutil.copy(source, broken)
    data = bytearray(broken.read_bytes())
    data[200] ^= 0xFF
    broken.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        list(iter_wandb_records(broken))
    (tmp_path / "other.wandb").write_bytes(b"not a wandb file at all")
    with pytest.raises(ValueError, match="not a wandb run file"):
        list(iter_wandb_records(tmp_path / "other.wandb"))


@pytest.mark.slow
def test_wandb_reader_never_follows_latest_run(tiny_balanced_run, tmp_path):
    """A second launch into the same directory that crashed at once: `latest-run` points at its
    empty run; the reader asks which run instead of returning nothing, and reads the one named."""
    save_dir = tmp_path / "wandb"
    shutil.copytree(tiny_balanced_run.run_dir / "wandb", save_dir, symlinks=True)
    good = wandb_run_file(save_dir)
    crashed = save_dir / "wandb" / "offline-run-29990101_000000-crashed0"
    crashed.mkdir()
    (crashed / "run-crashed0.wandb").write_bytes(good.read_bytes()[:7])  # the header only
    (save_dir / "wandb" / "latest-run").unlink()
    (save_dir / "wandb" / "latest-run").symlink_to(crashed.name)
    with pytest.raises(ValueError, match="2 wandb runs .*crashed0.*pass run_id"):
        read_wandb_history(save_dir)
    run_id = good.stem[len("run-") :]
    rows = read_wandb_history(save_dir, run_id=run_id)
    assert [row["_step"] for row in rows] == sorted(tiny_balanced_run.records)
    assert read_wandb_history(save_dir, run_id="crashed0") == []


def test_megatron_figures_go_where_megatron_does_not_write_them():
    """With a tensorboard writer Megatron writes losses, learning rate and grad norm to both
    writers itself, and the timers with --log-timers-to-tensorboard: nothing is written twice."""

    class Args:
        log_timers_to_tensorboard, log_throughput = False, True

    losses = {"lm loss": 2.5, "load_balancing_loss": 1.1}
    args = (losses, 1e-3, 0.4, 0.5, 2e12, 4)
    wandb_only = megatron_scalars(*args, megatron_owned_scalars(Args, writer=None))
    assert wandb_only == {
        "lm loss": 2.5,
        "load_balancing_loss": 1.1,
        "learning-rate": 1e-3,
        "grad-norm": 0.4,
        "iteration-time": 0.5,
        "throughput": 2e12 / (0.5 * 1e12 * 4),
    }
    with_tensorboard = megatron_scalars(*args, megatron_owned_scalars(Args, writer=object()))
    assert with_tensorboard == {"iteration-time": 0.5, "throughput": 1.0}
    Args.log_timers_to_tensorboard = True
    assert megatron_scalars(*args, megatron_owned_scalars(Args, writer=object())) == {}
    Args.log_throughput = False  # Megatron then writes the iteration time only
    assert megatron_scalars(*args, megatron_owned_scalars(Args, writer=object())) == {
        "throughput": 1.0
    }
    assert "iteration-time" not in megatron_scalars(losses, None, None, None, 2e12, 4, frozenset())


class _Writer:
    """Megatron's tensorboard writer interface (tensorboard itself is not in the environment)."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = value


def test_tensorboard_gets_the_same_names_as_wandb():
    class Wandb:
        def __init__(self):
            self.rows = {}

        def log(self, data, step):
            self.rows.setdefault(step, {}).update(data)

    writer, run = _Writer(), Wandb()
    dashboards.log_scalars(
        {"moe/load_imbalance/layer_01": 1.5, "ultraep/plan_ms/layer_01": 0.2}, 7, writer, run
    )
    assert {name: value for (name, step), value in writer.scalars.items() if step == 7} == run.rows[
        7
    ]


def test_a_resumed_run_keeps_the_metrics_records_before_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"iteration": i, "losses": {"lm loss": 10.0 - i}}) + "\n"
            for i in range(1, 7)
        )
    )
    keep_earlier_records(str(path), 5)  # resumed from the checkpoint of iteration 4
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    keep_earlier_records(str(path), 1)  # a fresh run
    assert path.read_text() == ""
    keep_earlier_records(str(tmp_path / "missing.jsonl"), 3)
    assert not (tmp_path / "missing.jsonl").exists()


def test_history_keeps_a_bounded_window_and_marks_missing_layers():
    history = ImbalanceHistory(max_iterations=3)
    history.add(1, {1: 2.0, 3: 1.5}, {1: 1.0, 3: 1.01})
    history.add(2, {1: 1.8}, None)
    history.add(3, {1: 1.7, 3: 1.2}, {1: 1.02, 3: 1.0})
    history.add(4, {3: 1.1}, {3: 1.0})
    iterations, layers, before, after = history.matrices()
    assert iterations.tolist() == [2, 3, 4] and layers.tolist() == [1, 3]
    np.testing.assert_array_equal(before, [[1.8, 1.7, np.nan], [np.nan, 1.2, 1.1]])
    np.testing.assert_array_equal(after, [[np.nan, 1.02, np.nan], [np.nan, 1.0, 1.0]])
    with pytest.raises(ValueError):
        ImbalanceHistory(max_iterations=0)


def test_heatmap_falls_due_at_checkpoints_and_the_last_iteration():
    class Args:
        save, save_interval, train_iters, exit_interval = "/ckpt", 50, 120, None

    dashboard = Dashboard(Args)
    assert [i for i in range(1, 121) if dashboard.heatmap_due(i)] == [50, 100, 120]
    Args.save, Args.exit_interval = None, 30
    assert [i for i in range(1, 121) if dashboard.heatmap_due(i)] == [30, 60, 90, 120]


def test_layer_summary_of_no_layers_is_nan():
    mean, peak = dashboards.layer_summary({})
    assert math.isnan(mean) and math.isnan(peak)
    assert dashboards.layer_summary({1: 1.0, 2: 3.0}) == (2.0, 3.0)
