"""ultraep check-recipe: check a launch recipe on this machine, without GPUs.

For each recipe (a bash script that ends in $ULTRAEP_PYTHON -m torch.distributed.run ...
pretrain_gpt.py ARGS) the launch is captured, not run; then Megatron's own argument parser and
validate_args run for the full world size, then UltraEP's validation; the rank layout is printed
from Megatron's own RankGenerator (every EP group must sit inside one rack's scale-up domain), and
memory per rank and pipeline stage is estimated: weights, fp32 main gradients, optimizer states,
and the redundant expert slots with and without cross-layer reuse. Activations are not estimated.
"""

from __future__ import annotations

import argparse
import sys

from ultraep_megatron.analysis.tables import dump_json

from . import common

SUMMARY = "validate launch recipes with Megatron's own checks for the full world size; layout and memory"
EXAMPLES = """examples:
  ultraep check-recipe recipes/qwen3_235b_a22b_ep64_dp4.sh
  ultraep check-recipe --env NNODES=128 recipes/qwen3_235b_a22b_ep64_dp4.sh      # another size
  ultraep check-recipe --world-size 256 --gpus-per-node 4 -- --num-layers 94 ...  # bare pretrain_gpt.py arguments

exit status: 0 when every recipe passes, 1 when one fails, 2 on bad usage.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ultraep_megatron.megatron.recipe_check import DEFAULT_RACK_SIZE

    parser = subparsers.add_parser("check-recipe", help=SUMMARY, description=__doc__.split("\n\n", 1)[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   usage="%(prog)s [options] RECIPE ... | %(prog)s --world-size N [options] -- ARGS")
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipe scripts to check")
    parser.add_argument("--rack-size", type=int, default=DEFAULT_RACK_SIZE,
                        help="GPUs per rack (scale-up domain); default %(default)s")
    parser.add_argument("--world-size", type=int, default=None,
                        help="check bare pretrain_gpt.py arguments (after --) for this world size")
    parser.add_argument("--gpus-per-node", type=int, default=4,
                        help="with --world-size: GPUs per node; default %(default)s")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the recipes (e.g. NNODES=8); repeatable")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")
    parser.set_defaults(run=run, takes_passthrough=True)
    return parser


def run(args) -> int:
    from ultraep_megatron.megatron import recipe_check as rc

    bad_env = [item for item in args.env if "=" not in item]
    if bad_env:
        raise common.CliError(f"--env takes KEY=VALUE, got {bad_env}")
    env = dict(item.split("=", 1) for item in args.env)
    launches, skipped = [], []
    if args.world_size is not None:
        if args.world_size % args.gpus_per_node:
            raise common.CliError("--world-size must be a multiple of --gpus-per-node")
        launches.append(rc.Launch(args.gpus_per_node, args.world_size // args.gpus_per_node,
                                  "pretrain_gpt.py", args.passthrough))
    elif args.passthrough:
        raise common.CliError("bare arguments after -- need --world-size")
    for recipe in args.recipes:
        try:
            launches.append(rc.capture_launch(recipe, env))
        except rc.NotARecipe as note:
            skipped.append(str(recipe))
            if not args.json:
                print(f"== {recipe}\nskipped: {note.problem}\n", flush=True)
        except rc.RecipeError as error:
            launches.append((recipe, error))
    if not launches:
        raise common.CliError("give recipes, or --world-size N -- ARGS" if not skipped else
                              f"no recipe to check ({', '.join(skipped)}: sourced by the recipes)")
    results = []
    for launch in launches:
        if isinstance(launch, tuple):
            result = failure(str(launch[0]), launch[1])
        else:
            try:
                report = rc.check_launch(launch, args.rack_size)
                result = {"source": launch.source, "passed": not report.problems(), "problems": report.problems(),
                          "text": rc.format_report(report), **summary(report)}
            except rc.RecipeError as error:
                result = failure(launch.source, error)
        results.append(result)
        if not args.json:
            print(result["text"] + "\n", flush=True)
    failed = sum(not r["passed"] for r in results)
    if args.json:
        dump_json({"recipes": results, "passed": len(results) - failed, "failed": failed,
                   "skipped": skipped}, stream=sys.stdout)
    else:
        print(f"{len(results) - failed}/{len(results)} recipe(s) passed"
              + (f" ({', '.join(skipped)} skipped: not a recipe)" if skipped else ""))
    return common.EXIT_FAILED if failed else common.EXIT_OK


def failure(source: str, error) -> dict:
    """A recipe that does not pass: one PROBLEM line per problem, then what was printed with it."""
    problems = error.problem.splitlines()
    text = "\n".join([f"== {source}", *(f"  PROBLEM: {p}" for p in problems)]
                     + [f"    | {line}" for line in error.details.strip().splitlines()])
    return {"source": source, "passed": False, "problems": problems, "error": str(error), "text": text}


def summary(report) -> dict:
    """The report's figures, JSON-ready."""
    a, layout = report.args, report.layout
    return {
        "world_size": a.world_size, "nnodes": report.launch.nnodes, "nproc_per_node": report.launch.nproc_per_node,
        "tensor_model_parallel_size": a.tensor_model_parallel_size,
        "pipeline_model_parallel_size": a.pipeline_model_parallel_size,
        "expert_model_parallel_size": a.expert_model_parallel_size, "data_parallel_size": a.data_parallel_size,
        "moe_balancer": a.moe_balancer, "moe_balancer_num_slots": a.moe_balancer_num_slots,
        "total_params": report.memory.total_params, "active_params": report.memory.active_params,
        "flops_per_iteration": report.flops,
        "ep_groups": layout.ep_groups, "rack_size": layout.rack_size,
        "stages": [{"stage": s.stage, "layers": s.layers, "moe_layers": s.moe_layers,
                    "model_state_bytes": s.model_states, "slot_bytes_with_reuse": s.slots_with_reuse,
                    "slot_bytes_without_reuse": s.slots_without_reuse, "total_bytes": s.total}
                   for s in report.memory.stages],
    }
