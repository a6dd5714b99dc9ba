"""Dashboards of a balanced MoE training run: what people look at rather than read.

Telemetry (``telemetry.py``) already writes one scalar per MoE layer and iteration to Megatron's
tensorboard and wandb writers (``moe/load_imbalance/layer_NN``, the load before balancing, and, for
balanced runs, ``ultraep/<metric>/layer_NN`` for every ``telemetry.LOGGED_BALANCER_METRICS``:
imbalance after, replicas, fan-out, in-flight ratio, plan time, the share of microbatches balanced
at all (``balanced_fraction``, below 1 when ``--moe-balancer-trigger`` skips some) and replicas
crossing an NVLink domain; wandb groups them by the metric path). On the last rank, after those,
:class:`Dashboard` adds:

* ``ultraep/summary/imbalance_{before,after}_{mean,max}``: the same figures over all MoE layers,
  one line each instead of one per layer (the ``_max`` lines are also the activation-memory peak of
  the worst layer, paper Fig. 14: a rank computes exactly the rows it receives), and
  ``balanced_fraction_mean``;
* an imbalance heatmap, MoE layer x iteration, before and after balancing (matplotlib), logged
  to wandb as the image ``ultraep/imbalance_heatmap`` and written next to the checkpoint
  (``<--save>/ultraep_imbalance_iter_NNNNNNN.png`` with its data in ``.npz``) whenever Megatron
  saves one, and at the last iteration;
* the model FLOPs of the iteration by Megatron's own formula
  (``megatron.training.training.num_floating_point_operations``), returned for the
  ``--metrics-jsonl`` record so that TFLOP/s/GPU can be recomputed at full precision.

"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Optional

from ultraep_megatron.analysis.figures import render_heatmap

#: wandb image key of the heatmap.
HEATMAP_METRIC = "ultraep/imbalance_heatmap"
#: Prefix of the all-layer summaries.
SUMMARY_PREFIX = "ultraep/summary"
#: File name stem of heatmaps written next to checkpoints.
HEATMAP_STEM = "ultraep_imbalance_iter_"


class ImbalanceHistory:
    """Per-layer imbalance of the most recent iterations, before and after balancing.

    Args:
        max_iterations: iterations kept (older ones are dropped, so a long run's memory stays
            bounded and its heatmap shows the recent window).
    """

    def __init__(self, max_iterations: int = 2000):
        if max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1, got {max_iterations}")
        self.max_iterations = max_iterations
        # iteration -> (before {layer: value}, after {layer: value} or None)
        self._rows: "OrderedDict[int, tuple[dict[int, float], Optional[dict[int, float]]]]" = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._rows)

    def add(
        self,
        iteration: int,
        before: Mapping[int, float],
        after: Optional[Mapping[int, float]] = None,
    ) -> None:
        """Record one iteration: {1-based layer: max/mean rank load} before (router) and after
        balancing (``None`` for an unbalanced run)."""
        self._rows[int(iteration)] = (dict(before), None if after is None else dict(after))
        self._rows.move_to_end(int(iteration))
        while len(self._rows) > self.max_iterations:
            self._rows.popitem(last=False)

    def matrices(self):
        """The history as arrays.

        Returns:
            (iterations [T] int64, layers [L] int64, before [L, T] float64, after [L, T] float64
            or None when no iteration was balanced); NaN where a layer has no figure.
        """
        import numpy as np

        iterations = np.array(list(self._rows), dtype=np.int64)
        layers = sorted(
            {
                layer
                for before, after in self._rows.values()
                for layer in list(before) + list(after or {})
            }
        )
        row = {layer: i for i, layer in enumerate(layers)}
        before = np.full((len(layers), len(iterations)), np.nan)
        balanced = any(after is not None for _, after in self._rows.values())
        after_m = np.full_like(before, np.nan) if balanced else None
        for t, (b, a) in enumerate(self._rows.values()):
            for layer, value in b.items():
                before[row[layer], t] = value
            for layer, value in (a or {}).items():
                after_m[row[layer], t] = value
        return iterations, np.array(layers, dtype=np.int64), before, after_m


def log_scalars(
    scalars: Mapping[str, float], iteration: int, writer: Any = None, wandb_writer: Any = None
) -> None:
    """Write ``scalars`` to Megatron's tensorboard writer and, as one step, its wandb writer
    (either may be ``None`` when that logger is off)."""
    if not scalars:
        return
    if writer:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer:
        wandb_writer.log(dict(scalars), iteration)


def layer_summary(values: Mapping[int, float]) -> tuple[float, float]:
    """(mean, max) over layers of {layer: value}; NaN for no layers."""
    if not values:
        return math.nan, math.nan
    data = list(values.values())
    return sum(data) / len(data), max(data)


class Dashboard:
    """Per-iteration dashboard figures of one training run (lives on the logging rank).

    Args:
        args: Megatron's arguments (``--save``/``--save-interval``, ``--train-iters``,
            ``--exit-interval``, ``--tensorboard-dir``, ``--wandb-save-dir``).
        max_iterations: iterations the heatmap keeps.
    """

    def __init__(self, args: Any, max_iterations: int = 2000):
        self.args = args
        self.history = ImbalanceHistory(max_iterations)
        self._flops: Optional[float] = None
        self._batch_size: Optional[int] = None
        self._warned = False

    # -- what telemetry calls ------------------------------------------------------------------

    def after_iteration(
        self,
        iteration: int,
        imbalance: Mapping[int, float],
        balancer_stats: Optional[Mapping[int, Mapping[str, float]]],
        writer: Any = None,
        wandb_writer: Any = None,
    ) -> dict:
        """Log the summaries (and, when due, the heatmap) for ``iteration``.

        Args:
            iteration: Megatron's iteration number.
            imbalance: {layer: max/mean rank load} from the router (telemetry's figure).
            balancer_stats: {layer: {metric: value}} of the balanced layers, or None.
            writer, wandb_writer: Megatron's tensorboard / wandb writers (None when off).

        Returns:
            Extra fields for the iteration's ``--metrics-jsonl`` record: ``flops_per_iteration``
            (Megatron's model-FLOPs count of the global batch) and ``world_size``.
        """
        after = None
        if balancer_stats:
            after = {layer: float(v["imbalance_after"]) for layer, v in balancer_stats.items()}
            # The balancer's own pre-balancing figure wherever the router hook has none.
            before = {layer: float(v["imbalance_before"]) for layer, v in balancer_stats.items()}
            before.update(imbalance)
        else:
            before = dict(imbalance)
        if before:
            self.history.add(iteration, before, after)
            scalars = {}
            (
                scalars[f"{SUMMARY_PREFIX}/imbalance_before_mean"],
                scalars[f"{SUMMARY_PREFIX}/imbalance_before_max"],
            ) = layer_summary(before)
            if after is not None:
                (
                    scalars[f"{SUMMARY_PREFIX}/imbalance_after_mean"],
                    scalars[f"{SUMMARY_PREFIX}/imbalance_after_max"],
                ) = layer_summary(after)
                scalars[f"{SUMMARY_PREFIX}/balanced_fraction_mean"] = layer_summary(
                    {layer: float(v["balanced_fraction"]) for layer, v in balancer_stats.items()}
                )[0]
            log_scalars(scalars, iteration, writer, wandb_writer)
        if len(self.history) and self.heatmap_due(iteration):
            self._guarded(self.write_heatmap, iteration, wandb_writer)
        return {
            "flops_per_iteration": self.flops_per_iteration(),
            "world_size": int(self.args.world_size),
        }

    # -- pieces --------------------------------------------------------------------------------

    def heatmap_due(self, iteration: int) -> bool:
        """At every checkpoint save and at the run's last iteration."""
        a = self.args
        saving = (
            bool(getattr(a, "save", None))
            and bool(getattr(a, "save_interval", None))
            and iteration % a.save_interval == 0
        )
        exit_interval = getattr(a, "exit_interval", None)
        last = iteration == getattr(a, "train_iters", None) or bool(
            exit_interval and iteration % exit_interval == 0
        )
        return saving or last

    def heatmap_dir(self) -> Optional[Path]:
        """Where heatmap files go: next to the checkpoints, else the tensorboard / wandb dir."""
        for name in ("save", "tensorboard_dir", "wandb_save_dir"):
            value = getattr(self.args, name, None)
            if value:
                return Path(value)
        return None

    def write_heatmap(self, iteration: int, wandb_writer: Any = None) -> Optional[Path]:
        """Render the heatmap of the kept iterations; write PNG + NPZ and log the image."""
        import numpy as np

        iterations, layers, before, after = self.history.matrices()
        directory = self.heatmap_dir()
        if directory is None and not wandb_writer:
            return None
        title = (
            f"expert-load imbalance per MoE layer, iterations {iterations[0]}-{iterations[-1]}\n"
            f"--moe-balancer {getattr(self.args, 'moe_balancer', 'none')}"
        )
        if directory is not None:
            path = directory / f"{HEATMAP_STEM}{iteration:07d}.png"
        else:
            import tempfile

            path = (
                Path(tempfile.mkdtemp(prefix="ultraep_heatmap_"))
                / f"{HEATMAP_STEM}{iteration:07d}.png"
            )
        panels = [("before balancing (router)", before)]
        if after is not None:
            panels.append(("after balancing", after))
        render_heatmap(iterations, layers, panels, path, title)
        arrays = {"iterations": iterations, "layers": layers, "imbalance_before": before}
        if after is not None:
            arrays["imbalance_after"] = after
        np.savez(path.with_suffix(".npz"), **arrays)
        if wandb_writer:
            import wandb

            wandb_writer.log({HEATMAP_METRIC: wandb.Image(str(path), caption=title)}, iteration)
        return path

    def flops_per_iteration(self) -> Optional[float]:
        """Megatron's model FLOPs of the current global batch (cached per batch size)."""
        try:
            from megatron.core.num_microbatches_calculator import get_current_global_batch_size
            from megatron.training.training import num_floating_point_operations

            batch_size = get_current_global_batch_size()
            if batch_size != self._batch_size:
                # The formula normalizes a few args in place: give it a copy.
                self._flops = float(num_floating_point_operations(copy.copy(self.args), batch_size))
                self._batch_size = batch_size
        except Exception as error:  # never stop training over a figure
            self._warn(f"model FLOPs unavailable: {error!r}")
            return None
        return self._flops

    def _guarded(self, function, *args):
        try:
            return function(*args)
        except Exception as error:  # never stop training over a plot; say so once
            self._warn(f"imbalance heatmap failed: {error!r}")
            return None

    def _warn(self, message: str) -> None:
        if not self._warned:
            print(f" [ultraep dashboards] WARNING: {message}", flush=True)
            self._warned = True
