"""Compiled (numba) solve of the quota-driven planner; ``solve`` uses it by default.

It implements exactly the algorithm of ``reference.py`` (same searches, same tie-breaks, same
output bit for bit; ``tests/planner`` checks that), restructured for speed: flat preallocated
arrays instead of lists, a compact list of candidate hosts instead of a scan over all ranks,
no integer division inside R x E loops. Read ``reference.py`` (or ``docs/planner.md``) for the
algorithm; comments here cover only what differs.

Everything is int64 on numpy arrays, so one call is one compiled function with no interpreter work
inside. ``cache=True`` stores the machine code next to this file (or in numba's user cache dir
when that is read-only), so a fresh process loads it instead of compiling again.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Status codes returned to ``planner.solve`` (which raises the ValueError).
OK = 0
NEGATIVE_LOAD = 1


@njit(cache=True, nogil=True)
def _probe(
    tau,
    expert_load,
    rank_load,
    experts_per_rank,
    num_slots,
    min_quota,
    domain_size,
    slack,
    free_slots,
    main_left,
    bins,
    hosts,
    domain_hosts,
    piece_expert,
    piece_rank,
    piece_quota,
):
    """Greedy feasibility oracle for threshold ``tau`` (reference.greedy_replicas).

    Fills piece_* (replica expert, host rank, quota) and ``main_left`` (main-instance quota);
    returns the number of replicas, or -1 if the greedy cannot bring every rank to ``tau``.
    ``slack``, ``free_slots``, ``bins``, ``hosts`` are scratch arrays of length R,
    ``domain_hosts`` of length R // domain_size. A rank only ever deals with hosts of its own
    domain d, kept in d's segment of ``hosts``: ``hosts[d*N : d*N + domain_hosts[d]]`` are the
    domain's ranks with a free slot and slack >= min_quota, in any order (host choice breaks ties
    by rank id, never by position).
    """
    R = rank_load.shape[0]
    G = experts_per_rank
    N = domain_size
    num_bins = 0
    for d in range(R // N):
        domain_hosts[d] = 0
        for r in range(d * N, d * N + N):
            free_slots[r] = num_slots
            if rank_load[r] > tau:
                slack[r] = 0
                bins[num_bins] = r
                num_bins += 1
            else:
                slack[r] = tau - rank_load[r]
                if slack[r] >= min_quota:
                    hosts[d * N + domain_hosts[d]] = r
                    domain_hosts[d] += 1
    for e in range(expert_load.shape[0]):
        main_left[e] = expert_load[e]
    # Overloaded ranks by descending load, ties by rank id (insertion sort: stable, few bins).
    for i in range(1, num_bins):
        r = bins[i]
        j = i - 1
        while j >= 0 and rank_load[bins[j]] < rank_load[r]:
            bins[j + 1] = bins[j]
            j -= 1
        bins[j + 1] = r

    n = 0
    for b in range(num_bins):
        r = bins[b]
        d = r // N
        base = d * N  # r's domain's hosts: hosts[base : base + num_hosts]
        num_hosts = domain_hosts[d]
        need = rank_load[r] - tau
        first = n  # this rank's replicas are pieces [first, n)
        while need > 0:
            # 1. Top up one of this rank's replicas (costs no slot).
            best_i = -1
            best_amount = 0
            for i in range(first, n):
                amount = min(need, slack[piece_rank[i]], main_left[piece_expert[i]])
                if amount > best_amount:
                    best_amount = amount
                    best_i = i
            if best_i >= 0:
                t = piece_rank[best_i]
                piece_quota[best_i] += best_amount
                slack[t] -= best_amount
                main_left[piece_expert[best_i]] -= best_amount
                need -= best_amount
                if slack[t] < min_quota:
                    for h in range(base, base + num_hosts):
                        if hosts[h] == t:
                            num_hosts -= 1
                            hosts[h] = hosts[base + num_hosts]
                            break
                continue
            # 2. New replica of the main expert with the most load left.
            e = r * G
            for x in range(r * G + 1, r * G + G):
                if main_left[x] > main_left[e]:
                    e = x
            cap = main_left[e]
            if cap < min_quota:
                return -1
            want = max(min(need, cap), min_quota)
            fit_h = -1
            big_h = -1
            for h in range(base, base + num_hosts):
                t = hosts[h]
                dup = False
                for i in range(first, n):
                    if piece_rank[i] == t and piece_expert[i] == e:
                        dup = True
                        break
                if dup:
                    continue
                s = slack[t]
                if s >= want and (
                    fit_h < 0
                    or s < slack[hosts[fit_h]]
                    or (s == slack[hosts[fit_h]] and t < hosts[fit_h])
                ):
                    fit_h = h
                if (
                    big_h < 0
                    or s > slack[hosts[big_h]]
                    or (s == slack[hosts[big_h]] and t < hosts[big_h])
                ):
                    big_h = h
            if big_h < 0:
                return -1
            h = fit_h if fit_h >= 0 else big_h
            t = hosts[h]
            if free_slots[t] == 1:
                amount = min(slack[t], cap)
            else:
                amount = min(max(need, min_quota), slack[t], cap)
            piece_expert[n] = e
            piece_rank[n] = t
            piece_quota[n] = amount
            n += 1
            free_slots[t] -= 1
            slack[t] -= amount
            main_left[e] -= amount
            if free_slots[t] == 0 or slack[t] < min_quota:
                num_hosts -= 1
                hosts[h] = hosts[base + num_hosts]
            if amount >= need:
                slack[r] += amount - need  # over-shed: r becomes a host
                need = 0
                if slack[r] >= min_quota:
                    hosts[base + num_hosts] = r
                    num_hosts += 1
            else:
                need -= amount
        domain_hosts[d] = num_hosts
    return n


@njit(cache=True, nogil=True)
def solve_arrays(load, num_slots, min_quota, min_quota_divisor, domain_size):
    """Plan for ``load`` int64 [R, E] (reference.solve_arrays).

    Returns (status, slot_expert [R, S], quota [E, R], physical_split [R, R * (E//R + S)],
    threshold). ``min_quota`` is an int >= 1, or 0 for the default (computed here, where the total
    is at hand: ``max(1, ceil(total / (min_quota_divisor * R)))``). ``domain_size`` divides R.
    """
    R, E = load.shape
    G = E // R
    S = num_slots
    P = G + S
    expert_load = np.zeros(E, np.int64)
    for s in range(R):
        for e in range(E):
            v = load[s, e]
            if v < 0:
                return (
                    NEGATIVE_LOAD,
                    np.empty((0, 0), np.int64),
                    np.empty((0, 0), np.int64),
                    np.empty((0, 0), np.int64),
                    0,
                )
            expert_load[e] += v
    rank_load = np.zeros(R, np.int64)
    total = 0
    for r in range(R):
        for j in range(G):
            rank_load[r] += expert_load[r * G + j]
        total += rank_load[r]
    max_rank_load = 0
    for r in range(R):
        max_rank_load = max(max_rank_load, rank_load[r])
    N = domain_size
    lower = 0  # reference.domain_lower_bound
    for d in range(R // N):
        domain_total = 0
        for r in range(d * N, d * N + N):
            domain_total += rank_load[r]
        lower = max(lower, -(-domain_total // N))
    if min_quota == 0:
        min_quota = max(1, -(-total // (min_quota_divisor * R)))

    slack = np.empty(R, np.int64)
    free_slots = np.empty(R, np.int64)
    bins = np.empty(R, np.int64)
    hosts = np.empty(R, np.int64)
    domain_hosts = np.empty(R // N, np.int64)
    main_left = np.empty(E, np.int64)
    cap_pieces = max(R * min(S, E), 1)  # each replica takes a slot; a rank holds < E distinct
    piece_expert = np.empty(cap_pieces, np.int64)
    piece_rank = np.empty(cap_pieces, np.int64)
    piece_quota = np.empty(cap_pieces, np.int64)

    # Threshold search (reference.search_threshold): probe the lower bound, else gallop upward
    # and bisect down to ``resolution``; finally re-probe the best threshold if the last probe was
    # another one. Written as one loop so that _probe has a single call site (faster compile).
    n = 0
    good = max_rank_load
    if S > 0 and R > 1 and lower < max_rank_load:
        resolution = max(1, lower >> 10)
        bad = lower
        tau = lower
        step = 0
        galloping = True
        final = False
        while True:
            n = _probe(
                tau,
                expert_load,
                rank_load,
                G,
                S,
                min_quota,
                N,
                slack,
                free_slots,
                main_left,
                bins,
                hosts,
                domain_hosts,
                piece_expert,
                piece_rank,
                piece_quota,
            )
            if final:
                break
            if n >= 0:
                good = tau
                if tau == lower:
                    break
                galloping = False
            else:
                bad = tau
                if galloping:
                    step = resolution if step == 0 else step * 2
                    if bad + step < max_rank_load:
                        tau = bad + step
                        continue
                    galloping = False
            if good - bad <= resolution:
                if good == tau or good == max_rank_load:
                    break
                tau = good  # the buffers hold a failed probe: redo the best one
                final = True
                continue
            tau = (bad + good) // 2
    if good == max_rank_load:  # no balancing possible or needed: the identity plan
        n = 0
        for e in range(E):
            main_left[e] = expert_load[e]

    # Materialize: redundant slots filled in creation order per host rank; quotas.
    slot_expert = np.full((R, S), -1, np.int64)
    quota = np.zeros((E, R), np.int64)
    used = np.zeros(R, np.int64)
    piece_slot = np.empty(cap_pieces, np.int64)
    num_replicas = np.zeros(E, np.int64)
    rank_after = np.zeros(R, np.int64)
    for r in range(R):
        for j in range(G):
            quota[r * G + j, r] = main_left[r * G + j]
            rank_after[r] += main_left[r * G + j]
    for i in range(n):
        t = piece_rank[i]
        slot_expert[t, used[t]] = piece_expert[i]
        piece_slot[i] = t * P + G + used[t]
        used[t] += 1
        quota[piece_expert[i], t] = piece_quota[i]
        num_replicas[piece_expert[i]] += 1
        rank_after[t] += piece_quota[i]
    threshold = 0
    for t in range(R):
        threshold = max(threshold, rank_after[t])

    # Reroute (reference.reroute). Every expert's tokens first go to its main instance; the
    # replicated experts are then redone: local quota first, then sources in rank order fill the
    # instances in rank order.
    physical_split = np.zeros((R, R * P), np.int64)
    for s in range(R):
        for r in range(R):
            for j in range(G):
                physical_split[s, r * P + j] = load[s, r * G + j]
    # Instances of each replicated expert, sorted by rank: offsets into inst_rank/inst_slot.
    offset = np.zeros(E + 1, np.int64)
    for e in range(E):
        offset[e + 1] = offset[e] + (num_replicas[e] + 1 if num_replicas[e] > 0 else 0)
    inst_rank = np.empty(offset[E], np.int64)
    inst_slot = np.empty(offset[E], np.int64)
    fill = np.zeros(E, np.int64)
    for e in range(E):
        if num_replicas[e] > 0:
            inst_rank[offset[e]] = e // G
            inst_slot[offset[e]] = (e // G) * P + e % G
            fill[e] = 1
    for i in range(n):
        e = piece_expert[i]
        k = offset[e] + fill[e]
        while k > offset[e] and inst_rank[k - 1] > piece_rank[i]:  # insertion by rank
            inst_rank[k] = inst_rank[k - 1]
            inst_slot[k] = inst_slot[k - 1]
            k -= 1
        inst_rank[k] = piece_rank[i]
        inst_slot[k] = piece_slot[i]
        fill[e] += 1
    local_taken = np.zeros(R, np.int64)  # scratch: tokens of source s already on its instance
    residual = np.empty(R + 1, np.int64)
    for e in range(E):
        if num_replicas[e] == 0:
            continue
        lo, hi = offset[e], offset[e + 1]
        main = (e // G) * P + e % G
        for s in range(R):
            physical_split[s, main] = 0
        for k in range(lo, hi):
            t = inst_rank[k]
            local = min(load[t, e], quota[e, t])
            physical_split[t, inst_slot[k]] = local
            local_taken[t] = local
            residual[k - lo] = quota[e, t] - local
        k = lo
        for s in range(R):
            demand = load[s, e] - local_taken[s]
            while demand > 0:
                while residual[k - lo] == 0:
                    k += 1
                take = min(demand, residual[k - lo])
                physical_split[s, inst_slot[k]] += take
                residual[k - lo] -= take
                demand -= take
        for k2 in range(lo, hi):
            local_taken[inst_rank[k2]] = 0
    return OK, slot_expert, quota, physical_split, threshold
