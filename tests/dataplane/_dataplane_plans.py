"""Plans for data-plane tests: skewed (Zipf) loads, an EPLB-like slot filler, random plans.

The EPLB-like rule stands in for ``ultraep_megatron.planner.solve`` (written concurrently): it only
has to produce realistic ``slot_expert`` tables (hot experts with many replicas, no duplicates per
rank, no replica on the home rank).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=32)  # shared by tests that plan the same loads; callers must not modify
def zipf_loads(num_ranks: int, num_experts: int, *, tokens_per_rank: int = 4096, top_k: int = 8,
               exponent: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Per-rank token counts routed to each expert, int64 ``[R, E]``.

    Expert popularity follows Zipf(``exponent``) over a random expert order; each token picks ``top_k``
    distinct experts; each rank's popularity is jittered so ranks differ.
    """
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_experts, generator=gen)
    popularity = torch.empty(num_experts)
    popularity[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64).pow(exponent).float()
    loads = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    for r in range(num_ranks):
        p = popularity * torch.empty(num_experts).uniform_(0.8, 1.2, generator=gen)
        # Gumbel top-k = sampling top_k distinct experts without replacement, proportional to p.
        gumbel = -(-torch.rand(tokens_per_rank, num_experts, generator=gen).log()).log()
        picks = (p.log() + gumbel).topk(top_k, dim=1).indices
        loads[r] = torch.bincount(picks.flatten(), minlength=num_experts)
    return loads


def eplb_like_slots(load: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Fill every rank's redundant slots EPLB-style; return ``slot_expert`` int64 ``[R, num_slots]``.

    Replicate the expert with the highest per-instance load until all ``R * num_slots`` slots are
    spoken for, then place replicas (heaviest first) on the least-loaded rank that has a free slot,
    is not the home and does not host that expert yet. Main experts stay on their home ranks.
    """
    num_ranks, num_experts = load.shape
    per_rank = num_experts // num_ranks
    expert_load = load.sum(0).double()
    instances = torch.ones(num_experts, dtype=torch.float64)
    for _ in range(num_ranks * num_slots):
        instances[torch.argmax(expert_load / instances)] += 1
    share = expert_load / instances
    home = torch.arange(num_experts) // per_rank
    rank_load = torch.zeros(num_ranks, dtype=torch.float64).index_add_(0, home, share)
    slot_expert = torch.full((num_ranks, num_slots), -1, dtype=torch.int64)
    free = torch.full((num_ranks,), num_slots)
    replicas = [(float(share[e]), e) for e in range(num_experts) for _ in range(int(instances[e]) - 1)]
    for weight, e in sorted(replicas, key=lambda x: (-x[0], x[1])):
        hosting = (slot_expert == e).any(1)
        admissible = (free > 0) & ~hosting
        admissible[home[e]] = False
        if not admissible.any():
            continue
        target = int(torch.where(admissible, rank_load, torch.inf).argmin())
        slot_expert[target, num_slots - int(free[target])] = e
        free[target] -= 1
        rank_load[target] += weight
    return slot_expert


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
