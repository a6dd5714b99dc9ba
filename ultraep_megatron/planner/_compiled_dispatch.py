"""Compiled (numba) kernels of the per-rank dispatch and the plan metrics: they run per layer and
microbatch between the load's arrival on the host and the reroute (``dispatch.py``, ``metrics.py``).

Everything is int64 on numpy arrays; ``cache=True`` as in ``_compiled_solve.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_INT64_MAX = np.iinfo(np.int64).max


@njit(cache=True, nogil=True)
def dispatch_arrays(physical_split, slot_expert, load, rank, rows_per_source_slot, rows_per_slot,
                    input_splits, output_splits, reroute_table):
    """One rank's dispatch metadata of a plan, into the given arrays (planner.rank_dispatch).

    physical_split [R, R * P], slot_expert [R, S], load [R, E] -> rows_per_source_slot [R, P],
    rows_per_slot [P], input_splits [R], output_splits [R], reroute_table [4, E * R + 1]. A
    rank's later slot of an expert wins over an earlier one (there is none in a valid plan).
    """
    R, E = load.shape
    S = slot_expert.shape[1]
    G = E // R
    P = G + S
    for j in range(P):
        rows_per_slot[j] = 0
    for s in range(R):
        total = 0
        for j in range(P):
            rows = physical_split[s, rank * P + j]
            rows_per_source_slot[s, j] = rows
            rows_per_slot[j] += rows
            total += rows
        output_splits[s] = total
    for t in range(R):
        total = 0
        for j in range(P):
            total += physical_split[rank, t * P + j]
        input_splits[t] = total
    # Rows 0 and 1, expert-major and instance rank minor: what this rank sends to each instance
    # (then its running total) and the instance's physical slot (0 where there is none).
    for i in range(E * R):
        reroute_table[0, i] = 0
        reroute_table[1, i] = 0
    for e in range(E):
        home = e // G
        slot = home * P + e - home * G
        reroute_table[0, e * R + home] = physical_split[rank, slot]
        reroute_table[1, e * R + home] = slot
    for t in range(R):
        for j in range(S):
            e = slot_expert[t, j]
            if e >= 0:
                slot = t * P + G + j
                reroute_table[0, e * R + t] = physical_split[rank, slot]
                reroute_table[1, e * R + t] = slot
    total = 0
    for i in range(E * R):
        total += reroute_table[0, i]
        reroute_table[0, i] = total
    reroute_table[0, E * R] = _INT64_MAX
    reroute_table[1, E * R] = R * P
    # Row 2: each expert's first expert-major position of this rank's pairs, minus one.
    total = 0
    for e in range(E):
        reroute_table[2, e] = total - 1
        total += load[rank, e]
    for i in range(E, E * R + 1):
        reroute_table[2, i] = 0
    # Row 3: the row of this rank's send buffer (physical-slot-major, the all-to-all's input) that
    # an instance's first pair fills, minus that pair's expert-major position; past the last
    # instance, a value that puts every position past the buffer and its spare row.
    slot_row = np.empty(R * P, np.int64)
    row = 0
    for slot in range(R * P):
        slot_row[slot] = row
        row += physical_split[rank, slot]
    begin = 0
    for i in range(E * R):
        reroute_table[3, i] = slot_row[reroute_table[1, i]] - begin
        begin = reroute_table[0, i]
    reroute_table[3, E * R] = total + 1


@njit(cache=True, nogil=True)
def metric_arrays(load, quota, slot_expert, physical_split, domain_size):
    """The integer figures behind planner.metrics, int64 [10]: max rank load before (experts at
    home) and after (quotas), total load, total quota, replicas, most replicas of one expert, most
    replicas of one rank's main experts, replicas outside their home's domain, tokens computed on
    their source rank, smallest replica quota (-1 without replicas)."""
    R, E = load.shape
    S = slot_expert.shape[1]
    G = E // R
    P = G + S
    out = np.zeros(10, np.int64)
    before = np.zeros(R, np.int64)  # rank loads, experts at home
    after = np.zeros(R, np.int64)  # rank loads under the quotas
    for s in range(R):  # row-major passes over load [R, E] and quota [E, R]
        for r in range(R):
            for j in range(G):
                before[r] += load[s, r * G + j]
    for e in range(E):
        for t in range(R):
            after[t] += quota[e, t]
    total = 0
    max_before = 0
    total_quota = 0
    max_after = 0
    for r in range(R):
        total += before[r]
        max_before = max(max_before, before[r])
        total_quota += after[r]
        max_after = max(max_after, after[r])
    per_expert = np.zeros(E, np.int64)
    replicas = 0
    cross = 0
    min_quota = -1
    for t in range(R):
        for j in range(S):
            e = slot_expert[t, j]
            if e < 0:
                continue
            replicas += 1
            per_expert[e] += 1
            if t // domain_size != e // (G * domain_size):
                cross += 1
            if min_quota < 0 or quota[e, t] < min_quota:
                min_quota = quota[e, t]
    max_per_expert = 0
    max_per_home = 0
    for r in range(R):
        home = 0
        for j in range(G):
            max_per_expert = max(max_per_expert, per_expert[r * G + j])
            home += per_expert[r * G + j]
        max_per_home = max(max_per_home, home)
    local = 0
    for s in range(R):
        for j in range(P):
            local += physical_split[s, s * P + j]
    out[0], out[1], out[2], out[3], out[4] = max_before, max_after, total, total_quota, replicas
    out[5], out[6], out[7], out[8], out[9] = max_per_expert, max_per_home, cross, local, min_quota
    return out
