"""Offline replay: recorded loads through each balancer, with the planner's metrics per record and,
given a model shape and a hardware description, the cost model's ESTIMATE of every invocation.

The balancers are the registry's (``ultraep_megatron.planner.baselines.registry``): ``none``,
``eplb``, ``eplb-exact``, ``ultraep``, each run by the same
:class:`~ultraep_megatron.planner.LayerBalancer` a training run uses (one per EP group and layer,
so EPLB's history is per layer as in training), and ``ideal`` (force-balanced dispatch). Plan time
is measured on this host (a metric) and, unless ``plan_seconds`` fixes it, each balancer's estimate
is charged its median; exact-load balancers plan on the critical path, ``eplb`` off it. The command
line (``ultraep replay``, ``ultraep advise``) passes ``plan_seconds``: the hardware's plan time,
else 0, so a GPU estimate never carries this CPU's. Next to them, the peers (:mod:`.peers`).

The tables over a :class:`ReplayResult` are in :mod:`.summary`. No Megatron import; pure
functions on load tensors plus the replay driver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Optional

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane.schedule import ScheduleCache
from ultraep_megatron.planner import BalancerConfig, LayerBalancer, Plan, baselines
from ultraep_megatron.planner.baselines import Placement, registry
from ultraep_megatron.planner.solve import validate_domain_size
from ultraep_megatron.settings.hardware import ExpertShape, Hardware
from ultraep_megatron.traces.records import Record

from .cost import ideal_cost, layer_cost
from .peers import PeerConfig

__all__ = ["METRIC_KEYS", "ReplayResult", "ideal_metrics", "outcome_metrics", "replay"]

METRIC_KEYS = (
    "imbalance_before",
    "imbalance_after",
    "threshold",
    "lower_bound",
    "replicas",
    "max_fanout",
    "max_replicas_per_home",
    "inflight_ratio",
    "min_replica_quota",
    "plan_seconds",
    "weight_copies",
    "main_moves",
    "cross_domain_copies",
    "memory_spread_before",
    "memory_spread_after",
    "balanced",
)

#: Per-record facts of the load itself (whatever the balancer).
LOAD_KEYS = ("routed", "expert_imbalance")


def ideal_metrics(load: torch.Tensor) -> dict:
    """Metrics of force-balanced dispatch (the paper's ideal: the router spreads tokens evenly over
    all experts), in the keys of ``planner.metrics``. load int64 [R, E]."""
    R, _ = planner.validate_load(load)
    total = int(load.sum())
    before = planner.rank_imbalance(load)
    return {
        "imbalance_before": before,
        "imbalance_after": 1.0,
        "threshold": -(-total // R),
        "lower_bound": -(-total // R),
        "replicas": 0,
        "max_fanout": 1,
        "max_replicas_per_home": 0,
        "inflight_ratio": (R - 1) / R if total else 0.0,  # uniform destinations
        "min_replica_quota": None,
        "weight_copies": 0,
        "main_moves": 0,
        "cross_domain_copies": 0,
        "memory_spread_before": before,
        "memory_spread_after": 1.0,
        "balanced": 1,
    }


def outcome_metrics(
    load: torch.Tensor, outcome: Plan | Placement, domain_size: Optional[int]
) -> dict:
    """The replay's metrics (``METRIC_KEYS`` but the plan time and ``balanced``) of a plan or a
    peer's placement on ``load`` [R, E], cross-domain copies counted for NVLink domains of
    ``domain_size`` ranks. A plan's weight copies are its replicas (main experts stay home); a
    placement's come from ``baselines.placement_metrics``, without the plan-only figures (NaN)."""
    if isinstance(outcome, Plan):
        m = planner.metrics(load, outcome, domain_size=domain_size)
        return {
            **m,
            "weight_copies": m["replicas"],
            "main_moves": 0,
            "cross_domain_copies": m["cross_domain_replicas"],
        }
    m = baselines.placement_metrics(load, outcome, domain_size=domain_size)
    R = load.shape[0]
    return {
        **m,
        "threshold": int(outcome.quota.sum(0).max()),
        "lower_bound": -(-int(load.sum()) // R),
        "replicas": m["weight_copies"],
        "max_replicas_per_home": None,
        "min_replica_quota": None,
    }


@dataclass
class ReplayResult:
    """Per-record results of a replay (N records, in the order the source yields them).

    Attributes:
        balancers: label -> the replayed configuration (labels name them below).
        peers: label -> the replayed peer (their labels key ``metrics``/``costs`` too).
        keys: ``group``, ``iteration``, ``microbatch``, ``layer`` -> int64 [N].
        load: ``routed`` ((token, expert) pairs of the record, float64 [N]) and
            ``expert_imbalance`` (max / mean load per expert, float64 [N]).
        metrics: label -> metric (``METRIC_KEYS``) -> float64 [N] (NaN for a missing value,
            e.g. ``min_replica_quota`` without replicas).
        costs: label -> cost term (``layer_cost`` keys) -> float64 [N] seconds, or None.
        rank_load: label -> int64 [N, R] per-rank load after balancing (``keep_loads``).
        expert_load: int64 [N, E] per-expert load (``keep_loads``).
        num_ranks, num_experts, shape, hardware, meta (facts about the traced run).
        ranks_per_domain: EP ranks per NVLink domain the cross-domain figures count.
    """

    balancers: dict[str, BalancerConfig]
    peers: dict[str, PeerConfig]
    keys: dict[str, np.ndarray]
    load: dict[str, np.ndarray]
    metrics: dict[str, dict[str, np.ndarray]]
    costs: Optional[dict[str, dict[str, np.ndarray]]]
    rank_load: Optional[dict[str, np.ndarray]]
    expert_load: Optional[np.ndarray]
    num_ranks: int
    num_experts: int
    shape: Optional[ExpertShape]
    hardware: Optional[Hardware]
    meta: dict = field(default_factory=dict)
    ranks_per_domain: Optional[int] = None

    @property
    def labels(self) -> list[str]:
        """Every replayed label: the balancers, then the peers."""
        return [*self.balancers, *self.peers]

    @property
    def num_records(self) -> int:
        return len(self.keys["layer"])

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.keys["layer"].tolist()))

    def label_of(self, name: str) -> Optional[str]:
        """The first label replaying balancer ``name``, if any."""
        return next((label for label, c in self.balancers.items() if c.name == name), None)


def _warm_up() -> None:
    """Compile the planner's numba kernels outside the timed region."""
    planner.solve(torch.tensor([[3, 0], [1, 0]], dtype=torch.int64), 1, min_quota=1)


def replay(
    records: Iterable[Record],
    balancers: Mapping[str, BalancerConfig],
    *,
    peers: Optional[Iterable[PeerConfig]] = None,
    domain_size: Optional[int] = None,
    shape: Optional[ExpertShape] = None,
    hardware: Optional[Hardware] = None,
    relay: bool = True,
    keep_loads: bool = False,
    plan_seconds: Optional[float] = None,
    plan_statistic: Literal["median", "each"] = "median",
    progress: Optional[Callable[[int], None]] = None,
) -> ReplayResult:
    """Replay loads through balancers.

    Args:
        records: ``(group, iteration, microbatch, layer, load int64 [R, E])`` in training order
            per EP group (EPLB's history follows this order per (group, layer)).
        balancers: label -> configuration.
        peers: peers to replay next to them, labelled by ``PeerConfig.label``.
        domain_size: EP ranks per NVLink domain for the cross-domain counts (default: the
            hardware's scale-up domain, else one domain).
        shape, hardware: give both to estimate costs (``layer_cost``/``ideal_cost``); else metrics only.
        relay: charge weight distribution with relay trees in ``total`` (both variants are kept).
        keep_loads: keep per-rank loads after balancing and per-expert loads (heatmaps).
        plan_seconds: charge this fixed plan time to the exact-load balancers instead of the measured
            one (the metrics keep the measured one).
        plan_statistic: cost every invocation with the ``"median"`` measured plan time of its
            balancer (default; robust to a noisy host) or with ``"each"`` invocation's own.
        progress: called with the number of records done after each record.
    """
    balancers = dict(balancers)
    peer_configs = {p.label: p for p in (peers or ())}
    if not balancers and not peer_configs:
        raise ValueError("no balancer to replay")
    if set(balancers) & set(peer_configs):
        raise ValueError(f"labels used twice: {sorted(set(balancers) & set(peer_configs))}")
    labels = [*balancers, *peer_configs]
    if (shape is None) != (hardware is None):
        raise ValueError("give both shape and hardware to estimate costs, or neither")
    with_cost = shape is not None
    layer_balancers: dict[tuple[str, int, int], LayerBalancer] = {}
    if any(c.name == registry.ULTRAEP for c in balancers.values()):
        _warm_up()
    keys: dict[str, list[int]] = {k: [] for k in ("group", "iteration", "microbatch", "layer")}
    load_stats: dict[str, list[float]] = {k: [] for k in LOAD_KEYS}
    metrics = {label: {m: [] for m in METRIC_KEYS} for label in labels}
    costs = {label: {} for label in labels} if with_cost else None
    rank_load = {label: [] for label in labels} if keep_loads else None
    N = None
    expert_load: list[torch.Tensor] = []
    R = E = None
    done = 0
    schedules = ScheduleCache(4096)  # replica layouts recur across microbatches and layers

    def _record(label, load, outcome, m, seconds, critical):
        m["plan_seconds"] = seconds
        for name in METRIC_KEYS:
            metrics[label][name].append(np.nan if m[name] is None else float(m[name]))
        if with_cost:
            c = (
                ideal_cost(load, shape, hardware)
                if outcome is None
                else layer_cost(
                    load,
                    outcome,
                    shape,
                    hardware,
                    plan_seconds=critical,
                    relay=relay,
                    schedules=schedules,
                )
            )
            for name, value in c.items():
                costs[label].setdefault(name, []).append(value)
        if keep_loads:
            if outcome is None:
                rank_load[label].append(
                    torch.full(
                        (load.shape[0],), int(load.sum()) // load.shape[0], dtype=torch.int64
                    )
                )
            else:
                rank_load[label].append(outcome.quota.sum(0).cpu())

    for group, iteration, microbatch, layer, load in records:
        if R is None:
            R, E = planner.validate_load(load)
            N = (
                domain_size
                if domain_size is not None
                else hardware.ranks_per_domain(R)
                if hardware is not None
                else None
            )
            N = validate_domain_size(N, R)
        elif tuple(load.shape) != (R, E):
            raise ValueError(
                f"all loads must be [R, E] = [{R}, {E}], got {tuple(load.shape)} "
                f"(group {group}, iteration {iteration}, layer {layer})"
            )
        for name, value in zip(
            ("group", "iteration", "microbatch", "layer"), (group, iteration, microbatch, layer)
        ):
            keys[name].append(int(value))
        per_expert = load.sum(0)
        load_stats["routed"].append(float(per_expert.sum()))
        load_stats["expert_imbalance"].append(float(planner.load_imbalance(per_expert)))
        if keep_loads:
            expert_load.append(per_expert)
        for label, config in balancers.items():
            balancer = layer_balancers.get((label, group, layer))
            if balancer is None:
                balancer = layer_balancers[(label, group, layer)] = config.build()
            start = time.perf_counter()
            plan = balancer.plan(load)
            seconds = (
                time.perf_counter() - start
                if plan is not None and config.name != registry.NONE
                else 0.0
            )
            m = ideal_metrics(load) if plan is None else outcome_metrics(load, plan, N)
            m["balanced"] = int(balancer.balances(load))
            # History-based EPLB plans off the critical path (between re-plans); its reroute is
            # a device-side lookup. The exact-load balancers plan after gating, on the path.
            critical = 0.0
            if config.name in registry.EXACT_LOAD:
                critical = seconds if plan_seconds is None else float(plan_seconds)
            _record(label, load, plan, m, seconds, critical)
        for label, peer in peer_configs.items():
            start = time.perf_counter()
            outcome = peer.balance(load)
            seconds = time.perf_counter() - start
            m = outcome_metrics(load, outcome, N)
            m["balanced"] = int(peer.balances(load))
            _record(label, load, outcome, m, seconds, 0.0)
        done += 1
        if progress is not None:
            progress(done)
    if R is None:
        raise ValueError("no records to replay")
    as_float = lambda d: {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}  # noqa: E731
    cost_arrays = {k: as_float(v) for k, v in costs.items()} if with_cost else None
    if with_cost and plan_statistic == "median" and plan_seconds is None:
        # Charge every invocation the median measured plan time of its balancer: timings on a busy
        # host are noisy, and a few slow solves should not decide between balancers.
        for label, c in cost_arrays.items():
            if label in peer_configs:
                continue  # not charged
            median = float(np.median(c["plan"]))
            for term in ("fwd", "total"):
                c[term] = c[term] - c["plan"] + median
            c["plan"] = np.full_like(c["plan"], median)
    return ReplayResult(
        balancers=balancers,
        peers=peer_configs,
        keys={k: np.asarray(v, dtype=np.int64) for k, v in keys.items()},
        load=as_float(load_stats),
        metrics={k: as_float(v) for k, v in metrics.items()},
        costs=cost_arrays,
        rank_load={k: torch.stack(v).numpy() for k, v in rank_load.items()} if keep_loads else None,
        expert_load=torch.stack(expert_load).numpy() if keep_loads else None,
        num_ranks=R,
        num_experts=E,
        shape=shape,
        hardware=hardware,
        meta=dict(getattr(records, "meta", {}) or {}),
        ranks_per_domain=N,
    )
