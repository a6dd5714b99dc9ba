"""``pretrain_gpt.py``'s checks of its command line, before Megatron validates its arguments, prints
them, initialises wandb or builds the model (:func:`startup_checks_or_exit`).

The CPU flags (on a machine without CUDA), Megatron's parser (a bad value or an unknown flag: one
line and a pointer to ``--help``, not argparse's several hundred lines of usage), then UltraEP's
argument problems (``arguments.startup_problems``): every problem found is reported once, on rank 0,
one line each; on an error every rank exits with status 2, without a traceback. ``--help`` is
Megatron's parser's own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import types
from typing import Sequence
from unittest import mock

from ultraep_megatron.megatron.run.arguments import add_ultraep_args, startup_problems
from ultraep_megatron.megatron.run.megatron_checks import parser_error_hint
from ultraep_megatron.megatron.cpu import backend as cpu_backend
from ultraep_megatron.megatron.cpu import flags as cpu_flags

#: How long a rank other than rank 0 waits before exiting on an argument problem (rank 0 prints it).
NON_LOG_RANK_EXIT_DELAY_S = 5.0


def _let_rank_zero_report(log_rank: bool) -> None:
    """Before a failing rank exits: torchrun stops every rank once one fails, so a rank other than
    rank 0 waits for rank 0 to print the problems."""
    if not log_rank:
        time.sleep(NON_LOG_RANK_EXIT_DELAY_S)


class _ParserError(Exception):
    """argparse refused the command line (its one-line message)."""


class _OneLineErrorParser(argparse.ArgumentParser):
    """Megatron's parser with argparse's errors raised instead of printed after the whole usage
    (megatron-core 0.19's runs to ~750 lines), with a "did you mean" for a misspelt flag or choice
    (``megatron_checks.parser_error_hint``), and the arguments it did not recognize kept."""

    unrecognized: list[str] = []
    options: list[str] = []

    def error(self, message):
        raise _ParserError(parser_error_hint(message, self._option_string_actions))

    def parse_known_args(self, args=None, namespace=None):
        type(self).options = list(self._option_string_actions)
        namespace, extras = super().parse_known_args(args, namespace)
        type(self).unrecognized = list(extras)
        return namespace, extras


def parse_megatron_args(log_rank: bool = True) -> tuple[argparse.Namespace | None, list[str]]:
    """Megatron's parse of ``sys.argv`` with UltraEP's groups: (args, parser errors), args
    ``None`` when argparse refused a value. Unknown flags are one error (args still parsed, so
    the other problems are reported with it), with a "did you mean" where one is close.
    ``--help`` prints Megatron's help and exits 0."""
    from megatron.training import arguments as megatron_arguments

    # Megatron's parse_args builds its parser as ``argparse.ArgumentParser(...)``: hand its module a
    # copy of argparse whose ArgumentParser is ours (argparse itself is left alone).
    proxy = types.ModuleType("argparse")
    proxy.__dict__.update(vars(argparse))
    proxy.ArgumentParser = type("ArgumentParser", (_OneLineErrorParser,), {"unrecognized": []})
    try:
        with (
            mock.patch.object(megatron_arguments, "argparse", proxy),
            contextlib.redirect_stderr(sys.stderr if log_rank else io.StringIO()),
        ):
            args = megatron_arguments.parse_args(
                extra_args_provider=add_ultraep_args, ignore_unknown_args=True
            )
    except _ParserError as error:
        return None, [str(error)]
    unknown = proxy.ArgumentParser.unrecognized
    return args, (
        [
            parser_error_hint(
                f"unrecognized arguments: {' '.join(unknown)}", proxy.ArgumentParser.options
            )
        ]
        if unknown
        else []
    )


def startup_checks_or_exit(argv: Sequence[str], *, prog: str = "pretrain_gpt.py") -> list[str]:
    """UltraEP's checks of a training command line, before Megatron validates its arguments,
    prints them, initialises wandb or builds the model.

    On a CPU machine (the CPU backend active) the missing ``cpu.flags.CPU_FLAGS`` are applied
    and logged, a conflicting one is an error. Then Megatron's parser reads the command line (a
    value it refuses or a flag it does not know: one line, then a pointer to ``--help``) and
    ``arguments.startup_problems`` checks it. Every rank runs the same checks; global rank 0 prints
    every problem found, one line each. On an error every rank exits with status 2 (argparse's),
    with no traceback.

    Args:
        argv: the command line without the program name.
        prog: the program name for the messages.

    Returns:
        ``argv`` with the CPU flags applied; hand it to Megatron (e.g. as ``sys.argv[1:]``).
    """
    log_rank = cpu_backend.is_log_rank()

    def report(kind: str, message: str) -> None:
        if log_rank:
            print(
                f"{prog}: {kind}: {message}",
                file=sys.stderr if kind == "error" else sys.stdout,
                flush=True,
            )

    argv, errors = list(argv), []
    if cpu_backend.is_active():
        try:
            argv, applied = cpu_flags.apply_required_args(argv)
        except ValueError as error:
            errors += str(error).splitlines()
        else:
            if applied and not {"-h", "--help"} & set(argv):  # --help prints the help, nothing else
                report("note", "no CUDA device: the CPU backend applied " + "; ".join(applied))

    saved_argv = sys.argv
    sys.argv = [prog, *argv]
    try:
        args, parser_errors = parse_megatron_args(log_rank)
    except SystemExit as parser_exit:  # --help (status 0)
        if parser_exit.code:
            _let_rank_zero_report(log_rank)
        raise
    finally:
        sys.argv = saved_argv
    errors += parser_errors
    if args is not None:
        problems, warnings = startup_problems(args)
        errors += problems
        for message in warnings:
            report("warning", message)
    for message in errors:
        report("error", message)
    if parser_errors and log_rank:
        print(f"{prog}: `{prog} --help` lists every argument", file=sys.stderr, flush=True)
    if errors:
        _let_rank_zero_report(log_rank)
        sys.exit(2)
    return argv
