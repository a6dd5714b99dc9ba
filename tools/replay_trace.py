#!/usr/bin/env python
"""Replay a recorded routing trace through each balancer and estimate what each one buys.

    python tools/replay_trace.py TRACE_DIR_OR_FILES [--balancers none,eplb,eplb-exact,ultraep,ideal]
        [--moe-balancer-num-slots 2] [--moe-balancer-min-quota auto|hw|N]
        [--moe-balancer-eplb-window 16] [--moe-balancer-eplb-interval 16]
        [--staleness-intervals 1,2,4,8,16,32] [--plot-dir DIR] [--json-out FILE]
        [--hidden-size H --moe-ffn-hidden-size F --swiglu] [--scale-up-bandwidth 900 ...]

Prints, per layer and overall: imbalance (max/mean rank load), replicas, fan-out and in-flight
ratio of every balancer; how EPLB degrades as its history goes stale (the paper's Fig. 6); and
an ESTIMATE of per-layer forward/backward time from a cost model (ultraep_megatron.costmodel),
as a fraction of the force-balanced ideal and as speedup over no balancing. Traces are written by
``--moe-balancer-trace-dir`` (docs/traces.md). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ultraep_megatron import costmodel as cm  # noqa: E402
from ultraep_megatron import traces  # noqa: E402

ESTIMATE = "ESTIMATE"


# ---------------------------------------------------------------------------------------------
# Shared CLI pieces (tools/slot_advisor.py imports them)
# ---------------------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def min_quota_arg(text: str):
    """'auto' (planner default), 'hw' (from the hardware) or an int >= 1."""
    if text in ("auto", "hw"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'hw' or an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"min quota must be >= 1, got {value}")
    return value


def add_input_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", help="trace files, or directories of *.uetrace files (one per EP group)")
    group = parser.add_argument_group("trace selection")
    group.add_argument("--layers", type=int_list, default=None, help="only these layer numbers (comma-separated)")
    group.add_argument("--max-records", type=int, default=None,
                       help="stop after this many records per trace file")
    group.add_argument("--load-scale", type=float, default=1.0,
                       help="multiply every load by this (e.g. project a small run onto a production "
                       "microbatch size; costs scale, balance barely does)")
    group.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def add_model_hardware_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model shape (default: the trace's meta, else a Qwen3-235B-A22B expert)")
    model.add_argument("--hidden-size", type=int, default=None)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    model.add_argument("--swiglu", dest="swiglu", action="store_true", default=None, help="gated experts (3 matrices)")
    model.add_argument("--no-swiglu", dest="swiglu", action="store_false", help="plain 2-matrix experts")
    model.add_argument("--param-bytes", type=int, default=None, help="bytes per weight moved to replicas (2)")
    model.add_argument("--grad-bytes", type=int, default=None, help="bytes per gradient reduced (4, fp32)")
    model.add_argument("--activation-bytes", type=int, default=None, help="bytes per token element on the wire (2)")
    hw = parser.add_argument_group("hardware (default: the UltraEP paper's rack, Table 2)")
    hw.add_argument("--scale-up-bandwidth", type=float, default=900.0, help="GB/s per GPU (900)")
    hw.add_argument("--peak-tflops", type=float, default=2250.0, help="bf16 TFLOP/s per GPU (2250)")
    hw.add_argument("--hbm-bandwidth", type=float, default=8.0, help="TB/s per GPU (8)")
    hw.add_argument("--compute-efficiency", type=float, default=1.0, help="achieved fraction of peak FLOP/s")
    hw.add_argument("--comm-efficiency", type=float, default=1.0, help="achieved fraction of scale-up bandwidth")
    hw.add_argument("--plan-time-us", type=float, default=None,
                    help="charge this plan time (us) to the exact-load balancers instead of the time "
                    "measured here (the planner runs on this host's CPU; the paper's GPU solver takes ~111 us)")
    hw.add_argument("--no-relay", action="store_true",
                    help="charge weight distribution without relay trees (both are always printed)")


def shape_and_hardware(args, meta: dict) -> tuple[cm.ExpertShape, str, cm.Hardware]:
    shape, source = cm.ExpertShape.from_meta(
        meta, hidden_size=args.hidden_size, ffn_hidden_size=args.moe_ffn_hidden_size, gated=args.swiglu,
        param_bytes=args.param_bytes, grad_bytes=args.grad_bytes, activation_bytes=args.activation_bytes)
    hardware = cm.Hardware(scale_up_gbps=args.scale_up_bandwidth, peak_tflops=args.peak_tflops,
                           hbm_tbps=args.hbm_bandwidth, compute_efficiency=args.compute_efficiency,
                           comm_efficiency=args.comm_efficiency)
    return shape, source, hardware


def resolve_min_quota(value, shape: cm.ExpertShape, hardware: cm.Hardware, *, training: bool = True) -> Optional[int]:
    if value == "auto":
        return None
    if value == "hw":
        return cm.min_quota_from_hardware(shape, hardware, training=training)
    return int(value)


class Progress:
    """A progress line on stderr: rewritten in place on a terminal, every few seconds otherwise."""

    def __init__(self, label: str, enabled: bool = True, stream=None):
        self.label, self.enabled = label, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last = self.start
        self.done = 0

    def __call__(self, done: int, total: int = 0) -> None:
        self.done = done
        now = time.perf_counter()
        if not self.enabled or now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        self._print(done, total, now - self.start)

    def _print(self, done: int, total: int, elapsed: float, end: str = "") -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        if total:
            eta = (total - done) / rate if rate > 0 else float("nan")
            text = f"[{self.label}] {done}/{total} records ({done / total:.0%}), {elapsed:.0f} s, ETA {eta:.0f} s"
        else:
            text = f"[{self.label}] {done} records, {elapsed:.0f} s"
        self.stream.write(("\r" + text + end) if self.tty else (text + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._print(self.done, 0, time.perf_counter() - self.start, end="\n" if self.tty else "")


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_inputs(files: Sequence[Path]) -> tuple[list[str], dict, int]:
    """Lines describing the trace files, the first file's meta and the number of committed records."""
    lines, meta, records = [], {}, 0
    for i, path in enumerate(files):
        reader = traces.TraceReader(path, on_truncated="ignore").scan()
        if i == 0:
            meta = reader.meta
        records += reader.committed_records
        tail = {"closed": "closed cleanly", "open": "still open (or the writer died between records)",
                "truncated": f"TRUNCATED tail of {reader.truncated_bytes} bytes ignored"}[reader.status]
        lines.append(f"  EP group {i}: {path} — R={reader.num_ranks}, E={reader.num_experts}, "
                     f"{reader.committed_records} loads in {reader.committed_iterations} iterations, {tail}"
                     + (f", {reader.uncommitted_records} uncommitted loads skipped" if reader.uncommitted_records else ""))
    return lines, meta, records


def fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


# ---------------------------------------------------------------------------------------------
# Replay report
# ---------------------------------------------------------------------------------------------

def build_specs(args, min_quota: Optional[int]) -> tuple[list[cm.BalancerSpec], list[cm.BalancerSpec]]:
    """(the main balancers, the extra EPLB specs of the staleness sweep)."""
    main = []
    for name in args.balancers:
        main.append(cm.BalancerSpec(name, num_slots=args.moe_balancer_num_slots, min_quota=min_quota,
                                    eplb_window=args.moe_balancer_eplb_window,
                                    eplb_interval=args.moe_balancer_eplb_interval))
    sweep = []
    if args.staleness_intervals:
        for interval in args.staleness_intervals:
            if interval < 1:
                raise SystemExit("--staleness-intervals must be >= 1")
            window = args.staleness_window or interval
            sweep.append(cm.BalancerSpec("eplb", num_slots=args.moe_balancer_num_slots, eplb_window=window,
                                         eplb_interval=interval, label=f"eplb/i={interval}/w={window}"))
    return main, sweep


def quality_tables(result: cm.ReplayResult, main_keys: Sequence[str]) -> str:
    summary = cm.metric_summary(result)
    rows = []
    for key in main_keys:
        s = summary[key]
        rows.append([key, fmt(s["imbalance_mean"]), fmt(s["imbalance_p95"]), fmt(s["imbalance_max"]),
                     fmt(s["worse_than_none"], ".1%"), fmt(s["replicas_mean"], ".1f"), fmt(s["fanout_mean"], ".2f"),
                     fmt(s["fanout_max"], ".0f"), fmt(s["inflight_mean"], ".1%"), fmt(s["min_replica_quota"], ".0f"),
                     fmt(s["plan_ms_mean"], ".3f")])
    out = [format_table(
        ["balancer", "imb mean", "imb p95", "imb max", "worse>none", "replicas", "fan-out", "fan max",
         "in-flight", "min quota", "plan ms"], rows,
        title="Balancing quality over all records (imbalance = max/mean per-rank load after balancing; "
              "plan ms measured on this host)")]
    layer_rows = []
    for layer in result.layers:
        mask = result.keys["layer"] == layer
        per = cm.metric_summary(result, mask)
        row = [str(layer), str(int(mask.sum()))]
        for key in main_keys:
            s = per[key]
            cell = f"{s['imbalance_mean']:.3f}/{s['imbalance_max']:.2f}"
            if s["replicas_mean"] > 0:
                cell += f" r{s['replicas_mean']:.1f} f{s['fanout_max']:.0f} i{s['inflight_mean']:.0%}"
            row.append(cell)
        layer_rows.append(row)
    out.append(format_table(["layer", "records", *main_keys], layer_rows,
                            title="Per layer: imbalance mean/max, and for replicating balancers r=replicas (mean), "
                                  "f=max fan-out, i=in-flight ratio"))
    return "\n\n".join(out)


def staleness_table(result: cm.ReplayResult, main_keys: Sequence[str]) -> str:
    summary = cm.metric_summary(result)
    rows = []
    for r in cm.staleness_summary(result):
        if r["key"] in main_keys:
            continue
        rows.append([f"eplb interval={r['interval']} window={r['window']}", fmt(r["imbalance_mean"]),
                     fmt(r["imbalance_p95"]), fmt(r["imbalance_max"]), fmt(r["worse_than_none"], ".1%")])
    for key in main_keys:
        if key in ("none", "eplb-exact", "ultraep", "eplb"):
            s = summary[key]
            label = {"none": "none (reference)", "eplb-exact": "eplb-exact (no staleness)",
                     "ultraep": "ultraep (exact load)", "eplb": "eplb (as configured)"}[key]
            rows.append([label, fmt(s["imbalance_mean"]), fmt(s["imbalance_p95"]), fmt(s["imbalance_max"]),
                         fmt(s["worse_than_none"], ".1%")])
    return format_table(["EPLB placement from history", "imb mean", "imb p95", "imb max", "worse>none"], rows,
                        title="Stale history (paper Fig. 6): EPLB re-planned every `interval` microbatches of a "
                              "layer from the last `window`; 'worse>none' = share of records it made worse than "
                              "no balancing")


def cost_tables(result: cm.ReplayResult, main_keys: Sequence[str], shape: cm.ExpertShape, source: str,
                hardware: cm.Hardware, relay: bool, plan_time_us: Optional[float]) -> str:
    summary = cm.cost_summary(result)
    header = (f"{ESTIMATE} — cost model, not a measurement. Expert h={shape.hidden_size}, f={shape.ffn_hidden_size}, "
              f"{'SwiGLU' if shape.gated else '2-matrix'} ({source}); {shape.weight_bytes / 2**20:.1f} MiB of weights. "
              f"Hardware: {hardware.scale_up_gbps:g} GB/s scale-up, {hardware.peak_tflops:g} TFLOP/s, "
              f"{hardware.hbm_tbps:g} TB/s HBM (efficiency {hardware.compute_efficiency:g}/{hardware.comm_efficiency:g}). "
              f"Plan time: {'fixed ' + format(plan_time_us, 'g') + ' us' if plan_time_us is not None else 'median of the times measured on this host (CPU)'}; "
              f"weight distribution {'with' if relay else 'without'} relay in the totals. MoE layers only "
              f"(attention etc. not modelled); ms per layer invocation (one microbatch), averaged.")
    rows = []
    for key in main_keys:
        c = summary[key]
        rows.append([key, fmt(c["fwd_ms"]), fmt(c["bwd_ms"]), fmt(c["total_ms"]), fmt(c["moe_fwd_ms"]),
                     fmt(c["a2a_fwd_ms"]), f"{c['wdist_direct_ms']:.3f}/{c['wdist_relay_ms']:.3f}", fmt(c["plan_ms"]),
                     fmt(c["bwd_exposed_ms"]), fmt(c.get("frac_ideal"), ".1%"), fmt(c.get("speedup_vs_none"), ".3f") + "x",
                     fmt(c.get("frac_ideal_excl_plan"), ".1%"), fmt(c.get("speedup_vs_none_excl_plan"), ".3f") + "x"])
    out = [header, format_table(
        ["balancer", "fwd ms", "bwd ms", "total ms", "expert fwd", "a2a fwd", "wdist direct/relay", "plan",
         "bwd exposed", "of ideal", "vs none", "of ideal*", "vs none*"], rows,
        title=f"{ESTIMATE}: time per MoE layer (* = without the plan term)")]
    layer_rows = []
    for layer in result.layers:
        per = cm.cost_summary(result, result.keys["layer"] == layer)
        row = [str(layer)]
        for key in main_keys:
            c = per[key]
            row.append(f"{c['total_ms']:.3f} ({fmt(c.get('speedup_vs_none'), '.2f')}x)")
        layer_rows.append(row)
    out.append(format_table(["layer", *main_keys], layer_rows,
                            title=f"{ESTIMATE}: fwd+bwd ms per layer (speedup over none)"))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

def _pick_layers(layers: Sequence[int], count: int) -> list[int]:
    if len(layers) <= count:
        return list(layers)
    idx = np.linspace(0, len(layers) - 1, count).round().astype(int)
    return [layers[i] for i in sorted(set(idx))]


def _save_figure(fig, path: Path) -> Path:
    """Lay out, write (110 dpi) and close ``fig``; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_replay(result: cm.ReplayResult, main_keys: Sequence[str], plot_dir: Path,
                heatmap_layers: Optional[Sequence[int]] = None) -> list[Path]:
    """PNG files: imbalance over time per layer, load heatmaps, EPLB staleness. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    layers = _pick_layers(result.layers, 16)
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        mask = result.keys["layer"] == layer
        x = np.arange(int(mask.sum()))
        ax.plot(x, result.metrics[main_keys[0]]["imbalance_before"][mask], color="0.4", lw=1, label="before (none)")
        for key in main_keys:
            if key in ("none", "ideal"):
                continue
            ax.plot(x, result.metrics[key]["imbalance_after"][mask], lw=1, label=key)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.axhline(1.0, color="k", lw=0.5, ls=":")
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("max/mean rank load")
    for ax in axes[-1, :]:
        ax.set_xlabel("microbatch (trace order)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Per-layer rank imbalance over time, before and after balancing (replayed)")
    written.append(_save_figure(fig, plot_dir / "imbalance_over_time.png"))

    if result.expert_load is not None:
        for layer in heatmap_layers or _pick_layers(result.layers, 3):
            mask = result.keys["layer"] == layer
            if not mask.any():
                continue
            expert = result.expert_load[mask].astype(np.float64)
            share = expert / np.maximum(expert.sum(1, keepdims=True), 1) * result.num_experts
            panels = [("expert load / mean", share.T, "expert")]
            for key, title in (("none", "rank load / mean, no balancing"), ("ultraep", "rank load / mean, ultraep")):
                if key in result.rank_load:
                    ranks = result.rank_load[key][mask].astype(np.float64)
                    panels.append((title, (ranks / np.maximum(ranks.mean(1, keepdims=True), 1e-9)).T, "rank"))
            fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
            # Rank panels share one colour scale (before/after comparable); experts get their own.
            rank_max = max([float(p[1].max()) for p in panels[1:]] or [1.0])
            for ax, (title, data, ylabel) in zip(axes[0], panels):
                vmax = float(data.max()) if ylabel == "expert" else rank_max
                im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=vmax)
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("microbatch (trace order)")
                ax.set_ylabel(ylabel)
                fig.colorbar(im, ax=ax)
            fig.suptitle(f"Layer {layer}: load heatmaps")
            written.append(_save_figure(fig, plot_dir / f"load_heatmap_layer{layer}.png"))

    stale = [r for r in cm.staleness_summary(result) if r["key"] not in main_keys]
    if stale:
        summary = cm.metric_summary(result)
        fig, ax = plt.subplots(figsize=(6, 3.8))
        x = [r["interval"] for r in stale]
        ax.plot(x, [r["imbalance_mean"] for r in stale], "o-", label="eplb mean")
        ax.plot(x, [r["imbalance_p95"] for r in stale], "s--", label="eplb p95")
        for key, style in (("none", ":"), ("eplb-exact", "-."), ("ultraep", "-")):
            if key in summary:
                ax.axhline(summary[key]["imbalance_mean"], ls=style, color="0.3", lw=1)
                ax.annotate(f"{key} mean", (x[0], summary[key]["imbalance_mean"]), fontsize=7,
                            textcoords="offset points", xytext=(2, 2))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("EPLB re-plan interval (microbatches of a layer; window = interval)")
        ax.set_ylabel("rank imbalance after")
        ax.set_title("How stale history hurts EPLB (replayed)")
        ax.legend(fontsize=8)
        written.append(_save_figure(fig, plot_dir / "eplb_staleness.png"))

    if result.costs is not None:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(result.layers) + 3), 3.8))
        width = 0.8 / len(main_keys)
        for i, key in enumerate(main_keys):
            totals = [cm.cost_summary(result, result.keys["layer"] == layer)[key]["total_ms"] for layer in result.layers]
            ax.bar(np.arange(len(result.layers)) + i * width, totals, width, label=key)
        ax.set_xticks(np.arange(len(result.layers)) + 0.4 - width / 2, [str(l) for l in result.layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("ms per invocation (fwd+bwd)")
        ax.set_title(f"{ESTIMATE}: MoE layer time per balancer (cost model)")
        ax.legend(fontsize=8)
        written.append(_save_figure(fig, plot_dir / "estimated_layer_time.png"))
    return written


# ---------------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_args(parser)
    bal = parser.add_argument_group("balancers")
    bal.add_argument("--balancers", type=lambda t: [x for x in t.split(",") if x],
                     default=list(cm.BALANCER_NAMES), help="comma-separated, from " + ",".join(cm.BALANCER_NAMES))
    bal.add_argument("--moe-balancer-num-slots", type=int, default=2, help="redundant slots per rank (2)")
    bal.add_argument("--moe-balancer-min-quota", type=min_quota_arg, default="auto",
                     help="ultraep quota floor: 'auto' (planner default, 1%% of the mean rank load), "
                     "'hw' (derived from the hardware, see slot_advisor.py) or tokens")
    bal.add_argument("--moe-balancer-eplb-window", type=int, default=16, help="eplb history, microbatches (16)")
    bal.add_argument("--moe-balancer-eplb-interval", type=int, default=16, help="eplb re-plan period, microbatches (16)")
    bal.add_argument("--staleness-intervals", type=int_list, default=[1, 2, 4, 8, 16, 32],
                     help="EPLB intervals of the staleness sweep ('' to skip)")
    bal.add_argument("--staleness-window", type=int, default=None, help="history window of the sweep (default: = interval)")
    bal.add_argument("--no-staleness", action="store_true", help="skip the staleness sweep")
    add_model_hardware_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--no-cost", action="store_true", help="balancing metrics only")
    out.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    out.add_argument("--heatmap-layers", type=int_list, default=None, help="layers to draw heatmaps of (default: 3 spread)")
    out.add_argument("--json-out", type=Path, default=None, help="write the summaries as JSON here")
    args = parser.parse_args(argv)
    bad = [b for b in args.balancers if b not in cm.BALANCER_NAMES]
    if bad or not args.balancers:
        parser.error(f"--balancers: unknown {bad}; choose from {cm.BALANCER_NAMES}")
    if args.no_staleness:
        args.staleness_intervals = []
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        files = traces.find_trace_files(args.traces)
        lines, meta, records = describe_inputs(files)
    except traces.TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shape, source, hardware = shape_and_hardware(args, meta)
    min_quota = resolve_min_quota(args.moe_balancer_min_quota, shape, hardware)
    main_specs, sweep_specs = build_specs(args, min_quota)
    main_keys = [s.key for s in main_specs]
    print(f"Replaying {len(files)} trace file(s):")
    print("\n".join(lines))
    if meta:
        print(f"  meta: {json.dumps(meta, sort_keys=True)}")
    print(f"  balancers: {', '.join(main_keys)}; slots={args.moe_balancer_num_slots}, "
          f"ultraep min quota={'planner default (1% of mean rank load)' if min_quota is None else min_quota}, "
          f"eplb window={args.moe_balancer_eplb_window} interval={args.moe_balancer_eplb_interval}"
          + (f"; staleness sweep intervals {args.staleness_intervals}" if sweep_specs else ""))
    progress = Progress("replay", enabled=not args.no_progress)
    with_cost = not args.no_cost
    try:
        result = cm.replay_files(
            files, main_specs + sweep_specs, layers=args.layers, max_records=args.max_records,
            load_scale=args.load_scale, progress=progress, shape=shape if with_cost else None,
            hardware=hardware if with_cost else None, relay=not args.no_relay,
            keep_loads=args.plot_dir is not None,
            plan_seconds=None if args.plan_time_us is None else args.plan_time_us * 1e-6)
    except (traces.TraceError, ValueError) as exc:
        progress.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress.close()
    print(f"  {result.num_records} records replayed, layers {result.layers}\n")
    print(quality_tables(result, main_keys))
    if sweep_specs:
        print()
        print(staleness_table(result, main_keys))
    if with_cost:
        print()
        print(cost_tables(result, main_keys, shape, source, hardware, not args.no_relay, args.plan_time_us))
    if args.plot_dir is not None:
        paths = plot_replay(result, main_keys, args.plot_dir, args.heatmap_layers)
        print("\nplots: " + ", ".join(str(p) for p in paths))
    if args.json_out is not None:
        payload = {
            "estimate_note": "cost figures are estimates from ultraep_megatron.costmodel, not measurements",
            "files": [str(f) for f in files], "num_records": result.num_records, "layers": result.layers,
            "quality": cm.metric_summary(result),
            "quality_per_layer": {str(l): cm.metric_summary(result, result.keys["layer"] == l) for l in result.layers},
            "staleness": [r for r in cm.staleness_summary(result) if r["key"] not in main_keys],
        }
        if with_cost:
            payload["estimated_cost"] = cm.cost_summary(result)
            payload["estimated_cost_per_layer"] = {
                str(l): cm.cost_summary(result, result.keys["layer"] == l) for l in result.layers}
            payload["shape"] = {"hidden_size": shape.hidden_size, "ffn_hidden_size": shape.ffn_hidden_size,
                                "gated": shape.gated, "source": source}
            payload["hardware"] = hardware.__dict__
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(payload, indent=1, sort_keys=True))
        print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
