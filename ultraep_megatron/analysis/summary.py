"""The tables of a replay: what the router sent (:func:`load_summary`), balancing quality
(:func:`metric_summary`), the cost model's ESTIMATE (:func:`cost_summary`), the balancers next to
the peers (:func:`peer_summary`), EPLB under stale history (:func:`staleness_summary`), and
whether the estimate says anything about a real run (:func:`estimate_problem`). Each takes a
:class:`~.replay.ReplayResult` and, optionally, a mask of its records (e.g. one layer's).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ultraep_megatron.planner.baselines import registry

from .replay import ReplayResult

__all__ = [
    "UNMODELLED_US",
    "cost_summary",
    "estimate_problem",
    "load_summary",
    "metric_summary",
    "peer_summary",
    "staleness_summary",
]


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


def _step_times(
    result: ReplayResult, label: str, term: str, mask: Optional[np.ndarray]
) -> np.ndarray:
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
    terms = (
        "fwd",
        "bwd",
        "total",
        "total_excl_plan",
        "moe_fwd",
        "moe_bwd",
        "a2a_fwd",
        "wdist",
        "wdist_direct",
        "wdist_relay",
        "plan",
        "fwd_exposed",
        "bwd_exposed",
    )
    sums = {
        label: {t: _step_times(result, label, t, mask) for t in terms} for label in result.labels
    }
    ideal, none = result.label_of(registry.IDEAL), result.label_of(registry.NONE)
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
            row["speedup_vs_none_excl_plan"] = (
                float(sums[none]["total"].sum() / excl) if excl else 1.0
            )
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
        if c.name == registry.EPLB and label in summary:
            rows.append(
                {
                    "label": label,
                    "interval": c.eplb_interval,
                    "window": c.eplb_window,
                    "num_slots": c.num_slots,
                    **summary[label],
                }
            )
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
    label = result.label_of(registry.NONE) or result.label_of(registry.IDEAL)
    if result.costs is None or label is None:
        return None
    layer_us = cost_summary(result)[label]["total_ms"] * 1e3
    if layer_us >= unmodelled_us:
        return None
    pairs = load_summary(result)["routed_mean"] / result.num_ranks
    return (
        f"the traced model's MoE layer (h={result.shape.hidden_size}, f={result.shape.ffn_hidden_size}, "
        f"{pairs:.0f} (token, expert) pairs per EP rank and microbatch) is estimated at {layer_us:.2f} us "
        f"per invocation ({label}) on this hardware, below the ~{unmodelled_us:g} us of kernel-launch and "
        "all-to-all latency the cost model leaves out: its times and speedups say nothing about a real run. "
        "Project the trace onto the model you will train: --hidden-size, --moe-ffn-hidden-size and "
        "--load-scale (tokens per microbatch x top-k / the traced ones; docs/traces.md)"
    )
