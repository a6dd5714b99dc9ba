"""Independent checks of a planner ``Plan`` against the load it was solved for.

Everything here is recomputed from the plan's raw outputs (``slot_expert``, ``quota``,
``physical_split``, ``threshold``) and the load with plain numpy loops; nothing reuses the
planner's own derived views (``Plan.split``, ``Plan.instance_slot``, ...), which are themselves
checked against these recomputations.
"""

from __future__ import annotations

import numpy as np
import torch


def expected_min_quota(load: np.ndarray, min_quota: int | None) -> int:
    """The documented floor: the given one, or 1 % of the mean rank load (at least 1)."""
    if min_quota is not None:
        return min_quota
    R = load.shape[0]
    total = int(load.sum())
    return max(1, (total + 100 * R - 1) // (100 * R))


def physical_layout(slot_expert: np.ndarray, num_experts: int) -> np.ndarray:
    """[R, L] logical expert of every physical slot, by the documented numbering."""
    R, S = slot_expert.shape
    G = num_experts // R
    layout = np.empty((R, G + S), np.int64)
    for t in range(R):
        for j in range(G):
            layout[t, j] = t * G + j
        for j in range(S):
            layout[t, G + j] = slot_expert[t, j]
    return layout


def dense_split(plan, num_experts: int) -> np.ndarray:
    """[R, E, R] recomputed from ``physical_split`` and the layout; asserts empty slots get 0."""
    slot_expert = plan.slot_expert.cpu().numpy()
    physical = plan.physical_split.cpu().numpy()
    R = slot_expert.shape[0]
    layout = physical_layout(slot_expert, num_experts)
    L = layout.shape[1]
    assert physical.shape == (R, R * L)
    split = np.zeros((R, num_experts, R), np.int64)
    for t in range(R):
        for j in range(L):
            column = physical[:, t * L + j]
            if layout[t, j] < 0:
                assert (column == 0).all(), "tokens sent to an empty slot"
            else:
                split[:, layout[t, j], t] += column
    return split


def domain_bound(load: np.ndarray, domain_size: int) -> int:
    """max over NVLink domains of ceil(load of the domain's experts / ranks per domain)."""
    R, E = load.shape
    G = E // R
    best = 0
    for d in range(R // domain_size):
        total = 0
        for e in range(d * domain_size * G, (d + 1) * domain_size * G):
            total += int(load[:, e].sum())
        best = max(best, (total + domain_size - 1) // domain_size)
    return best


def check_plan(load_t: torch.Tensor, plan, num_slots: int, *, min_quota: int | None = None,
               domain_size: int | None = None, check_min_quota: bool = True,
               check_locality: bool = True, check_no_worse: bool = True) -> np.ndarray:
    """Assert every documented invariant of ``plan`` for ``load_t``; return the dense split.

    With ``domain_size`` N: every replica is hosted in its home's domain and the threshold is at
    least the domain bound."""
    load = load_t.cpu().numpy()
    R, E = load.shape
    G = E // R
    slot_expert = plan.slot_expert.cpu().numpy()
    quota = plan.quota.cpu().numpy()
    for name in ("slot_expert", "quota", "physical_split"):
        tensor = getattr(plan, name)
        assert tensor.dtype == torch.int64 and tensor.device == load_t.device, name
    assert slot_expert.shape == (R, num_slots)
    assert quota.shape == (E, R)

    # Layout: slot entries are experts or -1; no rank holds two instances of one expert (its
    # mains included), hence at most num_slots replicas per rank by shape.
    assert ((slot_expert >= -1) & (slot_expert < E)).all()
    instance = np.zeros((E, R), bool)
    for e in range(E):
        instance[e, e // G] = True  # main experts fixed on their home rank
    N = R if domain_size is None else domain_size
    for t in range(R):
        for e in slot_expert[t]:
            if e >= 0:
                assert not instance[e, t], f"rank {t} holds expert {e} twice"
                instance[e, t] = True
                assert t // N == (e // G) // N, f"replica of {e} on rank {t} outside its domain"

    split = dense_split(plan, E)
    assert (split >= 0).all()
    assert np.array_equal(split.sum(2), load), "split does not route exactly the load"
    assert np.array_equal(split.sum(0), quota), "split does not realize the quotas"
    assert not (split * ~instance[None]).any(), "tokens sent to a rank without an instance"
    assert (quota[~instance] == 0).all()
    assert np.array_equal(plan.split.cpu().numpy(), split), "Plan.split disagrees"

    # Replica floor.
    floor = expected_min_quota(load, min_quota)
    if check_min_quota:
        for t in range(R):
            for e in slot_expert[t]:
                if e >= 0:
                    assert quota[e, t] >= floor, f"replica of {e} on {t}: {quota[e, t]} < {floor}"

    # Locality: a source's own tokens use the instance on its own rank first.
    if check_locality:
        for s in range(R):
            for e in range(E):
                if instance[e, s]:
                    assert split[s, e, s] == min(load[s, e], quota[e, s]), (s, e)

    # Threshold is the max rank load after reroute; never better than the average and (for the
    # UltraEP planner, not for EPLB) never worse than no balancing.
    after = quota.sum(0)
    assert plan.threshold == int(after.max())
    before = load.sum(0).reshape(R, G).sum(1)
    total = int(load.sum())
    if check_no_worse:
        assert plan.threshold <= int(before.max())
    assert plan.threshold >= (total + R - 1) // R
    assert plan.threshold >= domain_bound(load, N)
    return split
