"""ultraep advise: how many redundant slots, which quota floor and which trigger does UltraEP need
on my model's routing?

Replays the trace through ultraep for every (slots, min quota, trigger) combination and prints the
balance, the ESTIMATED speedup over no balancing and the memory each choice costs, then recommends
the smallest slot count past which extra slots stop paying (CRAFT's benefit per replica, applied to
real-time balancing). It also derives the quota floor from the hardware: a replica pays only if the
(token, expert) pairs it takes off the busiest rank save more compute time than moving the expert's
weights and running a GEMM of its own cost (HarMoEny's threshold plus the GEMM's small-M overhead);
by default the trigger follows from the floor (a load is balanced only if its busiest rank's excess
reaches it).
The recommendation is printed as the --moe-balancer-* flags to train with; when no slot count pays,
the advice is to train without balancing. A trace whose model is too small for the cost model (its
MoE layer estimated below the latencies the model leaves out, e.g. a tiny CPU run) gets no
recommendation, with what to pass to project it onto the model you train.
"""

from __future__ import annotations

import argparse
import sys

from ultraep_megatron.settings.knobs import add_balancer_arguments

from . import common

SUMMARY = (
    "recommend --moe-balancer-num-slots, --moe-balancer-min-quota and --moe-balancer-trigger for a "
    "routing trace"
)
EXAMPLES = """examples:
  ultraep advise runs/kjv/trace
  ultraep advise TRACE --slots 0,1,2,4 --min-quotas default,hw,256 --memory-budget-gb 2
  ultraep advise TRACE --load-scale 16 --hidden-size 7168 --moe-ffn-hidden-size 2048 --json
  ultraep advise TRACE --moe-balancer-hardware h100-hgx --triggers default,1.0,1.3
"""


def quota_list(text: str) -> list:
    """'default,hw,256' -> [None, 'hw', 256]."""
    return [
        None if x.strip() == "default" else common.min_quota_arg(x.strip())
        for x in text.split(",")
        if x.strip()
    ]


def trigger_list(text: str) -> list:
    """'default,1.0,1.3' -> [None, 1.0, 1.3] (rank imbalances >= 1)."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = None if x == "default" else float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected 'default' or a number >= 1, got {x!r}"
            ) from None
        if value is not None:
            common.setting_problem("trigger", value, "a trigger (a rank imbalance)")
        out.append(value)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "advise",
        help=SUMMARY,
        description=__doc__.split("\n\n", 1)[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_trace_input_args(parser)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--slots",
        type=common.int_list,
        default=[0, 1, 2, 3, 4, 6, 8],
        metavar="S,S",
        help="redundant slots per rank to try (default: 0,1,2,3,4,6,8)",
    )
    sweep.add_argument(
        "--min-quotas",
        type=quota_list,
        default=[None, "hw"],
        metavar="Q,Q",
        help="quota floors to try: 'default' (1%% of the mean rank load), 'hw' (from the "
        "hardware), or a number of (token, expert) pairs (default: default,hw)",
    )
    sweep.add_argument(
        "--triggers",
        type=trigger_list,
        default=[None],
        metavar="X,X",
        help="triggers to try: 'default' (1 + floor / mean rank load of each load) or rank "
        "imbalances, 1 = always balance (default: default)",
    )
    sweep.add_argument(
        "--eplb-exact", action="store_true", help="also sweep EPLB's rule on the exact load"
    )
    sweep.add_argument(
        "--inference",
        action="store_true",
        help="derive the hardware quota floor for inference/prefill (forward only)",
    )
    rec = parser.add_argument_group("recommendation")
    rec.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="recommend the fewest slots within this fraction of the best speedup (%(default)s)",
    )
    rec.add_argument(
        "--min-gain-per-slot",
        type=float,
        default=0.005,
        help="stop adding slots once one buys less speedup than this (%(default)s)",
    )
    rec.add_argument(
        "--memory-budget-gb",
        type=common.non_negative_float,
        default=None,
        help="skip slot counts whose slots (weights + fp32 gradients) take more than this, GiB per rank",
    )
    rec.add_argument(
        "--num-moe-layers",
        type=int,
        default=None,
        help="MoE layers of the model, for the per-layer-replica memory column (default: as traced)",
    )
    common.add_model_hardware_args(parser)
    topology = parser.add_argument_group("training settings (as in training)")
    add_balancer_arguments(
        topology, runtime=False, balancer_flag=False, only=("hardware", "domain_size")
    )
    common.add_output_args(parser, files="advisor.png, advise.json and advise.csv")
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    from ultraep_megatron.analysis import advise_report
    from ultraep_megatron.analysis.inputs import resolve_min_quota

    output_dir = common.prepare_output_dir(args.output_dir)
    records = common.open_records(args)
    hardware_source = common.apply_traced_run_settings(args, records)
    shape, source, hardware = common.shape_and_hardware(args, records.meta)
    common.check_balancer_flags(args)
    training = not args.inference
    quotas = list(
        dict.fromkeys(
            resolve_min_quota(q, shape, hardware, training=training) for q in args.min_quotas
        )
    )
    report, problem = advise_report.start_report(
        records, shape, source, hardware, training=training, inputs=records.describe()
    )
    report["hardware"]["named"] = hardware_source
    if problem is not None:
        return finish(report, args, output_dir, [])
    progress = common.progress_for(args, "advise", records)
    try:
        rows, advice = advise_report.complete_report(
            report,
            records,
            shape,
            hardware,
            slots=args.slots,
            min_quotas=quotas,
            triggers=args.triggers,
            domain_size=args.moe_balancer_domain_size,
            relay=not args.no_relay,
            include_eplb_exact=args.eplb_exact,
            num_layers=args.num_moe_layers,
            plan_seconds=common.plan_seconds(args),
            tolerance=args.tolerance,
            min_gain_per_slot=args.min_gain_per_slot,
            memory_budget_bytes=None
            if args.memory_budget_gb is None
            else int(args.memory_budget_gb * 2**30),
            progress=progress,
        )
    finally:
        progress.close()
    return finish(report, args, output_dir, rows, advice)


def finish(report: dict, args, output_dir, rows: list[dict], advice=None) -> int:
    """Write the files, print the report; exit status 0 with a recommendation, else 1."""
    from ultraep_megatron.analysis import advise_report
    from ultraep_megatron.analysis.tables import dump_json

    if output_dir is not None:
        report["files"] = advise_report.write_outputs(report, rows, output_dir, advice)
    if args.json:
        dump_json(report, stream=sys.stdout)
    else:
        print(advise_report.render(report))
    return common.EXIT_OK if advice is not None else common.EXIT_FAILED
