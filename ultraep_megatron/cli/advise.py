"""ultraep advise: how many redundant slots, which quota floor and which trigger does UltraEP need
on my model's routing?

Replays the trace through ultraep for every (slots, min quota, trigger) combination and prints the
balance, the ESTIMATED speedup over no balancing and the memory each choice costs, then recommends
the smallest slot count past which extra slots stop paying (CRAFT's benefit per replica, applied to
real-time balancing). It also derives the quota floor from the hardware: a replica pays only if the
tokens it takes off the busiest rank save more compute time than moving the expert's weights and
running a GEMM of its own cost (HarMoEny's threshold plus the GEMM's small-M overhead); by default the
trigger follows from the floor (a load is balanced only if its busiest rank's excess reaches it).
The recommendation is printed as the --moe-balancer-* flags to train with; when no slot count pays,
the advice is to train without balancing. A trace whose model is too small for the cost model (its
MoE layer estimated below the latencies the model leaves out, e.g. a tiny CPU run) gets no
recommendation, with what to pass to project it onto the model you train.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from ultraep_megatron.planner import policy
from ultraep_megatron.plotting import save_figure

from . import common
from .common import ESTIMATE, fmt, format_table
from .replay import resolve_min_quota

SUMMARY = ("recommend --moe-balancer-num-slots, --moe-balancer-min-quota and --moe-balancer-trigger for a "
           "routing trace")
#: Loads replayed (without balancing) to check, before the sweep, that the cost model applies.
PROBE_RECORDS = 64
EXAMPLES = """examples:
  ultraep advise runs/kjv/trace
  ultraep advise TRACE --slots 0,1,2,4 --min-quotas default,hw,256 --memory-budget-gb 2
  ultraep advise TRACE --load-scale 16 --hidden-size 7168 --moe-ffn-hidden-size 2048 --json
  ultraep advise TRACE --moe-balancer-hardware h100-hgx --triggers default,1.0,1.3
"""


def quota_list(text: str) -> list:
    """'default,hw,256' -> [None, 'hw', 256]."""
    return [None if x.strip() == "default" else common.min_quota_arg(x.strip()) for x in text.split(",") if x.strip()]


def trigger_list(text: str) -> list:
    """'default,1.0,1.3' -> [None, 1.0, 1.3] (rank imbalances >= 1)."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = None if x == "default" else float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'default' or a number >= 1, got {x!r}") from None
        if value is not None and not value >= 1:
            raise argparse.ArgumentTypeError(f"a trigger is a rank imbalance >= 1, got {x}")
        out.append(value)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("advise", help=SUMMARY, description=__doc__.split("\n\n", 1)[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_trace_input_args(parser)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--slots", type=common.int_list, default=[0, 1, 2, 3, 4, 6, 8], metavar="S,S",
                       help="redundant slots per rank to try (default: 0,1,2,3,4,6,8)")
    sweep.add_argument("--min-quotas", type=quota_list, default=[None, "hw"], metavar="Q,Q",
                       help="quota floors to try: 'default' (1%% of the mean rank load), 'hw' (from the "
                            "hardware), or tokens (default: default,hw)")
    sweep.add_argument("--triggers", type=trigger_list, default=[None], metavar="X,X",
                       help="triggers to try: 'default' (1 + floor / mean rank load of each load) or rank "
                            "imbalances, 1 = always balance (default: default)")
    sweep.add_argument("--eplb-exact", action="store_true", help="also sweep EPLB's rule on the exact load")
    sweep.add_argument("--inference", action="store_true",
                       help="derive the hardware quota floor for inference/prefill (forward only)")
    rec = parser.add_argument_group("recommendation")
    rec.add_argument("--tolerance", type=float, default=0.01,
                     help="recommend the fewest slots within this fraction of the best speedup (%(default)s)")
    rec.add_argument("--min-gain-per-slot", type=float, default=0.005,
                     help="stop adding slots once one buys less speedup than this (%(default)s)")
    rec.add_argument("--memory-budget-gb", type=float, default=None, help="skip slot counts over this (GiB per rank)")
    rec.add_argument("--num-moe-layers", type=int, default=None,
                     help="MoE layers of the model, for the per-layer-replica memory column (default: as traced)")
    common.add_model_hardware_args(parser)
    topology = parser.add_argument_group("training settings (as in training)")
    policy.add_balancer_arguments(topology, runtime=False, balancer_flag=False, only=("hardware", "domain_size"))
    common.add_output_args(parser, files="advisor.png, advise.json and advise.csv")
    parser.set_defaults(run=run)
    return parser


def quota_label(q, hw_quota: int, num_slots: int = 1) -> str:
    if num_slots == 0:
        return "-"  # no replicas: no floor
    if q is None:
        return "default(1%)"
    return f"hw={q}" if q == hw_quota else str(q)


def run(args) -> int:
    from ultraep_megatron.analysis import advisor
    from ultraep_megatron.analysis import replay as rp
    from ultraep_megatron.analysis.cost import min_quota_from_hardware
    from ultraep_megatron.planner.policy import BalancerConfig

    output_dir = common.prepare_output_dir(args.output_dir)
    records = common.open_records(args)
    shape, source, hardware = common.shape_and_hardware(args, records.meta)
    training = not args.inference
    hw_quota = min_quota_from_hardware(shape, hardware, training=training)
    quotas = list(dict.fromkeys(resolve_min_quota(q, shape, hardware, training=training) for q in args.min_quotas))
    probe = rp.replay(itertools.islice(records, PROBE_RECORDS), {policy.NONE: BalancerConfig(policy.NONE)},
                      shape=shape, hardware=hardware)
    problem = rp.estimate_problem(probe)
    report = {
        "estimate_note": "speedups are estimates from ultraep_megatron.analysis.cost, not measurements",
        "inputs": records.describe(),
        "shape": {"hidden_size": shape.hidden_size, "ffn_hidden_size": shape.ffn_hidden_size,
                  "gated": shape.gated, "weight_bytes": shape.weight_bytes, "source": source},
        "hardware": dict(hardware.__dict__), "training": training, "hardware_min_quota": hw_quota,
        "expert_transfer_us": shape.weight_bytes / hardware.link_bytes_per_s * 1e6,
        "pair_compute_ns": shape.fwd_flops_per_token / hardware.flops_per_s * 1e9,
        "gemm_overhead_tokens": hardware.gemm_overhead_tokens,
        "mean_rank_load": float(probe.metrics[policy.NONE]["lower_bound"].mean()),
    }
    if problem is not None:
        report.update(num_records=probe.num_records, rows=[], recommendation=None,
                      no_recommendation=f"this trace cannot support one: {problem}")
        return finish(report, args, output_dir, [], hw_quota)
    progress = common.progress_for(args, "advise", records)
    try:
        rows, result = advisor.slot_sweep(
            records, args.slots, quotas, shape, hardware, triggers=args.triggers,
            domain_size=args.moe_balancer_domain_size, relay=not args.no_relay, include_eplb_exact=args.eplb_exact,
            num_layers=args.num_moe_layers, plan_seconds=common.plan_seconds(args), progress=progress)
    finally:
        progress.close()
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    try:
        advice = advisor.advise_slots(rows, tolerance=args.tolerance, min_gain_per_slot=args.min_gain_per_slot,
                                      memory_budget_bytes=budget)
        problem = None
    except ValueError as exc:
        advice, problem = None, str(exc)
    report.update({
        "num_records": result.num_records, "layers": result.layers,
        "mean_rank_load": float(result.metrics[policy.IDEAL]["lower_bound"].mean()),
        "rows": rows,
        "recommendation": None if advice is None else {k: v for k, v in advice.items() if k != "best_per_slots"},
        "no_recommendation": problem,
    })
    if advice is not None:
        # The curve of the recommended floor and trigger (0 slots: neither).
        key = (advice["row"]["min_quota"], advice["row"]["trigger"])
        chosen = {r["num_slots"]: r["label"] for r in rows if r["balancer"] == policy.ULTRAEP
                  and ((r["min_quota"], r["trigger"]) == key or r["num_slots"] == 0)}
        report["per_layer_imbalance"] = {}
        for layer in result.layers:
            per = rp.metric_summary(result, result.keys["layer"] == layer)
            report["per_layer_imbalance"][layer] = {
                "none": per[policy.NONE]["imbalance_mean"],
                "by_slots": {s: per[label]["imbalance_mean"] for s, label in sorted(chosen.items())}}
        report["flags"] = advice["flags"] + (
            f" --moe-balancer-domain-size {args.moe_balancer_domain_size}"
            if advice["num_slots"] and args.moe_balancer_domain_size is not None else "")
    return finish(report, args, output_dir, rows, hw_quota, advice)


def finish(report: dict, args, output_dir, rows: list[dict], hw_quota: int, advice=None) -> int:
    """Write the files, print the report; exit status 0 with a recommendation, else 1."""
    if output_dir is not None:
        written = [common.write_csv(output_dir / "advise.csv", rows)] if rows else []
        if advice is not None:
            written.append(plot_advisor(rows, hw_quota, output_dir, advice))
        json_path = output_dir / "advise.json"
        json_path.write_text(common.dump_json({**report, "files": [str(p) for p in written + [json_path]]}))
        report["files"] = written + [json_path]
    if args.json:
        common.dump_json(report, stream=sys.stdout)
    else:
        print(render(report))
    return common.EXIT_OK if advice is not None else common.EXIT_FAILED


def render(report: dict) -> str:
    shape, hw = report["shape"], report["hardware"]
    hw_quota, training = report["hardware_min_quota"], report["training"]
    k = 3 if training else 1
    out = ["Slot advisor on:"] + [f"  {line}" for line in report["inputs"]]
    out += ["", f"Quota floor from the hardware ({'training: fwd+bwd compute saved' if training else 'inference: forward only'}):",
            f"  moving one expert ({shape['weight_bytes'] / 2**20:.1f} MiB, h={shape['hidden_size']}, "
            f"f={shape['ffn_hidden_size']}, {'SwiGLU' if shape['gated'] else '2-matrix'}; {shape['source']}) over "
            f"{hw['scale_up_gbps']:g} GB/s: {report['expert_transfer_us']:.2f} us",
            f"  one (token, expert) pair of compute at {hw['peak_tflops']:g} TFLOP/s: {report['pair_compute_ns']:.3f} ns "
            "forward" + (f", x{k} with backward" if k > 1 else ""),
            f"  one expert GEMM's fixed cost: {report['gemm_overhead_tokens']:g} tokens' worth (small-M efficiency)",
            f"  => a replica pays from q = ceil({report['expert_transfer_us']:.2f} us / ({k} x "
            f"{report['pair_compute_ns']:.3f} ns) + {report['gemm_overhead_tokens']:g}) = {hw_quota} tokens"]
    mean_load = report["mean_rank_load"]
    out.append(f"  the traced mean rank load is {mean_load:.0f} tokens per microbatch: q = {hw_quota} is "
               f"{hw_quota / max(mean_load, 1):.1%} of it (the planner default is 1%)"
               + (" — replicas will rarely pay at this load; try --load-scale to project a larger microbatch"
                  if hw_quota > 0.25 * mean_load else ""))
    out.append(f"  trigger (default): a load is balanced only if its busiest rank's excess over the mean reaches the "
               f"floor q, i.e. from rank imbalance 1 + q / mean rank load: {1 + hw_quota / max(mean_load, 1):.3f} with "
               f"q = {hw_quota} at the traced mean load")
    table = []
    for r in report["rows"]:
        ultraep = r["balancer"] == policy.ULTRAEP
        table.append([r["balancer"], r["num_slots"],
                      quota_label(r["min_quota"], hw_quota, r["num_slots"]) if ultraep else "-",
                      ((fmt(r["trigger"], "g") if r["trigger"] is not None else "default")
                       if ultraep and r["num_slots"] else "-"),
                      fmt(r["balanced_share"], ".0%"),
                      fmt(r["imbalance_mean"]), fmt(r["imbalance_p95"]), fmt(r["replicas_mean"], ".1f"),
                      fmt(r["fanout_max"], ".0f"), fmt(r["inflight_mean"], ".0%"),
                      fmt(r["speedup_vs_none"], ".3f") + "x", fmt(r["frac_ideal"], ".1%"),
                      fmt(r["speedup_vs_none_excl_plan"], ".3f") + "x",
                      f"{r['memory_bytes'] / 2**20:.0f}", f"{r['memory_bytes_per_layer_layout'] / 2**20:.0f}"])
    if table:
        out += ["", format_table(
            ["balancer", "slots", "min quota", "trigger", "balanced", "imb mean", "imb p95", "replicas", "fan max",
             "in-flight", "speedup", "of ideal", "speedup*", "MiB/rank", "MiB/rank per-layer"], table,
            title=f"Sweep over {report['num_records']} loads (speedup, of ideal: ESTIMATE from the cost model; * = "
                  "without the plan term; balanced: loads the trigger let through; MiB/rank: weights + fp32 grads "
                  "of the slots, shared across layers as UltraEP does, vs one set per MoE layer)")]
    advice = report["recommendation"]
    if advice is None:
        out += ["", f"no recommendation: {report['no_recommendation']}"]
        if report.get("files"):
            out += ["", "wrote: " + ", ".join(str(p) for p in report["files"])]
        return "\n".join(out)
    per_layer = report["per_layer_imbalance"]
    slots = list(next(iter(per_layer.values()))["by_slots"])
    out += ["", format_table(["layer", "none", *[f"S={s}" for s in slots]],
                             [[layer, fmt(v["none"])] + [fmt(v["by_slots"][s]) for s in slots]
                              for layer, v in per_layer.items()],
                             title=f"Per-layer imbalance (mean) vs slots, ultraep q="
                                   f"{quota_label(advice['row']['min_quota'], hw_quota)}, trigger "
                                   f"{'default' if advice['row']['trigger'] is None else format(advice['row']['trigger'], 'g')}")]
    row = advice["row"]
    out += ["", f"Recommendation ({ESTIMATE}): {report['flags']}",
            f"  {advice['reason']}",
            f"  imbalance {row['imbalance_mean']:.3f} (p95 {row['imbalance_p95']:.3f}), {row['replicas_mean']:.1f} "
            f"replicas per layer and microbatch, balanced on {row['balanced_share']:.0%} of the loads, "
            f"{row['memory_bytes'] / 2**20:.0f} MiB per rank",
            "  benefit per slot (speedup gained per slot over no replicas): "
            + ", ".join(f"S={s}: {b:+.3f}x" for s, b in advice["benefit_per_slot"].items())]
    if report.get("files"):
        out += ["", "wrote: " + ", ".join(str(p) for p in report["files"])]
    return "\n".join(out)


def plot_advisor(rows: list[dict], hw_quota: int, plot_dir: Path, recommendation: dict) -> Path:
    """advisor.png: balance and estimated speedup against slots, one curve per balancer and quota
    floor (in the balancer's colour; floors by line style), memory on the top axis."""
    from ultraep_megatron import plotting

    plt = plotting.pyplot()
    fig, (ax_imb, ax_speed) = plt.subplots(1, 2, figsize=(11.5, 4.4), layout="constrained")
    no_replicas = [r for r in rows if r["balancer"] == policy.ULTRAEP and r["num_slots"] == 0]
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["balancer"] == policy.ULTRAEP and r["num_slots"] > 0:
            label = (f"ultraep q={quota_label(r['min_quota'], hw_quota)}"
                     + (f" t={r['trigger']:g}" if r.get("trigger") is not None else ""))
            series.setdefault(label, list(no_replicas)).append(r)
        elif r["balancer"] != policy.ULTRAEP:
            series.setdefault(r["balancer"], []).append(r)
    styles = iter(("o-", "s--", "^:", "D-.", "v-", "P--", "X:", "*-.", "h-", "p--"))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["num_slots"])
        x = [r["num_slots"] for r in rs]
        style, color = next(styles), plotting.balancer_color(label)
        ax_imb.plot(x, [r["imbalance_mean"] for r in rs], style, color=color, label=label)
        ax_speed.plot(x, [r["speedup_vs_none"] for r in rs], style, color=color, label=label)
    ax_speed.axhline(1.0, color="0.8", lw=0.8, zorder=0)
    ax_speed.axvline(recommendation["num_slots"], color="k", ls=":", lw=1)
    ax_speed.annotate("recommended", (recommendation["num_slots"], 0.02), xycoords=("data", "axes fraction"),
                      fontsize=8, textcoords="offset points", xytext=(3, 0))
    for ax in (ax_imb, ax_speed):
        ax.set_xlabel("redundant slots per rank")
        plotting.integer_ticks(ax.xaxis)
    ax_imb.set_ylabel("rank imbalance after (mean)")
    ax_imb.set_title("Balance vs slots (replayed)", fontsize=10)
    ax_speed.set_ylabel("estimated speedup over none")
    ax_speed.set_title(f"{ESTIMATE}: MoE-layer speedup vs slots", fontsize=10)
    slots = sorted({r["num_slots"] for r in rows})
    memory = {r["num_slots"]: r["memory_bytes"] for r in rows}
    top = ax_speed.secondary_xaxis("top")
    top.set_xticks(slots, [f"{memory[s] / 2**20:.0f}" for s in slots], fontsize=7)
    top.set_xlabel("MiB per rank (shared slot buffers)", fontsize=8)
    ax_imb.legend(fontsize=8)
    return save_figure(fig, plot_dir / "advisor.png")
