"""``pretrain_gpt.py``'s checks of its command line, before Megatron validates its arguments, prints
them, initialises wandb or builds the model (:func:`startup_checks_or_exit`).

The CPU flags (on a machine without CUDA), then UltraEP's argument problems
(``arguments.startup_problems``), reported once, on rank 0, one line each; on an error every rank
exits with status 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from typing import Sequence

from ultraep_megatron.megatron.arguments import add_ultraep_args, startup_problems
from ultraep_megatron.megatron.cpu import backend as cpu_backend
from ultraep_megatron.megatron.cpu import flags as cpu_flags

#: How long a rank other than rank 0 waits before exiting on an argument problem (rank 0 prints it).
NON_LOG_RANK_EXIT_DELAY_S = 5.0


def _let_rank_zero_report(log_rank: bool) -> None:
    """Before a failing rank exits: torchrun stops every rank once one fails, so a rank other than
    rank 0 waits for rank 0 to print the problems."""
    if not log_rank:
        time.sleep(NON_LOG_RANK_EXIT_DELAY_S)


def startup_checks_or_exit(argv: Sequence[str], *, prog: str = "pretrain_gpt.py") -> list[str]:
    """UltraEP's checks of a training command line, before Megatron validates its arguments,
    prints them, initialises wandb or builds the model.

    On a CPU machine (the CPU backend active) the missing ``cpu.flags.CPU_FLAGS`` are applied
    and logged, a conflicting one is an error. Then Megatron's parser reads the command line and
    ``arguments.startup_problems`` checks it. Every rank runs the same checks; global rank 0 prints
    each problem on one line. On an error every rank exits with status 2 (argparse's), with no
    traceback.

    Args:
        argv: the command line without the program name.
        prog: the program name for the messages.

    Returns:
        ``argv`` with the CPU flags applied; hand it to Megatron (e.g. as ``sys.argv[1:]``).
    """
    from megatron.training.arguments import parse_args

    log_rank = cpu_backend.is_log_rank()

    def report(kind: str, message: str) -> None:
        if log_rank:
            print(f"{prog}: {kind}: {message}", file=sys.stderr if kind == "error" else sys.stdout,
                  flush=True)

    argv, errors = list(argv), []
    if cpu_backend.is_active():
        try:
            argv, applied = cpu_flags.apply_required_args(argv)
        except ValueError as error:
            errors.append(str(error))
        else:
            if applied and not {"-h", "--help"} & set(argv):  # --help prints the help, nothing else
                report("note", "no CUDA device: the CPU backend applied " + "; ".join(applied))

    saved_argv = sys.argv
    sys.argv = [prog, *argv]
    try:
        # argparse prints its own one-line usage error; only rank 0 lets it through.
        with contextlib.redirect_stderr(sys.stderr if log_rank else io.StringIO()):
            args = parse_args(extra_args_provider=add_ultraep_args, ignore_unknown_args=True)
    except SystemExit as parser_exit:
        if parser_exit.code:  # argparse's error: rank 0 prints it
            _let_rank_zero_report(log_rank)
        raise
    finally:
        sys.argv = saved_argv
    problems, warnings = startup_problems(args)
    errors += problems
    for message in warnings:
        report("warning", message)
    for message in errors:
        report("error", message)
    if errors:
        _let_rank_zero_report(log_rank)
        sys.exit(2)
    return argv
