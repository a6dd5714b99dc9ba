"""Every kind of figure the tools write, drawn by the tools' own code and checked for what can be
checked: counted axes (ranks, layers, iterations, microbatches, experts, slots) carry whole-number
ticks only; every title, label, legend entry and tick label lies inside the figure and no two of
them overlap; each balancer has one colour, the same in every figure; every layer of a model shows.

Figures: the training heatmap (balanced and `none`, from the shared product run's records),
`ultraep replay` (imbalance over time, the layer x iteration heatmap, load heatmaps, EPLB
staleness, estimated layer time; also on a 20-layer trace), `ultraep advise` (advisor.png) and the
resume experiment (comparison.png, with a failed run)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot  # noqa: F401  (matplotlib.pyplot below)
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from ultraep_megatron import traces
from ultraep_megatron.analysis import resume_experiment as rx
from ultraep_megatron.analysis import resume_runs
from ultraep_megatron.analysis.plotting import COLORS as BALANCER_COLORS, balancer_of
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK
from ultraep_megatron.megatron.run.dashboards import Dashboard

from product_runs import REPO

KJV = REPO / "tests" / "traces" / "data" / "kjv_tiny.uetrace"
PROJECTION = ["--hidden-size", "4096", "--moe-ffn-hidden-size", "1536", "--load-scale", "16"]
# Axis labels of counted quantities (colour bars and ratios start otherwise: "max / mean ...").
COUNTED_AXIS = re.compile(
    r"^(iteration|EP rank|MoE layer|layer|microbatch|expert|redundant slots|EPLB re-plan interval)"
)
INTEGER = re.compile(r"^-?\d+$")


@pytest.fixture
def drawn(monkeypatch):
    """{file name: Figure} of every figure saved while the fixture is active."""
    figures: dict[str, Figure] = {}
    save = Figure.savefig

    def recording_savefig(fig, path, *args, **kwargs):
        figures[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return figures


def _all_axes(fig: Figure):
    for ax in fig.axes:
        yield ax
        yield from ax.child_axes  # secondary axes


def _tick_labels(axis):
    """The tick labels drawn on ``axis``: visible, non-empty, inside the view interval."""
    low, high = sorted(axis.get_view_interval())
    span = (high - low) * 1e-9
    return [
        tick.label1
        for tick in axis.get_major_ticks()
        if tick.label1.get_visible()
        and tick.label1.get_text().strip()
        and low - span <= tick.get_loc() <= high + span
    ]


def _texts(fig: Figure):
    """(what, Text) of every text drawn in ``fig``."""
    if fig._suptitle is not None:
        yield "suptitle", fig._suptitle
    for legend in fig.legends:
        yield from (("figure legend", t) for t in legend.get_texts())
    for ax in _all_axes(fig):
        if not ax.get_visible() or not ax.axison:
            continue
        for what, text in (
            ("title", ax.title),
            ("xlabel", ax.xaxis.label),
            ("ylabel", ax.yaxis.label),
        ):
            yield what, text
        yield from (("annotation", t) for t in ax.texts)
        if ax.get_legend() is not None:
            yield from (("legend", t) for t in ax.get_legend().get_texts())
        for axis in (ax.xaxis, ax.yaxis):
            yield from (("tick", t) for t in _tick_labels(axis))


def figure_problems(name: str, fig: Figure) -> list[str]:
    """What is wrong with ``fig`` as saved: clipped or overlapping texts, fractional ticks on a
    counted axis."""
    canvas = FigureCanvasAgg(fig)  # closing the figure detached its canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    problems, boxes = [], []
    for what, text in _texts(fig):
        if not text.get_visible() or not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5:
            problems.append(f"{name}: {what} {text.get_text()!r} clipped by the figure bounds")
        boxes.append((what, text.get_text(), box))
    for (w1, t1, b1), (w2, t2, b2) in itertools.combinations(boxes, 2):
        if (
            b1.overlaps(b2)
            and b1.intersection(b1, b2).width > 1
            and b1.intersection(b1, b2).height > 1
        ):
            problems.append(f"{name}: {w1} {t1!r} overlaps {w2} {t2!r}")
    counted = 0
    for ax in _all_axes(fig):
        for axis in (ax.xaxis, ax.yaxis):
            if COUNTED_AXIS.match(axis.label.get_text()) and ax.axison:
                labels = [t.get_text().replace("\N{MINUS SIGN}", "-") for t in _tick_labels(axis)]
                counted += 1
                if not labels or not all(INTEGER.match(x) for x in labels):
                    problems.append(f"{name}: {axis.label.get_text()!r} ticks {labels}")
    if counted == 0:
        problems.append(f"{name}: no counted axis checked")
    return problems


def balancer_colors(fig: Figure) -> dict[str, set[str]]:
    """{balancer: colours it is drawn in} over the labelled lines and bars of ``fig``."""
    used: dict[str, set[str]] = {}
    for ax in _all_axes(fig):
        artists = [(line.get_label(), line.get_color()) for line in ax.lines]
        artists += [
            (bars.get_label(), patch.get_facecolor()) for bars in ax.containers for patch in bars
        ]
        for label, color in artists:
            if label and not label.startswith("_") and balancer_of(label) in BALANCER_COLORS:
                used.setdefault(balancer_of(label), set()).add(to_hex(color))
    return used


@pytest.fixture(scope="module")
def twenty_layer_trace(tmp_path_factory):
    return traces.write_synthetic_trace(
        tmp_path_factory.mktemp("plots") / "deep.uetrace",
        num_iterations=3,
        num_microbatches=2,
        num_layers=20,
        num_ranks=4,
        num_experts=16,
        tokens_per_rank=64,
        topk=2,
        seed=1,
        meta={"hidden_size": 4096, "moe_ffn_hidden_size": 1536, "swiglu": True},
    )


def _dashboard_heatmap(run, balancer: str, out: Path) -> None:
    class Args:
        save, save_interval, train_iters, exit_interval = str(out), 2, 2, None
        tensorboard_dir = wandb_save_dir = None
        moe_balancer = balancer

    dashboard = Dashboard(Args)
    for iteration, record in sorted(run.records.items()):
        before = {int(k): v for k, v in record["load_imbalance"].items()}
        after = {int(k): v["imbalance_after"] for k, v in record["balancer"].items()}
        dashboard.history.add(iteration, before, after if balancer != "none" else None)
    assert dashboard.write_heatmap(2) is not None


@pytest.mark.slow
def test_every_plot_type_is_readable_and_uses_one_colour_per_balancer(
    tiny_balanced_run, twenty_layer_trace, drawn, tmp_path, capsys
):
    assert (
        main(
            [
                "replay",
                str(twenty_layer_trace),
                "--balancers",
                "none,ultraep",
                "--no-staleness",
                "--no-cost",
                "--output-dir",
                str(tmp_path / "deep"),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    deep = {name: drawn.pop(name) for name in ("imbalance_over_time.png", "imbalance_heatmap.png")}
    drawn.clear()  # its load heatmaps: the KJV replay's follow
    assert (
        main(
            [
                "replay",
                str(KJV),
                "--max-records",
                "120",
                *PROJECTION,
                "--output-dir",
                str(tmp_path / "replay"),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    assert (
        main(
            [
                "advise",
                str(KJV),
                "--max-records",
                "80",
                *PROJECTION,
                "--slots",
                "0,1,2",
                "--eplb-exact",
                "--output-dir",
                str(tmp_path / "advise"),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    capsys.readouterr()
    for balancer in ("ultraep", "none"):
        _dashboard_heatmap(tiny_balanced_run, balancer, tmp_path / balancer)
        drawn[f"training heatmap ({balancer})"] = drawn.pop("ultraep_imbalance_iter_0000002.png")
    rx.plot(*_resume_runs(), tmp_path, 1, "resume of iteration 2, 3 iterations (1 warm-up)")
    expected = {
        "training heatmap (ultraep)",
        "training heatmap (none)",
        "imbalance_over_time.png",
        "imbalance_heatmap.png",
        "load_heatmap_layer1.png",
        "load_heatmap_layer3.png",
        "load_heatmap_layer4.png",
        "eplb_staleness.png",
        "estimated_layer_time.png",
        "advisor.png",
        "comparison.png",
    }
    assert set(drawn) == expected
    problems = [
        p
        for name, fig in {**drawn, **{f"{k} (20 layers)": v for k, v in deep.items()}}.items()
        for p in figure_problems(name, fig)
    ]
    assert problems == []
    # One colour per balancer, the same in every figure, and no two balancers alike.
    used: dict[str, set[str]] = {}
    for fig in drawn.values():
        for name, colors in balancer_colors(fig).items():
            used.setdefault(name, set()).update(colors)
    assert {name: colors for name, colors in used.items()} == {
        name: {to_hex(BALANCER_COLORS[name])} for name in used
    }
    assert {"none", "eplb", "eplb-exact", "ultraep", "ideal"} <= set(used)
    assert len(set(BALANCER_COLORS.values())) == len(BALANCER_COLORS)
    # Every layer shows: 16 of 20 in the small multiples (saying so), all 20 in the heatmap.
    over_time = deep["imbalance_over_time.png"]
    assert (
        sum(ax.axison for ax in over_time.axes) == 16
        and "16 of 20 layers" in over_time._suptitle.get_text()
    )
    heatmap_rows = [
        ax.images[0].get_array().shape[0] for ax in deep["imbalance_heatmap.png"].axes if ax.images
    ]
    assert heatmap_rows == [20, 20]


def test_colour_maps_put_white_at_the_mean():
    """Load / mean and max / mean share one convention: 1.0 (balanced) is white, above it red,
    below it blue; the max/mean map is the upper half of the load map."""
    from ultraep_megatron.analysis.figures import load_colors

    load_cmap, load_norm = load_colors(4.0, below_mean=True)
    imb_cmap, imb_norm = load_colors(4.0, below_mean=False)
    assert to_hex(load_cmap(load_norm(1.0))) == to_hex(imb_cmap(imb_norm(1.0))) == "#ffffff"
    for value in (1.5, 2.5, 4.0):
        assert np.allclose(load_cmap(load_norm(value)), imb_cmap(imb_norm(value)), atol=0.01)
        red, green, blue, _ = load_cmap(load_norm(value))
        assert red > blue
    red, green, blue, _ = load_cmap(load_norm(0.3))
    assert blue > red


def _resume_runs():
    """Three measured runs and a failed one, as the resume experiment summarizes them."""
    results = []
    for balancer, ms, after in (
        ("none", 900.0, 2.0),
        ("eplb", None, None),
        ("ultraep", 700.0, 1.0),
        ("ideal", 650.0, 1.0),
    ):
        run = resume_runs.RunResult(
            balancer, "ok" if ms else "failed: exit code 1", Path("/tmp") / balancer, []
        )
        for iteration in (3, 4, 5) if ms else ():
            run.iterations.append(
                resume_runs.IterationStat(
                    iteration,
                    ms * (1 + 0.01 * iteration),
                    None,
                    6.9,
                    3.2e9,
                    4,
                    {layer: 2.0 for layer in range(1, 5)},
                    {layer: after + 0.01 * layer for layer in range(1, 5)},
                )
            )
        results.append(run)
    return rx.summarize(results, 1), results


def test_the_checks_catch_what_the_issue_saw():
    """Negative control: the faults of the old figures (fractional rank ticks -0.5 ... 3.5, a
    colour-bar label cut by a short figure, ultraep in another balancer's colour) are found."""
    plt = matplotlib.pyplot
    fig, (heat, curve) = plt.subplots(1, 2, figsize=(5, 1.6))
    image = heat.imshow(np.random.default_rng(0).random((4, 30)), aspect="auto")
    heat.set_ylabel("EP rank")
    heat.set_yticks([-0.5, 0.5, 1.5, 2.5, 3.5])
    fig.colorbar(image, ax=heat, label="max / mean tokens per EP rank")
    curve.plot([1, 2, 3], [1.2, 1.0, 1.0], color="tab:orange", label="ultraep")
    curve.set_xlabel("iteration")
    problems = figure_problems("old", fig)
    assert any("'EP rank' ticks" in p for p in problems), problems
    assert any("clipped" in p and "max / mean tokens per EP rank" in p for p in problems), problems
    assert (
        balancer_colors(fig)
        == {"ultraep": {to_hex("tab:orange")}}
        != {"ultraep": {BALANCER_COLORS["ultraep"]}}
    )
    plt.close(fig)
