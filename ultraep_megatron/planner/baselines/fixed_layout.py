"""Baseline plans UltraEP is compared with (paper §8.1), on the same fixed slot layout.

- ``identity_plan(load, S)``: the unbalanced routing (``--moe-balancer none``), every token to its
  expert's main instance.
- ``eplb(history, S)``: DeepSeek EPLB's replication rule on historical load — repeatedly give one
  more replica to the expert with the largest load per instance — with the replicas packed into the
  redundant slots (main experts never move), then round-robin reroute.
- ``eplb_exact(load, S)``: the paper's EPLB++, the same rule on the exact current load.

Both EPLB baselines are the paper's *fixed-layout* EPLB: main experts stay at home and only the
redundant slots are filled, so their labels (``analysis/plotting.py``'s ``LABELS``) say so. DeepSeek's own EPLB
re-places every expert: :mod:`.deepseek`; both share EPLB's replication rule, :func:`replicate`.

Not on the hot path: plain numpy/torch, no compiled code.
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import Plan, plan_from_split
from ..solve import validate_load

__all__ = [
    "identity_plan",
    "eplb",
    "eplb_exact",
    "eplb_slots",
    "replicate",
    "round_robin",
    "round_robin_split",
    "check_num_slots",
]


def identity_plan(load: torch.Tensor, num_slots: int = 0) -> Plan:
    """The unbalanced routing of ``load`` [R, E]: no replica, every token to its expert's main
    instance on rank ``e // G``.

    Returns a Plan with ``slot_expert`` [R, S] all -1, ``quota`` [E, R] the expert totals on the
    home ranks, ``physical_split`` [R, R * (G + S)] the load in the main columns.
    """
    R, E = validate_load(load)
    check_num_slots(num_slots)
    array = (
        load.detach().cpu().numpy()
    )  # numpy: the runtime's skip path (trigger) runs it per layer
    if (array < 0).any():
        raise ValueError("load has negative entries")
    G, P = E // R, E // R + num_slots
    experts = np.arange(E)
    quota = np.zeros((E, R), dtype=np.int64)
    quota[experts, experts // G] = array.sum(0)
    physical = np.zeros((R, R, P), dtype=np.int64)  # [source, rank, physical slot]
    physical[:, :, :G] = array.reshape(R, R, G)
    physical = physical.reshape(R, R * P)
    slot_expert = np.full((R, num_slots), -1, dtype=np.int64)
    plan = [torch.from_numpy(x).to(load.device) for x in (slot_expert, quota, physical)]
    return Plan(*plan, int(quota.sum(0).max()))


def replicate(
    weight: np.ndarray, num_physical: int, *, max_copies: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's replication rule: ``num_physical - n`` times, give one more copy to the expert with
    the largest load per copy (ties: lowest id), never beyond ``max_copies`` copies of one expert
    (``None``: no cap, as DeepSeek's EPLB; stops early when every expert is at the cap).

    weight float64 [n] -> (phy2log int64 [<= num_physical]: the n experts, then each added copy's
    expert; count int64 [n]: copies per expert).
    """
    n = weight.shape[0]
    phy2log = [np.arange(n)]
    count = np.ones(n, np.int64)
    for _ in range(num_physical - n):
        per_copy = weight / count
        if max_copies is not None:
            per_copy = np.where(count < max_copies, per_copy, -np.inf)
        e = int(np.argmax(per_copy))  # first maximum
        if per_copy[e] == -np.inf:
            break
        phy2log.append(np.array([e]))
        count[e] += 1
    return np.concatenate(phy2log), count


def eplb_slots(expert_load: torch.Tensor, num_ranks: int, num_slots: int) -> torch.Tensor:
    """EPLB's replica choice packed into the fixed slot layout.

    Args:
        expert_load: [E] load per logical expert (any numeric dtype).
        num_ranks, num_slots: R and S.

    Returns:
        slot_expert int64 [R, S] (-1 where a replica could not be placed).

    Replication: R * S times, add an instance to the expert with the largest load per instance
    (ties: lower expert id), never beyond one instance per rank. Packing: replicas by descending
    load per instance (ties: lower expert id) go to the rank with the least estimated load (each
    instance carrying load / instances; ties: lower rank) that has a free slot and no instance of
    the expert yet. A replica that fits nowhere is dropped (only when the no-duplicate rule and
    full slots leave no choice).
    """
    lam = expert_load.detach().cpu().numpy().astype(np.float64)
    E, R, S = lam.shape[0], num_ranks, num_slots
    G = E // R
    counts = replicate(lam, E + R * S, max_copies=R)[1]
    per_instance = lam / counts
    estimate = per_instance.reshape(R, G).sum(1)  # main instances
    free = np.full(R, S)
    holds = np.zeros((E, R), bool)
    holds[np.arange(E), np.arange(E) // G] = True
    slot_expert = np.full((R, S), -1, np.int64)
    replicas = sorted(
        (e for e in range(E) for _ in range(counts[e] - 1)), key=lambda e: (-per_instance[e], e)
    )
    for e in replicas:
        allowed = (free > 0) & ~holds[e]
        if not allowed.any():
            continue
        t = int(np.flatnonzero(allowed)[np.argmin(estimate[allowed])])  # first minimum
        slot_expert[t, S - free[t]] = e
        free[t] -= 1
        holds[e, t] = True
        estimate[t] += per_instance[e]
    return torch.from_numpy(slot_expert).to(expert_load.device)


def round_robin(load: torch.Tensor, slot_expert: torch.Tensor) -> Plan:
    """Plan that spreads each source's tokens of an expert round-robin over its instances.

    ``load`` [R, E], ``slot_expert`` [R, S]. Instances of e are ordered main first, then replicas
    by rank; source s's j-th token of e goes to instance ``(s + j) % n_e`` (so remainders land on
    different instances for different sources). No locality preference, as in EPLB.
    """
    R, E = validate_load(load)
    if bool((load < 0).any()):
        raise ValueError("load has negative entries")
    G = E // R
    if slot_expert.dim() != 2 or slot_expert.shape[0] != R:
        raise ValueError(f"slot_expert must be [R={R}, S], got {tuple(slot_expert.shape)}")
    hosts = [[e // G] for e in range(E)]
    for t, row in enumerate(slot_expert.tolist()):
        for e in row:
            if e >= 0:
                hosts[e].append(t)
    M = max(len(h) for h in hosts)
    host_rank = torch.full((E, M), R, dtype=torch.int64)  # R: padding
    for e, h in enumerate(hosts):
        host_rank[e, : len(h)] = torch.tensor([h[0]] + sorted(h[1:]))
    return plan_from_split(slot_expert.to(load.device), round_robin_split(load, host_rank))


def round_robin_split(load: torch.Tensor, host_rank: torch.Tensor) -> torch.Tensor:
    """Round-robin split over given instances: int64 [R, E, R] tokens of e from s computed on t.

    ``load`` [R, E]; ``host_rank`` int64 [E, M]: the rank of each instance of expert e in
    instance order, padded with R (every expert has at least one instance; two instances may share
    a rank). Source s's j-th token of e goes to instance ``(s + j) % n_e``.
    """
    R, E = load.shape
    device = load.device
    host_rank = host_rank.to(device)
    M = host_rank.shape[1]
    n = (host_rank < R).sum(1)  # [E]
    base, rem = load // n, load % n  # [R, E]
    i = torch.arange(M, device=device).view(1, 1, M)
    s = torch.arange(R, device=device).view(R, 1, 1)
    amount = base.unsqueeze(2) + (((i - s) % n.view(1, E, 1)) < rem.unsqueeze(2)).long()
    amount = amount * (i < n.view(1, E, 1))  # [R, E, M]
    split = torch.zeros((R, E, R + 1), dtype=torch.int64, device=device)
    split.scatter_add_(2, host_rank.unsqueeze(0).expand(R, E, M), amount)
    return split[:, :, :R]


def eplb(history: torch.Tensor, num_slots: int, *, load: torch.Tensor | None = None) -> Plan:
    """DeepSeek EPLB on historical load.

    Args:
        history: int64 [H, R, E] loads of H past microbatches, or [R, E] already summed. The
            replicas are chosen from its per-expert total.
        num_slots: S.
        load: [R, E] the load to reroute over that placement (round-robin); default: the summed
            history itself.
    """
    if isinstance(history, torch.Tensor) and history.dim() == 3:
        history = history.sum(0)
    R, _ = validate_load(history, "history")
    check_num_slots(num_slots)
    if bool((history < 0).any()):
        raise ValueError("history has negative entries")
    slot_expert = eplb_slots(history.sum(0), R, num_slots)
    return round_robin(history if load is None else load, slot_expert)


def eplb_exact(load: torch.Tensor, num_slots: int) -> Plan:
    """The paper's EPLB++: EPLB's rule on the exact current load, round-robin reroute."""
    return eplb(load, num_slots, load=load)


def check_num_slots(num_slots) -> None:
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
