"""Readable reference implementation of the quota-driven planner (plain Python, no numba).

The one specification of the greedy: ``solve(..., implementation="reference")`` runs it whole.
Each device's fast path answers it bit for bit: the compiled pass of ``_compiled_solve.py`` on the
host, the fused Triton kernel of ``triton_plan.py`` on CUDA (``fused_plan.plan_invocation``); the
tests check both against it. About 1000x slower than the compiled pass: use it for small loads.

The algorithm (details and rationale in ``docs/planner.md``):

NVLink domains: with ``domain_size`` N, ranks ``[d*N, (d+1)*N)`` form domain d and a replica of
expert e may only be hosted in its home's domain. The load of domain d's experts then stays on its
N ranks, so no plan beats ``lower = max_d ceil(total_d / N)``; the oracle below only offers hosts of
the shedding rank's domain. One threshold for all domains: a domain below it needs no replica
(lowering a rank that is not the busiest does not shorten the layer). N = R is the plain planner.

1. Threshold search. ``lower = ceil(total / R)`` (no plan beats the average; with domains the
   bound above). Probe ``lower``; if
   the greedy oracle fails, gallop upward in steps ``resolution, 2*resolution, 4*resolution, ...``
   until a probe succeeds, then bisect down to ``resolution = max(1, lower >> 10)`` (0.1 % of the
   mean rank load). The maximum initial rank load is always feasible (no replicas).
2. Oracle ``greedy_replicas(tau)``: overloaded ranks, by descending load, shed their excess
   ``load - tau`` into replicas of their own main experts:
   a. top up a replica this rank already placed, if its host still has slack (no new slot);
   b. else create a replica of the rank's main expert with the most load left, on the host that
      best fits the remaining excess (smallest slack >= it), or if none fits on the host with the
      largest slack. Hosts are in the rank's domain and need a free slot, slack >= min_quota, and
      no instance of the expert.
      A replica takes ``max(min(excess, load left), min_quota)`` tokens, clipped to the host's
      slack and the load left; when it fills the host's *last* slot it takes all it can
      (``min(slack, load left)``), since slack behind a full rank would be stranded.
   Shedding more than the excess is allowed: the rank then ends below ``tau`` and becomes a host
   itself (its slots are free). This relay is what lets the greedy reach the average bound with
   one slot per rank, and what satisfies ``min_quota`` when the last bit of excess is small.
3. Reroute: for each expert, every host rank's own tokens use its local instance first; the
   remaining tokens of sources (in rank order) fill the remaining quotas of instances (in rank
   order). Integer, exact, and each source talks to few instances.
"""

from __future__ import annotations

import numpy as np


def greedy_replicas(
    tau: int,
    expert_load: list[int],
    rank_load: list[int],
    experts_per_rank: int,
    num_slots: int,
    min_quota: int,
    domain_size: int,
):
    """Greedy oracle: can every rank be brought to at most ``tau`` tokens (replicas inside the
    shedding rank's domain of ``domain_size`` ranks)?

    Returns ``(pieces, main_left)`` — ``pieces`` a list of ``[expert, host_rank, quota]`` in
    creation order and ``main_left[e]`` the quota left on expert e's main instance — or None.
    """
    R, G = len(rank_load), experts_per_rank
    slack = [max(tau - load, 0) for load in rank_load]
    free_slots = [num_slots] * R
    main_left = list(expert_load)
    pieces: list[list[int]] = []
    overloaded = sorted((r for r in range(R) if rank_load[r] > tau), key=lambda r: -rank_load[r])
    for r in overloaded:
        need = rank_load[r] - tau
        mine: list[list[int]] = []  # this rank's replicas, in creation order
        while need > 0:

            def top_up_room(piece):
                return min(need, slack[piece[1]], main_left[piece[0]])

            piece = max(mine, key=top_up_room, default=None)
            if piece is not None and top_up_room(piece) > 0:
                e, t, amount = piece[0], piece[1], top_up_room(piece)
                piece[2] += amount
            else:
                e = max(range(r * G, r * G + G), key=lambda x: main_left[x])
                cap = main_left[e]
                if cap < min_quota:
                    return None
                want = max(min(need, cap), min_quota)
                hosts = [
                    t
                    for t in range(R)
                    if t != r
                    and t // domain_size == r // domain_size
                    and free_slots[t] > 0
                    and slack[t] >= min_quota
                    and (e, t) not in {(p[0], p[1]) for p in mine}
                ]
                if not hosts:
                    return None
                fitting = [t for t in hosts if slack[t] >= want]
                if fitting:
                    t = min(fitting, key=lambda x: slack[x])
                else:
                    t = max(hosts, key=lambda x: slack[x])
                if free_slots[t] == 1:
                    amount = min(slack[t], cap)
                else:
                    amount = min(max(need, min_quota), slack[t], cap)
                piece = [e, t, amount]
                mine.append(piece)
                pieces.append(piece)
                free_slots[t] -= 1
            slack[t] -= amount
            main_left[e] -= amount
            if amount >= need:
                slack[r] += amount - need  # shed more than needed: r can host replicas now
                need = 0
            else:
                need -= amount
    return pieces, main_left


def domain_lower_bound(rank_load: list[int], domain_size: int) -> int:
    """``max_d ceil(total_d / N)``: no plan keeping replicas inside domains beats it."""
    N = domain_size
    return max(-(-sum(rank_load[d : d + N]) // N) for d in range(0, len(rank_load), N))


def search_threshold(
    expert_load: list[int],
    rank_load: list[int],
    experts_per_rank: int,
    num_slots: int,
    min_quota: int,
    domain_size: int,
):
    """Smallest threshold the oracle reaches (to ``resolution``); returns (pieces, main_left)."""
    R = len(rank_load)
    identity = ([], list(expert_load))
    lower, highest = domain_lower_bound(rank_load, domain_size), max(rank_load)
    if num_slots == 0 or R == 1 or lower >= highest:
        return identity

    def oracle(tau):
        return greedy_replicas(
            tau, expert_load, rank_load, experts_per_rank, num_slots, min_quota, domain_size
        )

    result = oracle(lower)
    if result is not None:
        return result
    resolution = max(1, lower >> 10)
    bad, good, best, step = lower, highest, identity, resolution
    while bad + step < highest:
        result = oracle(bad + step)
        if result is not None:
            good, best = bad + step, result
            break
        bad, step = bad + step, step * 2
    while good - bad > resolution:
        mid = (bad + good) // 2
        result = oracle(mid)
        if result is not None:
            good, best = mid, result
        else:
            bad = mid
    return best


def reroute(
    load: np.ndarray, quota: np.ndarray, instance_slot: np.ndarray, num_physical: int
) -> np.ndarray:
    """Source-to-physical-slot token counts realizing ``quota``.

    load [R, E], quota [E, R], instance_slot [E, R] (physical slot of e's instance on rank t, -1
    if none) -> int64 [R, num_physical].
    """
    R, E = load.shape
    split = np.zeros((R, num_physical), np.int64)
    for e in range(E):
        hosts = [t for t in range(R) if instance_slot[e, t] >= 0]
        demand = [int(x) for x in load[:, e]]
        residual = {}
        for t in hosts:  # locality: a host's own tokens use its own instance first
            local = min(demand[t], int(quota[e, t]))
            split[t, instance_slot[e, t]] = local
            demand[t] -= local
            residual[t] = int(quota[e, t]) - local
        open_hosts = [t for t in hosts if residual[t] > 0]  # rank order
        for s in range(R):
            while demand[s] > 0:
                t = open_hosts[0]
                take = min(demand[s], residual[t])
                split[s, instance_slot[e, t]] += take
                demand[s] -= take
                residual[t] -= take
                if residual[t] == 0:
                    open_hosts.pop(0)
    return split


def solve_arrays(load: np.ndarray, num_slots: int, min_quota: int, domain_size: int):
    """Same contract as ``_compiled_solve.solve_arrays`` (without the status code; input is valid).

    load int64 [R, E] -> (slot_expert [R, S], quota [E, R], physical_split [R, R*(E//R+S)],
    threshold).
    """
    R, E = load.shape
    G = E // R
    expert_load = [int(x) for x in load.sum(0)]
    rank_load = [sum(expert_load[r * G : (r + 1) * G]) for r in range(R)]
    pieces, main_left = search_threshold(
        expert_load, rank_load, G, num_slots, min_quota, domain_size
    )

    slot_expert = np.full((R, num_slots), -1, np.int64)
    quota = np.zeros((E, R), np.int64)
    instance_slot = np.full((E, R), -1, np.int64)
    for e in range(E):
        home = e // G
        quota[e, home] = main_left[e]
        instance_slot[e, home] = home * (G + num_slots) + (e - home * G)
    used = [0] * R
    for e, t, amount in pieces:
        slot_expert[t, used[t]] = e
        instance_slot[e, t] = t * (G + num_slots) + G + used[t]
        used[t] += 1
        quota[e, t] = amount
    split = reroute(load, quota, instance_slot, R * (G + num_slots))
    return slot_expert, quota, split, int(quota.sum(0).max())
