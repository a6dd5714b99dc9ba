"""Plans for data-plane tests: skewed (Zipf) loads, an EPLB-like slot filler, random plans.

The EPLB-like rule stands in for ``ultraep_megatron.planner.solve`` (written concurrently): it only
has to produce realistic ``slot_expert`` tables (hot experts with many replicas, no duplicates per
rank, no replica on the home rank).
"""

from __future__ import annotations

import functools

import torch

from ultraep_megatron.planner.synthetic import fill_slots_eplb_like, zipf_topk_load


@functools.lru_cache(maxsize=32)  # shared by tests that plan the same loads; callers must not modify
def zipf_loads(num_ranks: int, num_experts: int, *, tokens_per_rank: int = 4096, top_k: int = 8,
               exponent: float = 1.0, seed: int = 0) -> torch.Tensor:
    """``planner.synthetic.zipf_topk_load``, cached."""
    return zipf_topk_load(num_ranks, num_experts, tokens_per_rank=tokens_per_rank, top_k=top_k,
                          exponent=exponent, seed=seed)


eplb_like_slots = fill_slots_eplb_like


def random_plan(num_ranks: int, num_experts: int, num_slots: int, *, seed: int,
                hot_expert: int | tuple[int, ...] | None = None, empty_fraction: float = 0.2,
                local_replica: bool = False) -> torch.Tensor:
    """A random valid ``slot_expert`` ``[R, num_slots]``.

    Each hot expert (one or a tuple) gets a replica on every rank except its home (fan-out R-1), in
    the first slots. ``local_replica`` puts one expert into the last slot of its own home rank (filled
    by a local copy).
    """
    gen = torch.Generator().manual_seed(seed)
    per_rank = num_experts // num_ranks
    hot = () if hot_expert is None else (hot_expert,) if isinstance(hot_expert, int) else tuple(hot_expert)
    slot_expert = torch.full((num_ranks, num_slots), -1, dtype=torch.int64)
    for r in range(num_ranks):
        taken = set()
        first = 0
        for e in hot:
            if e // per_rank != r:
                slot_expert[r, first] = e
                taken.add(e)
                first += 1
        candidates = [e for e in range(num_experts) if e // per_rank != r and e not in taken]
        order = torch.randperm(len(candidates), generator=gen).tolist()
        for s in range(first, num_slots):
            if torch.rand((), generator=gen).item() < empty_fraction:
                continue
            slot_expert[r, s] = candidates[order.pop()]
    if local_replica:
        rank = num_ranks - 1
        slot_expert[rank, num_slots - 1] = rank * per_rank  # its own first main expert
    return slot_expert
