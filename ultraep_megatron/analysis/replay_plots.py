"""The figures of ``ultraep replay``: imbalance over time per layer and as a layer x iteration
heatmap, load heatmaps, EPLB under stale history, and the estimated layer time. Colours and colour
maps: :mod:`.plotting` and :mod:`.figures`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ultraep_megatron.planner.baselines import registry

from . import figures, plotting
from .replay import ReplayResult
from .summary import cost_summary, metric_summary, staleness_summary
from .tables import ESTIMATE

__all__ = ["layer_iteration_means", "plot_replay"]


def _pick_layers(layers: Sequence[int], count: int) -> list[int]:
    if len(layers) <= count:
        return list(layers)
    idx = np.linspace(0, len(layers) - 1, count).round().astype(int)
    return [layers[i] for i in sorted(set(idx))]


def layer_iteration_means(
    result: ReplayResult, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(iterations [T], layers [L], [L, T] mean of ``values`` [N] over the microbatches and EP groups
    of each layer and iteration; NaN where a layer has no record)."""
    k = result.keys
    iterations, t = np.unique(k["iteration"], return_inverse=True)
    layers, l = np.unique(k["layer"], return_inverse=True)
    sums = np.zeros((len(layers), len(iterations)))
    counts = np.zeros_like(sums)
    np.add.at(sums, (l, t), values)
    np.add.at(counts, (l, t), 1)
    with np.errstate(invalid="ignore"):
        return iterations, layers, sums / counts


def _plan_term(result) -> str:
    """How the estimate's plan term was charged: a fixed time given for the hardware estimated
    (``--plan-time-us``), or left out (never this machine's measured plan time)."""
    charged = [float(np.max(c["plan"])) for c in result.costs.values() if len(c["plan"])]
    top = max(charged, default=0.0)
    return f"plan time {top * 1e6:g} us charged" if top > 0 else "plan time left out"


def plot_replay(
    result: ReplayResult,
    labels: Sequence[str],
    plot_dir: Path,
    heatmap_layers: Optional[Sequence[int]] = None,
    cost: bool = True,
) -> list[Path]:
    """PNG files: imbalance over time per layer (up to 16 layers) and as a layer x iteration
    heatmap (every layer), load heatmaps, EPLB staleness, estimated layer time (with ``cost``, when
    the replay carries the cost model and its estimate applies). Colours: one per
    balancer (``registry.COLORS``); loads relative to the mean white at 1.0, as in the
    training dashboards. Returns the paths."""
    plt = figures.pyplot()
    written = []
    balanced = [
        label
        for label in labels
        if result.balancers[label].name not in (registry.NONE, registry.IDEAL)
    ]
    before = result.metrics[labels[0]]["imbalance_before"]

    layers = _pick_layers(result.layers, 16)
    cols = int(np.ceil(np.sqrt(len(layers))))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.6 * cols + 0.6, 2.5 * rows + 1.0),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    top = 1.0
    for ax, layer in zip(axes.flat, layers):
        mask = result.keys["layer"] == layer
        x = np.arange(int(mask.sum()))
        ax.axhline(1.0, color="0.8", lw=0.8, zorder=0)
        ax.plot(
            x,
            before[mask],
            color=plotting.balancer_color(registry.NONE),
            lw=1,
            label=f"{registry.NONE} (before balancing)",
        )
        for label in balanced:
            ax.plot(
                x,
                result.metrics[label]["imbalance_after"][mask],
                lw=1.3,
                color=plotting.balancer_color(label),
                label=label,
            )
        top = max(top, float(before[mask].max()))
        ax.set_title(f"layer {layer}", fontsize=9)
        figures.integer_ticks(ax.xaxis)
    axes[0, 0].set_ylim(0.9, top + 0.05 * (top - 0.9))  # 1.0 (balanced) clear of the axis
    for ax in axes.flat[len(layers) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("max/mean rank load")
    for ax in axes[-1, :]:
        ax.set_xlabel("microbatch (trace order)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles, names, loc="outside lower center", ncol=len(names), fontsize=8, frameon=False
    )
    shown = (
        ""
        if len(layers) == len(result.layers)
        else f" ({len(layers)} of {len(result.layers)} layers; every layer: imbalance_heatmap.png)"
    )
    fig.suptitle(f"Rank imbalance over time per layer, replayed{shown}", fontsize=10)
    written.append(figures.save_figure(fig, plot_dir / "imbalance_over_time.png"))

    iterations, layer_ids, mean_before = layer_iteration_means(result, before)
    panels = [(f"{registry.NONE} (before balancing)", mean_before)]
    panels += [
        (
            f"{label} (after balancing)",
            layer_iteration_means(result, result.metrics[label]["imbalance_after"])[2],
        )
        for label in balanced
    ]
    written.append(
        figures.render_heatmap(
            iterations,
            layer_ids,
            panels,
            plot_dir / "imbalance_heatmap.png",
            "Rank imbalance per layer and iteration (mean over microbatches), replayed",
        )
    )

    if result.expert_load is not None:
        for layer in heatmap_layers or _pick_layers(result.layers, 3):
            mask = result.keys["layer"] == layer
            if not mask.any():
                continue
            expert = result.expert_load[mask].astype(np.float64)
            share = expert / np.maximum(expert.sum(1, keepdims=True), 1) * result.num_experts
            panels = [("expert load / mean", share.T, "expert")]
            for name, title in (
                (registry.NONE, "rank load / mean, no balancing"),
                (registry.ULTRAEP, "rank load / mean, ultraep"),
            ):
                label = result.label_of(name)
                if label is not None:
                    ranks = result.rank_load[label][mask].astype(np.float64)
                    panels.append(
                        (
                            title,
                            (ranks / np.maximum(ranks.mean(1, keepdims=True), 1e-9)).T,
                            "EP rank",
                        )
                    )
            fig, axes = plt.subplots(
                1,
                len(panels),
                figsize=(4.6 * len(panels) + 0.8, 3.6),
                squeeze=False,
                layout="constrained",
            )
            # Rank panels share one colour scale (before/after comparable); experts get their own.
            rank_max = max([float(p[1].max()) for p in panels[1:]] or [1.0])
            for ax, (title, data, ylabel) in zip(axes[0], panels):
                cmap, norm = figures.load_colors(
                    float(data.max()) if ylabel == "expert" else rank_max, below_mean=True
                )
                im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("microbatch (trace order)")
                ax.set_ylabel(ylabel)
                figures.integer_ticks(ax.xaxis, ax.yaxis)
                fig.colorbar(im, ax=ax).set_label("load / mean (1 = the mean)", fontsize=8)
            fig.suptitle(f"Layer {layer}: load heatmaps (white = the mean load)", fontsize=10)
            written.append(figures.save_figure(fig, plot_dir / f"load_heatmap_layer{layer}.png"))

    stale = [r for r in staleness_summary(result) if r["label"] not in labels]
    if stale:
        summary = metric_summary(result)
        fig, ax = plt.subplots(figsize=(8.4, 4.0), layout="constrained")
        x = [r["interval"] for r in stale]
        eplb = plotting.balancer_color(registry.EPLB)
        ax.plot(
            x, [r["imbalance_mean"] for r in stale], "o-", color=eplb, label="eplb on history, mean"
        )
        ax.plot(
            x, [r["imbalance_p95"] for r in stale], "s--", color=eplb, label="eplb on history, p95"
        )
        for name, style in (
            (registry.NONE, ":"),
            (registry.EPLB_EXACT, "-."),
            (registry.ULTRAEP, "-"),
        ):
            label = result.label_of(name)
            if label in labels:
                ax.axhline(
                    summary[label]["imbalance_mean"],
                    ls=style,
                    lw=1.2,
                    color=plotting.balancer_color(label),
                    label=f"{label} mean",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(i) for i in x])
        ax.minorticks_off()
        ax.set_xlabel("EPLB re-plan interval (microbatches of a layer; window = interval)")
        ax.set_ylabel("rank imbalance after (max/mean)")
        ax.set_title("How stale history hurts EPLB (replayed)", fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # clear of the curves
        written.append(figures.save_figure(fig, plot_dir / "eplb_staleness.png"))

    if cost and result.costs is not None:
        fig, ax = plt.subplots(
            figsize=(max(8.0, 0.5 * len(result.layers) + 3.5), 4.0), layout="constrained"
        )
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            totals = [
                cost_summary(result, result.keys["layer"] == layer)[label]["total_ms"]
                for layer in result.layers
            ]
            ax.bar(
                np.arange(len(result.layers)) + i * width,
                totals,
                width,
                label=label,
                color=plotting.balancer_color(label),
            )
        ax.set_xticks(
            np.arange(len(result.layers)) + 0.4 - width / 2, [str(layer) for layer in result.layers]
        )
        ax.set_xlabel("layer")
        ax.set_ylabel("ms per invocation (fwd+bwd)")
        ax.set_title(
            f"{ESTIMATE}: MoE layer time per balancer (cost model, {_plan_term(result)})",
            fontsize=10,
        )
        ax.legend(
            fontsize=8,
            ncol=len(labels),
            loc="lower center",
            bbox_to_anchor=(0.5, 1.08),
            frameon=False,
        )
        written.append(figures.save_figure(fig, plot_dir / "estimated_layer_time.png"))
    return written
