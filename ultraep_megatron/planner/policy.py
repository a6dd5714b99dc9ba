"""The balancing policy, in one place: which balancers exist, their knobs with defaults and
validation, and the per-layer loop that turns each microbatch's exact load into a plan.

Megatron's argument parser (``--moe-balancer*``), the training runtime, the offline replay and
the ``ultraep`` command all read this module; nothing else names a balancer or a knob default.
No Megatron import.

    config = BalancerConfig("ultraep", num_slots=2)      # validated; errors name the flag
    balancer = config.build()                            # one per MoE layer (EPLB keeps history)
    plan = balancer.plan(load)                           # load int64 [R, E] -> planner.Plan

A new knob is one :class:`Knob` entry plus a :class:`BalancerConfig` field of the same name: the
Megatron flag, the ``ultraep`` flag, the validation and the default follow from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from . import baselines, default_min_quota, host_imbalance, host_rank_load, metrics, rank_dispatch, solve
from .plan import Plan

__all__ = [
    "BALANCERS",
    "BalancerConfig",
    "COMPARED",
    "DEFAULT_NUM_SLOTS",
    "EPLB",
    "EPLB_EXACT",
    "EXACT_LOAD",
    "IDEAL",
    "IDEAL_MEGATRON_ARGS",
    "KNOBS",
    "Knob",
    "LABELS",
    "LayerBalancer",
    "MOE_BALANCERS",
    "NONE",
    "ULTRAEP",
    "add_balancer_arguments",
    "describe",
]

NONE, ULTRAEP, EPLB, EPLB_EXACT = "none", "ultraep", "eplb", "eplb-exact"
#: The force-balanced router (megatron-core's ``--moe-router-force-load-balancing``): the paper's
#: ideal, a reference to compare with, not a balancer of the MoE layer.
IDEAL = "ideal"

#: ``--moe-balancer`` choices and what each does.
BALANCERS: dict[str, str] = {
    NONE: "megatron-core's MoELayer unchanged: every token goes to its expert's home rank",
    ULTRAEP: "replicates hot experts into redundant slots and reroutes tokens, planned on the exact "
             "load of every microbatch and MoE layer",
    EPLB: "DeepSeek EPLB's replication rule on the load history (--moe-balancer-eplb-window, "
          "re-planned every --moe-balancer-eplb-interval microbatches); main experts stay home",
    EPLB_EXACT: "EPLB's replication rule on the exact load of every microbatch (the paper's EPLB++)",
}
MOE_BALANCERS: tuple[str, ...] = tuple(BALANCERS)
#: Display labels in comparisons with other balancers: the EPLB baselines keep main experts at home
#: (the paper's fixed-layout EPLB), unlike DeepSeek's own re-placing EPLB (``peers``).
LABELS: dict[str, str] = {
    NONE: "none",
    ULTRAEP: "ultraep",
    EPLB: "eplb-fixed (history; mains at home)",
    EPLB_EXACT: "eplb++-fixed (exact load; mains at home)",
}
#: What replay and the resume experiment compare: the balancers and the ideal.
COMPARED: tuple[str, ...] = (NONE, EPLB, EPLB_EXACT, ULTRAEP, IDEAL)
IDEAL_DESCRIPTION = ("force-balanced routing (--moe-balancer none --moe-router-force-load-balancing): "
                     "every expert gets the same share of tokens; the upper bound of balancing")
#: Megatron arguments that run the ideal.
IDEAL_MEGATRON_ARGS: tuple[str, ...] = ("--moe-balancer", NONE, "--moe-router-force-load-balancing")
#: Balancers that plan on the exact load after gating, on the forward's critical path
#: (``eplb`` plans from history, off it).
EXACT_LOAD: frozenset[str] = frozenset({ULTRAEP, EPLB_EXACT})

#: Redundant slots per EP rank. Two: the paper's Table 3 uses 1-2 per rank; the planner reaches
#: ~1.00 max/mean with 2 on rack-scale loads (docs/planner.md); each costs one expert's weights +
#: fp32 gradients per rank, shared by all MoE layers.
DEFAULT_NUM_SLOTS = 2
DEFAULT_EPLB_WINDOW = 16
DEFAULT_EPLB_INTERVAL = 16


def describe(name: str) -> str:
    """One line saying what balancer ``name`` (or the ideal) does."""
    return IDEAL_DESCRIPTION if name == IDEAL else BALANCERS[name]


@dataclass(frozen=True)
class Knob:
    """One setting of a balancer: a :class:`BalancerConfig` field and its ``--moe-balancer-*`` flag.

    Attributes:
        field: the BalancerConfig attribute (and Megatron's ``args`` attribute ``moe_balancer_<field>``).
        flag: the command-line flag, the same in Megatron's parser and in ``ultraep``.
        type: the argparse type.
        default: the default (``None``: derived at run time, see ``help``).
        minimum: smallest valid value, for numbers (``None`` is always valid when it is the default).
        help: argparse help (``%%`` for a percent sign).
        runtime_only: a setting of a training run (not of the balancing policy): not offered by replay.
        metavar: the value's name in ``--help``.
        action: ``store_true`` / ``store_false`` for a switch (``type`` is then ``bool``).
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

    @property
    def dest(self) -> str:
        """Megatron's ``args`` attribute: ``moe_balancer_<field>`` (also for a negated switch)."""
        return f"moe_balancer_{self.field}"


KNOBS: tuple[Knob, ...] = (
    Knob("num_slots", "--moe-balancer-num-slots", int, DEFAULT_NUM_SLOTS, minimum=0, metavar="S",
         help="Redundant expert slots per expert-parallel rank (ultraep, eplb, eplb-exact). Their "
              "weight and fp32 gradient buffers are shared by all MoE layers. Default: %(default)s."),
    Knob("min_quota", "--moe-balancer-min-quota", int, None, minimum=1,
         help="ultraep: smallest number of (token, expert) pairs a replica may carry. Default: "
              "derived from --moe-balancer-hardware when given, else 1%% of the mean per-rank load "
              "of the microbatch."),
    Knob("trigger", "--moe-balancer-trigger", float, None, minimum=1.0, metavar="X",
         help="ultraep: a layer-microbatch whose rank imbalance before balancing (max/mean tokens "
              "per EP rank, from the exact load) is below X keeps every token at home: no replica, "
              "no transfer, no re-materialization, no reduction. 1 balances every one. Default: "
              "1 + min quota / mean rank load of the microbatch, below which even perfect balancing "
              "saves less than one replica must carry to pay for itself (docs/traces.md)."),
    Knob("domain_size", "--moe-balancer-domain-size", int, None, minimum=1,
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
    Knob("eplb_window", "--moe-balancer-eplb-window", int, DEFAULT_EPLB_WINDOW, minimum=1,
         help="eplb: microbatches of load history the placement is computed from. "
              "Default: %(default)s."),
    Knob("eplb_interval", "--moe-balancer-eplb-interval", int, DEFAULT_EPLB_INTERVAL, minimum=1,
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
    Knob("check_plans", "--moe-balancer-check-plans", bool, False, runtime_only=True,
         action="store_true",
         help="Check in every MoE layer that the routing matches the load its plan was solved for "
              "(also in activation-recompute replays). Reads device memory on the host in every "
              "layer: for debugging only."),
)
_KNOB = {k.field: k for k in KNOBS}


@dataclass(frozen=True)
class BalancerConfig:
    """A balancer and its settings, validated on construction (errors name the flag).

    Attributes:
        name: a balancer of :data:`BALANCERS`, or :data:`IDEAL` (replay only: no plan).
        num_slots: redundant slots per EP rank.
        min_quota: ultraep's smallest replica quota (``None``: derived from ``hardware`` when given,
            else 1 % of the mean rank load).
        trigger: ultraep balances a load only if its rank imbalance reaches this (``None``:
            ``1 + min quota / mean rank load``; see :meth:`LayerBalancer.balances`).
        domain_size: EP ranks per NVLink domain; ultraep keeps replicas inside their home's domain
            (``None``: one domain).
        hardware: a preset of ``analysis.cost.HARDWARE_PRESETS`` the min quota is derived from.
        eplb_window / eplb_interval: eplb's history and re-plan period, in microbatches of a layer.
        ring_size: virtual-layer ring capacity of a training run (``None``: from the schedule).
        trace_dir: where a training run records its loads (``None``: not recorded).
        overlap: a training run overlaps its replica transfers with the layer's other work.
        check_plans: a training run checks every plan against the routing (device reads).
    """

    name: str = ULTRAEP
    num_slots: int = DEFAULT_NUM_SLOTS
    min_quota: Optional[int] = None
    trigger: Optional[float] = None
    domain_size: Optional[int] = None
    hardware: Optional[str] = None
    eplb_window: int = DEFAULT_EPLB_WINDOW
    eplb_interval: int = DEFAULT_EPLB_INTERVAL
    ring_size: Optional[int] = None
    trace_dir: Optional[str] = None
    overlap: bool = True
    check_plans: bool = False

    def __post_init__(self):
        if self.name not in BALANCERS and self.name != IDEAL:
            raise ValueError(f"--moe-balancer: unknown balancer {self.name!r}; choose from "
                             f"{', '.join(MOE_BALANCERS)}")
        for knob in KNOBS:
            value = getattr(self, knob.field)
            if value is None and knob.default is None:
                continue
            if knob.type is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{knob.flag} is a switch (True or False), got {value!r}")
            elif knob.type in (int, float):
                if isinstance(value, bool) or not isinstance(value, (int, float) if knob.type is float else int):
                    raise ValueError(f"{knob.flag} must be {'a number' if knob.type is float else 'an integer'}, "
                                     f"got {value!r}")
                if knob.minimum is not None and not value >= knob.minimum:
                    raise ValueError(f"{knob.flag} must be >= {knob.minimum}, got {value}")
            elif not isinstance(value, knob.type):
                raise ValueError(f"{knob.flag} must be a {knob.type.__name__}, got {value!r}")
        if self.hardware is not None:
            _hardware_min_quota(self.hardware)  # an unknown name fails here, naming the flag
        if self.trace_dir and self.name in (NONE, IDEAL):
            raise ValueError("--moe-balancer-trace-dir records the load the balanced dispatcher "
                             f"gathers: use it with --moe-balancer {', '.join(sorted(EXACT_LOAD | {EPLB}))} "
                             "(balancing never changes the routing it records; megatron's own "
                             "--moe-routing-trace-path records an unbalanced run)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BalancerConfig":
        """The configuration of Megatron's (or ``ultraep``'s) parsed ``--moe-balancer*`` flags;
        knobs a parser did not define keep their defaults."""
        values = {k.field: getattr(args, k.dest) for k in KNOBS if hasattr(args, k.dest)}
        return cls(name=args.moe_balancer, **values)

    def replace(self, **changes) -> "BalancerConfig":
        return dataclasses.replace(self, **changes)

    def build(self) -> "LayerBalancer":
        """A fresh per-layer balancer (EPLB keeps per-layer history)."""
        return LayerBalancer(self)


def _hardware_min_quota(name: str) -> int:
    """The training quota floor derived from hardware preset ``name`` (``analysis.cost``; the floor
    does not depend on the expert's size)."""
    from ultraep_megatron.analysis.cost import DEFAULT_SHAPE, hardware_preset, min_quota_from_hardware

    return min_quota_from_hardware(DEFAULT_SHAPE, hardware_preset(name), training=True)


class LayerBalancer:
    """One MoE layer's balancing loop: each microbatch's exact load ``[R, E]`` -> a ``Plan``.

    Deterministic: every EP rank feeding the same loads gets the same plans. ``ultraep`` solves only
    loads that reach its trigger (:meth:`balances`); the others get the identity plan. ``eplb``
    keeps this layer's load history: its placement is computed from the last ``eplb_window`` loads
    (the current one on the first call) and refreshed every ``eplb_interval`` calls; the current load
    goes round-robin over the placement's instances.
    """

    def __init__(self, config: BalancerConfig):
        self.config = config
        # ultraep's quota floor: given, derived from the hardware, or None (1 % of each load).
        self.min_quota = (config.min_quota if config.min_quota is not None or config.hardware is None
                          else _hardware_min_quota(config.hardware))
        self._history: list[torch.Tensor] = []
        self._placement: Optional[torch.Tensor] = None  # eplb: slot_expert [R, S] in force
        self._calls = 0

    def balances(self, load: torch.Tensor) -> bool:
        """Whether ``load`` (int64 [R, E]) is balanced at all (always, except for ultraep below its
        trigger). With an explicit trigger X: ``planner.rank_imbalance(load) >= X``. By default the
        busiest rank's excess over the mean must reach the min quota q, ``max - mean >= q``, i.e. the
        imbalance reaches ``1 + q / mean``: below it, bringing every rank to the mean moves fewer
        tokens off the busiest rank than one replica must carry to pay for itself, so no plan can
        pay. Host arithmetic on the exact load: the same answer on every EP rank."""
        cfg = self.config
        if cfg.name != ULTRAEP:
            return True
        R = load.shape[0]
        rank_load = host_rank_load(load)
        total = int(rank_load.sum())
        if cfg.trigger is not None:
            return host_imbalance(rank_load) >= cfg.trigger
        q = self.min_quota if self.min_quota is not None else default_min_quota(total, R)
        return total > 0 and R * int(rank_load.max()) - total >= R * q

    def warm_up(self) -> None:
        """Load the compiled kernels this balancer's plans run (numba: 0.2-0.5 s even from its
        cache) on a small skewed load, past the trigger, in this balancer's NVLink domains, and the
        per-rank dispatch and metrics kernels every planned invocation runs; no state of this
        balancer changes."""
        R = 2 * (self.config.domain_size or 1)
        load = torch.ones(R, 2 * R, dtype=torch.int64)
        load[:, 0] += 64  # all on rank 0's first expert: a replica to place
        plan = LayerBalancer(dataclasses.replace(self.config, trigger=1.0)).plan(load)
        if plan is not None:
            rank_dispatch(plan, load, 0)
            metrics(load, plan, domain_size=self.config.domain_size)

    def plan(self, load: torch.Tensor, *, balances: Optional[bool] = None) -> Optional[Plan]:
        """load: int64 [R, E] host tensor -> Plan; ``None`` for the ideal (the router spreads the
        tokens). ``balances``: :meth:`balances` of ``load``, when the caller has it already."""
        cfg = self.config
        if cfg.name == ULTRAEP:
            if not (self.balances(load) if balances is None else balances):
                return baselines.identity_plan(load, cfg.num_slots)
            return solve(load, cfg.num_slots, min_quota=self.min_quota, domain_size=cfg.domain_size)
        if cfg.name == EPLB_EXACT:
            return baselines.eplb_exact(load, cfg.num_slots)
        if cfg.name == NONE:
            return baselines.identity_plan(load)
        if cfg.name == IDEAL:
            return None
        if self._placement is None or self._calls % cfg.eplb_interval == 0:
            history = torch.stack(self._history[-cfg.eplb_window:]) if self._history else load.unsqueeze(0)
            self._placement = baselines.eplb(history, cfg.num_slots).slot_expert
        self._calls += 1
        self._history.append(load.clone())
        del self._history[:-cfg.eplb_window]
        return baselines.round_robin(load, self._placement)


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
        parser.add_argument("--moe-balancer", type=str, default=NONE, choices=list(MOE_BALANCERS),
                            help="Expert-load balancer for the MoE layers (training is mathematically "
                                 "unchanged). " + " ".join(f'"{n}": {d}.' for n, d in BALANCERS.items())
                                 + " Default: %(default)s.")
    for knob in KNOBS:
        if (knob.runtime_only and not runtime) or (only is not None and knob.field not in only):
            continue
        if knob.action is not None:
            parser.add_argument(knob.flag, action=knob.action, dest=knob.dest, help=knob.help)
            continue
        parser.add_argument(knob.flag, type=(types or {}).get(knob.field, knob.type), default=knob.default,
                            dest=knob.dest, metavar=knob.metavar, help=knob.help)
