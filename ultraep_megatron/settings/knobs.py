"""The ``--moe-balancer*`` flags: one table of knobs (:data:`KNOBS`: flag, default, help), the
argparse groups built from it for Megatron's parser and for ``ultraep`` (:func:`add_balancer_arguments`),
their check naming each flag (:func:`knob_problems`) and the planner's numbers they give
(:func:`planner_config`).

A planner setting's rules are :class:`~ultraep_megatron.planner.BalancerConfig`'s
(:meth:`~ultraep_megatron.planner.BalancerConfig.problems`); here each problem it finds is named by
its flag (:data:`FLAGS`), and the run settings (``runtime_only`` knobs: settings of a training run,
not of the balancing policy) and the hardware preset are checked. No torch.distributed, no Megatron:
``megatron/run/arguments.py`` adds the flags to Megatron's parser, ``cli/`` to ``ultraep``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.balancer import (
    DEFAULT_EPLB_INTERVAL,
    DEFAULT_EPLB_WINDOW,
    DEFAULT_NUM_SLOTS,
    FIXES,
    SETTING,
    number_problem,
)
from ultraep_megatron.planner.baselines import registry

from .hardware import hardware_min_quota, hardware_preset

__all__ = [
    "FLAGS",
    "KNOBS",
    "Knob",
    "PLANNERS",
    "RUN_SETTINGS",
    "UltraEPArgumentError",
    "add_balancer_arguments",
    "knob_problems",
    "knob_values",
    "planner_config",
]

#: Where a balanced layer plans (``--moe-balancer-planner``).
PLANNERS = ("host", "device")


@dataclass(frozen=True)
class Knob:
    """One ``--moe-balancer-*`` setting: its flag, default and help.

    Attributes:
        field: the setting's name: a :class:`~ultraep_megatron.planner.BalancerConfig` field, a
            keyword of the model's ``BalancingContext`` (run settings), or ``hardware``; Megatron's
            ``args`` attribute is ``moe_balancer_<field>``.
        flag: the command-line flag, the same in Megatron's parser and in ``ultraep``.
        type: the argparse type.
        default: the default (``None``: derived at run time, see ``help``).
        minimum: smallest valid value of a run setting's number (``None`` is always valid when it
            is the default); the planner's numbers follow :meth:`BalancerConfig.problems`.
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
    Knob(
        "num_slots",
        "--moe-balancer-num-slots",
        int,
        DEFAULT_NUM_SLOTS,
        metavar="S",
        help="Redundant expert slots per expert-parallel rank (ultraep, eplb, eplb-exact). Their "
        "weight and fp32 gradient buffers are shared by all MoE layers. Default: %(default)s.",
    ),
    Knob(
        "min_quota",
        "--moe-balancer-min-quota",
        int,
        None,
        help="ultraep: smallest number of (token, expert) pairs a replica may carry. Default: "
        "derived from --moe-balancer-hardware when given, else 1%% of the mean per-rank load "
        "of the microbatch.",
    ),
    Knob(
        "trigger",
        "--moe-balancer-trigger",
        float,
        None,
        metavar="X",
        help="ultraep: a layer-microbatch whose rank imbalance before balancing (max/mean tokens "
        "per EP rank, from the exact load) is below X keeps every token at home: no replica, "
        "no transfer, no re-materialization, no reduction. 1 balances every one. Default: "
        "1 + min quota / mean rank load of the microbatch, below which even perfect balancing "
        "saves less than one replica must carry to pay for itself (docs/traces.md).",
    ),
    Knob(
        "domain_size",
        "--moe-balancer-domain-size",
        int,
        None,
        help="EP ranks per NVLink (scale-up) domain; consecutive EP ranks form a domain, and it "
        "must divide the EP size. ultraep hosts a replica only in its expert's home domain, so "
        "no expert weight or replica gradient crosses a domain (tokens still go anywhere); the "
        "other balancers place replicas anywhere, and telemetry counts the replicas of any "
        "balancer that cross a domain. Default: the whole EP group is one domain.",
    ),
    Knob(
        "hardware",
        "--moe-balancer-hardware",
        str,
        None,
        metavar="NAME",
        help="ultraep: the GPU system the default --moe-balancer-min-quota (and so the default "
        "trigger) is derived from, and the hardware `ultraep check-recipe` checks the layout and "
        "memory against: paper-rack (the UltraEP paper's GB200 NVL72 rack, 64 GPUs in use), "
        "h100-hgx or h200-hgx (8 x H100 / H200 SXM per node, the node is the NVLink domain); "
        "figures and derivation in docs/traces.md. Default: none, the min quota is 1%% of the "
        "mean rank load.",
    ),
    Knob(
        "eplb_window",
        "--moe-balancer-eplb-window",
        int,
        DEFAULT_EPLB_WINDOW,
        help="eplb: microbatches of load history the placement is computed from. "
        "Default: %(default)s.",
    ),
    Knob(
        "eplb_interval",
        "--moe-balancer-eplb-interval",
        int,
        DEFAULT_EPLB_INTERVAL,
        help="eplb: re-plan the replica placement every this many microbatches of a layer. "
        "Default: %(default)s.",
    ),
    Knob(
        "ring_size",
        "--moe-balancer-ring-size",
        int,
        None,
        minimum=1,
        runtime_only=True,
        help="Capacity of the virtual-layer ring (in-flight MoE invocations per rank). "
        "Default: MoE layers on the rank x the pipeline schedule's in-flight microbatches.",
    ),
    Knob(
        "trace_dir",
        "--moe-balancer-trace-dir",
        str,
        None,
        runtime_only=True,
        metavar="DIR",
        help="Record the exact expert load [EP ranks, experts] of every iteration, microbatch "
        "and MoE layer to one trace file per EP group in this directory (docs/traces.md; "
        "replay with `ultraep replay DIR`).",
    ),
    Knob(
        "overlap",
        "--moe-balancer-no-overlap",
        bool,
        True,
        runtime_only=True,
        action="store_false",
        help="Wait for each replica weight/gradient transfer where it is issued instead of "
        "overlapping it with the layer's other work (to measure what the overlap hides).",
    ),
    Knob(
        "planner",
        "--moe-balancer-planner",
        str,
        None,
        runtime_only=True,
        metavar="WHERE",
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
        "(to test that path; about 0.9 s per layer at EP=64, E=256).",
    ),
    Knob(
        "check_plans",
        "--moe-balancer-check-plans",
        bool,
        False,
        runtime_only=True,
        action="store_true",
        help="Check in every MoE layer that the routing matches the load its plan was solved for "
        "(also in activation-recompute replays). Reads device memory on the host in every "
        "layer: for debugging only.",
    ),
)
#: The knobs that are run settings of the model's ``BalancingContext``, not planner numbers.
RUN_SETTINGS = tuple(k.field for k in KNOBS if k.runtime_only)
#: The knobs that are :class:`BalancerConfig` numbers (validated by its rules).
PLANNER_SETTINGS = tuple(f.name for f in dataclasses.fields(BalancerConfig) if f.name != "name")
#: The flag that sets each setting, for the problems :meth:`BalancerConfig.problems` finds.
FLAGS: dict[str, str] = {"name": "--moe-balancer", **{k.field: k.flag for k in KNOBS}}


def add_balancer_arguments(
    parser,
    *,
    runtime: bool = True,
    balancer_flag: bool = True,
    types: Optional[Mapping[str, Callable[[str], Any]]] = None,
    only: Optional[tuple[str, ...]] = None,
) -> None:
    """Add ``--moe-balancer`` and the knobs' flags to ``parser`` (a parser or argument group).

    Args:
        runtime: also the settings of a training run (``runtime_only`` knobs).
        balancer_flag: add ``--moe-balancer`` itself (Megatron's parser; ``ultraep replay``
            compares several balancers instead).
        types: per knob field, a replacement argparse type (e.g. a quota that may be ``hw``).
        only: add just these knobs (fields), e.g. the hardware for a tool that sweeps the others.
    """
    if balancer_flag:
        parser.add_argument(
            "--moe-balancer",
            type=str,
            default=registry.NONE,
            choices=list(registry.MOE_BALANCERS),
            help="Expert-load balancer for the MoE layers (training is mathematically "
            "unchanged). "
            + " ".join(f'"{n}": {d}.' for n, d in registry.BALANCERS.items())
            + " Default: %(default)s.",
        )
    for knob in KNOBS:
        if (knob.runtime_only and not runtime) or (only is not None and knob.field not in only):
            continue
        if knob.action is not None:
            parser.add_argument(knob.flag, action=knob.action, dest=knob.dest, help=knob.help)
            continue
        parser.add_argument(
            knob.flag,
            type=(types or {}).get(knob.field, knob.type),
            default=knob.default,
            dest=knob.dest,
            metavar=knob.metavar,
            help=knob.help,
            **({"choices": knob.choices} if knob.choices else {}),
        )


def knob_problems(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The ``--moe-balancer-*`` values of parsed ``args`` (knobs a parser did not define: their
    defaults) and every problem with them, one line each naming its flag (empty: all valid): each
    knob's in the order of :data:`KNOBS` (the planner's numbers by :meth:`BalancerConfig.problems`,
    the run settings and the hardware preset by :func:`run_setting_problem`), then the
    combinations."""
    name = getattr(args, "moe_balancer", registry.NONE)
    values = {knob.field: getattr(args, knob.dest, knob.default) for knob in KNOBS}
    found = [
        (p.field, p.naming(FLAGS[p.field]))
        for p in BalancerConfig.problems(name=name, **{f: values[f] for f in PLANNER_SETTINGS})
    ]
    if name == registry.IDEAL:
        found.append(
            (
                "name",
                f"--moe-balancer: {name!r} is the replay's force-balanced reference, not a "
                f"balancer of the MoE layers; choose from {', '.join(registry.MOE_BALANCERS)}",
            )
        )
    for knob in KNOBS:
        value = values[knob.field]
        if knob.field not in PLANNER_SETTINGS and not (value is None and knob.default is None):
            problem = run_setting_problem(knob, value)
            if problem:
                found.append((knob.field, problem))
    order = list(FLAGS)
    problems = [text for _, text in sorted(found, key=lambda problem: order.index(problem[0]))]
    if (
        values["planner"] == "device"
        and name in registry.BALANCERS
        and name not in (registry.NONE, registry.ULTRAEP)
    ):
        problems.append(
            f"--moe-balancer-planner device plans {registry.ULTRAEP} only; --moe-balancer {name} "
            "plans on the host (leave the flag out)"
        )
    if values["trace_dir"] and name == registry.NONE:
        problems.append(
            "--moe-balancer-trace-dir records the load the balanced dispatcher gathers: use it "
            f"with --moe-balancer {', '.join(sorted(registry.EXACT_LOAD | {registry.EPLB}))} "
            "(balancing never changes the routing it records; megatron's own "
            "--moe-routing-trace-path records an unbalanced run)"
        )
    return values, problems


def run_setting_problem(knob: Knob, value) -> Optional[str]:
    """Why ``value`` cannot be the setting of ``knob`` (a run setting or the hardware), naming its
    flag; ``None`` if it can. Numbers follow the planner's rule
    (:func:`~ultraep_megatron.planner.balancer.number_problem`)."""
    if knob.type is bool:
        return (
            None
            if isinstance(value, bool)
            else f"{knob.flag} is a switch (True or False), got {value!r}"
        )
    if knob.type in (int, float):
        minimum = -math.inf if knob.minimum is None else knob.minimum
        fix = FIXES.get(knob.field, "")
        problem = number_problem(value, minimum=minimum, integer=knob.type is int, fix=fix)
        return problem.replace(SETTING, knob.flag) if problem else None
    if not isinstance(value, knob.type):
        return f"{knob.flag} must be a {knob.type.__name__}, got {value!r}"
    if knob.choices is not None and value not in knob.choices:
        return f"{knob.flag} must be one of {', '.join(knob.choices)}, got {value!r}"
    if knob.field == "hardware":
        try:
            hardware_preset(value)
        except ValueError as error:  # an unknown name, the message naming the flag
            return str(error)
    return None


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


def planner_config(name: str, values: Mapping[str, Any]) -> BalancerConfig:
    """The planner's numbers for balancer ``name`` from validated knob ``values``: the min quota
    given, else derived from the hardware preset when one is named, else ``None`` (1 % of the mean
    rank load)."""
    min_quota = values["min_quota"]
    if min_quota is None and values["hardware"] is not None:
        min_quota = hardware_min_quota(values["hardware"])
    return BalancerConfig(
        name,
        num_slots=values["num_slots"],
        min_quota=min_quota,
        trigger=values["trigger"],
        domain_size=values["domain_size"],
        eplb_window=values["eplb_window"],
        eplb_interval=values["eplb_interval"],
    )
