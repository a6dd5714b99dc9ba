"""Least-Loaded Expert Parallelism (Salesforce AI Research, LeastLoadedEP; the same planner in
torchtitan PR 2465), re-implemented from its public code and description (facts only): main experts
stay at home; an overloaded rank's excess pairs, with the expert's weights, spill to the least-loaded
ranks; no slot limit.

Not on the hot path: plain numpy/torch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..metrics import rank_imbalance
from ..plan import Plan, plan_from_split
from ..solve import validate_load
from .fixed_layout import identity_plan

__all__ = ["llep", "LLEP_CAPACITY_FACTOR", "LLEP_MIN_TOKENS_PER_GEMM", "LLEP_TRIGGER"]

#: LLEP's defaults (LeastLoadedEP: ``max_tokens_factor``, ``min_tokens_per_gemm``,
#: ``MOE_ADAPTIVE_LPT_ROUTING_RATIO``).
LLEP_CAPACITY_FACTOR, LLEP_MIN_TOKENS_PER_GEMM, LLEP_TRIGGER = 1.1, 1024, 1.3


def llep(
    load: torch.Tensor,
    *,
    capacity_factor: float = LLEP_CAPACITY_FACTOR,
    min_tokens_per_gemm: int = LLEP_MIN_TOKENS_PER_GEMM,
    trigger: float | None = LLEP_TRIGGER,
) -> Plan:
    """Least-Loaded Expert Parallelism's plan (LPT with weight spilling) on the exact load.

    Args:
        load: int64 [R, E].
        capacity_factor: alpha; a rank's capacity is ``int(alpha * (total // R))`` tokens (LLEP's
            ``max_tokens_factor``, default 1.1).
        min_tokens_per_gemm: m; a spilled chunk smaller than m is skipped in favour of a helper
            with more room (default 1024).
        trigger: lambda; when the rank imbalance (max / mean rank load, home layout) is below it,
            no balancing at all: the identity plan (LLEP's ``MOE_ADAPTIVE_LPT_ROUTING_RATIO``,
            default 1.3). ``None`` or <= 0: always balance.

    Experts by descending load (ties: lowest id). A rank's effective load is what it has been
    assigned plus its not-yet-processed home experts. The expert's home takes what fits under the
    capacity; the rest spills, in chunks of ``min(remaining, room)``, to the rank with the least
    effective load that has room (one rank after another while the home is full before it starts).
    Neither limit is hard: a chunk below m is taken when it is the expert's last one, the home's
    own share may be any size, and when no rank has room the remainder is forced onto the least
    loaded rank, capacity or not. Tokens of an expert, ordered by source rank, fill its chunks in
    order (home first).

    Returns:
        A ``Plan``: main experts at home (a main instance may carry 0), the spilled experts in
        ``slot_expert`` [R, S'], S' = most distinct spilled experts on one rank (0 without
        spills). LLEP may send one expert twice to a rank (two chunks); it is one instance here.
    """
    R, E = validate_load(load)
    if bool((load < 0).any()):
        raise ValueError("load has negative entries")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    if (
        isinstance(min_tokens_per_gemm, bool)
        or not isinstance(min_tokens_per_gemm, (int, np.integer))
        or min_tokens_per_gemm < 0
    ):
        raise ValueError(f"min_tokens_per_gemm must be an int >= 0, got {min_tokens_per_gemm!r}")
    G = E // R
    lam = load.sum(0).tolist()
    rank_load = [sum(lam[r * G : (r + 1) * G]) for r in range(R)]
    if trigger is not None and trigger > 0 and rank_imbalance(load) < trigger:
        return identity_plan(load, 0)
    total = sum(lam)
    balanced = total // R
    capacity = max(int(capacity_factor * balanced) if balanced > 0 else total, 1)
    m = int(min_tokens_per_gemm)
    pending, assigned = list(rank_load), [0] * R

    def by_effective_load(home):
        """Other ranks as (rank, room), least effective load first (ties: lowest rank)."""
        others = sorted((g for g in range(R) if g != home), key=lambda g: assigned[g] + pending[g])
        return [(g, capacity - assigned[g] - pending[g]) for g in others]

    chunks: dict[int, list[tuple[int, int]]] = {}  # expert -> [(rank, tokens)] in token order
    for e in sorted(range(E), key=lambda x: -lam[x]):
        tokens, home = lam[e], e // G
        if tokens == 0:
            continue
        pending[home] -= tokens
        room = capacity - assigned[home] - pending[home]
        mine = []
        if room > 0:  # the home takes what fits; each further chunk to the best helper ranked now
            mine.append((home, min(tokens, room)))
            assigned[home] += mine[0][1]
            remaining = tokens - mine[0][1]
            while remaining > 0:
                helpers = by_effective_load(home)
                # a chunk is min(remaining, room); one below m only when it is the last
                fits = [
                    (g, min(remaining, r))
                    for g, r in helpers
                    if r > 0 and (r >= remaining or r >= m)
                ]
                g, c = fits[0] if fits else (helpers[0][0] if helpers else home, remaining)
                mine.append((g, c))
                assigned[g] += c
                remaining -= c
        else:  # the home is full: one pass over the helpers as ranked now
            remaining = tokens
            helpers = by_effective_load(home)
            for g, r in helpers:
                if remaining > 0 and r > 0 and (r >= remaining or r >= m):
                    c = min(remaining, r)
                    mine.append((g, c))
                    assigned[g] += c
                    remaining -= c
            if remaining > 0:  # forced: no room (or only chunks below m) left
                g = helpers[0][0] if helpers else home
                mine.append((g, remaining))
                assigned[g] += remaining
        chunks[e] = mine

    # Source s's tokens of e occupy [cum[s], cum[s+1]) in source order; chunks take consecutive
    # intervals. split[s, e, t] = overlap.
    load_np = load.cpu().numpy()
    split = np.zeros((R, E, R), np.int64)
    slots: list[list[int]] = [[] for _ in range(R)]
    for e, mine in chunks.items():
        cum = np.concatenate([[0], np.cumsum(load_np[:, e])])
        ends = np.cumsum([c for _, c in mine])
        starts = ends - np.array([c for _, c in mine])
        overlap = np.minimum(cum[1:, None], ends[None]) - np.maximum(cum[:-1, None], starts[None])
        np.add.at(split[:, e], (slice(None), [g for g, _ in mine]), np.maximum(overlap, 0))
        for g, _ in mine:
            if g != e // G and e not in slots[g]:
                slots[g].append(e)
    width = max(len(s) for s in slots)
    slot_expert = torch.full((R, width), -1, dtype=torch.int64)
    for g, s in enumerate(slots):
        slot_expert[g, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return plan_from_split(slot_expert.to(load.device), torch.from_numpy(split).to(load.device))
