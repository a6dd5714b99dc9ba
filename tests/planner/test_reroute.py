"""One rank's reroute (``planner/reroute.py``): its host tables (``rank_reroute``), the two
instance searches of the routed pairs agreeing, and the
tests' oracle of the token reroute (``planner_helpers.assign_tokens``) that the dispatchers are
checked against."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_helpers import (
    assign_tokens,
    physical_layout,
    planned_routings,
    problems,
    routing_cases,
    tokens_received_per_local_slot,
    tokens_sent_per_physical_slot,
)
from ultraep_megatron.planner import baselines, rank_reroute, solve
from ultraep_megatron.planner.reroute import instances_of_positions


def routed_tokens(R: int, E: int, T: int, k: int, skew: float, seed: int) -> list[torch.Tensor]:
    """Router-like top-k ids per source rank: [T, k] int64, k distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.rand(E, generator=gen) ** skew + 1e-3
    if T == 0:
        return [torch.empty((0, k), dtype=torch.int64) for _ in range(R)]
    return [torch.multinomial(popularity.expand(T, E), k, generator=gen) for _ in range(R)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    R=st.integers(1, 8),
    G=st.integers(1, 4),
    S=st.integers(0, 3),
    T=st.integers(0, 64),
    k=st.integers(1, 4),
    skew=st.sampled_from([0.0, 2.0, 8.0]),
    seed=st.integers(0, 2**31),
    min_quota=st.sampled_from([None, 1, 5]),
    domains=st.sampled_from([1, 2, 4]),
)
def test_assign_tokens_realizes_the_split_exactly(R, G, S, T, k, skew, seed, min_quota, domains):
    E = R * G
    k = min(k, E)
    ids = routed_tokens(R, E, T, k, skew, seed)
    load = torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])
    # with NVLink domains where R allows (tokens still cross domains; only replicas may not)
    plan = solve(load, S, min_quota=min_quota, domain_size=R // domains if R % domains == 0 else R)
    layout = torch.from_numpy(physical_layout(plan.slot_expert.numpy(), E)).reshape(-1)
    L = G + S
    received = torch.zeros(R, R, L, dtype=torch.int64)  # [destination, source, local slot]
    for rank in range(R):
        physical = assign_tokens(plan, rank, ids[rank])
        assert physical.shape == ids[rank].shape and physical.dtype == torch.int64
        # every pair goes to a physical slot holding its logical expert
        assert torch.equal(layout[physical], ids[rank])
        # the per-slot counts are exactly the plan's split for this source
        counts = torch.bincount(physical.reshape(-1), minlength=R * L)
        assert torch.equal(counts, plan.physical_split[rank])
        assert torch.equal(tokens_sent_per_physical_slot(plan, rank), counts)
        # cumulative-quota lookup: an expert's pairs, in row-major order, fill its instances in
        # rank order
        flat_ids, destination = ids[rank].reshape(-1), physical.reshape(-1) // L
        for e in flat_ids.unique().tolist():
            assert (destination[flat_ids == e].diff() >= 0).all()
        # deterministic
        assert torch.equal(assign_tokens(plan, rank, ids[rank]), physical)
        received[:, rank] = counts.view(R, L)
    for t in range(R):
        assert torch.equal(tokens_received_per_local_slot(plan, t), received[t])
        assert received[t].sum() == plan.quota[:, t].sum()


def test_locality_in_token_assignment():
    """Source 1's own tokens of expert 0 use the replica on rank 1 first."""
    ids = [torch.tensor([[0]] * 6), torch.tensor([[0]] * 2)]
    load = torch.tensor([[6, 0], [2, 0]])
    plan = solve(load, 1, min_quota=1)
    assert plan.slot_expert.tolist() == [[-1], [0]]
    # physical slots: rank 0 -> [e0, slot], rank 1 -> [e1, slot(e0)] = ids 0, 1, 2, 3
    assert assign_tokens(plan, 1, ids[1]).reshape(-1).tolist() == [3, 3]
    assert assign_tokens(plan, 0, ids[0]).reshape(-1).tolist() == [0, 0, 0, 0, 3, 3]


def test_assign_tokens_rejects_mismatched_or_bad_ids():
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    load = torch.stack([torch.bincount(ids.reshape(-1), minlength=4), torch.zeros(4).long()])
    plan = solve(load, 1)
    assert assign_tokens(plan, 0, ids).shape == (3, 2)
    with pytest.raises(ValueError, match="do not match"):
        assign_tokens(plan, 1, ids)  # rank 1 had no tokens
    with pytest.raises(ValueError, match="do not match"):
        assign_tokens(plan, 0, ids[:2])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        assign_tokens(plan, 0, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="int64"):
        assign_tokens(plan, 0, ids.int())
    with pytest.raises(ValueError, match="rank"):
        assign_tokens(plan, 2, ids)


def plans_for(load: torch.Tensor, num_slots: int, min_quota):
    """UltraEP's plan and the baselines' (EPLB's placement on this load and on another, the
    identity), all on ``load``."""
    plans = [
        solve(load, num_slots, min_quota=min_quota),
        baselines.eplb_exact(load, num_slots),
        baselines.identity_plan(load, num_slots),
    ]
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
def test_rank_reroute_matches_the_plan(problem, data):
    load, S, min_quota = problem
    R, E = load.shape
    P = E // R + S
    rank = data.draw(st.integers(0, R - 1))
    for plan in plans_for(load, S, min_quota):
        reroute = rank_reroute(plan, load, rank)
        received = tokens_received_per_local_slot(plan, rank).numpy()  # [R, P]
        sent = tokens_sent_per_physical_slot(plan, rank).numpy()  # [R * P]
        np.testing.assert_array_equal(reroute.rows_per_source_slot, received)
        np.testing.assert_array_equal(reroute.rows_per_slot, received.sum(0))
        np.testing.assert_array_equal(reroute.output_splits, received.sum(1))
        np.testing.assert_array_equal(reroute.input_splits, sent.reshape(R, P).sum(1))
        table = reroute.reroute_table
        assert table.shape == (4, E * R + 1)
        assert table[0, -1] == np.iinfo(np.int64).max and table[1, -1] == R * P
        np.testing.assert_array_equal(table[2, E:], 0)
        # Row 1: the instance's physical slot, from the plan's own instance map (0 where none).
        np.testing.assert_array_equal(
            table[1, :-1], plan.instance_slot.clamp(min=0).reshape(-1).numpy()
        )
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
        np.testing.assert_array_equal(
            first_rows, np.cumsum((ends - begins)[order]) - (ends - begins)[order]
        )
        assert table[3, -1] == N + 1  # a position past the last instance lands past the spare row


def test_rank_reroute_fills_given_buffers_and_checks_them():
    load = torch.tensor([[90, 1, 2, 3], [80, 0, 1, 1]])
    plan = solve(load, 1, min_quota=1)
    rows = np.full((2, 3), -7, np.int64)
    table = np.full((4, 9), -7, np.int64)
    reroute = rank_reroute(plan, load, 1, rows_per_source_slot=rows, reroute_table=table)
    assert reroute.rows_per_source_slot is rows and reroute.reroute_table is table
    np.testing.assert_array_equal(rows, tokens_received_per_local_slot(plan, 1).numpy())
    assert (table != -7).all()
    with pytest.raises(ValueError, match="int64 array of shape"):
        rank_reroute(plan, load, 0, reroute_table=np.zeros((4, 8), np.int64))
    with pytest.raises(ValueError, match="int64 array of shape"):
        rank_reroute(plan, load, 0, rows_per_source_slot=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="rank must be in"):
        rank_reroute(plan, load, 2)
    with pytest.raises(ValueError, match="load has shape"):
        rank_reroute(plan, load[:, :2], 0)
    with pytest.raises(ValueError, match="load must be an int64 host tensor"):
        rank_reroute(plan, load.int(), 0)


@pytest.mark.parametrize("R,E,S,k,T,seed", list(routing_cases()))
def test_both_instance_searches_agree(R, E, S, k, T, seed):
    """The CPU's repeat and CUDA's binary search give the same instances."""
    routings, load, plans = planned_routings(R, E, S, k, T, seed)
    for plan in plans:
        for rank in range(R):
            running = torch.from_numpy(rank_reroute(plan, load, rank).reroute_table[0])
            positions = torch.arange(T * k)
            assert torch.equal(
                instances_of_positions(running, positions, binary_search=True),
                instances_of_positions(running, positions, binary_search=False),
            )
