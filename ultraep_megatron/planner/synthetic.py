"""Synthetic power-law (Zipf) expert loads, like UltraEP's Fig. 15 / Table 4 simulations.

Used by ``tools/bench_planner.py``, ``tools/bench_dataplane.py`` and the tests; deterministic for a
given seed.
"""

from __future__ import annotations

import numpy as np
import torch


def zipf_load(num_ranks: int, num_experts: int, imbalance: float, *, tokens_per_rank: int = 4096,
              topk: int = 8, seed: int = 0, source_noise: float = 0.3) -> torch.Tensor:
    """int64 [R, E] load whose expected max/mean rank load is about ``imbalance``.

    Expert popularity follows a Zipf law ``p ~ 1 / rank^alpha`` over a random permutation of the
    experts (so hot experts land on random ranks); ``alpha`` is bisected until the expected rank
    imbalance matches. A token picks ``topk`` distinct experts, so no expert gets more than 1/topk
    of the picks (the head of the law is capped there, which bounds the reachable imbalance for
    few experts per rank). Each source rank perturbs the popularity by a log-normal factor
    (``source_noise``) and draws its ``tokens_per_rank * topk`` picks from a multinomial, capped
    at ``tokens_per_rank`` per expert.
    """
    if num_experts % num_ranks:
        raise ValueError("num_experts must be a multiple of num_ranks")
    rng = np.random.default_rng(seed)
    R, E, G = num_ranks, num_experts, num_experts // num_ranks
    perm = rng.permutation(E)

    def popularity(alpha: float) -> np.ndarray:
        p = (np.arange(E) + 1.0) ** -alpha
        p /= p.sum()
        for _ in range(64):  # cap at 1/topk and renormalize the rest
            over = p > 1.0 / topk + 1e-12
            if not over.any():
                break
            p[over] = 1.0 / topk
            p[~over] *= (1.0 - over.sum() / topk) / p[~over].sum()
        out = np.empty(E)
        out[perm] = p
        return out

    def rank_imbalance(alpha: float) -> float:
        per_rank = popularity(alpha).reshape(R, G).sum(1)
        return per_rank.max() / per_rank.mean()

    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rank_imbalance(mid) < imbalance else (lo, mid)
    p = popularity(hi)
    per_source = p[None, :] * rng.lognormal(0.0, source_noise, size=(R, E))
    per_source /= per_source.sum(1, keepdims=True)
    load = np.stack([rng.multinomial(tokens_per_rank * topk, per_source[s]) for s in range(R)])
    return torch.from_numpy(np.minimum(load, tokens_per_rank).astype(np.int64))


def zipf_topk_load(num_ranks: int, num_experts: int, *, tokens_per_rank: int = 4096, top_k: int = 8,
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


def fill_slots_eplb_like(load: torch.Tensor, num_slots: int) -> torch.Tensor:
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
