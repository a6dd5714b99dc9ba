"""Compiled (numba) kernel of one rank's reroute on the host (``reroute.rank_reroute``): it runs per
layer and microbatch between the load's arrival on the host and the reroute, where the device waits.

Everything is int64 on numpy arrays; ``cache=True`` as in ``_compiled_solve.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_INT64_MAX = np.iinfo(np.int64).max


@njit(cache=True, nogil=True)
def reroute_arrays(
    physical_split,
    slot_expert,
    load,
    rank,
    rows_per_source_slot,
    rows_per_slot,
    input_splits,
    output_splits,
    reroute_table,
):
    """One rank's reroute of a plan (splits, rows per slot, reroute table), into the given arrays
    (``reroute.rank_reroute``).

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
