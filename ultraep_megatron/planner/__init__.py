"""UltraEP's quota-driven planner: exact post-gating load -> replication plan + token reroute.

Pure functions on tensors (no Megatron, no torch.distributed). Every rank of an EP group calls
``solve`` on the same gathered load and gets the same plan bit for bit, with no communication.

    plan = solve(load, num_slots)                # load int64 [R, E]
    plan = solve(load, num_slots, domain_size=8)  # replicas stay inside 8-rank NVLink domains
    physical_ids = assign_tokens(plan, rank, topk_ids)   # [T, k] logical -> physical slots

See ``docs/planner.md`` for the algorithm, ``min_quota`` and the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from . import _compiled, reference
from .plan import (
    Plan,
    plan_from_split,
    tokens_received_per_local_slot,
    tokens_sent_per_physical_slot,
)

__all__ = [
    "Plan",
    "solve",
    "assign_tokens",
    "RankDispatch",
    "rank_dispatch",
    "metrics",
    "load_imbalance",
    "rank_imbalance",
    "default_min_quota",
    "domain_lower_bound",
    "validate_load",
    "validate_domain_size",
    "plan_from_split",
    "tokens_sent_per_physical_slot",
    "tokens_received_per_local_slot",
    "baselines",
    "peers",
    "policy",
    "synthetic",
]

# Default quota floor: 1 % of the mean per-rank load. A replica costs a weight transfer (and a
# gradient reduction in backward) whatever it carries; one carrying less than 1 % of a rank's
# work is not worth it, and forbidding it also keeps the replica count down (docs/planner.md).
DEFAULT_MIN_QUOTA_DIVISOR = 100


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of a host tensor (a copy only if it is not contiguous or on a
    device)."""
    if tensor.is_cpu and not tensor.requires_grad:  # the per-invocation case: two torch calls less
        return np.ascontiguousarray(tensor.numpy())
    return np.ascontiguousarray(tensor.detach().cpu().numpy())


def validate_load(load: torch.Tensor, name: str = "load") -> tuple[int, int]:
    """Check ``load`` is an int64 [R, E] tensor with E % R == 0; return (R, E).

    Negative values are checked by the caller (in the compiled pass for ``solve``)."""
    if not isinstance(load, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(load).__name__}")
    if load.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {load.dtype}")
    if load.dim() != 2:
        raise ValueError(f"{name} must be [R, E], got shape {tuple(load.shape)}")
    R, E = load.shape
    if R == 0 or E == 0 or E % R != 0:
        raise ValueError(f"{name} has R={R} ranks and E={E} experts; need R >= 1 and E % R == 0")
    return R, E


def default_min_quota(total_load: int, num_ranks: int) -> int:
    """``max(1, ceil(total_load / (100 * num_ranks)))``: 1 % of the mean rank load, at least 1."""
    return max(1, -(-int(total_load) // (DEFAULT_MIN_QUOTA_DIVISOR * num_ranks)))


def validate_domain_size(domain_size, num_ranks: int) -> int:
    """``domain_size`` (None: one domain of all ``num_ranks``) as an int that divides R."""
    if domain_size is None:
        return num_ranks
    if (isinstance(domain_size, bool) or not isinstance(domain_size, (int, np.integer))
            or domain_size < 1 or num_ranks % domain_size):
        raise ValueError(f"domain_size must be an int >= 1 dividing the number of EP ranks "
                         f"R={num_ranks} (EP ranks per NVLink domain), got {domain_size!r}")
    return int(domain_size)


def domain_lower_bound(load: torch.Tensor, domain_size: int | None = None) -> int:
    """``max_d ceil(total_d / N)`` for ``load`` int64 [R, E]: no plan whose replicas stay inside
    their home's domain of N = ``domain_size`` ranks has a lower max rank load (domain d's experts'
    load stays on its N ranks). ``ceil(total / R)`` for one domain."""
    R, E = validate_load(load)
    N = validate_domain_size(domain_size, R)
    per_domain = load.sum(0).view(R // N, N * (E // R)).sum(1)  # [R / N]
    return int((-(-per_domain // N)).max())


def solve(load: torch.Tensor, num_slots: int, *, min_quota: int | None = None,
          domain_size: int | None = None,
          implementation: Literal["compiled", "reference"] = "compiled") -> Plan:
    """Replication and reroute plan for the exact load of one MoE layer.

    Args:
        load: int64 [R, E]; ``load[s, e]`` = (token, expert) pairs on source rank s routed to
            logical expert e. Expert e's main instance lives on rank ``e // (E // R)``.
        num_slots: S, redundant slots per rank (>= 0).
        min_quota: every replica (a filled redundant slot) carries at least this many tokens
            (>= 1). ``None``: ``default_min_quota`` = 1 % of the mean rank load. Main instances
            are exempt (0 .. their expert's load). The floor never makes a plan infeasible: a rank
            whose last bit of excess is below it sheds ``min_quota`` tokens anyway and ends below
            the threshold (docs/planner.md).
        domain_size: N, EP ranks per NVLink domain (ranks ``[d*N, (d+1)*N)`` form domain d); must
            divide R. A replica of expert e is hosted only in its home's domain
            (``t // N == home(e) // N``), so no weight or replica gradient crosses a domain; tokens
            still go anywhere. The max rank load is then at least ``domain_lower_bound``.
            ``None`` or R: one domain, the plain planner (same plans bit for bit).
        implementation: "compiled" (numba, the default) or "reference" (plain Python, slow;
            returns the same plan bit for bit).

    Returns:
        A ``Plan`` whose tensors live on ``load``'s device.
    """
    R, E = validate_load(load)
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
    domain_size = validate_domain_size(domain_size, R)
    if min_quota is not None and (isinstance(min_quota, bool)
                                  or not isinstance(min_quota, (int, np.integer)) or min_quota < 1):
        raise ValueError(f"min_quota must be an int >= 1 or None, got {min_quota!r}")
    device = load.device
    array = _host(load)

    if implementation == "compiled":
        # min_quota 0: the kernel derives the default from the total it computes anyway.
        status, slot_expert, quota, physical_split, threshold = _compiled.solve_arrays(
            array, int(num_slots), 0 if min_quota is None else int(min_quota),
            DEFAULT_MIN_QUOTA_DIVISOR, domain_size)
        if status == _compiled.NEGATIVE_LOAD:
            raise ValueError("load has negative entries")
    elif implementation == "reference":
        if (array < 0).any():
            raise ValueError("load has negative entries")
        if min_quota is None:
            min_quota = default_min_quota(int(array.sum()), R)
        slot_expert, quota, physical_split, threshold = reference.solve_arrays(
            array, int(num_slots), int(min_quota), domain_size)
    else:
        raise ValueError(
            f"implementation must be 'compiled' or 'reference', got {implementation!r}")

    slot_expert, quota, physical_split = (torch.from_numpy(slot_expert), torch.from_numpy(quota),
                                          torch.from_numpy(physical_split))
    if device.type != "cpu":
        slot_expert, quota, physical_split = (slot_expert.to(device), quota.to(device),
                                              physical_split.to(device))
    return Plan(slot_expert, quota, physical_split, int(threshold))


def assign_tokens(plan: Plan, rank: int, topk_ids: torch.Tensor) -> torch.Tensor:
    """Physical slot of every (token, expert) pair of source ``rank``, realizing the plan exactly.

    The j-th pair (in row-major order of ``topk_ids``) routed to expert e goes to the first
    instance of e, in rank order, whose cumulative count ``split[rank, e, :].cumsum()`` exceeds
    j (the cumulative-quota lookup of UltraEP §5.2). On CPU one compiled O(T*k + E*R) pass; on
    other devices the vectorized torch form (stable sort by expert + one searchsorted), which
    gives the same ids.

    Args:
        plan: the plan solved for the load these ids produced.
        rank: the source rank, 0 <= rank < R.
        topk_ids: int64 [T, k] logical expert ids from the router.

    Returns:
        int64 [T, k] physical slot ids ``t * (G + S) + j``, on ``topk_ids``' device.

    Raises:
        ValueError: bad shapes/ids, or if the ids' per-expert counts differ from the plan's load
            for ``rank`` (the plan was made for another load).
    """
    R, E = plan.num_ranks, plan.num_experts
    if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype != torch.int64
            or topk_ids.dim() != 2):
        raise ValueError("topk_ids must be an int64 [T, k] tensor")
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    if topk_ids.device.type != "cpu":
        return _assign_tokens_vectorized(plan, rank, topk_ids)
    # CPU: one compiled pass (a sort + searchsorted over T*k pairs costs ~1 ms on CPU).
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    status, physical = _compiled.assign_arrays(
        flat.numpy(), plan.physical_split[rank].cpu().numpy(), plan.instance_slot.cpu().numpy())
    if status == _compiled.OUT_OF_RANGE:
        raise ValueError(f"topk_ids must lie in [0, {E})")
    if status == _compiled.MISMATCH:
        raise ValueError(f"topk_ids of rank {rank} do not match the load the plan was solved for")
    return torch.from_numpy(physical).view(topk_ids.shape)


@dataclass(frozen=True)
class RankDispatch:
    """What one EP rank's dispatcher needs from a plan, as host int64 arrays.

    Attributes:
        rows_per_source_slot: [R, P] rows each source rank sends to each of this rank's physical
            slots (megatron's ``num_global_tokens_per_local_expert``).
        rows_per_slot: [P] rows each of this rank's physical slots receives.
        input_splits / output_splits: [R] rows this rank sends to / receives from each rank (the
            token all-to-all's splits).
        reroute_table: [4, E * R + 1], this rank as a source: row 0 is the running total of the
            rows it sends to the instances of each expert (expert-major, instance rank minor), then
            a sentinel above every position (int64 max); row 1 the physical slot of that instance
            (0 where there is none: such an entry sends no row), then ``R * P``, a spare column
            past the last physical slot; row 2's first E entries the expert-major position of each
            expert's first pair, minus one (exclusive running total of this rank's load), then 0;
            row 3 the row of this rank's send buffer (physical-slot-major, the all-to-all's input
            order) of the instance's first pair minus that pair's expert-major position, then
            ``N + 1`` (``N`` the rows this rank sends: a position past the last instance lands past
            the buffer and a spare row). A pair at expert-major position ``i`` goes to the instance
            ``k`` of the first entry of row 0 above ``i`` (``searchsorted(row0, i, right=True)``),
            to its physical slot ``row1[k]`` and to send-buffer row ``row3[k] + i``.
    """

    rows_per_source_slot: np.ndarray
    rows_per_slot: np.ndarray
    input_splits: np.ndarray
    output_splits: np.ndarray
    reroute_table: np.ndarray


def rank_dispatch(plan: Plan, load: torch.Tensor, rank: int, *,
                  rows_per_source_slot: np.ndarray | None = None,
                  reroute_table: np.ndarray | None = None) -> RankDispatch:
    """:class:`RankDispatch` of ``plan`` (host tensors) solved for ``load`` int64 [R, E], for
    ``rank``: one compiled pass, a few microseconds (it runs per layer and microbatch between the
    load's arrival on the host and the reroute, where the device waits).

    ``rows_per_source_slot`` ([R, P]) and ``reroute_table`` ([4, E * R + 1]), if given, are
    C-contiguous int64 arrays to fill (e.g. views of pinned host tensors to upload from).
    """
    R, E = plan.num_ranks, plan.num_experts
    P = plan.physical_slots_per_rank
    if tuple(load.shape) != (R, E):
        raise ValueError(f"load has shape {tuple(load.shape)}, the plan is for {(R, E)}")
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    for name, tensor in (("load", load), ("plan.physical_split", plan.physical_split),
                         ("plan.slot_expert", plan.slot_expert)):
        # Host int64 only: a device tensor would be a blocking read here, another dtype a fresh
        # compilation of the kernel.
        if tensor.device.type != "cpu" or tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 host tensor, got {tensor.dtype} on {tensor.device}")

    def output_array(given, shape):
        if given is None:
            return np.empty(shape, np.int64)
        if given.shape != shape or given.dtype != np.int64 or not given.flags.c_contiguous:
            raise ValueError(f"expected a C-contiguous int64 array of shape {shape}, got "
                             f"{given.dtype} {given.shape}")
        return given

    out = RankDispatch(output_array(rows_per_source_slot, (R, P)), np.empty(P, np.int64),
                       np.empty(R, np.int64), np.empty(R, np.int64),
                       output_array(reroute_table, (4, E * R + 1)))
    _compiled.dispatch_arrays(_host(plan.physical_split), _host(plan.slot_expert), _host(load),
                              rank, out.rows_per_source_slot, out.rows_per_slot, out.input_splits,
                              out.output_splits, out.reroute_table)
    return out


def _assign_tokens_vectorized(plan: Plan, rank: int, topk_ids: torch.Tensor) -> torch.Tensor:
    """``assign_tokens`` with torch ops only (any device): a stable sort by expert, then one
    searchsorted into the cumulative (expert, instance) counts. Same result as the compiled pass."""
    E = plan.num_experts
    flat = topk_ids.reshape(-1)
    device = flat.device
    inst = plan.instance_slot.to(device)  # [E, R]
    counts = plan.physical_split[rank].to(device)[inst.clamp(min=0)] * (inst >= 0)  # [E, R]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= E):
        raise ValueError(f"topk_ids must lie in [0, {E})")
    if not torch.equal(torch.bincount(flat, minlength=E), counts.sum(1)):
        raise ValueError(f"topk_ids of rank {rank} do not match the load the plan was solved for")
    order = torch.sort(flat, stable=True).indices
    # After the stable sort, pair i is the (i - start_e)-th pair of its expert e, so its
    # position in the flattened (expert, instance) cumulative counts is just i.
    instance = torch.searchsorted(counts.reshape(-1).cumsum(0),
                                  torch.arange(flat.numel(), device=device), right=True)
    physical = torch.empty_like(flat)
    physical[order] = inst.reshape(-1)[instance]
    return physical.view_as(topk_ids)


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """The rank imbalance: ``max / mean`` of ``load`` [..., R] over its last dimension.

    Returns float64 [...], >= 1, and 1.0 where nothing was routed. The one imbalance formula of
    the project: planner metrics, triggers, replay and the training telemetry all use it.
    """
    load = load.double()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.max(dim=-1).values / mean.clamp_min(1e-30), torch.ones_like(mean))


def rank_imbalance(load: torch.Tensor) -> float:
    """:func:`load_imbalance` of the per-rank load of ``load`` int64 [R, E] with every expert at
    home: the imbalance before balancing, what a trigger compares with."""
    validate_load(load)
    return host_imbalance(host_rank_load(load))


def host_rank_load(load: torch.Tensor) -> np.ndarray:
    """Per-rank load [R] of a host load int64 [R, E] with every expert at home, in numpy (per layer
    and microbatch: microseconds)."""
    R, E = load.shape
    return load.cpu().numpy().sum(0).reshape(R, E // R).sum(1)


def host_imbalance(rank_load: np.ndarray) -> float:
    """:func:`load_imbalance` of one integer [R] host array, in numpy: it runs per layer and
    microbatch (triggers, telemetry), where numpy costs microseconds and torch calls tens. Integer
    sums are exact, so the float64 max / mean is the same number."""
    return max_over_mean(int(rank_load.max()), int(rank_load.sum()), rank_load.size)


def max_over_mean(maximum: int, total: int, num_ranks: int) -> float:
    """:func:`host_imbalance` from integer figures a caller already has: the largest of
    ``num_ranks`` rank loads over their mean, 1.0 if they sum to zero."""
    return maximum / (total / num_ranks) if total > 0 else 1.0


def metrics(load: torch.Tensor, plan: Plan, *, domain_size: int | None = None) -> dict:
    """Balancing metrics of ``plan`` on ``load`` [R, E].

    Returns a dict of Python scalars:
        imbalance_before / imbalance_after: max / mean per-rank load before and after reroute
            (1.0 for an all-zero load);
        memory_spread_before / memory_spread_after: max / mean of the (token, expert) rows each
            rank receives in the dispatch all-to-all and keeps as expert activations, without
            balancing and under the plan. A rank receives exactly the rows it computes (the
            columns of ``physical_split`` realize the quotas), so these equal the imbalances:
            balancing the compute evens out activation memory too (UltraEP Fig. 14);
        threshold: the plan's max rank load; lower_bound: ceil(total / R);
        replicas: filled redundant slots; max_fanout: most instances of one expert (main
            included); max_replicas_per_home: most replicas of one rank's main experts (what that
            rank must send in weight distribution, UltraEP eq. 5);
        cross_domain_replicas: replicas hosted outside their home's NVLink domain of
            ``domain_size`` ranks (None: one domain, so 0);
        inflight_ratio: share of tokens whose destination rank is not their source rank;
        min_replica_quota: smallest quota of a replica (None without replicas).
    """
    R, E = validate_load(load)
    if plan.num_ranks != R or plan.num_experts != E:
        raise ValueError("plan and load have different shapes")
    N = validate_domain_size(domain_size, R)
    # One compiled pass over the host arrays: the training telemetry computes this for every layer
    # and microbatch (a dozen torch calls on [R, E] tensors cost ~0.4 ms, numpy ~40 us, this ~10 us).
    (max_before, max_after, total, total_quota, replicas, max_per_expert, max_per_home, cross,
     local, min_replica_quota) = _compiled.metric_arrays(
        _host(load), _host(plan.quota), _host(plan.slot_expert), _host(plan.physical_split), N).tolist()
    imbalance_before = max_over_mean(max_before, total, R)
    imbalance_after = max_over_mean(max_after, total_quota, R)
    return {
        "imbalance_before": imbalance_before,
        "imbalance_after": imbalance_after,
        "memory_spread_before": imbalance_before,
        "memory_spread_after": imbalance_after,
        "threshold": int(plan.threshold),
        "lower_bound": -(-total // R),
        "replicas": replicas,
        "max_fanout": 1 + max_per_expert,
        "max_replicas_per_home": max_per_home,
        "cross_domain_replicas": 0 if N == R else cross,
        "inflight_ratio": 1.0 - local / total if total else 0.0,
        "min_replica_quota": min_replica_quota if replicas else None,
    }


from . import baselines, peers, policy, synthetic  # noqa: E402  (they import validate_load from here)
