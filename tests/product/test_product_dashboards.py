"""wandb dashboards of a balanced run, read back from the offline run file: every per-layer,
per-iteration metric equals what the run computed (its --metrics-jsonl records), the all-layer
summaries equal their recomputation, and the layer x iteration heatmap is logged to wandb and
written next to the checkpoint with the run's values."""

from __future__ import annotations

import hashlib
import math
import shutil

import numpy as np
import pytest

from ultraep_megatron.megatron import dashboards
from ultraep_megatron.megatron.dashboards import HEATMAP_METRIC, Dashboard, ImbalanceHistory
from ultraep_megatron.megatron.telemetry import BALANCER_METRICS

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
            for metric in BALANCER_METRICS:
                assert row[f"ultraep/{metric}/layer_{int(layer):02d}"] == stats[metric], metric
        before = list(record["load_imbalance"].values())
        after = [stats["imbalance_after"] for stats in record["balancer"].values()]
        assert row["ultraep/summary/imbalance_before_mean"] == pytest.approx(sum(before) / 4, rel=1e-12)
        assert row["ultraep/summary/imbalance_before_max"] == max(before)
        assert row["ultraep/summary/imbalance_after_mean"] == pytest.approx(sum(after) / 4, rel=1e-12)
        assert row["ultraep/summary/imbalance_after_max"] == max(after)
        stats = record["balancer"].values()
        assert row["ultraep/summary/memory_spread_after_max"] == max(v["memory_spread_after"] for v in stats)
        assert row["ultraep/summary/balanced_fraction_mean"] == pytest.approx(
            sum(v["balanced_fraction"] for v in stats) / 4, rel=1e-12)
        # The recipe's skewed router, balanced: the figures are not trivially equal.
        assert max(after) < 1.05 < max(before)


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
            assert data["imbalance_after"][layer - 1, t] == \
                record["balancer"][str(layer)]["imbalance_after"]
    image = history[CHECKPOINT_ITERATION][HEATMAP_METRIC]
    assert image["_type"] == "image-file"
    assert image["sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
    logged = wandb_run_file(tiny_balanced_run.run_dir / "wandb").parent / "files" / image["path"]
    assert logged.read_bytes() == png.read_bytes()
    # Only at the checkpoint / last iteration.
    assert all(HEATMAP_METRIC not in row for step, row in history.items() if step != CHECKPOINT_ITERATION)


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
