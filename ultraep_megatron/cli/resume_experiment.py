"""ultraep resume-experiment: one checkpoint, every balancer, same data (the paper's §8.1).

Resumes the same Megatron checkpoint under each balancer for a short window (~20 iterations) with
your launch command (given after --), and compares Megatron's TFLOP/s/GPU. Each run gets
--load CKPT --ckpt-step S --exit-interval S+N --moe-balancer B (the ideal:
--moe-balancer none --moe-router-force-load-balancing), the checkpoint's --train-iters (read from
it first: a window past it is refused) and logging flags appended, and the environment
RUN_DIR=OUTPUT/B SAVE_CHECKPOINTS=0 (ULTRAEP_PYTHON: this python, unless set); the checkpoint is
never written. Tables (Markdown, CSV), a plot and every run's log go to --output-dir.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ultraep_megatron.planner.baselines import registry

from . import common

SUMMARY = "resume one checkpoint under every balancer and compare Megatron's TFLOP/s/GPU"
EXAMPLES = """examples:
  ultraep resume-experiment --load /ckpt/qwen3 --iterations 20 --output-dir results/qwen3 \\
      -- srun --ntasks-per-node 1 bash recipes/qwen3_235b_a22b_ep64_dp4.sh

exit status: 0 when every run succeeded, 1 when one failed (the table lists them all), 2 on bad usage.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "resume-experiment",
        help=SUMMARY,
        description=__doc__.split("\n\n", 1)[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --load DIR [options] -- LAUNCH COMMAND ...",
    )
    parser.add_argument(
        "--load",
        type=Path,
        required=True,
        metavar="DIR",
        help="Megatron checkpoint directory to resume (its --save); never written",
    )
    parser.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="iteration to resume (default: the latest in the directory)",
    )
    parser.add_argument(
        "--balancers",
        type=common.name_list(registry.COMPARED),
        default=list(registry.COMPARED),
        metavar="B,B",
        help=f"comma-separated, from {','.join(registry.COMPARED)} (default: all)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=20,
        help="iterations per balancer (default %(default)s, as in the paper)",
    )
    parser.add_argument(
        "--warmup-iterations",
        type=int,
        default=None,
        help="first iterations after the resume left out of the figures (default 1; 0 when "
        "--iterations is 1)",
    )
    parser.add_argument(
        "--ideal-args",
        default="",
        help="extra arguments of the ideal run, e.g. '--moe-router-force-biased 0' for a launcher "
        "that forces a routing skew",
    )
    parser.add_argument(
        "--exp-prefix", default="resume", help="wandb run-name prefix (default: %(default)s)"
    )
    parser.add_argument("--timeout-s", type=float, default=None, help="limit per run, seconds")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("runs/resume_experiment"),
        metavar="DIR",
        help="tables, plot and run logs (default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout (progress and tables go to stderr)",
    )
    parser.set_defaults(run=run, takes_passthrough=True)
    return parser


def run(args) -> int:
    from ultraep_megatron.analysis.resume_experiment import run_experiment
    from ultraep_megatron.analysis.resume_runs import ExperimentError
    from ultraep_megatron.analysis.tables import dump_json
    from ultraep_megatron.megatron.run.checkpoint_args import checkpoint_args

    progress = sys.stderr if args.json else sys.stdout
    try:
        results, summaries = run_experiment(
            args.passthrough,
            args.load,
            args.balancers,
            args.iterations,
            args.output_dir,
            warmup=args.warmup_iterations,
            ckpt_step=args.ckpt_step,
            ideal_args=shlex.split(args.ideal_args),
            exp_prefix=args.exp_prefix,
            timeout_s=args.timeout_s,
            progress=progress,
            read_args=checkpoint_args,
        )
    except ExperimentError as error:
        raise common.CliError(str(error)) from None
    failed = [r.balancer for r in results if not r.ok]
    if args.json:
        dump_json(
            {
                "summaries": [s.__dict__ for s in summaries],
                "runs": [
                    {
                        "balancer": r.balancer,
                        "status": r.status,
                        "run_dir": r.run_dir,
                        "wall_s": r.wall_s,
                    }
                    for r in results
                ],
                "output_dir": args.output_dir,
            },
            stream=sys.stdout,
        )
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return common.EXIT_FAILED if failed else common.EXIT_OK
