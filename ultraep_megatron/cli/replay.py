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
import sys

from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.knobs import add_balancer_arguments

from . import common

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
    parser = subparsers.add_parser(
        "replay",
        help=SUMMARY,
        description=__doc__.split("\n\n", 1)[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_trace_input_args(parser)
    add_balancer_args(parser)
    group = parser.add_argument_group("EPLB staleness sweep (paper Fig. 6)")
    group.add_argument(
        "--staleness-intervals",
        type=common.int_list,
        default=[1, 2, 4, 8, 16, 32],
        metavar="N,N",
        help="EPLB re-plan intervals to sweep (default: 1,2,4,8,16,32)",
    )
    group.add_argument(
        "--staleness-window",
        type=int,
        default=None,
        metavar="N",
        help="history window of the sweep (default: = interval)",
    )
    group.add_argument("--no-staleness", action="store_true", help="skip the staleness sweep")
    add_peer_args(parser)
    common.add_model_hardware_args(parser)
    out = common.add_output_args(parser, files="PNG plots, replay.json and replay_per_layer.csv")
    out.add_argument(
        "--no-cost", action="store_true", help="balancing metrics only, no time estimate"
    )
    out.add_argument(
        "--heatmap-layers",
        type=common.int_list,
        default=None,
        metavar="N,N",
        help="layers to draw load heatmaps of (default: 3 spread over the model)",
    )
    parser.set_defaults(run=run)
    return parser


def add_balancer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "balancers",
        "The same --moe-balancer-* flags as training, with the same defaults; "
        "--moe-balancer-min-quota also takes 'hw', the floor derived from the hardware flags (see ultraep advise). "
        + " ".join(f'"{n}": {registry.describe(n)}.' for n in registry.COMPARED),
    )
    group.add_argument(
        "--balancers",
        type=common.name_list(registry.COMPARED),
        default=list(registry.COMPARED),
        metavar="B,B",
        help=f"balancers to replay (default: {','.join(registry.COMPARED)})",
    )
    add_balancer_arguments(
        group, runtime=False, balancer_flag=False, types={"min_quota": common.min_quota_arg}
    )


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    from ultraep_megatron.analysis import plotting
    from ultraep_megatron.planner.baselines import least_loaded

    group = parser.add_argument_group(
        "peers",
        "Replayed next to the balancers, re-implemented from their public code "
        "(ultraep_megatron/planner/baselines/): "
        + " ".join(f'"{n}": {plotting.LABELS[n]}.' for n in registry.PEERS)
        + " With several NVLink domains (--scale-up-domain, --moe-balancer-domain-size) deepseek-eplb also "
        "runs its hierarchical policy, nodes = domains.",
    )
    group.add_argument(
        "--peers",
        type=common.name_list(registry.PEERS),
        default=list(registry.PEERS),
        metavar="P,P",
        help=f"peers to replay (default: {','.join(registry.PEERS)})",
    )
    group.add_argument("--no-peers", action="store_true", help="no peer table")
    group.add_argument(
        "--llep-capacity-factor",
        type=common.positive_float,
        default=least_loaded.LLEP_CAPACITY_FACTOR,
        metavar="ALPHA",
        help="LLEP's capacity factor alpha (%(default)s)",
    )
    group.add_argument(
        "--llep-min-tokens-per-gemm",
        type=int,
        default=least_loaded.LLEP_MIN_TOKENS_PER_GEMM,
        metavar="M",
        help="LLEP's minimum tokens per GEMM m (%(default)s; not a hard floor)",
    )
    group.add_argument(
        "--llep-trigger",
        type=float,
        default=least_loaded.LLEP_TRIGGER,
        metavar="LAMBDA",
        help="LLEP's trigger lambda: loads below this rank imbalance stay unbalanced "
        "(%(default)s; 0: always balance)",
    )


def run(args) -> int:
    from ultraep_megatron.analysis import inputs, replay_report
    from ultraep_megatron.analysis.replay import replay
    from ultraep_megatron.analysis.tables import dump_json
    from ultraep_megatron.planner import BalancerConfig

    output_dir = common.prepare_output_dir(args.output_dir)
    records = common.open_records(args)
    hardware_source = common.apply_traced_run_settings(args, records)
    shape, source, hardware = common.shape_and_hardware(args, records.meta)
    min_quota = inputs.resolve_min_quota(
        args.moe_balancer_min_quota,
        shape,
        hardware,
        from_hardware=args.moe_balancer_hardware is not None,
    )
    # ultraep's floor is resolved here, from the hardware the cost model uses.
    common.check_balancer_flags(args)
    base = BalancerConfig(
        registry.ULTRAEP,
        num_slots=args.moe_balancer_num_slots,
        min_quota=min_quota,
        trigger=args.moe_balancer_trigger,
        domain_size=args.moe_balancer_domain_size,
        eplb_window=args.moe_balancer_eplb_window,
        eplb_interval=args.moe_balancer_eplb_interval,
    )
    main, sweep = inputs.replay_balancers(
        args.balancers,
        base,
        [] if args.no_staleness else args.staleness_intervals,
        args.staleness_window,
    )
    if (
        args.moe_balancer_domain_size is not None
        and records.num_ranks % args.moe_balancer_domain_size
    ):
        raise common.CliError(
            f"--moe-balancer-domain-size {args.moe_balancer_domain_size} must divide the "
            f"trace's {records.num_ranks} EP ranks"
        )
    try:  # the NVLink domains the cross-domain figures count: the hardware's (common.shape_and_hardware)
        N = hardware.ranks_per_domain(records.num_ranks)
    except ValueError as exc:
        raise common.CliError(
            f"{exc} (--scale-up-domain, or the --moe-balancer-hardware preset)"
        ) from None
    peers = (
        []
        if args.no_peers
        else inputs.peer_configs(
            args.peers,
            num_slots=args.moe_balancer_num_slots,
            capacity_factor=args.llep_capacity_factor,
            min_tokens_per_gemm=args.llep_min_tokens_per_gemm,
            trigger=args.llep_trigger if args.llep_trigger > 0 else None,
            node_size=N < records.num_ranks and N,
        )
    )
    with_cost = not args.no_cost
    progress = common.progress_for(args, "replay", records)
    try:
        result = replay(
            records,
            {**main, **sweep},
            peers=peers,
            domain_size=N,
            shape=shape if with_cost else None,
            hardware=hardware if with_cost else None,
            relay=not args.no_relay,
            keep_loads=output_dir is not None,
            plan_seconds=common.plan_seconds(args),
            progress=progress,
        )
    finally:
        progress.close()
    report = replay_report.build_report(
        result,
        list(main),
        inputs=records.describe(),
        min_quota=min_quota,
        shape=shape,
        source=source,
        hardware=hardware,
        plan_time_us=args.plan_time_us,
        relay=not args.no_relay,
    )
    if "hardware" in report:
        report["hardware"]["named"] = hardware_source
    if output_dir is not None:
        report["files"] = replay_report.write_outputs(
            result, report, list(main), output_dir, args.heatmap_layers
        )
    if args.json:
        dump_json(report, stream=sys.stdout)
    else:
        print(replay_report.render(report, list(main)))
    return common.EXIT_OK
