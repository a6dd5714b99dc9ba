"""``assign_tokens`` and the per-rank count helpers the Megatron dispatcher reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_invariants import physical_layout
from ultraep_megatron.planner import (
    _assign_tokens_vectorized,
    assign_tokens,
    solve,
    tokens_received_per_local_slot,
    tokens_sent_per_physical_slot,
)


def routed_tokens(R: int, E: int, T: int, k: int, skew: float, seed: int) -> list[torch.Tensor]:
    """Router-like top-k ids per source rank: [T, k] int64, k distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.rand(E, generator=gen) ** skew + 1e-3
    if T == 0:
        return [torch.empty((0, k), dtype=torch.int64) for _ in range(R)]
    return [torch.multinomial(popularity.expand(T, E), k, generator=gen) for _ in range(R)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.integers(1, 8), G=st.integers(1, 4), S=st.integers(0, 3), T=st.integers(0, 64),
       k=st.integers(1, 4), skew=st.sampled_from([0.0, 2.0, 8.0]), seed=st.integers(0, 2**31),
       min_quota=st.sampled_from([None, 1, 5]), domains=st.sampled_from([1, 2, 4]))
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
        # deterministic, and the vectorized torch form (used off CPU) agrees
        assert torch.equal(assign_tokens(plan, rank, ids[rank]), physical)
        assert torch.equal(_assign_tokens_vectorized(plan, rank, ids[rank]), physical)
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
    for assign in (assign_tokens, _assign_tokens_vectorized):
        with pytest.raises(ValueError, match="do not match"):
            assign(plan, 1, ids)  # rank 1 had no tokens
        with pytest.raises(ValueError, match="do not match"):
            assign(plan, 0, ids[:2])
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            assign(plan, 0, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="int64"):
        assign_tokens(plan, 0, ids.int())
    with pytest.raises(ValueError, match="rank"):
        assign_tokens(plan, 2, ids)
