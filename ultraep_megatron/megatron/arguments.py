"""Command-line arguments UltraEP adds to Megatron's parser, in Megatron's own style.

Pass :func:`add_ultraep_args` as ``extra_args_provider`` to
``megatron.training.arguments.parse_and_validate_args``. The ``moe balancer`` group comes from
:data:`KNOBS` (one entry per ``--moe-balancer-*`` flag: default, validation, help); the planner
receives plain numbers (:func:`balancer_config_from_args`) and the model's balancing context the run
settings (:func:`balancing_context_from_args`). :func:`validate_ultraep_args` checks the
combination (the Megatron settings a balanced layer cannot run: :mod:`.capabilities`);
:func:`startup_problems` adds the trace directory's checks, for ``startup.startup_checks_or_exit``.
Every check collects: each problem found is one line naming its flag (:func:`ultraep_arg_problems`).

``ultraep`` (the console command) builds its balancer flags from the same table. No Megatron import
at module level.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ultraep_megatron.megatron import capabilities
from ultraep_megatron.megatron.device_planning import PLANNERS
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner import balancer as planner_balancer
from ultraep_megatron.planner.balancer import MINIMUMS
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.planner.device_solve import triton_available


@dataclass(frozen=True)
class Knob:
    """One ``--moe-balancer-*`` setting: its flag, default, validation and help.

    Attributes:
        field: the setting's name: a :class:`~ultraep_megatron.planner.BalancerConfig` field, a
            keyword of the model's ``BalancingContext`` (run settings), or ``hardware``; Megatron's
            ``args`` attribute is ``moe_balancer_<field>``.
        flag: the command-line flag, the same in Megatron's parser and in ``ultraep``.
        type: the argparse type.
        default: the default (``None``: derived at run time, see ``help``).
        minimum: smallest valid value, for numbers (``None`` is always valid when it is the default).
        help: argparse help (``%%`` for a percent sign).
        runtime_only: a setting of a training run (not of the balancing policy): not offered by replay.
        metavar: the value's name in ``--help``.
        action: ``store_true`` / ``store_false`` for a switch (``type`` is then ``bool``).
        choices: the values a string setting may take (``None``: any).
    """

    field: str
    flag: str
    type: Callable[[str], Any]
    default: Any
    help: str
    minimum: Optional[int] = None
    runtime_only: bool = False
    metavar: str = "N"
    action: Optional[str] = None
    choices: Optional[tuple[str, ...]] = None

    @property
    def dest(self) -> str:
        """Megatron's ``args`` attribute: ``moe_balancer_<field>`` (also for a negated switch)."""
        return f"moe_balancer_{self.field}"


KNOBS: tuple[Knob, ...] = (
    Knob("num_slots", "--moe-balancer-num-slots", int, planner_balancer.DEFAULT_NUM_SLOTS,
         minimum=MINIMUMS["num_slots"],
         metavar="S",
         help="Redundant expert slots per expert-parallel rank (ultraep, eplb, eplb-exact). Their "
              "weight and fp32 gradient buffers are shared by all MoE layers. Default: %(default)s."),
    Knob("min_quota", "--moe-balancer-min-quota", int, None, minimum=MINIMUMS["min_quota"],
         help="ultraep: smallest number of (token, expert) pairs a replica may carry. Default: "
              "derived from --moe-balancer-hardware when given, else 1%% of the mean per-rank load "
              "of the microbatch."),
    Knob("trigger", "--moe-balancer-trigger", float, None, minimum=MINIMUMS["trigger"], metavar="X",
         help="ultraep: a layer-microbatch whose rank imbalance before balancing (max/mean tokens "
              "per EP rank, from the exact load) is below X keeps every token at home: no replica, "
              "no transfer, no re-materialization, no reduction. 1 balances every one. Default: "
              "1 + min quota / mean rank load of the microbatch, below which even perfect balancing "
              "saves less than one replica must carry to pay for itself (docs/traces.md)."),
    Knob("domain_size", "--moe-balancer-domain-size", int, None, minimum=MINIMUMS["domain_size"],
         help="EP ranks per NVLink (scale-up) domain; consecutive EP ranks form a domain, and it "
              "must divide the EP size. ultraep hosts a replica only in its expert's home domain, so "
              "no expert weight or replica gradient crosses a domain (tokens still go anywhere); the "
              "other balancers place replicas anywhere, and telemetry counts the replicas of any "
              "balancer that cross a domain. Default: the whole EP group is one domain."),
    Knob("hardware", "--moe-balancer-hardware", str, None, metavar="NAME",
         help="ultraep: the GPU system the default --moe-balancer-min-quota (and so the default "
              "trigger) is derived from: paper-rack (the UltraEP paper's 64-GPU rack) or h100-hgx "
              "(8 x H100 SXM per NVLink domain); figures and derivation in docs/traces.md. Default: "
              "none, the min quota is 1%% of the mean rank load."),
    Knob("eplb_window", "--moe-balancer-eplb-window", int, planner_balancer.DEFAULT_EPLB_WINDOW,
         minimum=MINIMUMS["eplb_window"],
         help="eplb: microbatches of load history the placement is computed from. "
              "Default: %(default)s."),
    Knob("eplb_interval", "--moe-balancer-eplb-interval", int, planner_balancer.DEFAULT_EPLB_INTERVAL,
         minimum=MINIMUMS["eplb_interval"],
         help="eplb: re-plan the replica placement every this many microbatches of a layer. "
              "Default: %(default)s."),
    Knob("ring_size", "--moe-balancer-ring-size", int, None, minimum=1, runtime_only=True,
         help="Capacity of the virtual-layer ring (in-flight MoE invocations per rank). "
              "Default: MoE layers on the rank x the pipeline schedule's in-flight microbatches."),
    Knob("trace_dir", "--moe-balancer-trace-dir", str, None, runtime_only=True, metavar="DIR",
         help="Record the exact expert load [EP ranks, experts] of every iteration, microbatch "
              "and MoE layer to one trace file per EP group in this directory (docs/traces.md; "
              "replay with `ultraep replay DIR`)."),
    Knob("overlap", "--moe-balancer-no-overlap", bool, True, runtime_only=True, action="store_false",
         help="Wait for each replica weight/gradient transfer where it is issued instead of "
              "overlapping it with the layer's other work (to measure what the overlap hides)."),
    Knob("planner", "--moe-balancer-planner", str, None, runtime_only=True, metavar="WHERE",
         choices=PLANNERS,
         help="Where ultraep plans each layer-microbatch. host: the exact load crosses to the host, "
              "which plans, then the device reroutes and permutes the tokens. device: the plan, the "
              "reroute table, the reroute and the permutation are queued on the device, and the "
              "plan crosses to the host afterwards, where megatron's dispatcher waits for its splits "
              "anyway (ultraep only). Default: host, which is faster unless the preprocessing is "
              "captured in a CUDA graph (one compiled solve against the device planner's hundreds of "
              "small kernels); device where --cuda-graph-modules captures moe_preprocess, which needs "
              "a plan without a host read. When the model is built, the device planner compiles its kernels and "
              "checks its plans of probe loads against the host's references; rank 0 prints "
              "'device planner ready in X s' once, or, on any failure, one warning saying why, and "
              "the model plans on the host. host skips the check and the warning. On the CPU "
              "backend, device runs the device planner's torch calls step by step as a GPU would "
              "(to test that path; about 0.9 s per layer at EP=64, E=256)."),
    Knob("check_plans", "--moe-balancer-check-plans", bool, False, runtime_only=True,
         action="store_true",
         help="Check in every MoE layer that the routing matches the load its plan was solved for "
              "(also in activation-recompute replays). Reads device memory on the host in every "
              "layer: for debugging only."),
)
#: The knobs that are run settings of the model's ``BalancingContext``, not planner numbers.
RUN_SETTINGS = tuple(k.field for k in KNOBS if k.runtime_only)


def add_balancer_arguments(parser, *, runtime: bool = True, balancer_flag: bool = True,
                           types: Optional[Mapping[str, Callable[[str], Any]]] = None,
                           only: Optional[tuple[str, ...]] = None) -> None:
    """Add ``--moe-balancer`` and the knobs' flags to ``parser`` (a parser or argument group).

    Args:
        runtime: also the settings of a training run (``runtime_only`` knobs).
        balancer_flag: add ``--moe-balancer`` itself (Megatron's parser; ``ultraep replay``
            compares several balancers instead).
        types: per knob field, a replacement argparse type (e.g. a quota that may be ``hw``).
        only: add just these knobs (fields), e.g. the hardware for a tool that sweeps the others.
    """
    if balancer_flag:
        parser.add_argument("--moe-balancer", type=str, default=registry.NONE,
                            choices=list(registry.MOE_BALANCERS),
                            help="Expert-load balancer for the MoE layers (training is mathematically "
                                 "unchanged). " + " ".join(f'"{n}": {d}.' for n, d in registry.BALANCERS.items())
                                 + " Default: %(default)s.")
    for knob in KNOBS:
        if (knob.runtime_only and not runtime) or (only is not None and knob.field not in only):
            continue
        if knob.action is not None:
            parser.add_argument(knob.flag, action=knob.action, dest=knob.dest, help=knob.help)
            continue
        parser.add_argument(knob.flag, type=(types or {}).get(knob.field, knob.type), default=knob.default,
                            dest=knob.dest, metavar=knob.metavar, help=knob.help,
                            **({"choices": knob.choices} if knob.choices else {}))


def knob_problems(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The ``--moe-balancer-*`` values of parsed ``args`` (knobs a parser did not define: their
    defaults) and every problem with them, one line each naming its flag (empty: all valid)."""
    problems = []
    name = getattr(args, "moe_balancer", registry.NONE)
    if name not in registry.BALANCERS:
        problems.append(f"--moe-balancer: unknown balancer {name!r}; choose from "
                        f"{', '.join(registry.MOE_BALANCERS)}")
    values = {}
    for knob in KNOBS:
        value = getattr(args, knob.dest, knob.default)
        values[knob.field] = value
        if value is None and knob.default is None:
            continue
        if knob.type is bool:
            if not isinstance(value, bool):
                problems.append(f"{knob.flag} is a switch (True or False), got {value!r}")
        elif knob.type in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float) if knob.type is float else int):
                problems.append(f"{knob.flag} must be {'a number' if knob.type is float else 'an integer'}, "
                                f"got {value!r}")
            elif knob.minimum is not None and not value >= knob.minimum:
                problems.append(f"{knob.flag} must be >= {knob.minimum}, got {value}")
        elif not isinstance(value, knob.type):
            problems.append(f"{knob.flag} must be a {knob.type.__name__}, got {value!r}")
        elif knob.choices is not None and value not in knob.choices:
            problems.append(f"{knob.flag} must be one of {', '.join(knob.choices)}, got {value!r}")
    if isinstance(values["hardware"], str):
        try:
            hardware_min_quota(values["hardware"])  # an unknown name fails here, naming the flag
        except ValueError as error:
            problems.append(str(error))
    if values["planner"] == "device" and name in registry.BALANCERS and name not in (registry.NONE, registry.ULTRAEP):
        problems.append(f"--moe-balancer-planner device plans {registry.ULTRAEP} only; --moe-balancer {name} "
                        "plans on the host (leave the flag out)")
    if values["trace_dir"] and name == registry.NONE:
        problems.append("--moe-balancer-trace-dir records the load the balanced dispatcher gathers: use it "
                        f"with --moe-balancer {', '.join(sorted(registry.EXACT_LOAD | {registry.EPLB}))} "
                        "(balancing never changes the routing it records; megatron's own "
                        "--moe-routing-trace-path records an unbalanced run)")
    return values, problems


def knob_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--moe-balancer-*`` values of parsed ``args`` (knobs a parser did not define: their
    defaults), each validated (:func:`knob_problems`).

    Raises:
        UltraEPArgumentError: naming every invalid flag, one line each.
    """
    values, problems = knob_problems(args)
    if problems:
        raise UltraEPArgumentError(problems)
    return values


class UltraEPArgumentError(ValueError):
    """UltraEP's arguments cannot run: every problem found, one line each naming its flag
    (``problems``; the message is the lines joined by newlines)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def hardware_min_quota(name: str) -> int:
    """The training quota floor derived from ``--moe-balancer-hardware`` preset ``name``
    (``analysis.cost``; the floor does not depend on the expert's size)."""
    from ultraep_megatron.analysis.cost import DEFAULT_SHAPE, hardware_preset, min_quota_from_hardware

    return min_quota_from_hardware(DEFAULT_SHAPE, hardware_preset(name), training=True)


def planner_config(name: str, values: Mapping[str, Any]) -> BalancerConfig:
    """The planner's numbers for balancer ``name`` from validated knob ``values``: the min quota
    given, else derived from the hardware preset when one is named, else ``None`` (1 % of the mean
    rank load)."""
    min_quota = values["min_quota"]
    if min_quota is None and values["hardware"] is not None:
        min_quota = hardware_min_quota(values["hardware"])
    return BalancerConfig(name, num_slots=values["num_slots"], min_quota=min_quota,
                          trigger=values["trigger"], domain_size=values["domain_size"],
                          eplb_window=values["eplb_window"], eplb_interval=values["eplb_interval"])


def _add_moe_balancer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='moe balancer')
    add_balancer_arguments(group)
    return parser


def _add_telemetry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='ultraep telemetry')
    group.add_argument('--metrics-jsonl', type=str, default=None,
                       help='One JSON record per training iteration (losses, learning rate, grad '
                       'norm, per-layer expert-load imbalance) in this file, from the last rank. '
                       'A resumed run keeps the records before its first iteration; a run from '
                       'iteration 1 starts the file anew. The console/wandb logs are unchanged.')
    group.add_argument('--no-moe-load-telemetry', action='store_false',
                       dest='moe_load_telemetry',
                       help='Do not compute the per-layer expert-load imbalance '
                       '(one small reduction per iteration).')
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
    from ultraep_megatron.megatron.context import BalancingContext

    settings = {field: values[field] for field in RUN_SETTINGS}
    settings["planner"] = settings["planner"] or capabilities.default_planner(
        args.moe_balancer, capabilities.preprocess_graphed(args))
    return BalancingContext(planner_config(args.moe_balancer, values), hardware=values["hardware"], **settings)


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
    if not (isinstance(domain_size, int) and not isinstance(domain_size, bool) and domain_size >= 1):
        domain_size = None  # already reported by its knob
    model = capabilities.moe_model_problems(args, domain_size)
    problems += [f"--moe-balancer {name}: {problem}" for problem in model]
    if args.num_experts is not None:  # a dense model: the MoE settings do not apply
        problems += [f"--moe-balancer {name}: {problem}"
                     for problem in capabilities.unsupported_moe_settings(args, environment)]
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


def trace_dir_problem(args: argparse.Namespace) -> str | None:
    """Why ``--moe-balancer-trace-dir`` cannot take this run's trace (``None`` if it can).

    The directory must be (made) writable. A trace already there is appended to only by a run
    that resumes a checkpoint (``--load`` with one to load, not ``--finetune``); a fresh run
    would mix its iterations into another run's trace, so it is refused.
    """
    from ultraep_megatron.traces import TRACE_SUFFIX

    flag = f"--moe-balancer-trace-dir {args.moe_balancer_trace_dir}"
    path = Path(args.moe_balancer_trace_dir)
    if path.exists() and not path.is_dir():
        return f"{flag}: not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{flag}: cannot create the directory ({error.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{flag}: the directory is not writable"
    traces = sorted(p.name for p in path.glob(f"*{TRACE_SUFFIX}"))
    from megatron.training.checkpointing import checkpoint_exists

    resuming = args.load is not None and not args.finetune and (
        args.ckpt_step is not None or checkpoint_exists(args.load))
    if traces and not resuming:
        return (f"{flag} already holds a trace ({', '.join(traces)}) and this run resumes no "
                "checkpoint, so its records would be appended to another run's; use an empty "
                "directory (a run resuming with --load continues its trace there)")
    return None


def startup_problems(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(errors, warnings) about UltraEP's arguments, on Megatron's parsed, not yet validated
    ``args``: every problem found (:func:`ultraep_arg_problems`, the trace directory's), one line
    each naming its flag."""
    errors, warnings = ultraep_arg_problems(args), []
    name = getattr(args, "moe_balancer", registry.NONE)
    if name == registry.NONE or name not in registry.BALANCERS:
        return errors, warnings
    warning = capabilities.nothing_to_balance(args) if not errors else None
    if warning:
        warnings.append(warning)
    planner = getattr(args, "moe_balancer_planner", None) or capabilities.default_planner(
        name, capabilities.preprocess_graphed(args))
    if planner == "device" and not triton_available():
        warnings.append("the device planner (--moe-balancer-planner device, or the default with "
                        "--cuda-graph-modules moe_preprocess) without triton installed runs its torch "
                        "reference step by step (hundreds of small kernels per layer); install triton")
    if isinstance(args.moe_balancer_trace_dir, str) and args.moe_balancer_trace_dir:
        problem = trace_dir_problem(args)
        if problem:
            errors.append(problem)
    return errors, warnings
