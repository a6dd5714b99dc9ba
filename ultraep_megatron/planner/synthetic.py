"""Synthetic power-law (Zipf) expert loads, like UltraEP's Fig. 15 / Table 4 simulations.

Used by ``tools/bench_planner.py`` and the tests; deterministic for a given seed.
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
