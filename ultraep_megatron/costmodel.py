"""Trace replay, an MoE-layer cost model and the slot advisor. Every time here is an ESTIMATE.

Replay runs recorded loads (``ultraep_megatron.traces``) through each balancer — ``none``,
``eplb`` (placement from a history window, re-planned every ``interval`` microbatches, current load
spread round-robin over it), ``eplb-exact`` (EPLB's rule on the exact load, the paper's EPLB++),
``ultraep`` (the quota planner) and ``ideal`` (force-balanced dispatch) — and collects the planner's
balancing metrics per record. The cost model turns each plan into per-layer forward/backward times
from a model shape and a hardware description, following the UltraEP objective (paper eq. 1-5):

* expert compute: the busiest rank's instances, each ``max(tokens * flops / F, weights / HBM)``
  (roofline), backward = 2 x forward (dgrad + wgrad);
* token all-to-all: the busiest sender or receiver of remote tokens, dispatch + combine, forward and
  backward alike;
* weight distribution (forward, critical path): the busiest sender or receiver of replica weights,
  over the data plane's transfer schedule with and without relay trees
  (``ultraep_megatron.dataplane.schedule.build_schedule``);
* backward replica traffic (re-materialization + gradient reduction) is hidden under backward
  expert compute; only what exceeds it is exposed;
* plan time: measured wall clock of the planner on this host — the median per balancer by default —
  or a fixed value you pass, charged
  to the exact-load balancers (``ultraep``, ``eplb-exact``); history-based ``eplb`` plans off the
  critical path.

Not modelled: attention and other non-MoE work, kernel launch and latency terms, overlap of
all-to-all with compute, DeepEP deduplication. Ratios between balancers are the useful output.

No Megatron import; pure functions on load tensors plus the replay driver.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Optional, Sequence

import numpy as np
import torch

from ultraep_megatron import planner
from ultraep_megatron.dataplane.schedule import build_schedule
from ultraep_megatron.planner import Plan, baselines

__all__ = [
    "BALANCER_NAMES",
    "BalancerSpec",
    "DEFAULT_SHAPE",
    "ExpertShape",
    "Hardware",
    "ReplayResult",
    "advise_slots",
    "cost_summary",
    "ideal_cost",
    "ideal_metrics",
    "identity_plan",
    "layer_cost",
    "metric_summary",
    "min_quota_from_hardware",
    "replay",
    "replay_files",
    "TraceRecords",
    "slot_memory_bytes",
    "slot_sweep",
    "staleness_summary",
]

BALANCER_NAMES = ("none", "eplb", "eplb-exact", "ultraep", "ideal")


# ---------------------------------------------------------------------------------------------
# Hardware and model shape
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Per-GPU hardware figures. Defaults: the UltraEP paper's rack-scale node (Table 2).

    Attributes:
        scale_up_gbps: scale-up (intra-rack) bandwidth per GPU, GB/s.
        peak_tflops: dense bf16 peak, TFLOP/s.
        hbm_tbps: HBM bandwidth, TB/s.
        compute_efficiency / comm_efficiency: achieved fraction of peak (1.0 = peak; the absolute
            times are then lower bounds).
    """

    scale_up_gbps: float = 900.0
    peak_tflops: float = 2250.0
    hbm_tbps: float = 8.0
    compute_efficiency: float = 1.0
    comm_efficiency: float = 1.0

    def __post_init__(self):
        for name in ("scale_up_gbps", "peak_tflops", "hbm_tbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("compute_efficiency", "comm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.scale_up_gbps * 1e9 * self.comm_efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12


@dataclass(frozen=True)
class ExpertShape:
    """Shape of one expert (an MLP ``hidden -> ffn -> hidden``) and the byte widths that matter.

    Attributes:
        hidden_size / ffn_hidden_size: h and f (Megatron ``--hidden-size``, ``--moe-ffn-hidden-size``).
        gated: SwiGLU-style gated MLP (3 matrices) rather than 2.
        param_bytes: bytes per weight element moved to replicas (bf16: 2).
        grad_bytes: bytes per gradient element reduced from replicas (fp32 main grads: 4).
        activation_bytes: bytes per hidden element of a token on the wire (bf16: 2).
    """

    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True
    param_bytes: int = 2
    grad_bytes: int = 4
    activation_bytes: int = 2

    def __post_init__(self):
        for name in ("hidden_size", "ffn_hidden_size", "param_bytes", "grad_bytes", "activation_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    @property
    def numel(self) -> int:
        """Elements of one expert's weights."""
        return (3 if self.gated else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.numel * self.param_bytes

    @property
    def fwd_flops_per_token(self) -> int:
        """Forward FLOPs of one (token, expert) pair: 2 per weight (multiply-add)."""
        return 2 * self.numel

    @property
    def token_bytes(self) -> int:
        return self.hidden_size * self.activation_bytes

    @classmethod
    def from_meta(cls, meta: dict, *, hidden_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                  gated: Optional[bool] = None, **widths) -> tuple["ExpertShape", str]:
        """Shape from explicit values, else a trace header's ``meta`` (keys ``hidden_size``,
        ``moe_ffn_hidden_size`` or ``ffn_hidden_size``, ``gated_linear_unit`` or ``swiglu``), else
        :data:`DEFAULT_SHAPE`. ``widths``: byte widths (``param_bytes``...), None = default.
        Returns (shape, a phrase saying where h and f came from)."""
        meta_h = meta.get("hidden_size")
        meta_f = meta.get("moe_ffn_hidden_size") or meta.get("ffn_hidden_size")
        meta_g = meta.get("gated_linear_unit", meta.get("swiglu"))
        h, f = hidden_size or meta_h, ffn_hidden_size or meta_f
        if h is None or f is None:
            h, f = DEFAULT_SHAPE.hidden_size, DEFAULT_SHAPE.ffn_hidden_size
            meta_g = DEFAULT_SHAPE.gated
            source = "default: a Qwen3-235B-A22B expert"
        elif hidden_size is None and ffn_hidden_size is None:
            source = "trace meta"
        else:
            source = "flags" if (hidden_size and ffn_hidden_size) else "flags and trace meta"
        g = gated if gated is not None else (True if meta_g is None else bool(meta_g))
        extra = {k: int(v) for k, v in widths.items() if v is not None}
        return cls(int(h), int(f), g, **extra), source


#: Expert of Qwen3-235B-A22B (one of the paper's models), used when a trace says nothing.
DEFAULT_SHAPE = ExpertShape(hidden_size=4096, ffn_hidden_size=1536, gated=True)


def slot_memory_bytes(shape: ExpertShape, num_slots: int, *, num_layers: int = 1) -> int:
    """Bytes per rank for ``num_slots`` redundant slots: weights + fp32 gradient buffers, no
    optimizer state. UltraEP shares them across layers (``num_layers=1``, paper §4.1); a layout
    with per-layer replicas (EPLB/CRAFT style) pays ``num_layers`` times as much."""
    return int(num_slots) * shape.numel * (shape.param_bytes + shape.grad_bytes) * int(num_layers)


def min_quota_from_hardware(shape: ExpertShape, hardware: Hardware, *, training: bool = True) -> int:
    """Smallest replica quota (tokens) worth its weight transfer (HarMoEny's threshold, eq. 4).

    A replica taking q (token, expert) pairs off the busiest rank saves ``q * 2P / F`` of forward
    compute (P = expert weights) — and twice that again in backward when training, where the
    replica's backward traffic is hidden under compute — while its weights cost ``P * d / B`` on
    the forward critical path. It pays when ``q > F * d / (2 * B * k)`` with k = 3 (training) or
    1 (inference), independent of the expert's size.
    """
    transfer = shape.weight_bytes / hardware.link_bytes_per_s
    saved_per_token = shape.fwd_flops_per_token / hardware.flops_per_s * (3 if training else 1)
    return max(1, math.ceil(transfer / saved_per_token - 1e-9))


# ---------------------------------------------------------------------------------------------
# Plans and metrics of the simple balancers
# ---------------------------------------------------------------------------------------------

def identity_plan(load: torch.Tensor) -> Plan:
    """The ``none`` balancer: no replicas, every token to its expert's main instance.

    load int64 [R, E] -> Plan with ``slot_expert`` [R, 0], ``quota`` [E, R] (expert totals on home
    ranks), ``physical_split`` = load (with no redundant slot, physical slot e is main expert e).
    """
    R, E = planner.validate_load(load)
    G = E // R
    quota = torch.zeros((E, R), dtype=torch.int64, device=load.device)
    quota[torch.arange(E, device=load.device), torch.arange(E, device=load.device) // G] = load.sum(0)
    threshold = int(load.sum(0).view(R, G).sum(1).max())
    return Plan(torch.empty((R, 0), dtype=torch.int64, device=load.device), quota, load.clone(), threshold)


def ideal_metrics(load: torch.Tensor) -> dict:
    """Metrics of force-balanced dispatch (the paper's ideal: the router spreads tokens evenly over
    all experts), in the keys of ``planner.metrics``. load int64 [R, E]."""
    R, E = planner.validate_load(load)
    G = E // R
    total = int(load.sum())
    before = load.sum(0).view(R, G).sum(1)
    return {
        "imbalance_before": float(before.max()) / (total / R) if total else 1.0,
        "imbalance_after": 1.0,
        "threshold": -(-total // R),
        "lower_bound": -(-total // R),
        "replicas": 0,
        "max_fanout": 1,
        "max_replicas_per_home": 0,
        "inflight_ratio": (R - 1) / R if total else 0.0,  # uniform destinations
        "min_replica_quota": None,
    }


# ---------------------------------------------------------------------------------------------
# Cost model (seconds; estimates)
# ---------------------------------------------------------------------------------------------

def _compute_seconds(tokens_per_instance: torch.Tensor, shape: ExpertShape, hw: Hardware) -> float:
    """Busiest rank's forward expert compute. tokens_per_instance: [E_or_G, R] tokens of every
    instance; an instance with no token costs nothing (grouped GEMM skips it)."""
    tokens = tokens_per_instance.to(torch.float64)
    per_token = shape.fwd_flops_per_token / hw.flops_per_s
    weight_read = shape.weight_bytes / hw.hbm_bytes_per_s
    per_instance = torch.where(tokens > 0, torch.clamp(tokens * per_token, min=weight_read),
                               torch.zeros_like(tokens))
    return float(per_instance.sum(0).max()) if per_instance.numel() else 0.0


def _assemble(moe_fwd: float, a2a_one_way: float, wdist_direct: float, wdist_relay: float,
              plan_seconds: float, shape: ExpertShape, relay: bool) -> dict:
    wdist = wdist_relay if relay else wdist_direct
    moe_bwd = 2.0 * moe_fwd
    # Backward: weights re-materialized and gradients reduced over the same edges, hidden under
    # backward expert compute (paper §4.2); only the excess is exposed.
    bwd_replica = wdist * (1.0 + shape.grad_bytes / shape.param_bytes)
    bwd_exposed = max(0.0, bwd_replica - moe_bwd)
    fwd = plan_seconds + wdist + 2.0 * a2a_one_way + moe_fwd
    bwd = 2.0 * a2a_one_way + moe_bwd + bwd_exposed
    return {
        "plan": plan_seconds, "wdist_direct": wdist_direct, "wdist_relay": wdist_relay, "wdist": wdist,
        "a2a_fwd": 2.0 * a2a_one_way, "a2a_bwd": 2.0 * a2a_one_way, "moe_fwd": moe_fwd, "moe_bwd": moe_bwd,
        "bwd_replica": bwd_replica, "bwd_exposed": bwd_exposed, "fwd": fwd, "bwd": bwd, "total": fwd + bwd,
        "total_excl_plan": fwd + bwd - plan_seconds,
    }


class _ScheduleCache:
    """Busiest weight-distribution sender/receiver (in experts) per slot layout, direct and relayed."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._cache: dict[bytes, tuple[int, int]] = {}

    def volumes(self, slot_expert: torch.Tensor, num_experts: int) -> tuple[int, int]:
        key = slot_expert.cpu().numpy().tobytes() + slot_expert.shape[0].to_bytes(4, "little")
        hit = self._cache.get(key)
        if hit is None:
            out = []
            for mode in ("off", "adaptive"):
                s = build_schedule(slot_expert.cpu(), num_experts, 1, relay=mode)
                out.append(int(torch.maximum(s.send_volume(), s.recv_volume()).max()) if s.num_edges else 0)
            hit = (out[0], out[1])
            if len(self._cache) >= self.capacity:
                self._cache.clear()
            self._cache[key] = hit
        return hit


_SCHEDULES = _ScheduleCache()


def layer_cost(load: torch.Tensor, plan: Plan, shape: ExpertShape, hardware: Hardware, *,
               plan_seconds: float = 0.0, relay: bool = True) -> dict:
    """Estimated seconds of one MoE layer invocation (one microbatch) under ``plan``.

    Args:
        load: int64 [R, E], the load the plan serves.
        plan: a planner Plan (``identity_plan`` for ``none``).
        plan_seconds: time to solve the plan (forward critical path).
        relay: charge weight distribution with relay trees (else direct fan-out).

    Returns:
        dict of seconds: ``moe_fwd``/``moe_bwd`` (busiest rank's expert compute), ``a2a_fwd``/
        ``a2a_bwd`` (token dispatch + combine of the busiest remote sender/receiver),
        ``wdist_direct``/``wdist_relay``/``wdist`` (weight distribution; busiest sender/receiver),
        ``bwd_replica``/``bwd_exposed`` (backward replica traffic and the part not hidden),
        ``plan``, ``fwd``, ``bwd``, ``total``.
    """
    R, E = planner.validate_load(load)
    if plan.num_ranks != R or plan.num_experts != E:
        raise ValueError("plan and load have different shapes")
    L = plan.physical_slots_per_rank
    moe_fwd = _compute_seconds(plan.quota, shape, hardware)
    traffic = plan.physical_split.view(R, R, L).sum(2).to(torch.float64)  # [src, dst]
    local = traffic.diagonal()
    remote = max(float((traffic.sum(1) - local).max()), float((traffic.sum(0) - local).max()))
    a2a = remote * shape.token_bytes / hardware.link_bytes_per_s
    direct, relayed = _SCHEDULES.volumes(plan.slot_expert, E) if plan.num_slots else (0, 0)
    per_expert = shape.weight_bytes / hardware.link_bytes_per_s
    return _assemble(moe_fwd, a2a, direct * per_expert, relayed * per_expert, float(plan_seconds), shape, relay)


def ideal_cost(load: torch.Tensor, shape: ExpertShape, hardware: Hardware) -> dict:
    """Estimated seconds of one MoE layer under force-balanced dispatch (the paper's ideal): every
    expert gets total/E pairs, every source sends its pairs to uniformly spread destinations;
    no plan, no replicas. load int64 [R, E]; keys as :func:`layer_cost`."""
    R, E = planner.validate_load(load)
    total = float(load.sum())
    per_instance = torch.full((E // R, R), total / E, dtype=torch.float64)
    moe_fwd = _compute_seconds(per_instance, shape, hardware)
    sent = float(load.sum(1).max()) * (R - 1) / R
    received = total / R * (R - 1) / R
    a2a = max(sent, received) * shape.token_bytes / hardware.link_bytes_per_s
    return _assemble(moe_fwd, a2a, 0.0, 0.0, 0.0, shape, True)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BalancerSpec:
    """A balancer to replay.

    Attributes:
        name: one of :data:`BALANCER_NAMES`.
        num_slots: redundant slots per rank (eplb, eplb-exact, ultraep).
        min_quota: ultraep's quota floor (None: the planner's default, 1 % of the mean rank load).
        eplb_window / eplb_interval: eplb's history (microbatches of the layer) and re-plan period.
        label: name in reports (default: ``name``).
    """

    name: str
    num_slots: int = 2
    min_quota: Optional[int] = None
    eplb_window: int = 16
    eplb_interval: int = 16
    label: Optional[str] = None

    def __post_init__(self):
        if self.name not in BALANCER_NAMES:
            raise ValueError(f"unknown balancer {self.name!r}; choose from {BALANCER_NAMES}")
        if self.num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {self.num_slots}")
        if self.min_quota is not None and self.min_quota < 1:
            raise ValueError(f"min_quota must be >= 1 or None, got {self.min_quota}")
        if self.eplb_window < 1 or self.eplb_interval < 1:
            raise ValueError("eplb_window and eplb_interval must be >= 1")

    @property
    def key(self) -> str:
        return self.label or self.name


class _Runner:
    """Plans for one BalancerSpec; EPLB keeps history per (EP group, layer), like the runtime."""

    def __init__(self, spec: BalancerSpec):
        self.spec = spec
        self._eplb: dict[tuple[int, int], dict] = {}

    def plan(self, group: int, layer: int, load: torch.Tensor) -> tuple[Optional[Plan], float]:
        spec = self.spec
        start = time.perf_counter()
        if spec.name == "ideal":
            return None, 0.0
        if spec.name == "none":
            return identity_plan(load), 0.0
        if spec.name == "ultraep":
            plan = planner.solve(load, spec.num_slots, min_quota=spec.min_quota)
        elif spec.name == "eplb-exact":
            plan = baselines.eplb_exact(load, spec.num_slots)
        else:
            # Same policy as the runtime's LayerBalancer: a placement from the last `window`
            # microbatches of this layer (the current one on the very first call), refreshed every
            # `interval` microbatches; the current load goes round-robin over its instances.
            state = self._eplb.setdefault((group, layer), {"history": [], "placement": None, "calls": 0})
            if state["placement"] is None or state["calls"] % spec.eplb_interval == 0:
                history = (torch.stack(state["history"][-spec.eplb_window:]) if state["history"]
                           else load.unsqueeze(0))
                state["placement"] = baselines.eplb(history, spec.num_slots).slot_expert
            state["calls"] += 1
            state["history"].append(load)
            del state["history"][:-spec.eplb_window]
            plan = baselines.round_robin(load, state["placement"])
        return plan, time.perf_counter() - start


METRIC_KEYS = ("imbalance_before", "imbalance_after", "threshold", "lower_bound", "replicas", "max_fanout",
               "max_replicas_per_home", "inflight_ratio", "min_replica_quota", "plan_seconds")


@dataclass
class ReplayResult:
    """Per-record results of a replay (N records, in trace order, EP groups one after another).

    Attributes:
        specs: the replayed balancers (``spec.key`` names them below).
        keys: ``group``, ``iteration``, ``microbatch``, ``layer`` -> int64 [N].
        metrics: balancer key -> metric (``METRIC_KEYS``) -> float64 [N] (NaN for a missing value,
            e.g. ``min_replica_quota`` without replicas).
        costs: balancer key -> cost term (``layer_cost`` keys) -> float64 [N] seconds, or None.
        rank_load: balancer key -> int64 [N, R] per-rank load after balancing (``keep_loads``).
        expert_load: int64 [N, E] per-expert load (``keep_loads``).
        num_ranks, num_experts, shape, hardware, meta (the first trace's header meta).
    """

    specs: list[BalancerSpec]
    keys: dict[str, np.ndarray]
    metrics: dict[str, dict[str, np.ndarray]]
    costs: Optional[dict[str, dict[str, np.ndarray]]]
    rank_load: Optional[dict[str, np.ndarray]]
    expert_load: Optional[np.ndarray]
    num_ranks: int
    num_experts: int
    shape: Optional[ExpertShape]
    hardware: Optional[Hardware]
    meta: dict = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return len(self.keys["layer"])

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.keys["layer"].tolist()))


def _warm_up() -> None:
    """Compile the planner's numba kernels outside the timed region."""
    planner.solve(torch.tensor([[3, 0], [1, 0]], dtype=torch.int64), 1, min_quota=1)


def replay(records: Iterable[tuple[int, int, int, int, torch.Tensor]], specs: Sequence[BalancerSpec], *,
           shape: Optional[ExpertShape] = None, hardware: Optional[Hardware] = None, relay: bool = True,
           keep_loads: bool = False, plan_seconds: Optional[float] = None,
           plan_statistic: Literal["median", "each"] = "median",
           progress: Optional[Callable[[int], None]] = None) -> ReplayResult:
    """Replay loads through balancers.

    Args:
        records: ``(group, iteration, microbatch, layer, load int64 [R, E])`` in training order
            (per EP group; EPLB's history follows this order per (group, layer)).
        specs: balancers; their ``key`` values must be distinct.
        shape, hardware: give both to estimate costs (``layer_cost``/``ideal_cost``); else metrics only.
        relay: charge weight distribution with relay trees in ``total`` (both variants are kept).
        keep_loads: keep per-rank loads after balancing and per-expert loads (heatmaps).
        plan_seconds: charge this fixed plan time to the exact-load balancers instead of the measured
            one (the metrics keep the measured one).
        plan_statistic: cost every invocation with the ``"median"`` measured plan time of its
            balancer (default; robust to a noisy host) or with ``"each"`` invocation's own.
        progress: called with the number of records done after each record.
    """
    specs = list(specs)
    if len({s.key for s in specs}) != len(specs):
        raise ValueError(f"balancer keys must be distinct, got {[s.key for s in specs]}")
    if (shape is None) != (hardware is None):
        raise ValueError("give both shape and hardware to estimate costs, or neither")
    with_cost = shape is not None
    runners = [_Runner(s) for s in specs]
    if any(s.name in ("ultraep",) for s in specs):
        _warm_up()
    keys: dict[str, list[int]] = {k: [] for k in ("group", "iteration", "microbatch", "layer")}
    metrics = {s.key: {m: [] for m in METRIC_KEYS} for s in specs}
    costs = {s.key: {} for s in specs} if with_cost else None
    rank_load = {s.key: [] for s in specs} if keep_loads else None
    expert_load: list[torch.Tensor] = []
    R = E = None
    done = 0
    for group, iteration, microbatch, layer, load in records:
        if R is None:
            R, E = planner.validate_load(load)
        elif tuple(load.shape) != (R, E):
            raise ValueError(f"all loads must be [R, E] = [{R}, {E}], got {tuple(load.shape)} "
                             f"(group {group}, iteration {iteration}, layer {layer})")
        for name, value in zip(("group", "iteration", "microbatch", "layer"), (group, iteration, microbatch, layer)):
            keys[name].append(int(value))
        if keep_loads:
            expert_load.append(load.sum(0))
        for runner in runners:
            key = runner.spec.key
            plan, seconds = runner.plan(group, layer, load)
            m = ideal_metrics(load) if plan is None else planner.metrics(load, plan)
            m["plan_seconds"] = seconds
            for name in METRIC_KEYS:
                metrics[key][name].append(np.nan if m[name] is None else float(m[name]))
            if with_cost:
                # History-based EPLB plans off the critical path (between re-plans); its reroute is
                # a device-side lookup. The exact-load balancers plan after gating, on the path.
                critical = 0.0
                if runner.spec.name in ("ultraep", "eplb-exact"):
                    critical = seconds if plan_seconds is None else float(plan_seconds)
                c = (ideal_cost(load, shape, hardware) if plan is None
                     else layer_cost(load, plan, shape, hardware, plan_seconds=critical, relay=relay))
                for name, value in c.items():
                    costs[key].setdefault(name, []).append(value)
            if keep_loads:
                if plan is None:
                    total = int(load.sum())
                    rank_load[key].append(torch.full((R,), total // R, dtype=torch.int64))
                else:
                    rank_load[key].append(plan.quota.sum(0).cpu())
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
        for c in cost_arrays.values():
            median = float(np.median(c["plan"]))
            for term in ("fwd", "total"):
                c[term] = c[term] - c["plan"] + median
            c["plan"] = np.full_like(c["plan"], median)
    return ReplayResult(
        specs=specs,
        keys={k: np.asarray(v, dtype=np.int64) for k, v in keys.items()},
        metrics={k: as_float(v) for k, v in metrics.items()},
        costs=cost_arrays,
        rank_load={k: torch.stack(v).numpy() for k, v in rank_load.items()} if keep_loads else None,
        expert_load=torch.stack(expert_load).numpy() if keep_loads else None,
        num_ranks=R, num_experts=E, shape=shape, hardware=hardware,
    )


class TraceRecords:
    """Replay records ``(group, iteration, microbatch, layer, load)`` streamed from trace files.

    Args:
        paths: trace files; EP group g is ``paths[g]``. All must have the same R and E.
        layers: only these layer numbers.
        max_records: at most this many records per file (committed records only).
        load_scale: multiply every load by this (rounded) — e.g. to project a small run's routing
            onto a production microbatch size.

    ``meta`` is the first file's header meta; ``total`` the number of records the stream will
    yield (for progress), counted by a scan of the files.
    """

    def __init__(self, paths: Sequence, *, layers: Optional[Iterable[int]] = None,
                 max_records: Optional[int] = None, load_scale: float = 1.0):
        from ultraep_megatron.traces import TraceReader

        if not load_scale > 0:
            raise ValueError(f"load_scale must be > 0, got {load_scale}")
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self.readers = [TraceReader(p) for p in paths]
        if not self.readers:
            raise ValueError("no trace files")
        shapes = {(r.num_ranks, r.num_experts) for r in self.readers}
        if len(shapes) != 1:
            raise ValueError(f"trace files disagree on [R, E]: {sorted(shapes)}")
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.max_records, self.load_scale = max_records, float(load_scale)
        self.meta = dict(self.readers[0].meta)
        self._total: Optional[int] = None

    @property
    def total(self) -> int:
        if self._total is None:
            total = 0
            for r in self.readers:
                if self.layers is None:
                    r.scan()
                    n = r.committed_records
                else:
                    n = sum(1 for _ in r.records(layers=self.layers))
                total += n if self.max_records is None else min(n, self.max_records)
            self._total = total
        return self._total

    def __iter__(self) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
        for group, reader in enumerate(self.readers):
            for n, rec in enumerate(reader.records(layers=self.layers)):
                if self.max_records is not None and n >= self.max_records:
                    break
                load = rec.load
                if self.load_scale != 1.0:
                    load = torch.round(load.to(torch.float64) * self.load_scale).to(torch.int64)
                yield group, rec.iteration, rec.microbatch, rec.layer, load


def replay_files(paths: Sequence, specs: Sequence[BalancerSpec], *, layers: Optional[Iterable[int]] = None,
                 max_records: Optional[int] = None, load_scale: float = 1.0,
                 progress: Optional[Callable[[int, int], None]] = None, **kwargs) -> ReplayResult:
    """Replay trace files (one per EP group) through ``specs``; see :class:`TraceRecords` for the
    selection arguments and :func:`replay` for ``kwargs``. ``progress(done, total)``."""
    records = TraceRecords(paths, layers=layers, max_records=max_records, load_scale=load_scale)
    total = records.total if progress is not None else 0
    callback = None if progress is None else (lambda done: progress(done, total))
    result = replay(records, specs, progress=callback, **kwargs)
    result.meta = records.meta
    return result


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def _nan_stat(values: np.ndarray, fn) -> Optional[float]:
    finite = values[~np.isnan(values)]
    return float(fn(finite)) if finite.size else None


def metric_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict[str, dict]:
    """Balancing quality per balancer over the records in ``mask`` (default: all).

    Returns balancer key -> {``imbalance_mean``, ``imbalance_p95``, ``imbalance_max``,
    ``imbalance_before_mean``, ``worse_than_none`` (share of records whose imbalance after exceeds
    the unbalanced one), ``replicas_mean``, ``fanout_mean``, ``fanout_max``, ``inflight_mean``,
    ``min_replica_quota``, ``plan_ms_mean``, ``records``}.
    """
    out = {}
    for spec in result.specs:
        m = result.metrics[spec.key]
        sel = slice(None) if mask is None else mask
        after, before = m["imbalance_after"][sel], m["imbalance_before"][sel]
        if after.size == 0:
            continue
        out[spec.key] = {
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


def _step_times(result: ReplayResult, key: str, term: str, mask: Optional[np.ndarray]) -> np.ndarray:
    """Seconds per (iteration, microbatch, layer), the max over EP groups (they run side by side)."""
    k = result.keys
    sel = np.ones(result.num_records, dtype=bool) if mask is None else mask
    ident = np.stack([k["iteration"][sel], k["microbatch"][sel], k["layer"][sel]], axis=1)
    _, inverse = np.unique(ident, axis=0, return_inverse=True)
    out = np.zeros(inverse.max() + 1 if inverse.size else 0)
    np.maximum.at(out, inverse.reshape(-1), result.costs[key][term][sel])
    return out


def cost_summary(result: ReplayResult, mask: Optional[np.ndarray] = None) -> dict[str, dict]:
    """Estimated time per balancer over the records in ``mask``: mean ms per MoE-layer invocation of
    each term (``fwd``, ``bwd``, ``total``, ``moe_fwd``, ``a2a_fwd``, ``wdist``, ``wdist_direct``,
    ``wdist_relay``, ``plan``, ``bwd_exposed``), plus ``frac_ideal`` (ideal time / time) and
    ``speedup_vs_none`` (none time / time) when ``ideal``/``none`` were replayed, and the same two
    without the plan term (``frac_ideal_excl_plan``, ``speedup_vs_none_excl_plan``: the planner
    here runs on the CPU, the paper's on the GPU). EP groups count as running in parallel (max
    over groups per layer invocation)."""
    if result.costs is None:
        raise ValueError("the replay carried no cost model (give shape and hardware)")
    terms = ("fwd", "bwd", "total", "total_excl_plan", "moe_fwd", "moe_bwd", "a2a_fwd", "wdist", "wdist_direct",
             "wdist_relay", "plan", "bwd_exposed")
    sums = {s.key: {t: _step_times(result, s.key, t, mask) for t in terms} for s in result.specs}
    names = {s.key: s.name for s in result.specs}
    ideal = next((k for k, n in names.items() if n == "ideal"), None)
    none = next((k for k, n in names.items() if n == "none"), None)
    out = {}
    for key, per_term in sums.items():
        total = per_term["total"].sum()
        row = {f"{t}_ms": float(v.mean() * 1e3) if v.size else 0.0 for t, v in per_term.items()}
        excl = per_term["total_excl_plan"].sum()
        if ideal is not None:
            row["frac_ideal"] = float(sums[ideal]["total"].sum() / total) if total else 1.0
            row["frac_ideal_excl_plan"] = float(sums[ideal]["total"].sum() / excl) if excl else 1.0
        if none is not None:
            row["speedup_vs_none"] = float(sums[none]["total"].sum() / total) if total else 1.0
            row["speedup_vs_none_excl_plan"] = float(sums[none]["total"].sum() / excl) if excl else 1.0
        out[key] = row
    return out


def staleness_summary(result: ReplayResult) -> list[dict]:
    """EPLB under growing staleness (paper Fig. 6): one row per replayed ``eplb`` spec, sorted by
    interval: ``interval``, ``window``, ``num_slots`` and its :func:`metric_summary` figures."""
    summary = metric_summary(result)
    rows = []
    for spec in result.specs:
        if spec.name == "eplb" and spec.key in summary:
            rows.append({"key": spec.key, "interval": spec.eplb_interval, "window": spec.eplb_window,
                         "num_slots": spec.num_slots, **summary[spec.key]})
    return sorted(rows, key=lambda r: (r["interval"], r["window"]))


# ---------------------------------------------------------------------------------------------
# Slot advisor
# ---------------------------------------------------------------------------------------------

def slot_sweep(records: Iterable, slots: Sequence[int], min_quotas: Sequence[Optional[int]],
               shape: ExpertShape, hardware: Hardware, *, relay: bool = True, include_eplb_exact: bool = False,
               num_layers: Optional[int] = None, plan_seconds: Optional[float] = None,
               progress: Optional[Callable[[int], None]] = None) -> tuple[list[dict], ReplayResult]:
    """Balance and estimated speedup of ultraep as a function of redundant slots and quota floor.

    Args:
        records: replay records (see :func:`replay`), read once.
        slots: redundant slots per rank to try (e.g. 0, 1, 2, 4).
        min_quotas: quota floors to try (None: the planner's 1 % default).
        include_eplb_exact: also sweep EPLB's rule on the exact load, for comparison.
        num_layers: MoE layers of the model, for the per-layer-replica memory column (default:
            the layers seen in the trace).

    Returns:
        (rows, replay result). One row per (balancer, slots, min_quota): ``balancer``, ``key`` (the
        spec key in the result), ``num_slots``, ``min_quota``, ``imbalance_mean``/``_p95``,
        ``replicas_mean``, ``fanout_max``, ``inflight_mean``, ``speedup_vs_none``, ``frac_ideal``,
        ``speedup_vs_none_excl_plan``, ``total_ms``, ``memory_bytes`` (shared slots, per rank) and
        ``memory_bytes_per_layer_layout``.
    """
    slots = sorted(set(int(s) for s in slots))
    specs = [BalancerSpec("none", label="none"), BalancerSpec("ideal", label="ideal")]
    grid = []
    for s in slots:
        for q in dict.fromkeys(min_quotas):
            specs.append(BalancerSpec("ultraep", num_slots=s, min_quota=q, label=f"ultraep/S={s}/q={q}"))
            grid.append(("ultraep", s, q))
        if include_eplb_exact:
            specs.append(BalancerSpec("eplb-exact", num_slots=s, label=f"eplb-exact/S={s}"))
            grid.append(("eplb-exact", s, None))
    result = replay(records, specs, shape=shape, hardware=hardware, relay=relay,
                    plan_seconds=plan_seconds, progress=progress)
    quality = metric_summary(result)
    cost = cost_summary(result)
    layers = num_layers or len(result.layers)
    rows = []
    for spec, (name, s, q) in zip(specs[2:], grid):
        m, c = quality[spec.key], cost[spec.key]
        rows.append({
            "balancer": name, "key": spec.key, "num_slots": s, "min_quota": q,
            "imbalance_mean": m["imbalance_mean"], "imbalance_p95": m["imbalance_p95"],
            "replicas_mean": m["replicas_mean"], "fanout_max": m["fanout_max"], "inflight_mean": m["inflight_mean"],
            "speedup_vs_none": c["speedup_vs_none"], "frac_ideal": c["frac_ideal"], "total_ms": c["total_ms"],
            "speedup_vs_none_excl_plan": c["speedup_vs_none_excl_plan"],
            "memory_bytes": slot_memory_bytes(shape, s),
            "memory_bytes_per_layer_layout": slot_memory_bytes(shape, s, num_layers=layers),
        })
    return rows, result


def advise_slots(rows: Sequence[dict], *, tolerance: float = 0.01, min_gain_per_slot: float = 0.005,
                 memory_budget_bytes: Optional[int] = None) -> dict:
    """Pick redundant slots and a quota floor from :func:`slot_sweep` rows (ultraep rows only).

    For every slot count the best quota floor (highest estimated speedup; ties: the larger floor,
    fewer replicas) is kept. Walking slot counts upward, a slot count is taken while each added slot
    still buys at least ``min_gain_per_slot`` of speedup per slot (CRAFT's benefit per replica,
    diminishing returns); among those, the smallest one within ``tolerance`` of the best speedup is
    recommended. Slot counts over ``memory_budget_bytes`` are skipped.

    Returns:
        {``num_slots``, ``min_quota``, ``row`` (the chosen row), ``best_per_slots`` (slot count ->
        row), ``benefit_per_slot`` (slot count -> speedup gained per slot over 0 slots), ``reason``}.
    """
    candidates = [r for r in rows if r["balancer"] == "ultraep"
                  and (memory_budget_bytes is None or r["memory_bytes"] <= memory_budget_bytes)]
    if not candidates:
        raise ValueError("no ultraep row fits (check slots and the memory budget)")
    best: dict[int, dict] = {}
    for r in candidates:
        cur = best.get(r["num_slots"])
        q = r["min_quota"] if r["min_quota"] is not None else -1
        if cur is None or (r["speedup_vs_none"], q) > (cur["speedup_vs_none"],
                                                      cur["min_quota"] if cur["min_quota"] is not None else -1):
            best[r["num_slots"]] = r
    order = sorted(best)
    base = best[order[0]]["speedup_vs_none"] if order[0] == 0 else 1.0
    benefit = {s: (best[s]["speedup_vs_none"] - base) / s for s in order if s > 0}
    worthwhile = [order[0]]
    for prev, s in zip(order, order[1:]):
        gain = (best[s]["speedup_vs_none"] - best[prev]["speedup_vs_none"]) / (s - prev)
        if gain < min_gain_per_slot:
            break
        worthwhile.append(s)
    top = max(best[s]["speedup_vs_none"] for s in worthwhile)
    chosen = next(s for s in worthwhile if best[s]["speedup_vs_none"] >= top * (1 - tolerance))
    row = best[chosen]
    reason = (f"{chosen} slot(s) reach {row['speedup_vs_none']:.3f}x estimated speedup over none "
              f"({row['frac_ideal']:.1%} of ideal), within {tolerance:.0%} of the best worthwhile "
              f"({top:.3f}x); more slots gain < {min_gain_per_slot:.3f}x each")
    return {"num_slots": chosen, "min_quota": row["min_quota"], "row": row, "best_per_slots": best,
            "benefit_per_slot": benefit, "reason": reason}
