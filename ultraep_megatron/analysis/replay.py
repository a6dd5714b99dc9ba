"""Offline replay: recorded loads through each balancer, with the planner's metrics per record and,
given a model shape and a hardware description, the cost model's ESTIMATE of every invocation.

The balancers are the policy registry's (``ultraep_megatron.planner.policy``): ``none``, ``eplb``,
``eplb-exact``, ``ultraep``, each run by the same :class:`~ultraep_megatron.planner.policy.LayerBalancer`
a training run uses (one per EP group and layer, so EPLB's history is per layer as in training),
and ``ideal`` (force-balanced dispatch). Plan time is measured on this host and, by default, each
balancer is charged its median; exact-load balancers plan on the critical path, ``eplb`` off it.

Next to them, the peers (:class:`PeerConfig`, ``planner.peers``): DeepSeek's re-placing EPLB and
LLEP, re-implemented from their public code, replayed on the same loads and costed by the same
model; their plan time (Python re-implementations) is not charged.

No Megatron import; pure functions on load tensors plus the replay driver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Optional

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import Plan, peers, policy
from ultraep_megatron.planner.peers import Placement
from ultraep_megatron.planner.policy import BalancerConfig

from .cost import ExpertShape, Hardware, ideal_cost, layer_cost

__all__ = [
    "METRIC_KEYS",
    "PEERS",
    "PeerConfig",
    "ReplayResult",
    "UNMODELLED_US",
    "cost_summary",
    "estimate_problem",
    "ideal_metrics",
    "load_summary",
    "metric_summary",
    "outcome_metrics",
    "peer_summary",
    "replay",
    "staleness_summary",
]

Record = tuple[int, int, int, int, torch.Tensor]  # (EP group, iteration, microbatch, layer, load [R, E])

METRIC_KEYS = ("imbalance_before", "imbalance_after", "threshold", "lower_bound", "replicas", "max_fanout",
               "max_replicas_per_home", "inflight_ratio", "min_replica_quota", "plan_seconds",
               "weight_copies", "main_moves", "cross_domain_copies", "memory_spread_before",
               "memory_spread_after", "balanced")
#: The peers of the replay harness (``planner.peers``).
DEEPSEEK_EPLB, LLEP = "deepseek-eplb", "llep"
PEERS: tuple[str, ...] = (DEEPSEEK_EPLB, LLEP)


@dataclass(frozen=True)
class PeerConfig:
    """A peer balancer replayed next to the registry's, with its parameters.

    Attributes:
        name: ``deepseek-eplb`` (``peers.deepseek_eplb``: every expert re-placed, G + S physical
            experts per rank) or ``llep`` (``peers.llep``).
        num_slots: deepseek-eplb's S.
        node_size: deepseek-eplb: its hierarchical policy over nodes (NVLink domains) of this many
            ranks (groups = nodes = R / node_size); ``None``: its global policy.
        capacity_factor, min_tokens_per_gemm, imbalance_trigger: LLEP's alpha, m and lambda.
    """

    name: str
    num_slots: int = policy.DEFAULT_NUM_SLOTS
    node_size: Optional[int] = None
    capacity_factor: float = peers.LLEP_CAPACITY_FACTOR
    min_tokens_per_gemm: int = peers.LLEP_MIN_TOKENS_PER_GEMM
    imbalance_trigger: Optional[float] = peers.LLEP_TRIGGER

    def __post_init__(self):
        if self.name not in PEERS:
            raise ValueError(f"unknown peer {self.name!r}; choose from {', '.join(PEERS)}")

    @property
    def label(self) -> str:
        """Its name with the parameters that shape its result."""
        if self.name == LLEP:
            trigger = self.imbalance_trigger
            return (f"{LLEP} (alpha={self.capacity_factor:g}, m={self.min_tokens_per_gemm}, "
                    f"lambda={'off' if trigger is None else format(trigger, 'g')})")
        policy_name = "global" if self.node_size is None else f"hierarchical, nodes of {self.node_size}"
        return f"{DEEPSEEK_EPLB} ({policy_name}, S={self.num_slots})"

    def balance(self, load: torch.Tensor) -> Plan | Placement:
        """Its outcome on ``load`` int64 [R, E]."""
        if self.name == LLEP:
            return peers.llep(load, capacity_factor=self.capacity_factor,
                              min_tokens_per_gemm=self.min_tokens_per_gemm, trigger=self.imbalance_trigger)
        if self.node_size is None:
            return peers.deepseek_eplb(load, self.num_slots)
        nodes = load.shape[0] // self.node_size
        return peers.deepseek_eplb(load, self.num_slots, num_groups=nodes, num_nodes=nodes)

    def balances(self, load: torch.Tensor) -> bool:
        """Whether it balances ``load`` at all (LLEP's trigger)."""
        trigger = self.imbalance_trigger
        return not (self.name == LLEP and trigger is not None and trigger > 0
                    and planner.rank_imbalance(load) < trigger)
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


def outcome_metrics(load: torch.Tensor, outcome: Plan | Placement, domain_size: Optional[int]) -> dict:
    """The replay's metrics (``METRIC_KEYS`` but the plan time and ``balanced``) of a plan or a
    peer's placement on ``load`` [R, E], cross-domain copies counted for NVLink domains of
    ``domain_size`` ranks. A plan's weight copies are its replicas (main experts stay home); a
    placement's come from ``peers.placement_metrics``, without the plan-only figures (NaN)."""
    if isinstance(outcome, Plan):
        m = planner.metrics(load, outcome, domain_size=domain_size)
        return {**m, "weight_copies": m["replicas"], "main_moves": 0,
                "cross_domain_copies": m["cross_domain_replicas"]}
    m = peers.placement_metrics(load, outcome, domain_size=domain_size)
    R = load.shape[0]
    return {**m, "threshold": int(outcome.quota.sum(0).max()), "lower_bound": -(-int(load.sum()) // R),
            "replicas": m["weight_copies"], "max_replicas_per_home": None, "min_replica_quota": None}


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


def replay(records: Iterable[Record], balancers: Mapping[str, BalancerConfig], *,
           peers: Optional[Iterable[PeerConfig]] = None, domain_size: Optional[int] = None,
           shape: Optional[ExpertShape] = None, hardware: Optional[Hardware] = None, relay: bool = True,
           keep_loads: bool = False, plan_seconds: Optional[float] = None,
           plan_statistic: Literal["median", "each"] = "median",
           progress: Optional[Callable[[int], None]] = None) -> ReplayResult:
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
    layer_balancers: dict[tuple[str, int, int], policy.LayerBalancer] = {}
    if any(c.name == policy.ULTRAEP for c in balancers.values()):
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

    def _record(label, load, outcome, m, seconds, critical):
        m["plan_seconds"] = seconds
        for name in METRIC_KEYS:
            metrics[label][name].append(np.nan if m[name] is None else float(m[name]))
        if with_cost:
            c = (ideal_cost(load, shape, hardware) if outcome is None
                 else layer_cost(load, outcome, shape, hardware, plan_seconds=critical, relay=relay))
            for name, value in c.items():
                costs[label].setdefault(name, []).append(value)
        if keep_loads:
            if outcome is None:
                rank_load[label].append(torch.full((load.shape[0],), int(load.sum()) // load.shape[0],
                                                   dtype=torch.int64))
            else:
                rank_load[label].append(outcome.quota.sum(0).cpu())
    for group, iteration, microbatch, layer, load in records:
        if R is None:
            R, E = planner.validate_load(load)
            N = (domain_size if domain_size is not None
                 else hardware.ranks_per_domain(R) if hardware is not None else None)
            N = planner.validate_domain_size(N, R)
        elif tuple(load.shape) != (R, E):
            raise ValueError(f"all loads must be [R, E] = [{R}, {E}], got {tuple(load.shape)} "
                             f"(group {group}, iteration {iteration}, layer {layer})")
        for name, value in zip(("group", "iteration", "microbatch", "layer"), (group, iteration, microbatch, layer)):
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
            seconds = time.perf_counter() - start if plan is not None and config.name != policy.NONE else 0.0
            m = ideal_metrics(load) if plan is None else outcome_metrics(load, plan, N)
            m["balanced"] = int(balancer.balances(load))
            # History-based EPLB plans off the critical path (between re-plans); its reroute is
            # a device-side lookup. The exact-load balancers plan after gating, on the path.
            critical = 0.0
            if config.name in policy.EXACT_LOAD:
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
        num_ranks=R, num_experts=E, shape=shape, hardware=hardware,
        meta=dict(getattr(records, "meta", {}) or {}),
        ranks_per_domain=N,
    )


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def _nan_stat(values: np.ndarray, fn) -> Optional[float]:
    finite = values[~np.isnan(values)]
    return float(fn(finite)) if finite.size else None


def load_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict:
    """What the router sent, over the records in ``mask`` (default: all): ``records``,
    ``routed_mean`` ((token, expert) pairs per record), ``expert_imbalance_mean``/``_max`` (max /
    mean load per expert), ``rank_imbalance_mean``/``_max`` (max / mean load per EP rank, the
    unbalanced one)."""
    sel = slice(None) if mask is None else mask
    before = next(iter(result.metrics.values()))["imbalance_before"][sel]
    expert = result.load["expert_imbalance"][sel]
    return {
        "records": int(before.size),
        "routed_mean": float(result.load["routed"][sel].mean()),
        "expert_imbalance_mean": float(expert.mean()),
        "expert_imbalance_max": float(expert.max()),
        "rank_imbalance_mean": float(before.mean()),
        "rank_imbalance_max": float(before.max()),
    }


def metric_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict[str, dict]:
    """Balancing quality per balancer over the records in ``mask`` (default: all).

    Returns label -> {``imbalance_mean``, ``imbalance_p95``, ``imbalance_max``,
    ``imbalance_before_mean``, ``worse_than_none`` (share of records whose imbalance after exceeds
    the unbalanced one), ``replicas_mean``, ``fanout_mean``, ``fanout_max``, ``inflight_mean``,
    ``min_replica_quota``, ``plan_ms_mean``, ``records``}.
    """
    out = {}
    for label in result.labels:
        m = result.metrics[label]
        sel = slice(None) if mask is None else mask
        after, before = m["imbalance_after"][sel], m["imbalance_before"][sel]
        if after.size == 0:
            continue
        out[label] = {
            "imbalance_mean": float(after.mean()),
            "imbalance_p95": float(np.percentile(after, 95)),
            "imbalance_max": float(after.max()),
            "imbalance_before_mean": float(before.mean()),
            "worse_than_none": float((after > before + 1e-12).mean()),
            "replicas_mean": float(m["replicas"][sel].mean()),
            "fanout_mean": float(m["max_fanout"][sel].mean()),
            "fanout_max": float(m["max_fanout"][sel].max()),
            "inflight_mean": float(m["inflight_ratio"][sel].mean()),
            "min_replica_quota": _nan_stat(m["min_replica_quota"][sel], np.min),
            "plan_ms_mean": float(m["plan_seconds"][sel].mean() * 1e3),
            "records": int(after.size),
        }
    return out


def _step_times(result: ReplayResult, label: str, term: str, mask: Optional[np.ndarray]) -> np.ndarray:
    """Seconds per (iteration, microbatch, layer), the max over EP groups (they run side by side)."""
    k = result.keys
    sel = np.ones(result.num_records, dtype=bool) if mask is None else mask
    ident = np.stack([k["iteration"][sel], k["microbatch"][sel], k["layer"][sel]], axis=1)
    _, inverse = np.unique(ident, axis=0, return_inverse=True)
    out = np.zeros(inverse.max() + 1 if inverse.size else 0)
    np.maximum.at(out, inverse.reshape(-1), result.costs[label][term][sel])
    return out


def cost_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict[str, dict]:
    """Estimated time per balancer over the records in ``mask``: mean ms per MoE-layer invocation of
    each term (``fwd``, ``bwd``, ``total``, ``moe_fwd``, ``a2a_fwd``, ``wdist``, ``wdist_direct``,
    ``wdist_relay``, ``plan``, ``fwd_exposed``, ``bwd_exposed``: what the replica transfers add
    under the hardware's ``transfer_overlap``), plus ``frac_ideal`` (ideal time / time) and
    ``speedup_vs_none`` (none time / time) when ``ideal``/``none`` were replayed, and the same two
    without the plan term (``frac_ideal_excl_plan``, ``speedup_vs_none_excl_plan``: the planner
    here runs on the CPU, the paper's on the GPU). EP groups count as running in parallel (max
    over groups per layer invocation)."""
    if result.costs is None:
        raise ValueError("the replay carried no cost model (give shape and hardware)")
    terms = ("fwd", "bwd", "total", "total_excl_plan", "moe_fwd", "moe_bwd", "a2a_fwd", "wdist", "wdist_direct",
             "wdist_relay", "plan", "fwd_exposed", "bwd_exposed")
    sums = {label: {t: _step_times(result, label, t, mask) for t in terms} for label in result.labels}
    ideal, none = result.label_of(policy.IDEAL), result.label_of(policy.NONE)
    out = {}
    for label, per_term in sums.items():
        total = per_term["total"].sum()
        row = {f"{t}_ms": float(v.mean() * 1e3) if v.size else 0.0 for t, v in per_term.items()}
        excl = per_term["total_excl_plan"].sum()
        if ideal is not None:
            row["frac_ideal"] = float(sums[ideal]["total"].sum() / total) if total else 1.0
            row["frac_ideal_excl_plan"] = float(sums[ideal]["total"].sum() / excl) if excl else 1.0
        if none is not None:
            row["speedup_vs_none"] = float(sums[none]["total"].sum() / total) if total else 1.0
            row["speedup_vs_none_excl_plan"] = float(sums[none]["total"].sum() / excl) if excl else 1.0
        out[label] = row
    return out


def peer_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict[str, dict]:
    """The peer table: per label (balancers and peers) over the records in ``mask``:
    ``imbalance_mean``/``_max`` (after), ``weight_copies_mean`` (expert weights sent, main-expert
    moves included), ``main_moves_mean``, ``fanout_max``, ``cross_domain_copies_mean`` (copies landing
    outside their home's NVLink domain of ``result.ranks_per_domain`` ranks), ``memory_spread_before_mean``,
    ``memory_spread_after_mean``/``_max`` (max / mean rows received per rank), ``balanced_share``
    (loads balanced at all) and, with costs, ``xdom_mib_mean`` (replica weight + gradient MiB crossing
    a domain per invocation, under the cost model's schedule), ``total_excl_plan_ms`` and
    ``speedup_vs_none_excl_plan`` (ESTIMATES; plan time left out: the peers are Python
    re-implementations)."""
    sel = slice(None) if mask is None else mask
    costs = cost_summary(result, mask) if result.costs is not None else {}
    out = {}
    for label in result.labels:
        m = {k: v[sel] for k, v in result.metrics[label].items()}
        if m["imbalance_after"].size == 0:
            continue
        row = {
            "imbalance_mean": float(m["imbalance_after"].mean()),
            "imbalance_max": float(m["imbalance_after"].max()),
            "weight_copies_mean": float(m["weight_copies"].mean()),
            "main_moves_mean": float(m["main_moves"].mean()),
            "fanout_max": float(m["max_fanout"].max()),
            "cross_domain_copies_mean": float(m["cross_domain_copies"].mean()),
            "memory_spread_before_mean": float(m["memory_spread_before"].mean()),
            "memory_spread_after_mean": float(m["memory_spread_after"].mean()),
            "memory_spread_after_max": float(m["memory_spread_after"].max()),
            "balanced_share": float(m["balanced"].mean()),
            "records": int(m["imbalance_after"].size),
        }
        if label in costs:
            row["xdom_mib_mean"] = float(result.costs[label]["xdom_bytes"][sel].mean() / 2**20)
            row["total_excl_plan_ms"] = costs[label]["total_excl_plan_ms"]
            row["speedup_vs_none_excl_plan"] = costs[label].get("speedup_vs_none_excl_plan")
        out[label] = row
    return out


def staleness_summary(result: ReplayResult) -> list[dict]:
    """EPLB under growing staleness (paper Fig. 6): one row per replayed ``eplb`` configuration,
    sorted by interval: ``label``, ``interval``, ``window``, ``num_slots`` and its
    :func:`metric_summary` figures."""
    summary = metric_summary(result)
    rows = []
    for label, c in result.balancers.items():
        if c.name == policy.EPLB and label in summary:
            rows.append({"label": label, "interval": c.eplb_interval, "window": c.eplb_window,
                         "num_slots": c.num_slots, **summary[label]})
    return sorted(rows, key=lambda r: (r["interval"], r["window"]))


#: What the cost model leaves out of one MoE layer invocation: kernel launches and the latency of
#: its four all-to-alls (dispatch and combine, forward and backward), tens of microseconds on a
#: GPU. A layer the model estimates below this is dominated by what it does not model.
UNMODELLED_US = 10.0


def estimate_problem(result: ReplayResult, unmodelled_us: float = UNMODELLED_US) -> Optional[str]:
    """Why the cost model's estimate on this replay says nothing about a real run (``None`` when
    it can be used): the unbalanced MoE layer (``none``, else the ideal) is estimated below
    ``unmodelled_us``, the latency the model leaves out, so the shares of the terms (plan time
    above all) are not those of a training run. Typical of a small model's trace (the shipped
    KJV trace: h = f = 64) until it is projected onto a real expert shape and microbatch."""
    label = result.label_of(policy.NONE) or result.label_of(policy.IDEAL)
    if result.costs is None or label is None:
        return None
    layer_us = cost_summary(result)[label]["total_ms"] * 1e3
    if layer_us >= unmodelled_us:
        return None
    pairs = load_summary(result)["routed_mean"] / result.num_ranks
    return (f"the traced model's MoE layer (h={result.shape.hidden_size}, f={result.shape.ffn_hidden_size}, "
            f"{pairs:.0f} (token, expert) pairs per EP rank and microbatch) is estimated at {layer_us:.2f} us "
            f"per invocation ({label}) on this hardware, below the ~{unmodelled_us:g} us of kernel-launch and "
            "all-to-all latency the cost model leaves out: its times and speedups say nothing about a real run. "
            "Project the trace onto the model you will train: --hidden-size, --moe-ffn-hidden-size and "
            "--load-scale (tokens per microbatch x top-k / the traced ones; docs/traces.md)")
