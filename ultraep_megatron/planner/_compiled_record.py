"""Compiled (numba) packing of a host plan into one rank's plan record and reroute table
(``record_layout.py`` documents both): the host planner's half of the layout the fused device
kernel writes. ``cache=True`` as in ``_compiled_solve.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .plan import Plan
from .record_layout import (
    H_BALANCED,
    H_CROSS_DOMAIN,
    H_DOMAIN_SIZE,
    H_LOCAL,
    H_MAX_BEFORE,
    H_MAX_PER_EXPERT,
    H_MAX_PER_HOME,
    H_MIN_QUOTA,
    H_MIN_REPLICA_QUOTA,
    H_RANK,
    H_REPLICAS,
    H_SEND_ROWS,
    H_STATUS,
    H_THRESHOLD,
    H_TOTAL,
    HEADER,
    INT32_MAX,
    record_length,
    table_columns,
)
from .solve import host_array


@njit(cache=True, nogil=True)
def pack(
    load,
    slot_expert,
    quota,
    physical_split,
    balanced,
    min_quota,
    domain_size,
    rank,
    record,
    table,
):
    """Fill ``record`` int64 [L] and ``table`` int32 [4, E + R*S + 1] for ``rank`` from a plan
    (slot_expert [R, S], quota [E, R], physical_split [R, R*P]) of ``load`` int64 [R, E]. The
    caller checked the total fits int32."""
    R, E = load.shape
    S = slot_expert.shape[1]
    G = E // R
    P = G + S
    C = E + R * S + 1
    record[:] = 0
    before = np.zeros(R, np.int64)
    for s in range(R):
        for e in range(E):
            before[e // G] += load[s, e]
    after = np.zeros(R, np.int64)
    for e in range(E):
        for t in range(R):
            after[t] += quota[e, t]
    total = 0
    max_before = 0
    threshold = 0
    for r in range(R):
        total += before[r]
        max_before = max(max_before, before[r])
        threshold = max(threshold, after[r])
    per_expert = np.zeros(E, np.int64)
    replicas = 0
    cross = 0
    smallest = -1
    for t in range(R):
        for j in range(S):
            e = slot_expert[t, j]
            record[HEADER + t * S + j] = e
            if e < 0:
                continue
            replicas += 1
            per_expert[e] += 1
            if t // domain_size != e // (G * domain_size):
                cross += 1
            if smallest < 0 or quota[e, t] < smallest:
                smallest = quota[e, t]
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

    # This rank's splits and the rows each source sends to its physical slots.
    base = HEADER + R * S
    sent = 0
    for t in range(R):
        rows = 0
        for j in range(P):
            rows += physical_split[rank, t * P + j]
        record[base + t] = rows
        sent += rows
    base += R
    for s in range(R):
        rows = 0
        for j in range(P):
            value = physical_split[s, rank * P + j]
            record[base + R + s * P + j] = value
            rows += value
        record[base + s] = rows

    record[H_STATUS] = 0
    record[H_THRESHOLD] = threshold
    record[H_TOTAL] = total
    record[H_BALANCED] = balanced
    record[H_MAX_BEFORE] = max_before
    record[H_REPLICAS] = replicas
    record[H_MAX_PER_EXPERT] = max_per_expert
    record[H_MAX_PER_HOME] = max_per_home
    record[H_CROSS_DOMAIN] = cross
    record[H_LOCAL] = local
    record[H_MIN_REPLICA_QUOTA] = smallest
    record[H_MIN_QUOTA] = min_quota
    record[H_DOMAIN_SIZE] = domain_size
    record[H_RANK] = rank
    record[H_SEND_ROWS] = sent

    # The table: instances expert-major, instance rank minor (the main one at its home rank).
    slot_row = np.empty(R * P, np.int64)  # first send-buffer row of each physical slot
    row = 0
    for slot in range(R * P):
        slot_row[slot] = row
        row += physical_split[rank, slot]
    instance_slot = np.full((E, R), -1, np.int64)
    for e in range(E):
        home = e // G
        instance_slot[e, home] = home * P + e - home * G
    for t in range(R):
        for j in range(S):
            e = slot_expert[t, j]
            if e >= 0:
                instance_slot[e, t] = t * P + G + j
    k = 0
    running = 0
    for e in range(E):
        for t in range(R):
            slot = instance_slot[e, t]
            if slot < 0:
                continue
            table[1, k] = slot
            table[3, k] = slot_row[slot] - running
            running += physical_split[rank, slot]
            table[0, k] = running
            k += 1
    for i in range(k, C):
        table[0, i] = running if i < C - 1 else INT32_MAX
        table[1, i] = R * P
        table[3, i] = sent + 1
    position = 0
    for e in range(E):
        table[2, e] = position
        position += load[rank, e]
    for i in range(E, C):
        table[2, i] = 0


# ---- the host planner's packing (the layers call it once per invocation) -----------------


def host_parts(
    load: np.ndarray,
    plan: Plan,
    rank: int,
    *,
    balanced: bool,
    min_quota: int,
    domain_size: int,
    record: np.ndarray | None = None,
    table: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack a host ``plan`` (int64 host tensors) of ``load`` int64 [R, E] into ``rank``'s record
    int64 [L] and table int32 [4, C] (given arrays are filled: e.g. pinned host buffers). Any
    balancer's plan packs; ``balanced``, ``min_quota``, ``domain_size`` go into the header."""
    R, E = load.shape
    S = plan.num_slots
    L, C = record_length(R, E, S), table_columns(R, E, S)
    record = np.empty(L, np.int64) if record is None else record
    table = np.empty((4, C), np.int32) if table is None else table
    if record.shape != (L,) or table.shape != (4, C) or table.dtype != np.int32:
        raise ValueError(f"record must be int64 [{L}] and table int32 [4, {C}]")
    pack(
        load,
        host_array(plan.slot_expert),
        host_array(plan.quota),
        host_array(plan.physical_split),
        int(balanced),
        int(min_quota),
        int(domain_size),
        int(rank),
        record,
        table,
    )
    return record, table
