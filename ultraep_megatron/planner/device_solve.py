"""The device planner: the same kind of plan as ``solve``, computed where the load lives.

``device_solve`` never reads device data on the host: every shape and loop count follows from
R, E, S (host ints), everything else is integer tensor arithmetic on ``load``'s device, and ties are
broken by rank / expert id / creation order, so every rank computes the identical plan.

    plan = device_solve(load, num_slots)                 # load int64 [R, E] on any device
    plan = device_solve(load, num_slots, domain_size=8)  # replicas inside 8-rank NVLink domains

The algorithm (docs/planner.md, "Device planner"):

1. The oracle is the host planner's greedy, whose one specification is
   ``reference.greedy_replicas`` (overloaded ranks by descending load shed their excess, top-ups
   first, best-fit hosts, last slot filled, relay of the overshoot). A probe answers it at one
   threshold: whether it succeeds, and the quotas and creation order of its replicas.
2. The threshold search probes K = ``PROBES_PER_ROUND`` thresholds side by side per round on the
   grid ``lower + k * resolution`` (``resolution = max(1, lower >> 10)``, as the host's), k in
   (bad, good]: k = 0 is the lower bound, the grid point at or past the initial max rank load is
   feasible with no replica. Each round keeps the first feasible probe as ``good`` and the probe
   before it as ``bad``; the number of rounds is fixed by R and K (``search_rounds``), rounds after
   convergence probe the initial max (a probe with no overloaded rank, which ends at once).
3. The chosen threshold is probed once more, writing its replicas; the plan (slot layout in
   creation order per host, quotas, reroute: local first, then sources in rank order fill the
   instances in rank order) is built by tensor operations.

Who runs the probe (the same plan bit for bit): on a CPU load the specification itself
(:func:`reference_probe`, host reads of host data); on the device, the greedy as one step function
over fixed-size state (slack [R], free slots [R], the current rank's main load left [G] and its
replicas [G, R]) with a fixed step bound and no host read, run by ``_triton_solve.probe`` (one
Triton program per threshold; the CUDA path) or, where Triton does not run (the CPU backend's
device path, a GPU without Triton), by :func:`lockstep_probe` (the same steps as torch calls, the K
thresholds side by side). The step function is the device's form of the specification, not a
second one: the tests and the self-check compare it with ``reference.greedy_replicas`` bit for bit.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from . import reference
from .plan import Plan
from .solve import DEFAULT_MIN_QUOTA_DIVISOR, validate_solve_args

__all__ = [
    "device_solve",
    "device_min_quota",
    "lockstep_probe",
    "reference_probe",
    "search_rounds",
    "PROBES_PER_ROUND",
    "triton_available",
]

#: Thresholds probed side by side in one search round (one Triton program each on a GPU).
PROBES_PER_ROUND = 32
#: Order of a replica that does not exist (larger than any creation index).
NO_REPLICA = torch.iinfo(torch.int64).max
_BIG = torch.iinfo(torch.int64).max


def triton_available() -> bool:
    """Whether ``triton`` is installed (the CUDA path of ``device_solve``)."""
    return importlib.util.find_spec("triton") is not None


def search_rounds(num_ranks: int, probes: int = PROBES_PER_ROUND) -> int:
    """Rounds that narrow any search interval to one grid step.

    The grid has at most ``2048 * R`` steps: ``highest <= total <= R * lower`` and
    ``lower / resolution <= 2048``. A round over an interval of w steps leaves at most
    ``ceil((w - 1) / K)`` steps."""
    width, rounds = 2048 * num_ranks + 1, 0
    while width > 1:
        width = max(1, -(-(width - 1) // probes))
        rounds += 1
    return rounds


def max_probe_steps(num_ranks: int, num_slots: int) -> int:
    """A bound on the lockstep steps of one probe: every step creates a replica (at most R * S),
    tops one up (at most one more than the rank's replicas per rank: each top-up that does not end
    the rank exhausts a host's slack or an expert's load) or fails (once)."""
    return 2 * num_ranks * num_slots + num_ranks + 2


def reference_probe(
    taus: torch.Tensor,
    expert_load: torch.Tensor,
    rank_load: torch.Tensor,
    rank_order: torch.Tensor,
    min_quota: torch.Tensor,
    num_slots: int,
    domain_size: int,
    write_plan: bool = True,
):
    """The probe at K thresholds by the specification, ``reference.greedy_replicas``, one threshold
    after the other on the host (the tests' oracle and the self-check's reference; it reads its
    inputs on the host, so it is not the device path).

    Args:
        taus: int64 [K] thresholds.
        expert_load: int64 [E]; rank_load: int64 [R]; rank_order: int64 [R], ranks by descending
            load, ties by rank id (the greedy's own order: not read); min_quota: int64 0-dim.
    Returns:
        success bool [K]; main_left int64 [K, E] (quota of each main instance); rep_quota int64
        [K, E, R] (quota of the replica of e on t, 0 if none); rep_order int64 [K, E, R] (its
        creation index, ``NO_REPLICA`` if none), on ``taus``' device. The last three only with
        ``write_plan`` (else None), and meaningful only where ``success``. Every probe
        implementation returns this.
    """
    K, R, E = taus.shape[0], rank_load.shape[0], expert_load.shape[0]
    expert, ranks, floor = expert_load.tolist(), rank_load.tolist(), int(min_quota)
    success = torch.zeros(K, dtype=torch.bool)
    main_left = torch.tensor(expert, dtype=torch.int64).repeat(K, 1)
    rep_quota = torch.zeros((K, E, R), dtype=torch.int64)
    rep_order = torch.full((K, E, R), NO_REPLICA, dtype=torch.int64)
    for k, tau in enumerate(taus.tolist()):
        result = reference.greedy_replicas(
            tau, expert, ranks, E // R, num_slots, floor, domain_size
        )
        success[k] = result is not None
        if result is not None and write_plan:
            pieces, left = result
            main_left[k] = torch.tensor(left, dtype=torch.int64)
            for created, (e, t, quota) in enumerate(pieces):
                rep_quota[k, e, t], rep_order[k, e, t] = quota, created
    device = taus.device
    if not write_plan:
        return success.to(device), None, None, None
    return tuple(x.to(device) for x in (success, main_left, rep_quota, rep_order))


def lockstep_probe(
    taus: torch.Tensor,
    expert_load: torch.Tensor,
    rank_load: torch.Tensor,
    rank_order: torch.Tensor,
    min_quota: torch.Tensor,
    num_slots: int,
    domain_size: int,
    write_plan: bool = True,
):
    """The device's probe as torch calls, where Triton does not run (the CPU backend's device path,
    a GPU without Triton): the K probes of ``_triton_solve.probe`` side by side, each step one
    masked update of every probe's fixed-size state, a fixed number of steps
    (:func:`max_probe_steps`), no host read. Same contract and outputs as :func:`reference_probe`.
    """
    device = taus.device

    def arange(n):
        return torch.arange(n, device=device)

    def full(shape, value):
        return torch.full(shape, value, dtype=torch.int64, device=device)

    K, R, E = taus.shape[0], rank_load.shape[0], expert_load.shape[0]
    G, S, N = E // R, num_slots, domain_size
    ar, ag, ks = arange(R), arange(G), arange(K)
    tau = taus.reshape(K, 1)
    over = rank_load.reshape(1, R) > tau
    slack = torch.where(over, 0, tau - rank_load.reshape(1, R))  # [K, R]
    free = full((K, R), S)
    num_over = over.sum(1)  # [K]
    position = full((K,), -1)  # in rank_order
    rank = full((K,), 0)
    need = full((K,), 0)
    failed = torch.zeros(K, dtype=torch.bool, device=device)
    created = full((K,), 0)
    main_left_rank = full((K, G), 0)
    mine_quota = full((K, G, R), 0)
    mine_order = full((K, G, R), NO_REPLICA)
    if write_plan:
        main_left = expert_load.reshape(1, E).repeat(K, 1)
        rep_quota = full((K, E, R), 0)
        rep_order = full((K, E, R), NO_REPLICA)

    for _ in range(max_probe_steps(R, S)):
        active = ~failed & ((need > 0) | (position + 1 < num_over))
        # Next overloaded rank.
        advance = active & (need == 0)
        position = torch.where(advance, position + 1, position)
        rank = torch.where(advance, rank_order[torch.clamp(position, 0, R - 1)], rank)
        need = torch.where(advance, rank_load[rank] - taus, need)
        main_left_rank = torch.where(
            advance.reshape(K, 1),
            expert_load[rank.reshape(K, 1) * G + ag.reshape(1, G)],
            main_left_rank,
        )
        mine_quota = torch.where(advance.reshape(K, 1, 1), 0, mine_quota)
        mine_order = torch.where(advance.reshape(K, 1, 1), NO_REPLICA, mine_order)

        # 1. Top up one of this rank's replicas: the largest room, ties by creation order.
        has = mine_quota > 0
        room = torch.minimum(
            torch.minimum(need.reshape(K, 1, 1), slack.reshape(K, 1, R)),
            main_left_rank.reshape(K, G, 1),
        )
        room = torch.where(has, room, 0)
        best_room = room.amax((1, 2))
        top_order = torch.amin(
            torch.where(has & (room == best_room.reshape(K, 1, 1)), mine_order, NO_REPLICA), (1, 2)
        )
        top_cell = has & (mine_order == top_order.reshape(K, 1, 1))
        top_g = torch.where(top_cell, ag.reshape(1, G, 1), 0).sum((1, 2))
        top_t = torch.where(top_cell, ar.reshape(1, 1, R), 0).sum((1, 2))
        topping = best_room > 0

        # 2. Else a new replica of the rank's main expert with the most load left (lowest id).
        cap = torch.amax(main_left_rank, 1)
        new_g = torch.amin(torch.where(main_left_rank == cap.reshape(K, 1), ag.reshape(1, G), G), 1)
        row = mine_quota[ks, torch.clamp(new_g, 0, G - 1)]  # [K, R]
        hosts = (
            (ar.reshape(1, R) // N == (rank // N).reshape(K, 1))
            & (ar.reshape(1, R) != rank.reshape(K, 1))
            & (free > 0)
            & (slack >= min_quota)
            & (row == 0)
        )
        want = torch.maximum(torch.minimum(need, cap), min_quota)
        fitting = hosts & (slack >= want.reshape(K, 1))
        fit_slack = torch.amin(torch.where(fitting, slack, _BIG), 1)
        fit_t = torch.amin(
            torch.where(fitting & (slack == fit_slack.reshape(K, 1)), ar.reshape(1, R), R), 1
        )
        big_slack = torch.amax(torch.where(hosts, slack, -1), 1)
        big_t = torch.amin(
            torch.where(hosts & (slack == big_slack.reshape(K, 1)), ar.reshape(1, R), R), 1
        )
        new_t = torch.where(fit_t < R, fit_t, big_t)
        cannot = (cap < min_quota) | (big_t >= R)
        host_slack = slack[ks, torch.clamp(new_t, 0, R - 1)]
        host_free = free[ks, torch.clamp(new_t, 0, R - 1)]
        new_amount = torch.where(
            host_free == 1,
            torch.minimum(host_slack, cap),
            torch.minimum(torch.minimum(torch.maximum(need, min_quota), host_slack), cap),
        )

        creating = active & ~topping & ~cannot
        applying = active & (topping | ~cannot)
        failed = failed | (active & ~topping & cannot)
        t = torch.where(topping, top_t, new_t)
        g = torch.where(topping, top_g, new_g)
        amount = torch.where(applying, torch.where(topping, best_room, new_amount), 0)
        at_t = ar.reshape(1, R) == t.reshape(K, 1)
        at_g = ag.reshape(1, G) == g.reshape(K, 1)
        cell = at_g.reshape(K, G, 1) & at_t.reshape(K, 1, R)
        slack = slack - torch.where(at_t, amount.reshape(K, 1), 0)
        main_left_rank = main_left_rank - torch.where(at_g, amount.reshape(K, 1), 0)
        mine_quota = mine_quota + torch.where(cell, amount.reshape(K, 1, 1), 0)
        mine_order = torch.where(
            cell & creating.reshape(K, 1, 1), created.reshape(K, 1, 1), mine_order
        )
        free = free - torch.where(at_t & creating.reshape(K, 1), 1, 0)
        created = created + torch.where(creating, 1, 0)
        # Shedding more than the excess: the rank ends below tau and can host (the relay).
        overshoot = torch.where(applying & (amount >= need), amount - need, 0)
        slack = slack + torch.where(
            ar.reshape(1, R) == rank.reshape(K, 1), overshoot.reshape(K, 1), 0
        )
        need = torch.where(applying, torch.clamp(need - amount, 0), need)

        if write_plan:  # write through the current rank's state (idempotent)
            started = (position >= 0).reshape(K, 1)
            kk = ks.reshape(K, 1)
            rows = rank.reshape(K, 1) * G + ag.reshape(1, G)  # [K, G]
            main_left[kk, rows] = torch.where(started, main_left_rank, main_left[kk, rows])
            started = started.reshape(K, 1, 1)
            rep_quota[kk, rows] = torch.where(started, mine_quota, rep_quota[kk, rows])
            rep_order[kk, rows] = torch.where(started, mine_order, rep_order[kk, rows])
    if not write_plan:
        return ~failed, None, None, None
    return ~failed, main_left, rep_quota, rep_order


def _probe(
    implementation: str,
    taus,
    expert_load,
    rank_load,
    rank_order,
    min_quota,
    num_slots,
    domain_size,
    write_plan,
):
    if implementation == "triton":
        from . import _triton_solve

        return _triton_solve.probe(
            taus, expert_load, rank_load, rank_order, min_quota, num_slots, domain_size, write_plan
        )
    probe = lockstep_probe if implementation == "torch" else reference_probe
    return probe(
        taus, expert_load, rank_load, rank_order, min_quota, num_slots, domain_size, write_plan
    )


def search_threshold(
    expert_load: torch.Tensor,
    rank_load: torch.Tensor,
    rank_order: torch.Tensor,
    lower: torch.Tensor,
    min_quota: torch.Tensor,
    num_slots: int,
    domain_size: int,
    implementation: str,
    probes: int = PROBES_PER_ROUND,
) -> torch.Tensor:
    """The threshold the planner plans for (0-dim int64 tensor): the first feasible grid point of
    the last search interval (the initial max rank load when nothing is feasible below it)."""
    device = expert_load.device
    R = rank_load.shape[0]
    highest = rank_load.max()
    if num_slots == 0 or R == 1:
        return highest
    resolution = (lower >> 10).clamp(min=1)
    # Grid index k <-> threshold min(lower + k * resolution, highest); k = steps is feasible.
    steps = (-((lower - highest) // resolution)).clamp(min=0)
    bad = torch.full((), -1, dtype=torch.int64, device=device)
    good = steps
    index = torch.arange(probes, device=device)
    for _ in range(search_rounds(R, probes)):
        width = good - bad
        converged = width <= 1
        ks = bad + 1 + ((width - 1) * index) // probes
        taus = torch.where(converged, highest, torch.minimum(lower + ks * resolution, highest))
        success = _probe(
            implementation,
            taus,
            expert_load,
            rank_load,
            rank_order,
            min_quota,
            num_slots,
            domain_size,
            write_plan=False,
        )[0]
        first = torch.where(success, index, probes).amin()
        found = first < probes
        # Gathers, not ks[first]: indexing with a 0-dim tensor reads it on the host.
        first_k = ks.gather(0, first.clamp(max=probes - 1).view(1)).view(())
        before_k = ks.gather(0, (first - 1).clamp(min=0).view(1)).view(())
        new_good = torch.where(found, first_k, good)
        new_bad = torch.where(found, torch.where(first > 0, before_k, bad), ks[probes - 1])
        good = torch.where(converged, good, new_good)
        bad = torch.where(converged, bad, new_bad)
    return torch.minimum(lower + good * resolution, highest)


def build_plan(
    load: torch.Tensor,
    num_slots: int,
    main_left: torch.Tensor,
    rep_quota: torch.Tensor,
    rep_order: torch.Tensor,
) -> Plan:
    """The Plan of one probe's replicas (tensor operations only).

    main_left [E], rep_quota [E, R], rep_order [E, R] (creation index, NO_REPLICA if none)."""
    device = load.device
    R, E = load.shape
    G, S = E // R, num_slots
    P = G + S
    ar = torch.arange(R, device=device)
    experts = torch.arange(E, device=device)
    home = experts // G
    is_main = home.view(E, 1) == ar.view(1, R)  # [E, R]
    quota = torch.where(is_main, main_left.view(E, 1), rep_quota)

    # Redundant slots of a host are filled in creation order.
    order, expert_by_order = torch.sort(rep_order, dim=0, stable=True)  # [E, R]
    slot_expert = torch.full((R, S), -1, dtype=torch.int64, device=device)
    filled = min(S, E)
    if filled:
        taken = order[:filled] != NO_REPLICA
        slot_expert[:, :filled] = torch.where(taken, expert_by_order[:filled], -1).t()

    # Reroute: a host's own tokens use its instance first; then the remaining demand of the
    # sources (rank order) fills the remaining quotas of the instances (rank order). Source s
    # sends to instance (e, t) the overlap of its demand interval with the instance's quota
    # interval on the cumulative axis, computed per physical slot: [R, R * P], not [E, R, R].
    demand = load.t()  # [E, R] by source
    instance = is_main | (rep_order != NO_REPLICA)
    local = torch.where(instance, torch.minimum(demand, quota), 0)  # [E, R]
    demand_left = demand - local
    quota_left = quota - local
    demand_hi = demand_left.cumsum(1)
    quota_hi = quota_left.cumsum(1)
    demand_lo, quota_lo = demand_hi - demand_left, quota_hi - quota_left
    mains = experts.view(R, G)
    slot_owner = torch.cat([mains, slot_expert], dim=1).reshape(R * P)  # -1: empty slot
    holder = torch.arange(R * P, device=device) // P  # rank of each physical slot
    e = slot_owner.clamp(min=0)
    overlap = (
        torch.minimum(demand_hi[e].t(), quota_hi[e, holder].view(1, R * P))
        - torch.maximum(demand_lo[e].t(), quota_lo[e, holder].view(1, R * P))
    ).clamp(min=0)
    own = ar.view(R, 1) == holder.view(1, R * P)  # source is the holder
    physical = torch.where(
        slot_owner.view(1, R * P) >= 0, overlap + own * local[e, holder].view(1, R * P), 0
    )
    threshold = quota.sum(0).max()
    return Plan(slot_expert, quota, physical, threshold)


def device_min_quota(total: torch.Tensor, num_ranks: int, min_quota: int | None) -> torch.Tensor:
    """The quota floor as a 0-dim int64 tensor on ``total``'s device: ``min_quota``, or
    ``solve.default_min_quota`` (``max(1, ceil(total / (100 R)))``) of the 0-dim ``total``."""
    if min_quota is not None:
        return torch.full((), min_quota, dtype=torch.int64, device=total.device)
    return (-(-total // (DEFAULT_MIN_QUOTA_DIVISOR * num_ranks))).clamp(min=1)


def probe_inputs(load: torch.Tensor, min_quota: int | None, domain_size: int):
    """What every probe reads, from ``load`` int64 [R, E] (device tensors, no host read):
    expert_load [E], rank_load [R], rank_order [R] (descending load, ties by rank id), lower
    (0-dim: the domain bound ``max_d ceil(total_d / N)``), min_quota (0-dim: the given floor or
    ``max(1, ceil(total / (100 R)))``)."""
    R, E = load.shape
    N = domain_size
    expert_load = load.sum(0)
    rank_load = expert_load.view(R, E // R).sum(1)
    floor = device_min_quota(rank_load.sum(), R, min_quota)
    lower = (-(-rank_load.view(R // N, N).sum(1) // N)).max()
    rank_order = torch.sort(rank_load, descending=True, stable=True).indices
    return expert_load, rank_load, rank_order, lower, floor


def device_solve(
    load: torch.Tensor,
    num_slots: int,
    *,
    min_quota: int | None = None,
    domain_size: int | None = None,
    implementation: Literal["auto", "triton", "reference", "torch"] = "auto",
) -> Plan:
    """Replication and reroute plan for the exact load of one MoE layer, on ``load``'s device.

    Same arguments and plan meaning as ``solve`` (docs/planner.md); the plan is the device
    planner's (``Device planner``), not ``solve``'s bit for bit.

    Args:
        load: int64 [R, E] on any device. Negative entries are checked on CPU only (checking a
            device tensor would read it on the host).
        num_slots: S >= 0; min_quota: int >= 1 or None (1 % of the mean rank load, computed on
            the device); domain_size: N dividing R, or None.
        implementation: who runs the probe (module docstring): "triton" (CUDA tensors; CPU
            tensors under ``TRITON_INTERPRET=1``), "torch" (:func:`lockstep_probe`, any device, a
            CPU load included: fixed step counts, no host read, what a device runs without
            Triton), "reference" (the specification on the host: a CPU load, or a device load read
            on the host) or "auto" (triton for a CUDA load when triton is installed, reference for
            a CPU load, else torch). Same plan bit for bit.

    Returns:
        A ``Plan`` whose tensors, ``threshold`` included (0-dim int64), live on ``load``'s device.
    """
    R, E, num_slots, min_quota, N = validate_solve_args(load, num_slots, min_quota, domain_size)
    if implementation == "auto":
        implementation = (
            "triton"
            if load.is_cuda and triton_available()
            else "reference"
            if load.device.type == "cpu"
            else "torch"
        )
    if implementation not in ("triton", "reference", "torch"):
        raise ValueError(
            f"implementation must be 'auto', 'triton', 'reference' or 'torch', "
            f"got {implementation!r}"
        )
    if implementation == "reference" and load.device.type == "cpu" and bool((load < 0).any()):
        raise ValueError("load has negative entries")

    load = load.contiguous()
    expert_load, rank_load, rank_order, lower, floor = probe_inputs(load, min_quota, N)
    tau = search_threshold(
        expert_load, rank_load, rank_order, lower, floor, num_slots, N, implementation
    )
    _, main_left, rep_quota, rep_order = _probe(
        implementation,
        tau.view(1),
        expert_load,
        rank_load,
        rank_order,
        floor,
        num_slots,
        N,
        write_plan=True,
    )
    return build_plan(load, num_slots, main_left[0], rep_quota[0], rep_order[0])
