"""How every figure of the project is drawn, and the one figure a training run draws too: matplotlib
on the Agg backend, one colour map for load relative to the mean, integer ticks on counted axes
(ranks, layers, iterations, slots), saving, and the layer x iteration heatmap of max/mean load
(:func:`render_heatmap`) that the training dashboards (``megatron/run/dashboards.py``) log and ``ultraep
replay`` writes.

Nothing of the planner or of the offline comparisons: what a balancer looks like in them (its
colour and label) is :mod:`.plotting`'s. matplotlib is imported on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = [
    "LOAD_COLORS",
    "index_ticks",
    "integer_ticks",
    "load_colors",
    "pyplot",
    "render_heatmap",
    "save_figure",
]

#: Load relative to the mean, 1.0 = the mean (balanced): blue below, white at 1.0, red above
#: (ColorBrewer RdBu). Figures of max/mean, never below 1, use the white-to-red half.
LOAD_COLORS = ("#053061", "#2166ac", "#92c5de", "#ffffff", "#f4a582", "#d6604d", "#67001f")


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def load_colors(vmax: float, *, below_mean: bool):
    """(colormap, norm) for load / mean with white at 1.0.

    Args:
        vmax: the largest value shown (at least a little above 1).
        below_mean: the data go below the mean (load / mean, 0 at the bottom); else they are
            max / mean figures (1 at the bottom: the white-to-red half).
    """
    from matplotlib.colors import LinearSegmentedColormap, Normalize, TwoSlopeNorm

    vmax = max(float(vmax), 1.05)
    if below_mean:  # an odd number of entries: the middle one, 1.0, is exactly white
        return (
            LinearSegmentedColormap.from_list("ultraep_load", LOAD_COLORS, N=255),
            TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
        )
    return (
        LinearSegmentedColormap.from_list("ultraep_imbalance", LOAD_COLORS[3:], N=128),
        Normalize(vmin=1.0, vmax=vmax),
    )


def integer_ticks(*axes) -> None:
    """Only whole numbers as major ticks on these ``Axis`` objects (ax.xaxis, ax.yaxis)."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def index_ticks(axis, values: Sequence[int], max_ticks: int = 12) -> None:
    """Label an image axis whose cells are ``values`` (layer or iteration numbers, increasing, not
    necessarily contiguous): ticks at the cells of round values, labelled with the values."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

    values = [int(v) for v in values]
    position = {v: i for i, v in enumerate(values)}
    wanted = (
        MaxNLocator(nbins=max_ticks, integer=True).tick_values(values[0], values[-1])
        if values
        else []
    )
    ticks = [position[int(t)] for t in wanted if t == int(t) and int(t) in position]
    if len(ticks) < min(2, len(values)):  # sparse values: every k-th cell
        ticks = list(range(0, len(values), max(1, -(-len(values) // max_ticks))))
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(
        FuncFormatter(
            lambda x, _: str(values[int(round(x))]) if 0 <= round(x) < len(values) else ""
        )
    )


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Lay out (unless the figure has a layout engine), write and close ``fig``; returns ``path``."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def render_heatmap(
    iterations,
    layers,
    panels: Sequence[tuple[str, np.ndarray]],
    path: str | Path,
    title: str = "",
    xlabel: str = "iteration",
) -> Path:
    """Layer x iteration heatmaps of max/mean load, one panel each, one colour scale (white = 1.0,
    balanced; red = the busiest EP rank's excess), every layer a row.

    Args:
        iterations: [T] iteration numbers (columns).
        layers: [L] layer numbers (rows; any, e.g. MoE layers only).
        panels: (title, [L, T] max/mean per EP rank, NaN where missing) per panel.
        path: output PNG.
        title: figure title.
        xlabel: what a column is.

    Returns:
        ``path``.
    """
    plt = pyplot()
    finite = [m[np.isfinite(m)] for _, m in panels]
    vmax = max([float(f.max()) for f in finite if f.size] or [1.0])
    cmap, norm = load_colors(vmax, below_mean=False)
    width = min(7.0 + 0.03 * len(iterations), 14.0)
    height = min(1.3 + 0.12 * len(layers), 5.0)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, 0.9 + height * len(panels)),
        squeeze=False,
        sharex=True,
        constrained_layout=True,
    )
    image = None
    for ax, (name, matrix) in zip(axes[:, 0], panels):
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("MoE layer")
        index_ticks(ax.yaxis, layers, max_ticks=min(len(layers), 12))
        index_ticks(ax.xaxis, iterations)
    axes[-1, 0].set_xlabel(xlabel)
    colorbar = fig.colorbar(image, ax=axes[:, 0].tolist(), shrink=min(1.0, 0.6 + 0.2 * len(panels)))
    colorbar.set_label("max / mean tokens\nper EP rank (1 = balanced)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=100)
