"""One MoE layer's balancing loop: a balancer and its settings (plain numbers), and the per-layer
state that turns each microbatch's exact load into a :class:`Plan`.

    config = BalancerConfig("ultraep", num_slots=2)  # validated
    balancer = config.build()                        # one per MoE layer (EPLB keeps history)
    plan = balancer.plan(load)                       # load int64 [R, E] -> Plan

The rules a setting must meet live here, once (:meth:`BalancerConfig.problems`); the command-line
flags that set these numbers, and the hardware presets a quota floor may be derived from, are the
settings layer's (``settings/knobs.py`` names each problem by its flag).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import _compiled_record
from .baselines import fixed_layout
from .baselines.registry import BALANCERS, EPLB, EPLB_EXACT, IDEAL, MOE_BALANCERS, NONE, ULTRAEP
from .metrics import host_imbalance, host_rank_load
from .plan import Plan
from .solve import default_min_quota, solve

__all__ = [
    "BalancerConfig",
    "ConfigProblem",
    "InvalidConfig",
    "LayerBalancer",
    "DEFAULT_NUM_SLOTS",
    "DEFAULT_EPLB_WINDOW",
    "DEFAULT_EPLB_INTERVAL",
    "number_problem",
]

#: Redundant slots per EP rank. Two: the paper's Table 3 uses 1-2 per rank; the planner reaches
#: ~1.00 max/mean with 2 on rack-scale loads (docs/planner.md); each costs one expert's weights +
#: fp32 gradients per rank, shared by all MoE layers.
DEFAULT_NUM_SLOTS = 2
DEFAULT_EPLB_WINDOW = 16
DEFAULT_EPLB_INTERVAL = 16

#: Smallest valid value of each numeric setting (``None`` is valid where it is the default).
MINIMUMS = {
    "num_slots": 0,
    "min_quota": 1,
    "trigger": 1.0,
    "domain_size": 1,
    "eplb_window": 1,
    "eplb_interval": 1,
}
#: What to use instead, per setting, after a value below its minimum.
FIXES = {
    "num_slots": f"use {DEFAULT_NUM_SLOTS} (the default) or the slot rule's "
    "max(2, ceil(experts / (2 x EP))) (docs/recipes.md)",
    "min_quota": "use 1 or more tokens, or leave it out (1 % of the mean rank load)",
    "trigger": "use 1.0 (balance every load) or more, or leave it out (derived from the quota)",
    "domain_size": "use the EP ranks of one NVLink domain (8 on an HGX node), or leave it out",
    "eplb_window": f"use {DEFAULT_EPLB_WINDOW} (the default) or another count of microbatches",
    "eplb_interval": f"use {DEFAULT_EPLB_INTERVAL} (the default) or another count of microbatches",
}
#: The settings whose ``None`` means "derived" (see :class:`BalancerConfig`).
OPTIONAL = ("min_quota", "trigger", "domain_size")
#: Where a problem's text puts the setting's name (a field here, a flag in the settings layer).
SETTING = "{setting}"


@dataclass(frozen=True)
class ConfigProblem:
    """One setting that cannot run: the :class:`BalancerConfig` field and why, as a text that names
    the setting where :data:`SETTING` stands, so that a caller names it as its user knows it (the
    settings layer: by its flag)."""

    field: str
    text: str

    def naming(self, setting: str) -> str:
        """The problem in one line, the setting called ``setting``."""
        return self.text.replace(SETTING, setting)


class InvalidConfig(ValueError):
    """A :class:`BalancerConfig` that cannot run: every problem (``problems``), one line each naming
    the field."""

    def __init__(self, problems: list[ConfigProblem]):
        super().__init__("\n".join(p.naming(p.field) for p in problems))
        self.problems = list(problems)


def number_problem(value, *, minimum, integer: bool, fix: str = "") -> Optional[str]:
    """Why ``value`` is not a valid number of at least ``minimum`` (an integer if ``integer``), as a
    text naming the setting at :data:`SETTING`; ``None`` if it is valid. The rule every numeric
    setting follows, the planner's and the run's (``settings/knobs.py``); ``fix`` (what to use
    instead) follows a value below the minimum."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return f"{SETTING} must be {'an integer' if integer else 'a number'}, got {value!r}"
    if not value >= minimum:
        return f"{SETTING} must be >= {minimum}, got {value}" + (f": {fix}" if fix else "")
    return None


@dataclass(frozen=True)
class BalancerConfig:
    """A balancer and its settings, validated on construction (:meth:`problems`).

    Attributes:
        name: a balancer of ``registry.BALANCERS``, or ``registry.IDEAL`` (replay only: no plan).
        num_slots: S, redundant slots per EP rank.
        min_quota: ultraep's smallest replica quota (``None``: 1 % of the mean rank load).
        trigger: ultraep balances a load only if its rank imbalance reaches this (``None``:
            ``1 + min quota / mean rank load``; see :meth:`LayerBalancer.balances`).
        domain_size: EP ranks per NVLink domain; ultraep keeps replicas inside their home's domain
            (``None``: one domain).
        eplb_window / eplb_interval: eplb's history and re-plan period, in microbatches of a layer.

    Raises:
        InvalidConfig: a ``ValueError`` naming every invalid field.
    """

    name: str = ULTRAEP
    num_slots: int = DEFAULT_NUM_SLOTS
    min_quota: Optional[int] = None
    trigger: Optional[float] = None
    domain_size: Optional[int] = None
    eplb_window: int = DEFAULT_EPLB_WINDOW
    eplb_interval: int = DEFAULT_EPLB_INTERVAL

    def __post_init__(self):
        problems = self.problems(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )
        if problems:
            raise InvalidConfig(problems)

    @staticmethod
    def problems(**settings) -> list[ConfigProblem]:
        """Every problem of these settings (fields of a :class:`BalancerConfig`; those left out are
        not checked), in field order; empty when they can run. The one place the rules live: a
        config checks itself with it, and the flags' check (``settings/knobs.py``) names each
        problem by its flag."""
        found = []
        name = settings.pop("name", ULTRAEP)
        if name not in BALANCERS and name != IDEAL:
            found.append(
                ConfigProblem(
                    "name",
                    f"{SETTING}: unknown balancer {name!r}; choose from {', '.join(MOE_BALANCERS)}",
                )
            )
        for field, minimum in MINIMUMS.items():
            if field not in settings or (settings[field] is None and field in OPTIONAL):
                continue
            problem = number_problem(
                settings[field], minimum=minimum, integer=field != "trigger", fix=FIXES[field]
            )
            if problem:
                found.append(ConfigProblem(field, problem))
        unknown = set(settings) - set(MINIMUMS)
        if unknown:
            raise TypeError(f"not settings of a BalancerConfig: {', '.join(sorted(unknown))}")
        return found

    def replace(self, **changes) -> "BalancerConfig":
        return dataclasses.replace(self, **changes)

    def build(self) -> "LayerBalancer":
        """A fresh per-layer balancer (EPLB keeps per-layer history)."""
        return LayerBalancer(self)


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
        self._history: list[torch.Tensor] = []
        self._placement: Optional[torch.Tensor] = None  # eplb: slot_expert [R, S] in force
        self._calls = 0

    def balances(self, load: torch.Tensor) -> bool:
        """Whether ``load`` (int64 [R, E]) is balanced at all (always, except for ultraep below its
        trigger). With an explicit trigger X: ``rank_imbalance(load) >= X``. By default the busiest
        rank's excess over the mean must reach the min quota q, ``max - mean >= q``, i.e. the
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
        q = cfg.min_quota if cfg.min_quota is not None else default_min_quota(total, R)
        return total > 0 and R * int(rank_load.max()) - total >= R * q

    def warm_up(self) -> None:
        """Load the compiled kernels this balancer's plans run (numba: 0.2-0.5 s even from its
        cache) on a small skewed load, past the trigger, in this balancer's NVLink domains, and the
        packing of the plan record and reroute table every planned invocation runs; no state of
        this balancer changes."""

        R = 2 * (self.config.domain_size or 1)
        load = torch.ones(R, 2 * R, dtype=torch.int64)
        load[:, 0] += 64  # all on rank 0's first expert: a replica to place
        plan = LayerBalancer(dataclasses.replace(self.config, trigger=1.0)).plan(load)
        if plan is not None:
            _compiled_record.host_parts(
                load.numpy(), plan, 0, balanced=True, min_quota=1, domain_size=R
            )

    def plan(self, load: torch.Tensor, *, balances: Optional[bool] = None) -> Optional[Plan]:
        """load: int64 [R, E] host tensor -> Plan; ``None`` for the ideal (the router spreads the
        tokens). ``balances``: :meth:`balances` of ``load``, when the caller has it already."""
        cfg = self.config
        if cfg.name == ULTRAEP:
            if not (self.balances(load) if balances is None else balances):
                return fixed_layout.identity_plan(load, cfg.num_slots)
            return solve(load, cfg.num_slots, min_quota=cfg.min_quota, domain_size=cfg.domain_size)
        if cfg.name == EPLB_EXACT:
            return fixed_layout.eplb_exact(load, cfg.num_slots)
        if cfg.name == NONE:
            return fixed_layout.identity_plan(load)
        if cfg.name == IDEAL:
            return None
        assert cfg.name == EPLB
        if self._placement is None or self._calls % cfg.eplb_interval == 0:
            history = (
                torch.stack(self._history[-cfg.eplb_window :])
                if self._history
                else load.unsqueeze(0)
            )
            self._placement = fixed_layout.eplb(history, cfg.num_slots).slot_expert
        self._calls += 1
        self._history.append(load.clone())
        del self._history[: -cfg.eplb_window]
        return fixed_layout.round_robin(load, self._placement)
