#!/usr/bin/env python
"""How many redundant slots (and which quota floor) does UltraEP need on my model's routing?

    python tools/slot_advisor.py TRACE_DIR_OR_FILES [--slots 0,1,2,3,4,6,8]
        [--min-quotas auto,hw,256] [--eplb-exact] [--memory-budget-gb 2]
        [--hidden-size H --moe-ffn-hidden-size F --swiglu] [--scale-up-bandwidth 900 ...]
        [--plot-dir DIR] [--json-out FILE]

Replays the trace through ultraep for every (slots, min quota) pair and prints the balance, the
ESTIMATED speedup over no balancing and the memory each choice costs, then recommends the
smallest slot count past which extra slots stop paying (CRAFT's benefit per replica, applied to
real-time balancing). It also derives the quota floor from the hardware: a replica pays only if the
tokens it takes off the busiest rank cost more compute time than moving the expert's weights
(HarMoEny's threshold). All times come from the cost model in ultraep_megatron.costmodel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import replay_trace as rt  # noqa: E402

from ultraep_megatron import costmodel as cm  # noqa: E402
from ultraep_megatron import traces  # noqa: E402


def quota_list(text: str) -> list:
    return [rt.min_quota_arg(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    rt.add_input_args(parser)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--slots", type=rt.int_list, default=[0, 1, 2, 3, 4, 6, 8],
                       help="redundant slots per rank to try (0,1,2,3,4,6,8)")
    sweep.add_argument("--min-quotas", type=quota_list, default=["auto", "hw"],
                       help="quota floors to try: 'auto' (planner default), 'hw' (from the hardware), tokens")
    sweep.add_argument("--eplb-exact", action="store_true", help="also sweep EPLB's rule on the exact load")
    sweep.add_argument("--inference", action="store_true",
                       help="derive the hardware quota floor for inference/prefill (forward only)")
    rec = parser.add_argument_group("recommendation")
    rec.add_argument("--tolerance", type=float, default=0.01,
                     help="recommend the fewest slots within this fraction of the best speedup (0.01)")
    rec.add_argument("--min-gain-per-slot", type=float, default=0.005,
                     help="stop adding slots once one buys less speedup than this (0.005)")
    rec.add_argument("--memory-budget-gb", type=float, default=None, help="skip slot counts over this (GiB per rank)")
    rec.add_argument("--num-moe-layers", type=int, default=None,
                     help="MoE layers of the model, for the per-layer-replica memory column (default: as traced)")
    rt.add_model_hardware_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--plot-dir", type=Path, default=None, help="write advisor curves (PNG) here")
    out.add_argument("--json-out", type=Path, default=None, help="write the sweep and recommendation as JSON")
    return parser.parse_args(argv)


def quota_label(q, hw_quota: int) -> str:
    if q is None:
        return "auto(1%)"
    if q == hw_quota:
        return f"hw={q}"
    return str(q)


def mean_rank_load(result: cm.ReplayResult) -> float:
    """Mean per-rank load per record (the planner default floor is 1 % of it)."""
    thresholds = result.metrics["ideal"]["lower_bound"]
    return float(thresholds.mean())


def plot_advisor(rows: list[dict], hw_quota: int, plot_dir: Path, recommendation: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax_imb, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        label = f"ultraep q={quota_label(r['min_quota'], hw_quota)}" if r["balancer"] == "ultraep" else r["balancer"]
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["num_slots"])
        x = [r["num_slots"] for r in rs]
        ax_imb.plot(x, [r["imbalance_mean"] for r in rs], "o-", label=label)
        ax_speed.plot(x, [r["speedup_vs_none"] for r in rs], "o-", label=label)
    ax_speed.axvline(recommendation["num_slots"], color="k", ls=":", lw=1)
    ax_speed.annotate("recommended", (recommendation["num_slots"], ax_speed.get_ylim()[0]), fontsize=8,
                      textcoords="offset points", xytext=(3, 5))
    ax_imb.set_xlabel("redundant slots per rank")
    ax_imb.set_ylabel("rank imbalance after (mean)")
    ax_imb.set_title("Balance vs slots (replayed)")
    ax_speed.set_xlabel("redundant slots per rank")
    ax_speed.set_ylabel("estimated speedup over none")
    ax_speed.set_title("ESTIMATE: MoE-layer speedup vs slots")
    slots = sorted({r["num_slots"] for r in rows})
    memory = {r["num_slots"]: r["memory_bytes"] for r in rows}
    top = ax_speed.secondary_xaxis("top")
    top.set_xticks(slots, [f"{memory[s] / 2**20:.0f}" for s in slots], fontsize=7)
    top.set_xlabel("MiB per rank (shared slot buffers)", fontsize=8)
    ax_imb.legend(fontsize=7)
    fig.tight_layout()
    path = plot_dir / "slot_advisor.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        files = traces.find_trace_files(args.traces)
        lines, meta, _ = rt.describe_inputs(files)
        records = cm.TraceRecords(files, layers=args.layers, max_records=args.max_records, load_scale=args.load_scale)
    except (traces.TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shape, source, hardware = rt.shape_and_hardware(args, meta)
    training = not args.inference
    hw_quota = cm.min_quota_from_hardware(shape, hardware, training=training)
    quotas = list(dict.fromkeys(rt.resolve_min_quota(q, shape, hardware, training=training) for q in args.min_quotas))
    print(f"Slot advisor on {len(files)} trace file(s):")
    print("\n".join(lines))

    transfer_us = shape.weight_bytes / hardware.link_bytes_per_s * 1e6
    per_token_ns = shape.fwd_flops_per_token / hardware.flops_per_s * 1e9
    k = 3 if training else 1
    print(f"\nQuota floor from the hardware ({'training: fwd+bwd compute saved' if training else 'inference: forward only'}):")
    print(f"  moving one expert ({shape.weight_bytes / 2**20:.1f} MiB, h={shape.hidden_size}, f={shape.ffn_hidden_size}, "
          f"{'SwiGLU' if shape.gated else '2-matrix'}; {source}) over {hardware.scale_up_gbps:g} GB/s: {transfer_us:.2f} us")
    print(f"  one (token, expert) pair of compute at {hardware.peak_tflops:g} TFLOP/s: {per_token_ns:.3f} ns forward"
          + (f", x{k} with backward" if k > 1 else ""))
    print(f"  => a replica pays from q = ceil({transfer_us:.2f} us / ({k} x {per_token_ns:.3f} ns)) = {hw_quota} tokens")

    progress = rt.Progress("advisor", enabled=not args.no_progress)
    total = records.total if not args.no_progress else 0
    try:
        rows, result = cm.slot_sweep(
            records, args.slots, quotas, shape, hardware, relay=not args.no_relay, include_eplb_exact=args.eplb_exact,
            num_layers=args.num_moe_layers,
            plan_seconds=None if args.plan_time_us is None else args.plan_time_us * 1e-6,
            progress=lambda done: progress(done, total))
    except (traces.TraceError, ValueError) as exc:
        progress.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress.close()
    mean_load = mean_rank_load(result)
    print(f"  the traced mean rank load is {mean_load:.0f} tokens per microbatch: q = {hw_quota} is "
          f"{hw_quota / max(mean_load, 1):.1%} of it (the planner default is 1%)"
          + (" — replicas will rarely pay at this load; try --load-scale to project a larger microbatch"
             if hw_quota > 0.25 * mean_load else ""))

    table = []
    for r in rows:
        table.append([r["balancer"], r["num_slots"], quota_label(r["min_quota"], hw_quota) if r["balancer"] == "ultraep" else "-",
                      rt.fmt(r["imbalance_mean"]), rt.fmt(r["imbalance_p95"]), rt.fmt(r["replicas_mean"], ".1f"),
                      rt.fmt(r["fanout_max"], ".0f"), rt.fmt(r["inflight_mean"], ".0%"),
                      rt.fmt(r["speedup_vs_none"], ".3f") + "x", rt.fmt(r["frac_ideal"], ".1%"),
                      rt.fmt(r["speedup_vs_none_excl_plan"], ".3f") + "x",
                      f"{r['memory_bytes'] / 2**20:.0f}", f"{r['memory_bytes_per_layer_layout'] / 2**20:.0f}"])
    print()
    print(rt.format_table(
        ["balancer", "slots", "min quota", "imb mean", "imb p95", "replicas", "fan max", "in-flight",
         "speedup", "of ideal", "speedup*", "MiB/rank", "MiB/rank per-layer"], table,
        title=f"Sweep over {result.num_records} records (speedup, of ideal: ESTIMATE from the cost model; * = without "
              "the plan term; MiB/rank: weights + fp32 grads of the slots, shared across layers as UltraEP does, "
              "vs one set per MoE layer)"))

    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    try:
        advice = cm.advise_slots(rows, tolerance=args.tolerance, min_gain_per_slot=args.min_gain_per_slot,
                                 memory_budget_bytes=budget)
    except ValueError as exc:
        print(f"\nno recommendation: {exc}")
        return 1

    # CRAFT's per-layer view: how much each layer gains from the slots (at the chosen floor).
    layer_rows = []
    chosen_q = advice["min_quota"]
    keys = {r["num_slots"]: r["key"] for r in rows if r["balancer"] == "ultraep" and r["min_quota"] == chosen_q}
    for layer in result.layers:
        per = cm.metric_summary(result, result.keys["layer"] == layer)
        layer_rows.append([layer, rt.fmt(per["none"]["imbalance_mean"])]
                          + [rt.fmt(per[keys[s]]["imbalance_mean"]) for s in sorted(keys)])
    print()
    print(rt.format_table(["layer", "none", *[f"S={s}" for s in sorted(keys)]], layer_rows,
                          title=f"Per-layer imbalance (mean) vs slots, ultraep q={quota_label(chosen_q, hw_quota)}"))

    row = advice["row"]
    print(f"\nRecommendation ({rt.ESTIMATE}): --moe-balancer-num-slots {advice['num_slots']} "
          f"--moe-balancer-min-quota {row['min_quota'] if row['min_quota'] is not None else '<planner default>'}")
    print(f"  {advice['reason']}")
    print(f"  imbalance {row['imbalance_mean']:.3f} (p95 {row['imbalance_p95']:.3f}), {row['replicas_mean']:.1f} replicas "
          f"per layer and microbatch, {row['memory_bytes'] / 2**20:.0f} MiB per rank")
    print("  benefit per slot (speedup gained per slot over no replicas): "
          + ", ".join(f"S={s}: {b:+.3f}x" for s, b in advice["benefit_per_slot"].items()))

    if args.plot_dir is not None:
        print(f"\nplot: {plot_advisor(rows, hw_quota, args.plot_dir, advice)}")
    if args.json_out is not None:
        payload = {"estimate_note": "speedups are estimates from ultraep_megatron.costmodel, not measurements",
                   "hardware_min_quota": hw_quota, "training": training, "rows": rows,
                   "recommendation": {k: v for k, v in advice.items() if k != "best_per_slots"}}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
        print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
