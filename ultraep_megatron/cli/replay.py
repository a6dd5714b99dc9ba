"""ultraep replay: what each balancer would have done on a run's recorded routing.

Replays a routing trace (the project's --moe-balancer-trace-dir or Megatron's own
--moe-routing-trace-path) through each balancer and prints, per layer and overall, what the
router sent and what every balancer makes of it: imbalance (max/mean tokens per EP rank),
replicas, fan-out, in-flight ratio; how EPLB degrades as its history goes stale (the paper's
Fig. 6); an ESTIMATE of per-layer forward/backward time from the cost model, as a fraction of
the force-balanced ideal and as speedup over no balancing; and the peer table: every balancer next
to DeepSeek's re-placing EPLB and LLEP, with the weight copies each implies (main-expert moves
included), fan-out, what crosses an NVLink domain, the memory spread and the estimated time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ultraep_megatron.planner import policy
from ultraep_megatron.planner.policy import BalancerConfig


from . import common
from .common import ESTIMATE, fmt, format_table

SUMMARY = "replay a routing trace through every balancer: balance, replicas, estimated layer time"
EXAMPLES = """examples:
  ultraep replay runs/kjv/trace                           # the project's trace (--moe-balancer-trace-dir)
  ultraep replay runs/tiny/megatron_trace --run-args runs/tiny/log.txt   # Megatron's --moe-routing-trace-path
  ultraep replay TRACE --balancers none,ultraep --moe-balancer-num-slots 1 --json > replay.json
  ultraep replay TRACE --output-dir plots                 # PNG plots, replay.json, replay_per_layer.csv
  ultraep replay TRACE --moe-balancer-domain-size 8       # ultraep's replicas inside 8-rank NVLink domains
  ultraep replay TRACE --moe-balancer-hardware h100-hgx   # cost model, floor and trigger for 8 x H100 nodes
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("replay", help=SUMMARY, description=__doc__.split("\n\n", 1)[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_trace_input_args(parser)
    add_balancer_args(parser)
    group = parser.add_argument_group("EPLB staleness sweep (paper Fig. 6)")
    group.add_argument("--staleness-intervals", type=common.int_list, default=[1, 2, 4, 8, 16, 32], metavar="N,N",
                       help="EPLB re-plan intervals to sweep (default: 1,2,4,8,16,32)")
    group.add_argument("--staleness-window", type=int, default=None, metavar="N",
                       help="history window of the sweep (default: = interval)")
    group.add_argument("--no-staleness", action="store_true", help="skip the staleness sweep")
    add_peer_args(parser)
    common.add_model_hardware_args(parser)
    out = common.add_output_args(parser, files="PNG plots, replay.json and replay_per_layer.csv")
    out.add_argument("--no-cost", action="store_true", help="balancing metrics only, no time estimate")
    out.add_argument("--heatmap-layers", type=common.int_list, default=None, metavar="N,N",
                     help="layers to draw load heatmaps of (default: 3 spread over the model)")
    parser.set_defaults(run=run)
    return parser


def add_balancer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "balancers", "The same --moe-balancer-* flags as training, with the same defaults; "
        "--moe-balancer-min-quota also takes 'hw', the floor derived from the hardware flags (see ultraep advise). "
        + " ".join(f'"{n}": {policy.describe(n)}.' for n in policy.COMPARED))
    group.add_argument("--balancers", type=common.name_list(policy.COMPARED), default=list(policy.COMPARED),
                       metavar="B,B", help=f"balancers to replay (default: {','.join(policy.COMPARED)})")
    policy.add_balancer_arguments(group, runtime=False, balancer_flag=False,
                                  types={"min_quota": common.min_quota_arg})


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    from ultraep_megatron.analysis.replay import PEERS
    from ultraep_megatron.planner import peers

    group = parser.add_argument_group(
        "peers", "Replayed next to the balancers, re-implemented from their public code "
        "(ultraep_megatron/planner/peers.py): " + " ".join(f'"{n}": {peers.LABELS[n]}.' for n in PEERS)
        + " With several NVLink domains (--scale-up-domain, --moe-balancer-domain-size) deepseek-eplb also "
          "runs its hierarchical policy, nodes = domains.")
    group.add_argument("--peers", type=common.name_list(PEERS), default=list(PEERS), metavar="P,P",
                       help=f"peers to replay (default: {','.join(PEERS)})")
    group.add_argument("--no-peers", action="store_true", help="no peer table")
    group.add_argument("--llep-capacity-factor", type=common.positive_float, default=peers.LLEP_CAPACITY_FACTOR,
                       metavar="ALPHA", help="LLEP's capacity factor alpha (%(default)s)")
    group.add_argument("--llep-min-tokens-per-gemm", type=int, default=peers.LLEP_MIN_TOKENS_PER_GEMM,
                       metavar="M", help="LLEP's minimum tokens per GEMM m (%(default)s; not a hard floor)")
    group.add_argument("--llep-trigger", type=float, default=peers.LLEP_TRIGGER, metavar="LAMBDA",
                       help="LLEP's trigger lambda: loads below this rank imbalance stay unbalanced "
                            "(%(default)s; 0: always balance)")


def resolve_min_quota(value, shape, hardware, *, training: bool = True, from_hardware: bool = False) -> Optional[int]:
    """A ``--moe-balancer-min-quota`` value: 'hw' (or, with ``from_hardware``, no value: a
    ``--moe-balancer-hardware`` run's default) derives it from the hardware."""
    from ultraep_megatron.analysis.cost import min_quota_from_hardware

    if value == "hw" or (value is None and from_hardware):
        return min_quota_from_hardware(shape, hardware, training=training)
    return value


def balancer_configs(args, min_quota: Optional[int]) -> tuple[dict, dict]:
    """(the compared balancers, the extra EPLB configurations of the staleness sweep), label -> config.
    ultraep's floor is resolved here (``min_quota``), from the hardware the cost model uses."""
    base = BalancerConfig(policy.ULTRAEP, num_slots=args.moe_balancer_num_slots, min_quota=min_quota,
                          trigger=args.moe_balancer_trigger, domain_size=args.moe_balancer_domain_size,
                          eplb_window=args.moe_balancer_eplb_window, eplb_interval=args.moe_balancer_eplb_interval)
    main = {name: base.replace(name=name) for name in args.balancers}
    sweep = {}
    for interval in ([] if args.no_staleness else args.staleness_intervals):
        if interval < 1:
            raise common.CliError("--staleness-intervals must be >= 1")
        window = args.staleness_window or interval
        sweep[f"{policy.EPLB}/i={interval}/w={window}"] = base.replace(
            name=policy.EPLB, eplb_window=window, eplb_interval=interval)
    return main, sweep


def run(args) -> int:
    from ultraep_megatron.analysis import replay as rp

    output_dir = common.prepare_output_dir(args.output_dir)
    records = common.open_records(args)
    shape, source, hardware = common.shape_and_hardware(args, records.meta)
    min_quota = resolve_min_quota(args.moe_balancer_min_quota, shape, hardware,
                                  from_hardware=args.moe_balancer_hardware is not None)
    main, sweep = balancer_configs(args, min_quota)
    if args.moe_balancer_domain_size is not None and records.num_ranks % args.moe_balancer_domain_size:
        raise common.CliError(f"--moe-balancer-domain-size {args.moe_balancer_domain_size} must divide the "
                              f"trace's {records.num_ranks} EP ranks")
    try:  # the NVLink domains the cross-domain figures count: the hardware's (common.shape_and_hardware)
        N = hardware.ranks_per_domain(records.num_ranks)
    except ValueError as exc:
        raise common.CliError(f"{exc} (--scale-up-domain, or the --moe-balancer-hardware preset)") from None
    peer_configs = peer_configs_from_args(args, N < records.num_ranks and N)
    with_cost = not args.no_cost
    progress = common.progress_for(args, "replay", records)
    try:
        result = rp.replay(records, {**main, **sweep}, peers=peer_configs, domain_size=N,
                           shape=shape if with_cost else None,
                           hardware=hardware if with_cost else None, relay=not args.no_relay,
                           keep_loads=output_dir is not None, plan_seconds=common.plan_seconds(args),
                           progress=progress)
    finally:
        progress.close()
    report = build_report(result, list(main), args, min_quota, shape, source, hardware, records)
    if output_dir is not None:
        report["files"] = write_outputs(result, report, list(main), output_dir, args.heatmap_layers)
    if args.json:
        common.dump_json(report, stream=sys.stdout)
    else:
        print(render(report, result, list(main)))
    return common.EXIT_OK


def peer_configs_from_args(args, node_size) -> list:
    """The peers to replay: each ``--peers`` one, and DeepSeek's hierarchical policy over NVLink
    domains of ``node_size`` ranks when there are several."""
    from ultraep_megatron.analysis.replay import DEEPSEEK_EPLB, PeerConfig

    if args.no_peers:
        return []
    out = []
    for name in args.peers:
        config = PeerConfig(name, num_slots=args.moe_balancer_num_slots,
                            capacity_factor=args.llep_capacity_factor,
                            min_tokens_per_gemm=args.llep_min_tokens_per_gemm,
                            imbalance_trigger=args.llep_trigger if args.llep_trigger > 0 else None)
        out.append(config)
        if name == DEEPSEEK_EPLB and node_size:
            out.append(dataclasses.replace(config, node_size=node_size))
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def build_report(result, labels: Sequence[str], args, min_quota, shape, source, hardware, records) -> dict:
    """Everything the replay found, JSON-ready (the peers in ``peer_table``)."""
    from ultraep_megatron.analysis import replay as rp

    def balancers_only(summary: dict) -> dict:
        return {label: row for label, row in summary.items() if label in result.balancers}

    per_layer_mask = {layer: result.keys["layer"] == layer for layer in result.layers}
    report = {
        "inputs": records.describe(),
        "meta": result.meta,
        "num_records": result.num_records, "layers": result.layers,
        "num_ranks": result.num_ranks, "num_experts": result.num_experts,
        "balancers": {label: c.__dict__ for label, c in result.balancers.items()},
        "compared": list(labels),
        "min_quota": min_quota,
        "load": rp.load_summary(result),
        "load_per_layer": {layer: rp.load_summary(result, m) for layer, m in per_layer_mask.items()},
        "quality": balancers_only(rp.metric_summary(result)),
        "quality_per_layer": {layer: balancers_only(rp.metric_summary(result, m)) for layer, m in per_layer_mask.items()},
        "staleness": [r for r in rp.staleness_summary(result) if r["label"] not in labels],
        "ranks_per_domain": result.ranks_per_domain,
        "peer_labels": {**{label: display_label(result.balancers[label]) for label in labels},
                        **{label: label for label in result.peers}},
        "peer_table": {label: row for label, row in rp.peer_summary(result).items()
                       if label in labels or label in result.peers},
    }
    if result.costs is not None:
        report["estimate_note"] = "cost figures are estimates from ultraep_megatron.analysis.cost, not measurements"
        report["estimated_cost"] = balancers_only(rp.cost_summary(result))
        report["estimated_cost_per_layer"] = {layer: balancers_only(rp.cost_summary(result, m))
                                              for layer, m in per_layer_mask.items()}
        report["shape"] = {"hidden_size": shape.hidden_size, "ffn_hidden_size": shape.ffn_hidden_size,
                           "gated": shape.gated, "weight_bytes": shape.weight_bytes, "source": source}
        report["hardware"] = dict(hardware.__dict__)
        report["plan_time_us"] = args.plan_time_us
        report["relay"] = not args.no_relay
        report["estimate_problem"] = rp.estimate_problem(result)
    return report


def render(report: dict, result, labels: Sequence[str]) -> str:
    """The human report: inputs, per-layer loads, balancing quality, staleness, estimated cost."""
    b = next(iter(report["balancers"].values()))
    out = [f"Replaying {report['num_records']} loads of {len(report['layers'])} layer(s), "
           f"R={report['num_ranks']} EP ranks, E={report['num_experts']} experts:"]
    out += [f"  {line}" for line in report["inputs"]]
    out.append(f"  balancers: {', '.join(labels)}; --moe-balancer-num-slots {b['num_slots']}, "
               f"--moe-balancer-min-quota {report['min_quota'] if report['min_quota'] is not None else 'default (1% of the mean rank load)'}, "
               f"--moe-balancer-eplb-window {b['eplb_window']} --moe-balancer-eplb-interval {b['eplb_interval']}")
    out.append("")
    out.append(load_table(report))
    out.append("")
    out.append(quality_tables(report, labels))
    if report["staleness"]:
        out += ["", staleness_table(report, labels)]
    if report.get("estimate_problem"):
        out += ["", f"{ESTIMATE} not shown (its figures stay in the JSON output): {report['estimate_problem']}"]
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
        rows.append([layer, s["records"], fmt(s["routed_mean"], ".1f"), fmt(s["expert_imbalance_mean"]),
                     fmt(s["expert_imbalance_max"]), fmt(s["rank_imbalance_mean"]), fmt(s["rank_imbalance_max"])])
    return format_table(["layer", "loads", "pairs/load", "expert imb mean", "expert imb max", "rank imb mean",
                         "rank imb max"], rows,
                        title="What the router sent, per layer ((token, expert) pairs per load; imbalance = "
                              "max/mean per expert and per EP rank, before balancing)")


def quality_tables(report: dict, labels: Sequence[str]) -> str:
    rows = []
    for label in labels:
        s = report["quality"][label]
        rows.append([label, fmt(s["imbalance_mean"]), fmt(s["imbalance_p95"]), fmt(s["imbalance_max"]),
                     fmt(s["worse_than_none"], ".1%"), fmt(s["replicas_mean"], ".1f"), fmt(s["fanout_mean"], ".2f"),
                     fmt(s["fanout_max"], ".0f"), fmt(s["inflight_mean"], ".1%"), fmt(s["min_replica_quota"], ".0f"),
                     fmt(s["plan_ms_mean"], ".3f")])
    out = [format_table(
        ["balancer", "imb mean", "imb p95", "imb max", "worse>none", "replicas", "fan-out", "fan max",
         "in-flight", "min quota", "plan ms"], rows,
        title="Balancing quality over all loads (imbalance = max/mean per-rank load after balancing; "
              "plan ms measured on this host)")]
    layer_rows = []
    for layer, per in report["quality_per_layer"].items():
        row = [str(layer)]
        for label in labels:
            s = per[label]
            cell = f"{s['imbalance_mean']:.3f}/{s['imbalance_max']:.3f}"
            if s["replicas_mean"] > 0:
                cell += f" r{s['replicas_mean']:.1f} f{s['fanout_max']:.0f} i{s['inflight_mean']:.0%}"
            row.append(cell)
        layer_rows.append(row)
    out.append(format_table(["layer", *labels], layer_rows,
                            title="Per layer: imbalance mean/max, and for replicating balancers r=replicas (mean), "
                                  "f=max fan-out, i=in-flight ratio"))
    return "\n\n".join(out)


def display_label(config: BalancerConfig) -> str:
    """A balancer's label in comparisons (``policy.LABELS``), with its NVLink domain."""
    label = policy.LABELS.get(config.name, config.name)
    if config.name == policy.ULTRAEP and config.domain_size is not None:
        label += f" (replicas in domains of {config.domain_size})"
    return label


def peer_table(report: dict) -> str:
    """The balancers and the peers side by side."""
    N, R = report["ranks_per_domain"], report["num_ranks"]
    with_cost = "estimated_cost" in report and not report.get("estimate_problem")
    rows = []
    for label, s in report["peer_table"].items():
        row = [report["peer_labels"][label], fmt(s["imbalance_mean"]), fmt(s["imbalance_max"]),
               fmt(s["weight_copies_mean"], ".1f"), fmt(s["main_moves_mean"], ".1f"), fmt(s["fanout_max"], ".0f"),
               fmt(s["cross_domain_copies_mean"], ".1f")]
        if with_cost:
            row.append(fmt(s["xdom_mib_mean"], ".1f"))
        row += [f"{s['memory_spread_after_mean']:.3f}/{s['memory_spread_after_max']:.3f}", fmt(s["balanced_share"], ".0%")]
        if with_cost:
            row += [fmt(s["total_excl_plan_ms"]), fmt(s.get("speedup_vs_none_excl_plan"), ".3f") + "x"]
        rows.append(row)
    headers = ["balancer", "imb mean", "imb max", "copies", "main moves", "fan max", "xdom copies"]
    headers += ["xdom MiB"] if with_cost else []
    headers += ["mem spread mean/max", "balanced"]
    headers += ["est. ms*", "vs none*"] if with_cost else []
    domains = f"NVLink domains of {N} ranks" if N is not None and N < R else "one NVLink domain"
    title = (f"Peers (imbalance after = max/mean per-rank load; copies = expert weights sent per load, main-expert "
             f"moves included; fan max = most ranks holding one expert; xdom = copies landing outside their "
             f"home's domain ({domains})"
             + (", and the replica weight + gradient MiB crossing one per invocation" if with_cost else "")
             + "; mem spread = max/mean (token, expert) rows received per rank, the expert activations; "
               "balanced = loads balanced at all"
             + (f"; {ESTIMATE}: ms per layer invocation and speedup over none without plan time" if with_cost else "")
             + ")")
    return format_table(headers, rows, title=title)


def staleness_table(report: dict, labels: Sequence[str]) -> str:
    rows = []
    for r in report["staleness"]:
        rows.append([f"eplb interval={r['interval']} window={r['window']}", fmt(r["imbalance_mean"]),
                     fmt(r["imbalance_p95"]), fmt(r["imbalance_max"]), fmt(r["worse_than_none"], ".1%")])
    for label in labels:
        name = report["balancers"][label]["name"]
        if name != policy.IDEAL:
            s = report["quality"][label]
            rows.append([f"{label} (as configured)", fmt(s["imbalance_mean"]), fmt(s["imbalance_p95"]),
                         fmt(s["imbalance_max"]), fmt(s["worse_than_none"], ".1%")])
    return format_table(["EPLB placement from history", "imb mean", "imb p95", "imb max", "worse>none"], rows,
                        title="Stale history (paper Fig. 6): EPLB re-planned every `interval` microbatches of a "
                              "layer from the last `window`; 'worse>none' = share of loads it made worse than "
                              "no balancing")


def cost_tables(report: dict, labels: Sequence[str]) -> str:
    shape, hw = report["shape"], report["hardware"]
    plan = report["plan_time_us"]
    header = (f"{ESTIMATE} — cost model, not a measurement. Expert h={shape['hidden_size']}, "
              f"f={shape['ffn_hidden_size']}, {'SwiGLU' if shape['gated'] else '2-matrix'} ({shape['source']}); "
              f"{shape['weight_bytes'] / 2**20:.1f} MiB of weights. Hardware: {hw['scale_up_gbps']:g} GB/s scale-up, "
              f"{hw['peak_tflops']:g} TFLOP/s, {hw['hbm_tbps']:g} TB/s HBM (efficiency "
              f"{hw['compute_efficiency']:g}/{hw['comm_efficiency']:g}). Plan time: "
              f"{'fixed ' + format(plan, 'g') + ' us' if plan is not None else 'median of the times measured on this host (CPU)'}; "
              f"weight distribution {'with' if report['relay'] else 'without'} relay in the totals; replica "
              f"transfers overlapped as the runtime schedules them, hiding {hw['transfer_overlap']:.0%} of their "
              "windows (--transfer-overlap). MoE layers only "
              "(attention etc. not modelled); ms per layer invocation (one microbatch), averaged.")
    rows = []
    for label in labels:
        c = report["estimated_cost"][label]
        rows.append([label, fmt(c["fwd_ms"]), fmt(c["bwd_ms"]), fmt(c["total_ms"]), fmt(c["moe_fwd_ms"]),
                     fmt(c["a2a_fwd_ms"]), f"{c['wdist_direct_ms']:.3f}/{c['wdist_relay_ms']:.3f}", fmt(c["plan_ms"]),
                     f"{c['fwd_exposed_ms']:.3f}/{c['bwd_exposed_ms']:.3f}", fmt(c.get("frac_ideal"), ".1%"),
                     fmt(c.get("speedup_vs_none"), ".3f") + "x",
                     fmt(c.get("frac_ideal_excl_plan"), ".1%"), fmt(c.get("speedup_vs_none_excl_plan"), ".3f") + "x"])
    out = [header, format_table(
        ["balancer", "fwd ms", "bwd ms", "total ms", "expert fwd", "a2a fwd", "wdist direct/relay", "plan",
         "exposed fwd/bwd", "of ideal", "vs none", "of ideal*", "vs none*"], rows,
        title=f"{ESTIMATE}: time per MoE layer (* = without the plan term)")]
    layer_rows = []
    for layer, per in report["estimated_cost_per_layer"].items():
        layer_rows.append([str(layer)] + [f"{per[label]['total_ms']:.3f} ({fmt(per[label].get('speedup_vs_none'), '.2f')}x)"
                                          for label in labels])
    out.append(format_table(["layer", *labels], layer_rows,
                            title=f"{ESTIMATE}: fwd+bwd ms per layer (speedup over none)"))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------
# Files: JSON, CSV, plots
# ---------------------------------------------------------------------------------------------

def write_outputs(result, report: dict, labels: Sequence[str], output_dir: Path,
                  heatmap_layers: Optional[Sequence[int]]) -> list[Path]:
    rows = []
    for layer, per in report["quality_per_layer"].items():
        for label, q in per.items():
            row = {"layer": layer, "balancer": label, **q}
            if "estimated_cost_per_layer" in report:
                row.update({f"estimated_{k}": v for k, v in report["estimated_cost_per_layer"][layer][label].items()})
            rows.append(row)
    written = [common.write_csv(output_dir / "replay_per_layer.csv", rows)]
    written += plot_replay(result, labels, output_dir, heatmap_layers, cost=not report.get("estimate_problem"))
    json_path = output_dir / "replay.json"
    json_path.write_text(common.dump_json({**report, "files": [str(p) for p in written + [json_path]]}))
    return written + [json_path]


def _pick_layers(layers: Sequence[int], count: int) -> list[int]:
    if len(layers) <= count:
        return list(layers)
    idx = np.linspace(0, len(layers) - 1, count).round().astype(int)
    return [layers[i] for i in sorted(set(idx))]


def layer_iteration_means(result, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def plot_replay(result, labels: Sequence[str], plot_dir: Path,
                heatmap_layers: Optional[Sequence[int]] = None, cost: bool = True) -> list[Path]:
    """PNG files: imbalance over time per layer (up to 16 layers) and as a layer x iteration
    heatmap (every layer), load heatmaps, EPLB staleness, estimated layer time (with ``cost``, when
    the replay carries the cost model and its estimate applies). Colours: one per
    balancer (``plotting.BALANCER_COLORS``); loads relative to the mean white at 1.0, as in the
    training dashboards. Returns the paths."""
    from ultraep_megatron import plotting
    from ultraep_megatron.analysis import replay as rp

    plt = plotting.pyplot()
    written = []
    balanced = [label for label in labels if result.balancers[label].name not in (policy.NONE, policy.IDEAL)]
    before = result.metrics[labels[0]]["imbalance_before"]

    layers = _pick_layers(result.layers, 16)
    cols = int(np.ceil(np.sqrt(len(layers))))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 0.6, 2.5 * rows + 1.0), squeeze=False,
                             sharey=True, layout="constrained")
    top = 1.0
    for ax, layer in zip(axes.flat, layers):
        mask = result.keys["layer"] == layer
        x = np.arange(int(mask.sum()))
        ax.axhline(1.0, color="0.8", lw=0.8, zorder=0)
        ax.plot(x, before[mask], color=plotting.balancer_color(policy.NONE), lw=1,
                label=f"{policy.NONE} (before balancing)")
        for label in balanced:
            ax.plot(x, result.metrics[label]["imbalance_after"][mask], lw=1.3,
                    color=plotting.balancer_color(label), label=label)
        top = max(top, float(before[mask].max()))
        ax.set_title(f"layer {layer}", fontsize=9)
        plotting.integer_ticks(ax.xaxis)
    axes[0, 0].set_ylim(0.9, top + 0.05 * (top - 0.9))  # 1.0 (balanced) clear of the axis
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("max/mean rank load")
    for ax in axes[-1, :]:
        ax.set_xlabel("microbatch (trace order)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=len(names), fontsize=8, frameon=False)
    shown = "" if len(layers) == len(result.layers) else \
        f" ({len(layers)} of {len(result.layers)} layers; every layer: imbalance_heatmap.png)"
    fig.suptitle(f"Rank imbalance over time per layer, replayed{shown}", fontsize=10)
    written.append(plotting.save_figure(fig, plot_dir / "imbalance_over_time.png"))

    iterations, layer_ids, mean_before = layer_iteration_means(result, before)
    panels = [(f"{policy.NONE} (before balancing)", mean_before)]
    panels += [(f"{label} (after balancing)", layer_iteration_means(result, result.metrics[label]["imbalance_after"])[2])
               for label in balanced]
    written.append(plotting.render_heatmap(
        iterations, layer_ids, panels, plot_dir / "imbalance_heatmap.png",
        "Rank imbalance per layer and iteration (mean over microbatches), replayed"))

    if result.expert_load is not None:
        for layer in heatmap_layers or _pick_layers(result.layers, 3):
            mask = result.keys["layer"] == layer
            if not mask.any():
                continue
            expert = result.expert_load[mask].astype(np.float64)
            share = expert / np.maximum(expert.sum(1, keepdims=True), 1) * result.num_experts
            panels = [("expert load / mean", share.T, "expert")]
            for name, title in ((policy.NONE, "rank load / mean, no balancing"),
                                (policy.ULTRAEP, "rank load / mean, ultraep")):
                label = result.label_of(name)
                if label is not None:
                    ranks = result.rank_load[label][mask].astype(np.float64)
                    panels.append((title, (ranks / np.maximum(ranks.mean(1, keepdims=True), 1e-9)).T, "EP rank"))
            fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 0.8, 3.6), squeeze=False,
                                     layout="constrained")
            # Rank panels share one colour scale (before/after comparable); experts get their own.
            rank_max = max([float(p[1].max()) for p in panels[1:]] or [1.0])
            for ax, (title, data, ylabel) in zip(axes[0], panels):
                cmap, norm = plotting.load_colors(float(data.max()) if ylabel == "expert" else rank_max,
                                                  below_mean=True)
                im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("microbatch (trace order)")
                ax.set_ylabel(ylabel)
                plotting.integer_ticks(ax.xaxis, ax.yaxis)
                fig.colorbar(im, ax=ax).set_label("load / mean (1 = the mean)", fontsize=8)
            fig.suptitle(f"Layer {layer}: load heatmaps (white = the mean load)", fontsize=10)
            written.append(plotting.save_figure(fig, plot_dir / f"load_heatmap_layer{layer}.png"))

    stale = [r for r in rp.staleness_summary(result) if r["label"] not in labels]
    if stale:
        summary = rp.metric_summary(result)
        fig, ax = plt.subplots(figsize=(8.4, 4.0), layout="constrained")
        x = [r["interval"] for r in stale]
        eplb = plotting.balancer_color(policy.EPLB)
        ax.plot(x, [r["imbalance_mean"] for r in stale], "o-", color=eplb, label="eplb on history, mean")
        ax.plot(x, [r["imbalance_p95"] for r in stale], "s--", color=eplb, label="eplb on history, p95")
        for name, style in ((policy.NONE, ":"), (policy.EPLB_EXACT, "-."), (policy.ULTRAEP, "-")):
            label = result.label_of(name)
            if label in labels:
                ax.axhline(summary[label]["imbalance_mean"], ls=style, lw=1.2, color=plotting.balancer_color(label),
                           label=f"{label} mean")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(i) for i in x])
        ax.minorticks_off()
        ax.set_xlabel("EPLB re-plan interval (microbatches of a layer; window = interval)")
        ax.set_ylabel("rank imbalance after (max/mean)")
        ax.set_title("How stale history hurts EPLB (replayed)", fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # clear of the curves
        written.append(plotting.save_figure(fig, plot_dir / "eplb_staleness.png"))

    if cost and result.costs is not None:
        fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * len(result.layers) + 3.5), 4.0), layout="constrained")
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            totals = [rp.cost_summary(result, result.keys["layer"] == layer)[label]["total_ms"] for layer in result.layers]
            ax.bar(np.arange(len(result.layers)) + i * width, totals, width, label=label,
                   color=plotting.balancer_color(label))
        ax.set_xticks(np.arange(len(result.layers)) + 0.4 - width / 2, [str(layer) for layer in result.layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("ms per invocation (fwd+bwd)")
        ax.set_title(f"{ESTIMATE}: MoE layer time per balancer (cost model + plan time on this CPU)",
                     fontsize=10)
        ax.legend(fontsize=8, ncol=len(labels), loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False)
        written.append(plotting.save_figure(fig, plot_dir / "estimated_layer_time.png"))
    return written
