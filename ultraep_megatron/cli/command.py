"""The ultraep command: offline tools for UltraEP's expert-load balancing in Megatron-LM.

    ultraep replay TRACE             what each balancer would have done on a run's routing
    ultraep advise TRACE             --moe-balancer-num-slots / --moe-balancer-min-quota for that routing
    ultraep check-recipe RECIPE      Megatron's own argument checks for the full world size, layout, memory
    ultraep resume-experiment ...    one checkpoint, every balancer, Megatron's TFLOP/s/GPU
    ultraep trace {info,convert,merge,synth}

Training itself is Megatron's: torchrun ... pretrain_gpt.py ... --moe-balancer ultraep.
Subcommands import Megatron and matplotlib only when they run. Also runnable as
python -m ultraep_megatron.cli.

This module is the command itself: its parser (every subcommand's ``add_parser``), the parse, and
one line on stderr for a failure, under the innermost command's name, with the exit status
``common`` defines.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from typing import Optional, Sequence

from . import advise, check_recipe, common, replay, resume_experiment, trace

__all__ = ["build_parser", "main"]

SUBCOMMANDS = (replay, advise, check_recipe, resume_experiment, trace)
EPILOG = f"""Training: torchrun ... pretrain_gpt.py ... --moe-balancer ultraep (see docs/user_guide.md).
Record a routing trace with --moe-balancer-trace-dir DIR, or use Megatron's own --moe-routing-trace-path.

exit status: {common.EXIT_OK} success; {common.EXIT_FAILED} the command ran and found a failure (a recipe that does not
pass, a failed run, no recommendation); {common.EXIT_USAGE} bad arguments or unreadable input; {common.EXIT_INTERNAL} an internal error."""


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = common.Parser(
        prog="ultraep",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        parser.add_argument(
            "--version", action="version", version=f"%(prog)s {version('ultraep-megatron')}"
        )
    except PackageNotFoundError:  # run from a checkout that was never installed
        pass
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    mark_commands(parser)
    return parser


def mark_commands(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)command's parser itself as the default ``command_parser``: after parsing, the
    innermost command's (e.g. ``ultraep trace synth``), whose prog errors are reported under."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                mark_commands(sub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if (
        "--" in argv
    ):  # a launch command (resume-experiment) or bare training arguments (check-recipe)
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = (
        args.command_parser
    )  # errors are the innermost command's: "ultraep trace synth: error: ..."
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if passthrough and not getattr(args, "takes_passthrough", False):
        command.error("takes no arguments after --")
    args.passthrough = passthrough
    prog = command.prog
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warnings(prog)
        return run_command(args, prog)


def one_line_warnings(prog: str):
    """A ``warnings.showwarning``: a warning (a truncated trace's, a library's) as one line under
    the command's name, ``PROG: warning: MESSAGE``, instead of Python's ``file:line: Category:
    message`` with the source line below it."""

    def show(message, *_, **__) -> None:
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=sys.stderr)

    return show


def run_command(args, prog: str) -> int:
    """``args.run(args)``, its failures reported in one line as the exit status says."""
    try:
        return args.run(args)
    except common.CliError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return common.EXIT_USAGE
    except (
        ValueError,
        OSError,
    ) as error:  # unreadable or inconsistent input (traces, recipes, files)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return common.EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"{prog}: internal error (a bug: please report the traceback above)", file=sys.stderr)
        return common.EXIT_INTERNAL
