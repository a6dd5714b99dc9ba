"""``rank_dispatch``: one rank's dispatch metadata of a plan (splits, per-slot rows, reroute table),
checked against the plan's own views and against what the reroute does with the table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_strategies import problems
from ultraep_megatron.planner import (
    baselines,
    rank_dispatch,
    solve,
    tokens_received_per_local_slot,
    tokens_sent_per_physical_slot,
)


def plans_for(load: torch.Tensor, num_slots: int, min_quota):
    """UltraEP's plan and the baselines' (EPLB's placement on this load and on another, the
    identity), all on ``load``."""
    plans = [solve(load, num_slots, min_quota=min_quota), baselines.eplb_exact(load, num_slots),
             baselines.identity_plan(load, num_slots)]
    if num_slots > 0:  # a stale placement, as the eplb balancer reroutes on
        stale = baselines.eplb(load.flip(1).unsqueeze(0), num_slots).slot_expert
        plans.append(baselines.round_robin(load, stale))
    return plans


def routed_rows(table: np.ndarray, load_row: np.ndarray, num_slots: int) -> np.ndarray:
    """[num_slots + 1] rows per physical slot (the last: the spare column) under the reroute's rule,
    for one source rank: its pairs in expert-major order, pair ``i`` of expert ``e`` at position
    ``row2[e] + 1 + i``, each sent to the slot (row 1) of the first entry of row 0 above its
    position. Counted by intervals (entry ``k`` takes positions ``[row0[k-1], row0[k])``), so
    loads of any size are exact."""
    rows = np.zeros(num_slots + 1, np.int64)
    starts = np.concatenate([[0], table[0, :-1]])
    for e in range(load_row.shape[0]):
        first, end = table[2, e] + 1, table[2, e] + 1 + load_row[e]
        taken = np.clip(np.minimum(end, table[0]) - np.maximum(first, starts), 0, None)
        np.add.at(rows, table[1], taken)
    return rows


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_ranks=8), data=st.data())
def test_rank_dispatch_matches_the_plan(problem, data):
    load, S, min_quota = problem
    R, E = load.shape
    G, P = E // R, E // R + S
    rank = data.draw(st.integers(0, R - 1))
    for plan in plans_for(load, S, min_quota):
        d = rank_dispatch(plan, load, rank)
        received = tokens_received_per_local_slot(plan, rank).numpy()  # [R, P]
        sent = tokens_sent_per_physical_slot(plan, rank).numpy()  # [R * P]
        np.testing.assert_array_equal(d.rows_per_source_slot, received)
        np.testing.assert_array_equal(d.rows_per_slot, received.sum(0))
        np.testing.assert_array_equal(d.output_splits, received.sum(1))
        np.testing.assert_array_equal(d.input_splits, sent.reshape(R, P).sum(1))
        table = d.reroute_table
        assert table.shape == (4, E * R + 1)
        assert table[0, -1] == np.iinfo(np.int64).max and table[1, -1] == R * P
        np.testing.assert_array_equal(table[2, E:], 0)
        # Row 1: the instance's physical slot, from the plan's own instance map (0 where none).
        np.testing.assert_array_equal(table[1, :-1], plan.instance_slot.clamp(min=0).reshape(-1).numpy())
        # The reroute sends exactly the plan's rows to every physical slot, and only to instances.
        rows = routed_rows(table, load[rank].numpy(), R * P)
        np.testing.assert_array_equal(rows[:-1], sent)
        assert rows[-1] == 0, "pairs past the last instance"
        # Row 3: the send buffer holds the pairs in expert-major order stably sorted by physical
        # slot (megatron's permutation order): instance k's pairs (positions begin..end) fill
        # rows row3[k] + begin .., and the instances that send rows, ordered by (slot, first
        # position), fill the buffer back to back from row 0.
        N = int(load[rank].sum())
        ends = table[0, :-1]
        begins = np.concatenate([[0], ends[:-1]])
        sending = np.flatnonzero(ends > begins)
        order = sending[np.lexsort((begins[sending], table[1, sending]))]
        first_rows = table[3, order] + begins[order]
        np.testing.assert_array_equal(first_rows, np.cumsum((ends - begins)[order]) - (ends - begins)[order])
        assert table[3, -1] == N + 1  # a position past the last instance lands past the spare row


def test_rank_dispatch_fills_given_buffers_and_checks_them():
    load = torch.tensor([[90, 1, 2, 3], [80, 0, 1, 1]])
    plan = solve(load, 1, min_quota=1)
    rows = np.full((2, 3), -7, np.int64)
    table = np.full((4, 9), -7, np.int64)
    d = rank_dispatch(plan, load, 1, rows_per_source_slot=rows, reroute_table=table)
    assert d.rows_per_source_slot is rows and d.reroute_table is table
    np.testing.assert_array_equal(rows, tokens_received_per_local_slot(plan, 1).numpy())
    assert (table != -7).all()
    with pytest.raises(ValueError, match="int64 array of shape"):
        rank_dispatch(plan, load, 0, reroute_table=np.zeros((4, 8), np.int64))
    with pytest.raises(ValueError, match="int64 array of shape"):
        rank_dispatch(plan, load, 0, rows_per_source_slot=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="rank must be in"):
        rank_dispatch(plan, load, 2)
    with pytest.raises(ValueError, match="load has shape"):
        rank_dispatch(plan, load[:, :2], 0)
    with pytest.raises(ValueError, match="load must be an int64 host tensor"):
        rank_dispatch(plan, load.int(), 0)
