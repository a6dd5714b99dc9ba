"""ultraep trace: inspect, convert, merge and synthesize routing traces.

info     what trace files hold: shape, records, iterations, layers, how the file ends
convert  Megatron's --moe-routing-trace-path directory -> the project's trace files (streaming)
merge    pieces of one run's traces (e.g. a resumed job traced into a new directory) -> one per EP group
synth    a synthetic drifting-Zipf trace, for trying the tools
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import common

SUMMARY = "inspect, convert (from Megatron's --moe-routing-trace-path), merge or synthesize traces"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "trace",
        help=SUMMARY,
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="trace_command", required=True, metavar="{info,convert,merge,synth}"
    )

    info = sub.add_parser(
        "info",
        help="what trace files hold: shape, records, layers, how they end",
        description="Header, record counts, layers and tail status of trace files (the "
        "project's, or a Megatron --moe-routing-trace-path directory).",
    )
    info.add_argument("traces", nargs="+", metavar="TRACE", help=common.TRACE_HELP)
    info.add_argument(
        "--json", action="store_true", help="print JSON on stdout instead of the report"
    )
    common.add_megatron_layout_args(info)
    info.set_defaults(run=run_info)

    convert = sub.add_parser(
        "convert",
        help="Megatron's --moe-routing-trace-path directory -> the project's trace files",
        description="Group the per-rank records of every step of a Megatron routing trace into the [R, E] "
        "load of each EP group, microbatch and layer (decoder and MTP), and write them as the "
        "project's trace files, one per EP group, streaming step by step.",
        epilog="example:\n  ultraep trace convert runs/tiny/megatron_trace runs/tiny/trace --run-args runs/tiny/log.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("source", type=Path, metavar="MEGATRON_TRACE_DIR")
    convert.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")
    convert.add_argument(
        "--strict",
        action="store_true",
        help="a truncated trace is an error (default: convert its complete steps, with a warning)",
    )
    convert.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    common.add_megatron_layout_args(convert)
    convert.set_defaults(run=run_convert)

    merge = sub.add_parser(
        "merge",
        help="pieces of one run's traces -> one file per EP group, in iteration order",
        description="Merge trace files written in pieces by one run (e.g. a job resumed with a new "
        "--moe-balancer-trace-dir) into one file per EP group. Files of one EP group must have "
        "the same shape and disjoint iterations.",
    )
    merge.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")
    merge.add_argument(
        "traces", nargs="+", metavar="TRACE", help="trace files or directories, in any order"
    )
    merge.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    merge.set_defaults(run=run_merge)

    synth = sub.add_parser(
        "synth",
        help="write a synthetic drifting-Zipf trace",
        description="Write a synthetic drifting-Zipf routing trace "
        "(ultraep_megatron.traces.synthetic.synthetic_loads).",
    )
    synth.add_argument("output", type=Path, metavar="OUTPUT.uetrace")
    for flag, default, minimum in (
        ("--num-iterations", 8, 1),
        ("--num-microbatches", 2, 1),
        ("--num-layers", 4, 1),
        ("--num-ranks", 8, 1),
        ("--num-experts", 32, 1),
        ("--tokens-per-rank", 512, 1),
        ("--topk", 2, 1),
        ("--seed", 0, 0),
    ):
        synth.add_argument(
            flag,
            type=common.int_at_least(minimum),
            default=default,
            help=f">= {minimum}; default: %(default)s",
        )
    synth.add_argument(
        "--skew",
        type=common.non_negative_float,
        default=1.0,
        help="Zipf exponent, >= 0 (0: uniform popularity; default: %(default)s)",
    )
    synth.add_argument(
        "--drift",
        type=common.non_negative_float,
        default=0.3,
        help="random-walk step of the logits per iteration, >= 0 (default: %(default)s)",
    )
    synth.add_argument("--force", action="store_true", help="overwrite OUTPUT.uetrace if it exists")
    synth.set_defaults(run=run_synth)
    return parser


def run_info(args) -> int:
    from ultraep_megatron import traces
    from ultraep_megatron.analysis.tables import dump_json
    from ultraep_megatron.traces.reader import trace_info
    from ultraep_megatron.traces.router import (
        RouterTraceRecords,
        is_router_trace,
        router_trace_info,
    )

    if is_router_trace(args.traces):
        records = RouterTraceRecords(
            args.traces[0], common.megatron_layout(args), on_truncated="ignore"
        )
        entries = [router_trace_info(records)]
    else:
        entries = [trace_info(path) for path in traces.find_trace_files(args.traces)]
    if args.json:
        dump_json({"traces": entries}, stream=sys.stdout)
        return common.EXIT_OK
    for e in entries:
        torn = f" ({e['truncated_bytes']} bytes torn)" if e.get("truncated_bytes") else ""
        groups = (
            f", {e['rank_files']} rank files = {e['ep_groups']} EP group(s)"
            if "rank_files" in e
            else ""
        )
        print(
            f"{e['path']}: {e['format']}, R={e['num_ranks']}, E={e['num_experts']}{groups}, "
            f"status={e['status']}{torn}"
        )
        # Committed loads and iterations, as replay and advise count them; the uncommitted tail apart.
        uncommitted = (
            f", {e['uncommitted']} uncommitted loads after the last commit (replay and advise skip them)"
            if e.get("uncommitted")
            else ""
        )
        print(
            f"  {e['loads']} loads in {e['iterations']} iterations{uncommitted}, layers {list(e['layers'])}"
        )
        print(f"  meta: {json.dumps(e['meta'], sort_keys=True)}")
    return common.EXIT_OK


def run_convert(args) -> int:
    from ultraep_megatron.traces.router import RouterTraceRecords, convert_router_trace

    records = RouterTraceRecords(
        args.source, common.megatron_layout(args), on_truncated="error" if args.strict else "warn"
    )
    with common.output_dir_undone_on_failure(args.output_dir, "OUTPUT_DIR"):
        progress = common.progress_for(args, "convert", records)
        try:
            written = convert_router_trace(records, args.output_dir, progress=progress)
        finally:
            progress.close()
    print(
        f"converted {progress.done} loads of {records.num_groups} EP group(s) "
        f"({records.status}): " + ", ".join(str(p) for p in written)
    )
    return common.EXIT_OK


def run_merge(args) -> int:
    from ultraep_megatron import traces

    traces.find_trace_files(args.traces)  # a missing input fails before OUTPUT_DIR is made
    with common.output_dir_undone_on_failure(args.output_dir, "OUTPUT_DIR"):
        progress = common.Progress("merge", enabled=not args.no_progress, unit="loads")
        try:
            written = traces.merge_traces(args.traces, args.output_dir, progress=progress)
        finally:
            progress.close()
    print(f"merged {progress.done} loads into " + ", ".join(str(p) for p in written))
    return common.EXIT_OK


def run_synth(args) -> int:
    from ultraep_megatron import traces

    if args.num_experts % args.num_ranks:
        raise common.CliError(
            f"--num-experts {args.num_experts} must be a multiple of --num-ranks {args.num_ranks}"
        )
    if args.topk > args.num_experts:
        raise common.CliError(
            f"--topk {args.topk} must be at most --num-experts {args.num_experts}"
        )
    if args.output.is_dir():
        raise common.CliError(f"{args.output} is a directory: name the trace file to write")
    if args.output.exists() and not args.force:
        raise common.CliError(f"{args.output} exists; pass --force to overwrite it")
    common.prepare_output_dir(args.output.parent, "the directory of OUTPUT.uetrace")
    kwargs = {
        k: getattr(args, k)
        for k in (
            "num_iterations",
            "num_microbatches",
            "num_layers",
            "num_ranks",
            "num_experts",
            "tokens_per_rank",
            "topk",
            "seed",
            "skew",
            "drift",
        )
    }
    path = traces.write_synthetic_trace(args.output, **kwargs)
    loads = args.num_iterations * args.num_microbatches * args.num_layers
    print(f"wrote {path} ({path.stat().st_size} bytes, {loads:d} loads)")
    return common.EXIT_OK
