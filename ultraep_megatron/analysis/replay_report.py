"""The report of ``ultraep replay``: everything a replay found as one JSON-ready dict
(:func:`build_report`), rendered as text tables (:func:`render`) and written as JSON, CSV and plots
(:func:`write_outputs`): per layer what the router sent, balancing quality, EPLB under stale
history, the cost model's ESTIMATE, and the balancers next to the peers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.hardware import ExpertShape, Hardware

from . import plotting
from .replay import ReplayResult
from .replay_plots import plot_replay
from .summary import (
    cost_summary,
    estimate_problem,
    load_summary,
    metric_summary,
    peer_summary,
    staleness_summary,
)
from .tables import ESTIMATE, dump_json, fmt, format_table, write_csv

__all__ = ["build_report", "display_label", "render", "write_outputs"]


def build_report(
    result: ReplayResult,
    labels: Sequence[str],
    *,
    inputs: Sequence[str],
    min_quota: Optional[int],
    shape: ExpertShape,
    source: str,
    hardware: Hardware,
    plan_time_us: Optional[float] = None,
    relay: bool = True,
) -> dict:
    """Everything the replay found, JSON-ready (the peers next to the balancers in ``peer_table``,
    empty when no peer was replayed).

    Args:
        result: the replay; labels: the compared balancers' labels (the others: the staleness sweep).
        inputs: what was replayed, one line per source (``TraceRecords.describe()``).
        min_quota: ultraep's quota floor as replayed (None: the planner's default).
        shape, source, hardware: the cost model's inputs and where h and f came from.
        plan_time_us: the fixed plan time charged (None: the measured median); relay: whether the
            totals charge weight distribution with relay trees.
    """

    def balancers_only(summary: dict) -> dict:
        return {label: row for label, row in summary.items() if label in result.balancers}

    per_layer_mask = {layer: result.keys["layer"] == layer for layer in result.layers}
    report = {
        "inputs": list(inputs),
        "meta": result.meta,
        "num_records": result.num_records,
        "layers": result.layers,
        "num_ranks": result.num_ranks,
        "num_experts": result.num_experts,
        "balancers": {label: c.__dict__ for label, c in result.balancers.items()},
        "compared": list(labels),
        "min_quota": min_quota,
        "load": load_summary(result),
        "load_per_layer": {layer: load_summary(result, m) for layer, m in per_layer_mask.items()},
        "quality": balancers_only(metric_summary(result)),
        "quality_per_layer": {
            layer: balancers_only(metric_summary(result, m)) for layer, m in per_layer_mask.items()
        },
        "staleness": [r for r in staleness_summary(result) if r["label"] not in labels],
        "ranks_per_domain": result.ranks_per_domain,
        "peer_labels": {
            **{label: display_label(result.balancers[label]) for label in labels},
            **{label: label for label in result.peers},
        },
        # No peers replayed (ultraep replay --no-peers): no peer table.
        "peer_table": {
            label: row
            for label, row in peer_summary(result).items()
            if label in labels or label in result.peers
        }
        if result.peers
        else {},
    }
    if result.costs is not None:
        report["estimate_note"] = (
            "cost figures are estimates from ultraep_megatron.analysis.cost, not measurements"
        )
        report["estimated_cost"] = balancers_only(cost_summary(result))
        report["estimated_cost_per_layer"] = {
            layer: balancers_only(cost_summary(result, m)) for layer, m in per_layer_mask.items()
        }
        report["shape"] = {
            "hidden_size": shape.hidden_size,
            "ffn_hidden_size": shape.ffn_hidden_size,
            "gated": shape.gated,
            "weight_bytes": shape.weight_bytes,
            "source": source,
        }
        report["hardware"] = dict(hardware.__dict__)
        report["plan_time_us"] = plan_time_us
        report["relay"] = relay
        report["estimate_problem"] = estimate_problem(result)
    return report


def render(report: dict, labels: Sequence[str]) -> str:
    """The human report: inputs, per-layer loads, balancing quality, staleness, estimated cost."""
    b = next(iter(report["balancers"].values()))
    out = [
        f"Replaying {report['num_records']} loads of {len(report['layers'])} layer(s), "
        f"R={report['num_ranks']} EP ranks, E={report['num_experts']} experts:"
    ]
    out += [f"  {line}" for line in report["inputs"]]
    out.append(
        f"  balancers: {', '.join(labels)}; --moe-balancer-num-slots {b['num_slots']}, "
        f"--moe-balancer-min-quota {report['min_quota'] if report['min_quota'] is not None else 'default (1% of the mean rank load)'}, "
        f"--moe-balancer-eplb-window {b['eplb_window']} --moe-balancer-eplb-interval {b['eplb_interval']}"
    )
    out.append("")
    out.append(load_table(report))
    out.append("")
    out.append(quality_tables(report, labels))
    if report["staleness"]:
        out += ["", staleness_table(report, labels)]
    if report.get("estimate_problem"):
        out += [
            "",
            f"{ESTIMATE} not shown (its figures stay in the JSON output): {report['estimate_problem']}",
        ]
    elif "estimated_cost" in report:
        out += ["", cost_tables(report, labels)]
    if report["peer_table"]:
        out += ["", peer_table(report)]
    if report.get("files"):
        out += ["", "wrote: " + ", ".join(str(p) for p in report["files"])]
    return "\n".join(out)


def load_table(report: dict) -> str:
    rows = []
    for layer, s in list(report["load_per_layer"].items()) + [("all", report["load"])]:
        rows.append(
            [
                layer,
                s["records"],
                fmt(s["routed_mean"], ".1f"),
                fmt(s["expert_imbalance_mean"]),
                fmt(s["expert_imbalance_max"]),
                fmt(s["rank_imbalance_mean"]),
                fmt(s["rank_imbalance_max"]),
            ]
        )
    return format_table(
        [
            "layer",
            "loads",
            "pairs/load",
            "expert imb mean",
            "expert imb max",
            "rank imb mean",
            "rank imb max",
        ],
        rows,
        title="What the router sent, per layer ((token, expert) pairs per load; imbalance = "
        "max/mean per expert and per EP rank, before balancing)",
    )


def quality_tables(report: dict, labels: Sequence[str]) -> str:
    rows = []
    for label in labels:
        s = report["quality"][label]
        rows.append(
            [
                label,
                fmt(s["imbalance_mean"]),
                fmt(s["imbalance_p95"]),
                fmt(s["imbalance_max"]),
                fmt(s["worse_than_none"], ".1%"),
                fmt(s["replicas_mean"], ".1f"),
                fmt(s["fanout_mean"], ".2f"),
                fmt(s["fanout_max"], ".0f"),
                fmt(s["inflight_mean"], ".1%"),
                fmt(s["min_replica_quota"], ".0f"),
                fmt(s["plan_ms_mean"], ".3f"),
            ]
        )
    out = [
        format_table(
            [
                "balancer",
                "imb mean",
                "imb p95",
                "imb max",
                "worse>none",
                "replicas",
                "fan-out",
                "fan max",
                "in-flight",
                "min quota",
                "plan ms",
            ],
            rows,
            title="Balancing quality over all loads (imbalance = max/mean per-rank load after balancing; "
            "plan ms measured on this host)",
        )
    ]
    layer_rows = []
    for layer, per in report["quality_per_layer"].items():
        row = [str(layer)]
        for label in labels:
            s = per[label]
            cell = f"{s['imbalance_mean']:.3f}/{s['imbalance_max']:.3f}"
            if s["replicas_mean"] > 0:
                cell += (
                    f" r{s['replicas_mean']:.1f} f{s['fanout_max']:.0f} i{s['inflight_mean']:.0%}"
                )
            row.append(cell)
        layer_rows.append(row)
    out.append(
        format_table(
            ["layer", *labels],
            layer_rows,
            title="Per layer: imbalance mean/max, and for replicating balancers r=replicas (mean), "
            "f=max fan-out, i=in-flight ratio",
        )
    )
    return "\n\n".join(out)


def display_label(config: BalancerConfig) -> str:
    """A balancer's label in comparisons (``plotting.LABELS``), with its NVLink domain."""
    label = plotting.LABELS.get(config.name, config.name)
    if config.name == registry.ULTRAEP and config.domain_size is not None:
        label += f" (replicas in domains of {config.domain_size})"
    return label


def peer_table(report: dict) -> str:
    """The balancers and the peers side by side."""
    N, R = report["ranks_per_domain"], report["num_ranks"]
    with_cost = "estimated_cost" in report and not report.get("estimate_problem")
    rows = []
    for label, s in report["peer_table"].items():
        row = [
            report["peer_labels"][label],
            fmt(s["imbalance_mean"]),
            fmt(s["imbalance_max"]),
            fmt(s["weight_copies_mean"], ".1f"),
            fmt(s["main_moves_mean"], ".1f"),
            fmt(s["fanout_max"], ".0f"),
            fmt(s["cross_domain_copies_mean"], ".1f"),
        ]
        if with_cost:
            row.append(fmt(s["xdom_mib_mean"], ".1f"))
        row += [
            f"{s['memory_spread_after_mean']:.3f}/{s['memory_spread_after_max']:.3f}",
            fmt(s["balanced_share"], ".0%"),
        ]
        if with_cost:
            row += [
                fmt(s["total_excl_plan_ms"]),
                fmt(s.get("speedup_vs_none_excl_plan"), ".3f") + "x",
            ]
        rows.append(row)
    headers = ["balancer", "imb mean", "imb max", "copies", "main moves", "fan max", "xdom copies"]
    headers += ["xdom MiB"] if with_cost else []
    headers += ["mem spread mean/max", "balanced"]
    headers += ["est. ms*", "vs none*"] if with_cost else []
    domains = f"NVLink domains of {N} ranks" if N is not None and N < R else "one NVLink domain"
    title = (
        f"Peers (imbalance after = max/mean per-rank load; copies = expert weights sent per load, main-expert "
        f"moves included; fan max = most ranks holding one expert; xdom = copies landing outside their "
        f"home's domain ({domains})"
        + (
            ", and the replica weight + gradient MiB crossing one per invocation"
            if with_cost
            else ""
        )
        + "; mem spread = max/mean (token, expert) rows received per rank, the expert activations; "
        "balanced = loads balanced at all"
        + (
            f"; {ESTIMATE}: ms per layer invocation and speedup over none without plan time"
            if with_cost
            else ""
        )
        + ")"
    )
    return format_table(headers, rows, title=title)


def staleness_table(report: dict, labels: Sequence[str]) -> str:
    rows = []
    for r in report["staleness"]:
        rows.append(
            [
                f"eplb interval={r['interval']} window={r['window']}",
                fmt(r["imbalance_mean"]),
                fmt(r["imbalance_p95"]),
                fmt(r["imbalance_max"]),
                fmt(r["worse_than_none"], ".1%"),
            ]
        )
    for label in labels:
        name = report["balancers"][label]["name"]
        if name != registry.IDEAL:
            s = report["quality"][label]
            rows.append(
                [
                    f"{label} (as configured)",
                    fmt(s["imbalance_mean"]),
                    fmt(s["imbalance_p95"]),
                    fmt(s["imbalance_max"]),
                    fmt(s["worse_than_none"], ".1%"),
                ]
            )
    return format_table(
        ["EPLB placement from history", "imb mean", "imb p95", "imb max", "worse>none"],
        rows,
        title="Stale history (paper Fig. 6): EPLB re-planned every `interval` microbatches of a "
        "layer from the last `window`; 'worse>none' = share of loads it made worse than "
        "no balancing",
    )


#: What the estimate says of its plan term without ``--plan-time-us``.
PLAN_LEFT_OUT = (
    "left out (measured here, on this CPU, it is not the estimated hardware's; "
    "--plan-time-us US charges the hardware's)"
)


def cost_tables(report: dict, labels: Sequence[str]) -> str:
    shape, hw = report["shape"], report["hardware"]
    plan = report["plan_time_us"]
    header = (
        f"{ESTIMATE} — cost model, not a measurement. Expert h={shape['hidden_size']}, "
        f"f={shape['ffn_hidden_size']}, {'SwiGLU' if shape['gated'] else '2-matrix'} ({shape['source']}); "
        f"{shape['weight_bytes'] / 2**20:.1f} MiB of weights. Hardware: "
        + (f"{hw['named']}: " if hw.get("named") else "")
        + f"{hw['scale_up_gbps']:g} GB/s scale-up, "
        f"{hw['peak_tflops']:g} TFLOP/s, {hw['hbm_tbps']:g} TB/s HBM (efficiency "
        f"{hw['compute_efficiency']:g}/{hw['comm_efficiency']:g}). Plan time: "
        f"{'fixed ' + format(plan, 'g') + ' us (--plan-time-us)' if plan is not None else PLAN_LEFT_OUT}; "
        f"weight distribution {'with' if report['relay'] else 'without'} relay in the totals; replica "
        f"transfers overlapped as the runtime schedules them, hiding {hw['transfer_overlap']:.0%} of their "
        "windows (--transfer-overlap). MoE layers only "
        "(attention etc. not modelled); ms per layer invocation (one microbatch), averaged."
    )
    rows = []
    for label in labels:
        c = report["estimated_cost"][label]
        rows.append(
            [
                label,
                fmt(c["fwd_ms"]),
                fmt(c["bwd_ms"]),
                fmt(c["total_ms"]),
                fmt(c["moe_fwd_ms"]),
                fmt(c["a2a_fwd_ms"]),
                f"{c['wdist_direct_ms']:.3f}/{c['wdist_relay_ms']:.3f}",
                fmt(c["plan_ms"]),
                f"{c['fwd_exposed_ms']:.3f}/{c['bwd_exposed_ms']:.3f}",
                fmt(c.get("frac_ideal"), ".1%"),
                fmt(c.get("speedup_vs_none"), ".3f") + "x",
                fmt(c.get("frac_ideal_excl_plan"), ".1%"),
                fmt(c.get("speedup_vs_none_excl_plan"), ".3f") + "x",
            ]
        )
    out = [
        header,
        format_table(
            [
                "balancer",
                "fwd ms",
                "bwd ms",
                "total ms",
                "expert fwd",
                "a2a fwd",
                "wdist direct/relay",
                "plan",
                "exposed fwd/bwd",
                "of ideal",
                "vs none",
                "of ideal*",
                "vs none*",
            ],
            rows,
            title=f"{ESTIMATE}: time per MoE layer (* = without the plan term)",
        ),
    ]
    layer_rows = []
    for layer, per in report["estimated_cost_per_layer"].items():
        layer_rows.append(
            [str(layer)]
            + [
                f"{per[label]['total_ms']:.3f} ({fmt(per[label].get('speedup_vs_none'), '.2f')}x)"
                for label in labels
            ]
        )
    out.append(
        format_table(
            ["layer", *labels],
            layer_rows,
            title=f"{ESTIMATE}: fwd+bwd ms per layer (speedup over none)",
        )
    )
    return "\n\n".join(out)


def write_outputs(
    result: ReplayResult,
    report: dict,
    labels: Sequence[str],
    output_dir: Path,
    heatmap_layers: Optional[Sequence[int]] = None,
) -> list[Path]:
    """replay_per_layer.csv, the PNG plots (:func:`.replay_plots.plot_replay`) and replay.json in
    ``output_dir``; returns the paths."""
    rows = []
    for layer, per in report["quality_per_layer"].items():
        for label, q in per.items():
            row = {"layer": layer, "balancer": label, **q}
            if "estimated_cost_per_layer" in report:
                row.update(
                    {
                        f"estimated_{k}": v
                        for k, v in report["estimated_cost_per_layer"][layer][label].items()
                    }
                )
            rows.append(row)
    written = [write_csv(output_dir / "replay_per_layer.csv", rows)]
    written += plot_replay(
        result, labels, output_dir, heatmap_layers, cost=not report.get("estimate_problem")
    )
    json_path = output_dir / "replay.json"
    json_path.write_text(dump_json({**report, "files": [str(p) for p in written + [json_path]]}))
    return written + [json_path]
