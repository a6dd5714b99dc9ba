"""ultraep check-recipe: check a launch recipe on this machine, without GPUs.

For each recipe (a bash script that ends in a launch: torchrun, python -m torch.distributed.run,
srun, deepspeed or mpirun ... pretrain_gpt.py ARGS) the launch is read, never run: the recipe's
shell code runs with recording shims first on PATH in place of every launcher (and of
$ULTRAEP_PYTHON), so nothing starts; a recipe that calls a launcher by its path (/usr/bin/python3,
which no shim can stand in for) is refused before any of it runs. Arguments after -- are appended,
as the recipe appends its own command-line arguments. Then UltraEP's checks and Megatron's own
argument parser and validate_args run for the full world size; the rank layout is printed from
Megatron's own RankGenerator, and memory per rank and pipeline stage is estimated: weights, fp32
main gradients, optimizer states, the redundant expert slots with and without cross-layer reuse,
activations (sequence, micro batch, TP/CP/SP, recompute, pipeline microbatches in flight) and a
fixed runtime allowance, against the GPU's memory.

Hardware: the recipe's --moe-balancer-hardware preset (h100-hgx, h200-hgx: nodes of 8 GPUs, the
node is the NVLink domain, 80 / 141 GiB; paper-rack: a GB200 NVL72 rack of 64 GPUs in use, 4 per
node, 186 GiB), or --rack-size and --gpu-memory-gb. Without them the checker says loudly what it
assumed (NVLink ends at the node, 80 GiB per GPU) and refuses an EP group that spans nodes: whether
it crosses NVLink or InfiniBand is exactly what it was not told. An EP group must sit inside one
scale-up domain, or span domains with --moe-balancer-domain-size D such that every D consecutive EP
ranks (a balancer domain, where an expert's replicas live) sit inside one: EP16-64 across HGX nodes
needs --moe-balancer-domain-size 8.

A Megatron-Bridge recipe (recipes/bridge/*.py: a .py file whose config() returns a ConfigContainer,
FILE.py:FUNCTION, or module:function) is built here, not run, in the environment with Bridge
(ULTRAEP_BRIDGE=1): enable_ultraep's checks run on its fields (a refusal names the field,
cfg.model.moe_expert_capacity_factor), then the same layout and memory report, for the cluster its
module names (NUM_GPUS, GPUS_PER_NODE) or --world-size / --gpus-per-node.

The recipe is checked for the cluster it targets: what the GPU nodes need installed and this
machine cannot import (DeepEP / HybridEP for the flex dispatcher, the GB200 recipes' default) is a
NOTE line, not a problem; pretrain_gpt.py refuses to start without it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ultraep_megatron.analysis.tables import dump_json

from . import common

SUMMARY = (
    "validate launch recipes with Megatron's own checks for the full world size; layout and memory"
)
EXAMPLES = """examples:
  ultraep check-recipe recipes/qwen3_235b_a22b_ep64_dp4.sh
  ultraep check-recipe --env NNODES=128 recipes/qwen3_235b_a22b_ep64_dp4.sh      # another size
  ultraep check-recipe recipes/deepseek_v2_lite_16b_a2b_ep8_hgx.sh -- --moe-balancer-num-slots 3
                                                                  # the recipe with your overrides
  ultraep check-recipe recipes/qwen3_235b_a22b_ep32_pp8_hgx.sh -- --moe-balancer-hardware h200-hgx  # H200 nodes
  ultraep check-recipe --world-size 16 -- --moe-balancer-hardware h100-hgx --num-layers 27 ...  # bare arguments
  ultraep check-recipe recipes/bridge/deepseek_v3_h100.py        # a Megatron-Bridge recipe (ULTRAEP_BRIDGE=1)
  ultraep check-recipe mypkg.recipes:my_config --world-size 512  # module:function -> ConfigContainer

exit status: 0 when every recipe passes, 1 when one fails (a PROBLEM line each), 2 on bad usage
(one error line).
"""


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
        return value

    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "check-recipe",
        help=SUMMARY,
        description=__doc__.split("\n\n", 1)[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] RECIPE ... | %(prog)s --world-size N [options] -- ARGS",
    )
    parser.add_argument(
        "recipes",
        nargs="*",
        metavar="RECIPE",
        help="recipe scripts to check (arguments after -- are appended to each), or Megatron-Bridge "
        "recipes: a .py file (its config(), or FILE.py:FUNCTION) or module:function returning a "
        "ConfigContainer",
    )
    parser.add_argument(
        "--rack-size",
        "--scale-up-domain",
        dest="rack_size",
        type=_positive(int),
        default=None,
        metavar="GPUS",
        help="GPUs per scale-up (NVLink) domain, consecutive ranks: a GB200 rack's 64 in use, "
        "an HGX node's 8. Default: the recipe's --moe-balancer-hardware preset's "
        "(h100-hgx, h200-hgx: 8, the node; paper-rack: 64); without one, assumed to "
        "be the node, and EP across nodes is refused until the hardware is named",
    )
    parser.add_argument(
        "--gpu-memory-gb",
        type=_positive(float),
        default=None,
        metavar="GIB",
        help="memory per GPU in GiB that each rank's estimated peak must fit. Default: the "
        "recipe's --moe-balancer-hardware preset's (h100-hgx: 80, h200-hgx: 141, "
        "paper-rack: 186); without one, assumed 80 (an H100's), as the report says",
    )
    parser.add_argument(
        "--world-size",
        type=_positive(int),
        default=None,
        help="check bare pretrain_gpt.py arguments (after --) for this world size",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=_positive(int),
        default=None,
        help="with --world-size: GPUs per node. Default: the --moe-balancer-hardware "
        "preset's in the arguments (h100-hgx, h200-hgx: 8; paper-rack: 4, a GB200 "
        "tray), else assumed 8, as the report says. A recipe's comes from its launch "
        "(--env GPUS_PER_NODE=N)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the recipes (e.g. NNODES=8); repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")
    parser.set_defaults(run=run, takes_passthrough=True)
    return parser


def run(args) -> int:
    if not args.json:
        return _run(args, sys.stdout)
    out = sys.stdout  # the JSON document alone: what imports print (transformers' wandb line) aside
    with contextlib.redirect_stdout(sys.stderr):
        return _run(args, out)


def _run(args, out) -> int:
    from ultraep_megatron.megatron import recipe_check as rc
    from ultraep_megatron.megatron.recipe_check import bridge_recipe as bridge

    bad_env = [item for item in args.env if "=" not in item]
    if bad_env:
        raise common.CliError(f"--env takes KEY=VALUE, got {bad_env}")
    env = dict(item.split("=", 1) for item in args.env)
    bridge_recipes = [r for r in args.recipes if bridge.is_bridge_recipe(r)]
    if bridge_recipes and args.passthrough:
        raise common.CliError(
            "arguments after -- go to launch scripts; a Bridge recipe's settings are its "
            f"ConfigContainer's ({', '.join(bridge_recipes)})"
        )
    missing = [
        r for r in args.recipes if bridge.recipe_file(r) and not bridge.recipe_file(r).is_file()
    ]
    if missing:
        raise common.CliError(
            "; ".join(
                f"no such recipe file: {r}{common.did_you_mean(r, close_recipes(r), cutoff=None)}"
                for r in missing
            )
        )
    if args.world_size is not None and args.recipes and args.passthrough:
        raise common.CliError(
            "arguments after -- go to the recipes, or with --world-size to a bare launch; "
            "not both (check a recipe at another size with --env NNODES=N)"
        )
    if args.gpus_per_node is not None and args.world_size is None and not bridge_recipes:
        raise common.CliError(
            "--gpus-per-node applies to --world-size; a recipe's comes from its launch "
            "(--env GPUS_PER_NODE=N)"
        )
    launches, skipped = [], []
    if args.world_size is not None and not (bridge_recipes and not args.passthrough):
        if not args.passthrough:
            raise common.CliError(
                "--world-size checks bare pretrain_gpt.py arguments: give them after --"
            )
        gpus_per_node = args.gpus_per_node or rc.default_gpus_per_node(args.passthrough)
        assumed = gpus_per_node is None
        if (
            assumed
        ):  # no hardware named: an HGX node's 8, or the largest divisor below (the report says so)
            gpus_per_node = max(
                n for n in range(1, ASSUMED_GPUS_PER_NODE + 1) if args.world_size % n == 0
            )
        if args.world_size % gpus_per_node:
            raise common.CliError(
                f"--world-size {args.world_size} is not a multiple of {gpus_per_node} "
                "GPUs per node (--gpus-per-node)"
            )
        launches.append(
            rc.Launch(
                gpus_per_node,
                args.world_size // gpus_per_node,
                "pretrain_gpt.py",
                args.passthrough,
                gpus_per_node_assumed=assumed,
            )
        )
    elif args.passthrough and not args.recipes:
        raise common.CliError(
            "bare arguments after -- need --world-size (or a recipe to append them to)"
        )
    extra = args.passthrough if args.world_size is None else []
    for recipe in args.recipes:
        if recipe in bridge_recipes:
            launches.append(("bridge", recipe))
            continue
        try:
            found = rc.capture_launches(recipe, env, extra_args=extra)
            for k, launch in enumerate(found, 1):
                if len(found) > 1:  # a job script starting a run and its baseline: each checked
                    launch.source = f"{recipe} (launch {k} of {len(found)})"
                launches.append(launch)
        except rc.NotARecipe as note:
            skipped.append(str(recipe))
            if not args.json:
                print(f"== {recipe}\nskipped: {note.problem}\n", flush=True)
        except rc.RecipeError as error:
            launches.append((recipe, error))
    if not launches:
        raise common.CliError(
            "give recipes, or --world-size N -- ARGS"
            if not skipped
            else f"no recipe to check ({', '.join(skipped)}: sourced by the recipes)"
        )
    results = []
    for launch in launches:
        if isinstance(launch, tuple) and launch[0] != "bridge":
            result = failure(str(launch[0]), launch[1])
        else:
            source = launch[1] if isinstance(launch, tuple) else launch.source
            try:
                if isinstance(launch, tuple):  # a Bridge recipe: its ConfigContainer built here
                    recipe = bridge.load_recipe(source, args.world_size, args.gpus_per_node)
                    report = bridge.check_bridge_recipe(recipe, args.rack_size, args.gpu_memory_gb)
                else:
                    report = rc.check_launch(launch, args.rack_size, args.gpu_memory_gb)
                result = {
                    "source": source,
                    "passed": not report.problems(),
                    "problems": report.problems(),
                    "notes": report.notes,
                    "text": rc.format_report(report),
                    **summary(report),
                }
            except rc.RecipeError as error:
                result = failure(source, error)
        results.append(result)
        if not args.json:
            print(result["text"] + "\n", flush=True)
    failed = sum(not r["passed"] for r in results)
    if args.json:
        dump_json(
            {
                "recipes": results,
                "passed": len(results) - failed,
                "failed": failed,
                "skipped": skipped,
            },
            stream=out,
        )
    else:
        print(
            f"{len(results) - failed}/{len(results)} recipe(s) passed"
            + (f" ({', '.join(skipped)} skipped: not a recipe)" if skipped else "")
        )
    return common.EXIT_FAILED if failed else common.EXIT_OK


#: GPUs per node of bare arguments when neither --gpus-per-node nor a hardware preset says (HGX).
ASSUMED_GPUS_PER_NODE = 8


def close_recipes(path: str) -> list[str]:
    """Recipe files whose names are close to a path that does not exist: in its directory (or, when
    that does not exist, the repository's ``recipes/``), by spelling or by a shared prefix."""
    import difflib

    given = Path(path)
    directory = (
        given.parent if given.parent.is_dir() else Path(__file__).resolve().parents[2] / "recipes"
    )
    if not directory.is_dir():
        return []
    names = sorted(p.name for p in directory.glob("*.sh"))
    stem = given.name.removesuffix(".sh")
    close = difflib.get_close_matches(given.name, names, n=3, cutoff=0.6)
    close += [n for n in names if stem and n.startswith(stem) and n not in close]
    where = given.parent if given.parent.is_dir() else directory
    return [str(where / n) for n in close[:3]]


def failure(source: str, error) -> dict:
    """A recipe that does not pass: one PROBLEM line per problem, then what was printed with it."""
    problems = error.problem.splitlines()
    text = "\n".join(
        [f"== {source}", *(f"  PROBLEM: {p}" for p in problems)]
        + [f"    | {line}" for line in error.details.strip().splitlines()]
    )
    return {
        "source": source,
        "passed": False,
        "problems": problems,
        "error": str(error),
        "text": text,
    }


def summary(report) -> dict:
    """The report's figures, JSON-ready."""
    a, layout = report.args, report.layout
    return {
        "world_size": a.world_size,
        "nnodes": report.launch.nnodes,
        "nproc_per_node": report.launch.nproc_per_node,
        "tensor_model_parallel_size": a.tensor_model_parallel_size,
        "pipeline_model_parallel_size": a.pipeline_model_parallel_size,
        "expert_model_parallel_size": a.expert_model_parallel_size,
        "data_parallel_size": a.data_parallel_size,
        "moe_balancer": a.moe_balancer,
        "moe_balancer_num_slots": a.moe_balancer_num_slots,
        "total_params": report.memory.total_params,
        "active_params": report.memory.active_params,
        "flops_per_iteration": report.flops,
        "ep_groups": layout.ep_groups,
        "rack_size": layout.rack_size,
        "launcher": report.launch.launcher,
        "hardware": report.hardware_named,
        "assumed": report.assumed,
        "moe_balancer_domain_size": layout.balancer_domain,
        "gpu_memory_gb": report.gpu_memory_gb,
        "margin_bytes": report.margin_bytes(),
        "stages": [
            {
                "stage": s.stage,
                "layers": s.layers,
                "moe_layers": s.moe_layers,
                "model_state_bytes": s.model_states,
                "slot_bytes_with_reuse": s.slots_with_reuse,
                "slot_bytes_without_reuse": s.slots_without_reuse,
                "total_bytes": s.total,
                "activation_bytes": s.activations,
                "runtime_reserve_bytes": s.runtime_reserve,
                "peak_bytes": s.peak,
            }
            for s in report.memory.stages
        ],
    }
