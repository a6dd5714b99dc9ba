"""Command-line arguments UltraEP adds to Megatron's parser, in Megatron's own style.

Pass :func:`add_ultraep_args` as ``extra_args_provider`` to
``megatron.training.arguments.parse_and_validate_args``. The ``moe balancer`` group is the settings
layer's (``settings/knobs.py``: one entry per ``--moe-balancer-*`` flag, its check naming the
flag); the planner receives plain numbers (:func:`balancer_config_from_args`) and the model's
balancing context the run settings (:func:`balancing_context_from_args`).
:func:`validate_ultraep_args` checks the combination with Megatron's arguments (the Megatron
settings a balanced layer cannot run: :mod:`.capabilities`); :func:`startup_problems` adds the trace
directory's checks, for ``startup.startup_checks_or_exit``. Every check collects: each problem found
is one line naming its flag (:func:`ultraep_arg_problems`).

No Megatron import at module level.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

from ultraep_megatron.megatron.release import capabilities
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.planner.fused_plan import triton_available
from ultraep_megatron.settings.knobs import (
    RUN_SETTINGS,
    UltraEPArgumentError,
    add_balancer_arguments,
    knob_problems,
    knob_values,
    planner_config,
)


def _add_moe_balancer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='moe balancer')
    add_balancer_arguments(group)
    return parser


def _add_telemetry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='ultraep telemetry')
    group.add_argument(
        '--metrics-jsonl',
        type=str,
        default=None,
        help='One JSON record per training iteration (losses, learning rate, grad '
        'norm, per-layer expert-load imbalance) in this file, from the last rank. '
        'A resumed run keeps the records before its first iteration; a run from '
        'iteration 1 starts the file anew. The console/wandb logs are unchanged.',
    )
    group.add_argument(
        '--no-moe-load-telemetry',
        action='store_false',
        dest='moe_load_telemetry',
        help='Do not compute the per-layer expert-load imbalance '
        '(one small reduction per iteration).',
    )
    return parser


def add_ultraep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds UltraEP's argument groups to ``parser`` (and makes
    Megatron's own help printable, see :func:`escape_stray_percent_in_help`)."""
    parser = _add_moe_balancer_args(parser)
    parser = _add_telemetry_args(parser)
    escape_stray_percent_in_help(parser)
    return parser


# A '%' that argparse expands in a help string: '%(name)s'-style or '%%'.
_HELP_FORMAT = re.compile(r"%(\(\w+\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%)?")


def escape_stray_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """Escape the ``%`` signs argparse cannot expand in ``parser``'s help strings.

    megatron-core 0.19.2's help of ``--moe-paged-stash-buffer-size-factor-cuda`` ends in a bare
    "10%", so ``pretrain_gpt.py --help`` died in argparse's formatting. Strings that format are
    left as they are.
    """
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = _HELP_FORMAT.sub(lambda m: m[0] if m[1] else "%%", action.help)


def balancer_config_from_args(args: argparse.Namespace) -> Optional[BalancerConfig]:
    """The planner's ``BalancerConfig`` selected by ``--moe-balancer*``; ``None`` for ``none``."""
    values = knob_values(args)
    if args.moe_balancer == registry.NONE:
        return None
    return planner_config(args.moe_balancer, values)


def balancing_context_from_args(args: argparse.Namespace):
    """The model's ``BalancingContext`` for ``--moe-balancer*``; ``None`` for ``none``."""
    values = knob_values(args)
    if args.moe_balancer == registry.NONE:
        return None
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext

    settings = {field: values[field] for field in RUN_SETTINGS}
    settings["planner"] = settings["planner"] or capabilities.default_planner(
        args.moe_balancer, capabilities.preprocess_graphed(args)
    )
    return BalancingContext(
        planner_config(args.moe_balancer, values), hardware=values["hardware"], **settings
    )


def ultraep_arg_problems(args: argparse.Namespace, environment: bool = True) -> list[str]:
    """Every problem of UltraEP's arguments against Megatron's (parsed ``args``), one line each
    naming its flag: every knob, then the model and the settings a balanced layer cannot run
    (:mod:`.capabilities`). Empty when they can run (and for ``--moe-balancer none`` with valid
    knobs). ``environment``: also what this machine lacks to run them (a flex dispatcher backend
    it cannot import); ``False`` for a check of the configuration for other machines
    (``ultraep check-recipe``, which notes it instead: ``capabilities.missing_packages``)."""
    values, problems = knob_problems(args)
    name = getattr(args, "moe_balancer", registry.NONE)
    if name == registry.NONE or name not in registry.BALANCERS:
        return problems
    domain_size = values["domain_size"]
    if not (
        isinstance(domain_size, int) and not isinstance(domain_size, bool) and domain_size >= 1
    ):
        domain_size = None  # already reported by its knob
    model = capabilities.moe_model_problems(args, domain_size)
    problems += [f"--moe-balancer {name}: {problem}" for problem in model]
    if args.num_experts is not None:  # a dense model: the MoE settings do not apply
        problems += [
            f"--moe-balancer {name}: {problem}"
            for problem in capabilities.unsupported_moe_settings(args, environment)
        ]
    return problems


def validate_ultraep_args(args: argparse.Namespace, environment: bool = True) -> None:
    """Check UltraEP's arguments against Megatron's (after Megatron's own validation): every knob,
    then the model and the settings a balanced layer cannot run (:func:`ultraep_arg_problems`;
    ``environment``: also what this machine lacks to run them).

    Raises:
        UltraEPArgumentError: a ``ValueError`` naming every problem's flag, one line each (its
            ``problems``).
    """
    problems = ultraep_arg_problems(args, environment)
    if problems:
        raise UltraEPArgumentError(problems)


def trace_dir_problem(args: argparse.Namespace, create: bool = True) -> str | None:
    """Why ``--moe-balancer-trace-dir`` cannot take this run's trace (``None`` if it can).

    The directory must be (made) writable: ``create`` makes it, as the run that writes it does;
    without (``ultraep check-recipe``) writability is probed by making and removing a scratch entry
    in it, or in its nearest existing parent, on this machine. A trace already there is appended
    to only by a run that resumes a checkpoint (``--load`` with one to load, not ``--finetune``); a
    fresh run would mix its iterations into another run's trace, so it is refused.
    """
    from ultraep_megatron.traces import TRACE_SUFFIX

    flag = f"--moe-balancer-trace-dir {args.moe_balancer_trace_dir}"
    fix = "use a directory the training job can write (the ranks that record it are each EP group's first)"
    path = Path(args.moe_balancer_trace_dir)
    if path.exists() and not path.is_dir():
        return f"{flag}: not a directory; {fix}"
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            return f"{flag}: cannot create the directory ({error.strerror}); {fix}"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{flag}: the directory is not writable; {fix}"
    else:
        existing = next(p for p in (path, *path.parents) if p.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(20, "Not a directory")
            tempfile.TemporaryDirectory(dir=existing).cleanup()
        except OSError as error:
            where = "not writable" if existing == path else f"cannot be created, {existing}"
            return f"{flag}: {where} here ({error.strerror}); {fix}"
        if existing != path:
            return None  # the run creates it: no trace in it yet
    traces = sorted(p.name for p in path.glob(f"*{TRACE_SUFFIX}"))
    from megatron.training.checkpointing import checkpoint_exists

    resuming = (
        args.load is not None
        and not args.finetune
        and (args.ckpt_step is not None or checkpoint_exists(args.load))
    )
    if traces and not resuming:
        return (
            f"{flag} already holds a trace ({', '.join(traces)}) and this run resumes no "
            "checkpoint, so its records would be appended to another run's; use an empty "
            "directory (a run resuming with --load continues its trace there)"
        )
    return None


def balancing_noop_problems(args: argparse.Namespace) -> list[str]:
    """Settings with which a balancer plans every layer but can move no token: one EP rank, or no
    redundant slot. ``pretrain_gpt.py`` warns (training is still correct); ``ultraep check-recipe``
    fails the recipe (a recipe that asks for balancing should get it)."""
    out = []
    nothing = capabilities.nothing_to_balance(args)
    if nothing:
        out.append(nothing)
    if getattr(args, "moe_balancer_num_slots", None) == 0:
        out.append(
            f"--moe-balancer-num-slots 0 with --moe-balancer {args.moe_balancer}: no redundant slot, so "
            "no replica: balancing does nothing (every layer is still planned); use "
            "--moe-balancer-num-slots 2 or more (the slot rule: docs/recipes.md) or --moe-balancer none"
        )
    return out


def startup_problems(
    args: argparse.Namespace, environment: bool = True
) -> tuple[list[str], list[str]]:
    """(errors, warnings) about a training command line, on Megatron's parsed, not yet validated
    ``args``: what Megatron would refuse with a bare assertion or only after starting
    (``megatron_checks.megatron_arg_problems``), every problem of UltraEP's arguments
    (:func:`ultraep_arg_problems`), the trace directory's; warnings for balancing that does nothing
    (:func:`balancing_noop_problems`). One line each naming its flag. ``environment``: also what
    this machine lacks, and the trace directory is created; ``False`` judges the configuration for
    the machines it targets (``ultraep check-recipe``), probing the trace directory without making
    it."""
    from ultraep_megatron.megatron.run.megatron_checks import megatron_arg_problems

    errors, warnings = megatron_arg_problems(args), []
    balancer = ultraep_arg_problems(args, environment)
    if any(p.startswith("--num-experts ") for p in errors):  # said once, with the fix
        balancer = [
            p for p in balancer if "is not divisible by --expert-model-parallel-size" not in p
        ]
    errors += balancer
    name = getattr(args, "moe_balancer", registry.NONE)
    if name == registry.NONE or name not in registry.BALANCERS:
        return errors, warnings
    if not errors:
        warnings += balancing_noop_problems(args)
    planner = getattr(args, "moe_balancer_planner", None) or capabilities.default_planner(
        name, capabilities.preprocess_graphed(args)
    )
    if environment and planner == "device" and not triton_available():
        warnings.append(
            "the device planner (--moe-balancer-planner device, or the default with "
            "--cuda-graph-modules moe_preprocess) needs triton for its kernel: without it the "
            "self-check fails and the model plans on the host; install triton"
        )
    if isinstance(args.moe_balancer_trace_dir, str) and args.moe_balancer_trace_dir:
        problem = trace_dir_problem(args, create=environment)
        if problem:
            errors.append(problem)
    return errors, warnings
