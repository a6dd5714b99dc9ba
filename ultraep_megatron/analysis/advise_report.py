"""The report of ``ultraep advise``: the slot advisor's sweep (:mod:`.advisor`) on a trace, with the
quota floor the hardware implies, as one JSON-ready dict (:func:`start_report`, then
:func:`complete_report`), rendered as text (:func:`render`) and written as JSON, CSV and
advisor.png (:func:`write_outputs`). A trace whose model the cost model cannot size (its MoE layer
estimated below the latencies the model leaves out) gets no recommendation, with what to pass to
project it onto the model trained."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.hardware import ExpertShape, Hardware, min_quota_from_hardware

from . import figures, plotting
from .advisor import CAPACITY_TAIL, CAPACITY_TARGET, advise_slots, recipe_slots, slot_sweep
from .cost import slot_memory_bytes
from .replay import replay
from .summary import estimate_problem, metric_summary
from .tables import ESTIMATE, dump_json, fmt, format_table, write_csv

__all__ = ["PROBE_RECORDS", "complete_report", "render", "start_report", "write_outputs"]

#: Loads replayed (without balancing) to check, before the sweep, that the cost model applies.
PROBE_RECORDS = 64


def quota_label(q, hw_quota: int, num_slots: int = 1) -> str:
    if num_slots == 0:
        return "-"  # no replicas: no floor
    if q is None:
        return "default(1%)"
    return f"hw={q}" if q == hw_quota else str(q)


def start_report(
    records: Iterable,
    shape: ExpertShape,
    source: str,
    hardware: Hardware,
    *,
    training: bool = True,
    inputs: Sequence[str] = (),
) -> tuple[dict, Optional[str]]:
    """The report's head (the cost model's inputs, the hardware quota floor and its terms) and why
    the trace cannot support a recommendation (None when it can), from a replay of its first
    :data:`PROBE_RECORDS` loads without balancing. With a problem the report is complete (no rows,
    no recommendation)."""
    hw_quota = min_quota_from_hardware(shape, hardware, training=training)
    probe = replay(
        itertools.islice(records, PROBE_RECORDS),
        {registry.NONE: BalancerConfig(registry.NONE)},
        shape=shape,
        hardware=hardware,
    )
    problem = estimate_problem(probe)
    report = {
        "estimate_note": "speedups are estimates from ultraep_megatron.analysis.cost, not measurements",
        "inputs": list(inputs),
        "shape": {
            "hidden_size": shape.hidden_size,
            "ffn_hidden_size": shape.ffn_hidden_size,
            "gated": shape.gated,
            "weight_bytes": shape.weight_bytes,
            "source": source,
        },
        "hardware": dict(hardware.__dict__),
        "training": training,
        "hardware_min_quota": hw_quota,
        "expert_transfer_us": shape.weight_bytes / hardware.link_bytes_per_s * 1e6,
        "pair_compute_ns": shape.fwd_flops_per_token / hardware.flops_per_s * 1e9,
        "gemm_overhead_tokens": hardware.gemm_overhead_tokens,
        "mean_rank_load": float(probe.metrics[registry.NONE]["lower_bound"].mean()),
    }
    if problem is not None:
        report.update(
            num_records=probe.num_records,
            rows=[],
            recommendation=None,
            no_recommendation=f"this trace cannot support one: {problem}",
        )
    return report, problem


def complete_report(
    report: dict,
    records: Iterable,
    shape: ExpertShape,
    hardware: Hardware,
    *,
    slots: Sequence[int],
    min_quotas: Sequence[Optional[int]],
    triggers: Sequence[Optional[float]] = (None,),
    domain_size: Optional[int] = None,
    relay: bool = True,
    include_eplb_exact: bool = False,
    num_layers: Optional[int] = None,
    plan_seconds: Optional[float] = None,
    tolerance: float = 0.01,
    min_gain_per_slot: float = 0.005,
    memory_budget_bytes: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> tuple[list[dict], Optional[dict]]:
    """The sweep (:func:`.advisor.slot_sweep`) and the recommendation (:func:`.advisor.advise_slots`)
    added to ``report`` (of :func:`start_report`): its rows, the recommendation or why there is
    none, the per-layer imbalance of the recommended floor and trigger, and the training flags.
    Slot counts over ``memory_budget_bytes`` (per rank) are neither swept nor listed
    (``report["over_budget_slots"]``); when every slot count with replicas is over it, there is no
    recommendation, saying so. Returns (rows, the advice or None)."""
    slots = sorted(set(int(s) for s in slots))
    over = (
        []
        if memory_budget_bytes is None
        else [s for s in slots if slot_memory_bytes(shape, s) > memory_budget_bytes]
    )
    slots = [s for s in slots if s not in over]
    rows, result = slot_sweep(
        records,
        slots,
        min_quotas,
        shape,
        hardware,
        triggers=triggers,
        domain_size=domain_size,
        relay=relay,
        include_eplb_exact=include_eplb_exact,
        num_layers=num_layers,
        plan_seconds=plan_seconds,
        progress=progress,
    )
    if over and not any(s > 0 for s in slots):
        advice, problem = (
            None,
            (
                f"no slot count with replicas fits the memory budget of {memory_budget_bytes / 2**20:.0f} MiB per rank: "
                f"{over[0]} slot(s) take {slot_memory_bytes(shape, over[0]) / 2**20:.0f} MiB (weights + fp32 gradients); "
                "raise --memory-budget-gb, or train without balancing"
            ),
        )
    else:
        try:
            advice = advise_slots(
                rows,
                tolerance=tolerance,
                min_gain_per_slot=min_gain_per_slot,
                memory_budget_bytes=memory_budget_bytes,
            )
            problem = None
        except ValueError as exc:
            advice, problem = None, str(exc)
    report.update(
        {
            "num_ranks": result.num_ranks,
            "num_experts": result.num_experts,
            "recipe_slots": recipe_slots(result.num_experts, result.num_ranks),
            "memory_budget_bytes": memory_budget_bytes,
            "over_budget_slots": {s: slot_memory_bytes(shape, s) for s in over},
            "num_records": result.num_records,
            "layers": result.layers,
            "mean_rank_load": float(result.metrics[registry.IDEAL]["lower_bound"].mean()),
            "rows": rows,
            "recommendation": None
            if advice is None
            else {k: v for k, v in advice.items() if k != "best_per_slots"},
            "no_recommendation": problem,
        }
    )
    if advice is not None:
        # The curve of the recommended floor and trigger (0 slots: neither).
        key = (advice["row"]["min_quota"], advice["row"]["trigger"])
        chosen = {
            r["num_slots"]: r["label"]
            for r in rows
            if r["balancer"] == registry.ULTRAEP
            and ((r["min_quota"], r["trigger"]) == key or r["num_slots"] == 0)
        }
        report["per_layer_imbalance"] = {}
        for layer in result.layers:
            per = metric_summary(result, result.keys["layer"] == layer)
            report["per_layer_imbalance"][layer] = {
                "none": per[registry.NONE]["imbalance_mean"],
                "by_slots": {
                    s: per[label]["imbalance_mean"] for s, label in sorted(chosen.items())
                },
            }
        report["flags"] = advice["flags"] + (
            f" --moe-balancer-domain-size {domain_size}"
            if advice["num_slots"] and domain_size is not None
            else ""
        )
    return rows, advice


def write_outputs(
    report: dict, rows: list[dict], output_dir: Path, advice: Optional[dict] = None
) -> list[Path]:
    """advise.csv (with rows), advisor.png (with a recommendation) and advise.json in ``output_dir``;
    returns the paths."""
    written = [write_csv(output_dir / "advise.csv", rows)] if rows else []
    if advice is not None:
        written.append(plot_advisor(rows, report["hardware_min_quota"], output_dir, advice))
    json_path = output_dir / "advise.json"
    json_path.write_text(dump_json({**report, "files": [str(p) for p in written + [json_path]]}))
    return written + [json_path]


def render(report: dict) -> str:
    shape, hw = report["shape"], report["hardware"]
    hw_quota, training = report["hardware_min_quota"], report["training"]
    k = 3 if training else 1
    out = ["Slot advisor on:"] + [f"  {line}" for line in report["inputs"]]
    if hw.get("named"):
        out += ["", f"Hardware: {hw['named']}"]
    out += [
        "",
        f"Quota floor from the hardware ({'training: fwd+bwd compute saved' if training else 'inference: forward only'}):",
        f"  moving one expert ({shape['weight_bytes'] / 2**20:.1f} MiB, h={shape['hidden_size']}, "
        f"f={shape['ffn_hidden_size']}, {'SwiGLU' if shape['gated'] else '2-matrix'}; {shape['source']}) over "
        f"{hw['scale_up_gbps']:g} GB/s: {report['expert_transfer_us']:.2f} us",
        f"  one (token, expert) pair of compute at {hw['peak_tflops']:g} TFLOP/s: {report['pair_compute_ns']:.3f} ns "
        "forward" + (f", x{k} with backward" if k > 1 else ""),
        f"  one expert GEMM's fixed cost: {report['gemm_overhead_tokens']:g} pairs' worth (small-M efficiency)",
        f"  => a replica pays from q = ceil({report['expert_transfer_us']:.2f} us / ({k} x "
        f"{report['pair_compute_ns']:.3f} ns) + {report['gemm_overhead_tokens']:g}) = {hw_quota} pairs",
    ]
    mean_load = report["mean_rank_load"]
    out.append(
        f"  the traced mean rank load is {mean_load:.0f} (token, expert) pairs per microbatch: q = {hw_quota} is "
        f"{hw_quota / max(mean_load, 1):.1%} of it (the planner default is 1%)"
        + (
            " — replicas will rarely pay at this load; try --load-scale to project a larger microbatch"
            if hw_quota > 0.25 * mean_load
            else ""
        )
    )
    out.append(
        f"  trigger (default): a load is balanced only if its busiest rank's excess over the mean reaches the "
        f"floor q, i.e. from rank imbalance 1 + q / mean rank load: {1 + hw_quota / max(mean_load, 1):.3f} with "
        f"q = {hw_quota} at the traced mean load"
    )
    over = report.get("over_budget_slots") or {}
    if over:
        out += [
            "",
            f"Memory budget {report['memory_budget_bytes'] / 2**20:.0f} MiB per rank: slot counts "
            + ", ".join(f"{s} ({b / 2**20:.0f} MiB)" for s, b in over.items())
            + " are over it, not swept",
        ]
    table = []
    for r in report["rows"]:
        ultraep = r["balancer"] == registry.ULTRAEP
        table.append(
            [
                r["balancer"],
                r["num_slots"],
                quota_label(r["min_quota"], hw_quota, r["num_slots"]) if ultraep else "-",
                (
                    (fmt(r["trigger"], "g") if r["trigger"] is not None else "default")
                    if ultraep and r["num_slots"]
                    else "-"
                ),
                fmt(r["balanced_share"], ".0%"),
                fmt(r["imbalance_mean"]),
                fmt(r["imbalance_p95"]),
                fmt(r["replicas_mean"], ".1f"),
                fmt(r["fanout_max"], ".0f"),
                fmt(r["inflight_mean"], ".0%"),
                fmt(r.get("capacity_bound_p95")),
                fmt(r["speedup_vs_none"], ".3f") + "x",
                fmt(r["frac_ideal"], ".1%"),
                fmt(r["speedup_vs_none_excl_plan"], ".3f") + "x",
                f"{r['memory_bytes'] / 2**20:.0f}",
                f"{r['memory_bytes_per_layer_layout'] / 2**20:.0f}",
            ]
        )
    if table:
        out += [
            "",
            format_table(
                [
                    "balancer",
                    "slots",
                    "min quota",
                    "trigger",
                    "balanced",
                    "imb mean",
                    "imb p95",
                    "replicas",
                    "fan max",
                    "in-flight",
                    "cap p95",
                    "speedup",
                    "of ideal",
                    "speedup*",
                    "MiB/rank",
                    "MiB/rank per-layer",
                ],
                table,
                title=f"Sweep over {report['num_records']} loads (speedup, of ideal: ESTIMATE from the cost model; * = "
                "without the plan term; balanced: loads the trigger let through; cap p95: the capacity bound, "
                "the lowest imbalance any plan with that many slots reaches, 95th percentile; MiB/rank: weights "
                "+ fp32 grads of the slots, shared across layers as UltraEP does, vs one set per MoE layer)",
            ),
        ]
    advice = report["recommendation"]
    if advice is None:
        out += ["", f"no recommendation: {report['no_recommendation']}"]
        if report.get("files"):
            out += ["", "wrote: " + ", ".join(str(p) for p in report["files"])]
        return "\n".join(out)
    per_layer = report["per_layer_imbalance"]
    slots = list(next(iter(per_layer.values()))["by_slots"])
    out += [
        "",
        format_table(
            ["layer", "none", *[f"S={s}" for s in slots]],
            [
                [layer, fmt(v["none"])] + [fmt(v["by_slots"][s]) for s in slots]
                for layer, v in per_layer.items()
            ],
            title=f"Per-layer imbalance (mean) vs slots, ultraep q="
            f"{quota_label(advice['row']['min_quota'], hw_quota)}, trigger "
            f"{'default' if advice['row']['trigger'] is None else format(advice['row']['trigger'], 'g')}",
        ),
    ]
    row = advice["row"]
    out += [
        "",
        f"Recommendation ({ESTIMATE}): {report['flags']}",
        f"  {advice['reason']}",
        f"  imbalance {row['imbalance_mean']:.3f} (p95 {row['imbalance_p95']:.3f}), {row['replicas_mean']:.1f} "
        f"replicas per layer and microbatch, balanced on {row['balanced_share']:.0%} of the loads, "
        f"{row['memory_bytes'] / 2**20:.0f} MiB per rank",
    ]
    capacity = {
        r["num_slots"]: r["capacity_bound_p95"]
        for r in report["rows"]
        if r["balancer"] == registry.ULTRAEP and "capacity_bound_p95" in r
    }
    if capacity:
        need = advice.get("capacity_need")
        out.append(
            "  slot rule, capacity: a rank's S slots carry at most S expert loads; lowest imbalance any plan "
            "reaches (95th percentile) "
            + ", ".join(f"S={s}: {b:.3f}" for s, b in sorted(capacity.items()))
            + (
                f"; the fewest slots reaching {CAPACITY_TARGET:g} on {1 - CAPACITY_TAIL:.0%} of the loads: {need}"
                if need is not None
                else f"; no slot count swept reaches {CAPACITY_TARGET:g} on "
                f"{1 - CAPACITY_TAIL:.0%} of the loads (the NVLink domains, or more slots than swept)"
            )
        )
    if report.get("recipe_slots") is not None:
        out.append(
            f"  a recipe without a trace takes max(2, ceil(E / 2R)) = {report['recipe_slots']} slot(s) for "
            f"E={report['num_experts']} over R={report['num_ranks']} (docs/recipes.md, the slot rule)"
        )
    if advice["benefit_per_slot"]:
        out.append(
            "  benefit per slot (speedup gained per slot over no replicas): "
            + ", ".join(f"S={s}: {b:+.3f}x" for s, b in advice["benefit_per_slot"].items())
        )
    if report.get("files"):
        out += ["", "wrote: " + ", ".join(str(p) for p in report["files"])]
    return "\n".join(out)


def plot_advisor(rows: list[dict], hw_quota: int, plot_dir: Path, recommendation: dict) -> Path:
    """advisor.png: balance and estimated speedup against slots, one curve per balancer and quota
    floor (in the balancer's colour; floors by line style), memory on the top axis."""
    plt = figures.pyplot()
    fig, (ax_imb, ax_speed) = plt.subplots(1, 2, figsize=(11.5, 4.4), layout="constrained")
    no_replicas = [r for r in rows if r["balancer"] == registry.ULTRAEP and r["num_slots"] == 0]
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["balancer"] == registry.ULTRAEP and r["num_slots"] > 0:
            label = f"ultraep q={quota_label(r['min_quota'], hw_quota)}" + (
                f" t={r['trigger']:g}" if r.get("trigger") is not None else ""
            )
            series.setdefault(label, list(no_replicas)).append(r)
        elif r["balancer"] != registry.ULTRAEP:
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
    ax_speed.annotate(
        "recommended",
        (recommendation["num_slots"], 0.02),
        xycoords=("data", "axes fraction"),
        fontsize=8,
        textcoords="offset points",
        xytext=(3, 0),
    )
    for ax in (ax_imb, ax_speed):
        ax.set_xlabel("redundant slots per rank")
        figures.integer_ticks(ax.xaxis)
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
    return figures.save_figure(fig, plot_dir / "advisor.png")
