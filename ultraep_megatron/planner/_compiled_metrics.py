"""Compiled (numba) kernel of the plan metrics (``metrics.py``): the integer figures of a plan in one
pass. Everything is int64 on numpy arrays; ``cache=True`` as in ``_compiled_solve.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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
