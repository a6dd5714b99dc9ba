"""The ultraep command: offline tools for UltraEP's expert-load balancing in Megatron-LM.

    ultraep replay TRACE             what each balancer would have done on a run's routing
    ultraep advise TRACE             --moe-balancer-num-slots / --moe-balancer-min-quota for that routing
    ultraep check-recipe RECIPE      Megatron's own argument checks for the full world size, layout, memory
    ultraep resume-experiment ...    one checkpoint, every balancer, Megatron's TFLOP/s/GPU
    ultraep trace {info,convert,merge,synth}

Training itself is Megatron's: torchrun ... pretrain_gpt.py ... --moe-balancer ultraep.
Subcommands import Megatron and matplotlib only when they run. Also runnable as
python -m ultraep_megatron.cli.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional, Sequence

from . import advise, check_recipe, common, replay, resume_experiment, trace

__all__ = ["main"]

SUBCOMMANDS = (replay, advise, check_recipe, resume_experiment, trace)
EPILOG = f"""Training: torchrun ... pretrain_gpt.py ... --moe-balancer ultraep (see docs/user_guide.md).
Record a routing trace with --moe-balancer-trace-dir DIR, or use Megatron's own --moe-routing-trace-path.

exit status: {common.EXIT_OK} success; {common.EXIT_FAILED} the command ran and found a failure (a recipe that does not
pass, a failed run, no recommendation); {common.EXIT_USAGE} bad arguments or unreadable input; {common.EXIT_INTERNAL} an internal error."""


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = argparse.ArgumentParser(
        prog="ultraep", description=__doc__.split("\n\n")[0],
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        parser.add_argument("--version", action="version", version=f"%(prog)s {version('ultraep-megatron')}")
    except PackageNotFoundError:  # run from a checkout that was never installed
        pass
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # a launch command (resume-experiment) or bare training arguments (check-recipe)
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and not getattr(args, "takes_passthrough", False):
        parser.error(f"ultraep {args.command} takes no arguments after --")
    args.passthrough = passthrough
    prog = f"ultraep {args.command}"
    try:
        return args.run(args)
    except common.CliError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return common.EXIT_USAGE
    except (ValueError, OSError) as error:  # unreadable or inconsistent input (traces, recipes, files)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return common.EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"{prog}: internal error (a bug: please report the traceback above)", file=sys.stderr)
        return common.EXIT_INTERNAL
