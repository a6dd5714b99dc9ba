"""Shared helpers of the planner tests: independent checks of a ``Plan`` against the load it was
solved for, Hypothesis strategies of random and adversarial int64 [R, E] loads, the token reroute's
oracle (:func:`assign_tokens`) and random routings with their plans (the reroute's tests here and
the dispatchers' in ``tests/megatron/test_pair_routing.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import strategies as st

from ultraep_megatron.planner import solve
from ultraep_megatron.planner.baselines import fixed_layout

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(script: str, *args: str) -> object:
    """Runs ``script`` in a fresh process with ``TRITON_INTERPRET=1`` (Triton reads it at import,
    so the Triton kernels run in the interpreter on CPU tensors), one thread, this checkout first
    on the path; returns the JSON its last stdout line prints (it prints it, and fails the test
    with its stderr's tail when the process fails)."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(summary)
    return summary


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


def check_plan(
    load_t: torch.Tensor,
    plan,
    num_slots: int,
    *,
    min_quota: int | None = None,
    domain_size: int | None = None,
    check_min_quota: bool = True,
    check_locality: bool = True,
    check_no_worse: bool = True,
) -> np.ndarray:
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


LOAD_KINDS = (
    "drawn",
    "uniform",
    "zipf",
    "sparse",
    "one_expert",
    "equal",
    "binary",
    "empty_rank",
    "one_rank_hot",
    "huge",
    "all_zero",
)


def make_load(draw, kind: str, R: int, G: int) -> np.ndarray:
    """A random or adversarial int64 [R, R*G] load of the given kind."""
    E = R * G
    if kind == "drawn":  # fully hypothesis-controlled (shrinks to minimal counterexamples)
        values = draw(st.lists(st.integers(0, 30), min_size=R * E, max_size=R * E))
        return np.array(values, np.int64).reshape(R, E)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "uniform":
        return rng.integers(0, int(rng.choice([3, 100, 10_000])), (R, E))
    if kind == "zipf":
        p = (np.arange(E) + 1.0) ** -rng.uniform(0.3, 3.0)
        p = p[rng.permutation(E)]
        return np.stack(
            [rng.multinomial(int(rng.integers(0, 5000)), p / p.sum()) for _ in range(R)]
        )
    if kind == "sparse":
        return rng.integers(0, 1000, (R, E)) * (rng.random((R, E)) < 0.1)
    if kind == "one_expert":  # one expert takes every token
        load = np.zeros((R, E), np.int64)
        load[:, rng.integers(E)] = rng.integers(0, 1000, R)
        return load
    if kind == "equal":  # ties everywhere
        return np.full((R, E), int(rng.integers(0, 50)), np.int64)
    if kind == "binary":
        return rng.integers(0, 2, (R, E))
    if kind == "empty_rank":  # a source with no tokens and a rank whose experts get none
        load = rng.integers(0, 500, (R, E))
        load[rng.integers(R)] = 0
        r = rng.integers(R)
        load[:, r * G : (r + 1) * G] = 0
        return load
    if kind == "one_rank_hot":
        load = rng.integers(0, 20, (R, E))
        r = rng.integers(R)
        load[:, r * G : (r + 1) * G] += rng.integers(0, 5000, (R, G))
        return load
    if kind == "huge":  # far from int32, sums stay far from int64 overflow
        return rng.integers(0, 10**12, (R, E))
    if kind == "all_zero":
        return np.zeros((R, E), np.int64)
    raise AssertionError(kind)


@st.composite
def problems(draw, max_ranks: int = 12, max_experts_per_rank: int = 4, max_slots: int = 4):
    R = draw(st.integers(1, max_ranks))
    G = draw(st.integers(1, max_experts_per_rank))
    S = draw(st.integers(0, max_slots))
    kind = draw(st.sampled_from(LOAD_KINDS))
    if kind == "drawn":  # keep hypothesis' buffer small
        R, G = min(R, 4), min(G, 3)
    load = torch.from_numpy(make_load(draw, kind, R, G).astype(np.int64))
    min_quota = draw(st.one_of(st.none(), st.integers(1, 3), st.integers(1, 2000)))
    return load, S, min_quota


@st.composite
def domain_problems(draw, max_ranks: int = 12, max_experts_per_rank: int = 4, max_slots: int = 4):
    """``problems`` plus an NVLink domain size dividing R."""
    load, S, min_quota = draw(problems(max_ranks, max_experts_per_rank, max_slots))
    R = load.shape[0]
    N = draw(st.sampled_from([d for d in range(1, R + 1) if R % d == 0]))
    return load, S, min_quota, N


# ---- placements (the balancers that may move main experts) ----

#: Hypothesis settings of the slower property tests.
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def holdings(physical_expert: np.ndarray, num_experts: int) -> list[list[int]]:
    """Per expert, the ranks of its physical copies in physical-slot order (plain loops)."""
    ranks: list[list[int]] = [[] for _ in range(num_experts)]
    for t in range(physical_expert.shape[0]):
        for e in physical_expert[t]:
            if e >= 0:
                ranks[e].append(t)
    return ranks


def copy_counts(physical_expert: np.ndarray, num_experts: int, domain_size: int):
    """(weight copies, main moves, cross-domain copies) by plain loops over the layout."""
    R = physical_expert.shape[0]
    G = num_experts // R
    held = {(int(e), t) for t in range(R) for e in physical_expert[t] if e >= 0}
    copies = sum(1 for e, t in held if t != e // G)
    moves = sum(1 for e in range(num_experts) if (e, e // G) not in held)
    cross = sum(1 for e, t in held if t // domain_size != (e // G) // domain_size)
    return copies, moves, cross


def assign_tokens(plan, rank: int, topk_ids: torch.Tensor) -> torch.Tensor:
    """The test oracle of the token reroute: the physical slot of every (token, expert) pair of
    source ``rank``, realizing the plan exactly (the cumulative-quota lookup of UltraEP §5.2).

    The j-th pair (in row-major order of ``topk_ids``) routed to expert e goes to the first instance
    of e, in rank order, whose cumulative count ``split[rank, e, :].cumsum()`` exceeds j: a stable
    sort by expert, then one searchsorted into the cumulative (expert, instance) counts. int64
    [T, k] logical ids -> int64 [T, k] physical slot ids ``t * (G + S) + j``.

    Raises:
        ValueError: bad shapes/ids, or ids whose per-expert counts differ from the plan's load for
            ``rank`` (the plan was made for another load).
    """
    R, E = plan.num_ranks, plan.num_experts
    if (
        not isinstance(topk_ids, torch.Tensor)
        or topk_ids.dtype != torch.int64
        or topk_ids.dim() != 2
    ):
        raise ValueError("topk_ids must be an int64 [T, k] tensor")
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    flat = topk_ids.reshape(-1)
    device = flat.device
    inst = plan.instance_slot.to(device)  # [E, R]
    counts = plan.physical_split[rank].to(device)[inst.clamp(min=0)] * (inst >= 0)  # [E, R]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= E):
        raise ValueError(f"topk_ids must lie in [0, {E})")
    if not torch.equal(torch.bincount(flat, minlength=E), counts.sum(1)):
        raise ValueError(f"topk_ids of rank {rank} do not match the load the plan was solved for")
    order = torch.sort(flat, stable=True).indices
    # After the stable sort, pair i is the (i - start_e)-th pair of its expert e, so its position
    # in the flattened (expert, instance) cumulative counts is just i.
    instance = torch.searchsorted(
        counts.reshape(-1).cumsum(0), torch.arange(flat.numel(), device=device), right=True
    )
    physical = torch.empty_like(flat)
    physical[order] = inst.reshape(-1)[instance]
    return physical.view_as(topk_ids)


def tokens_sent_per_physical_slot(plan, rank: int) -> torch.Tensor:
    """[R * P] tokens ``rank`` sends to every physical slot (summed per P-block: its
    ``input_splits``)."""
    return plan.physical_split[rank]


def tokens_received_per_local_slot(plan, rank: int) -> torch.Tensor:
    """[R, P] tokens ``rank`` receives from each source rank for each of its physical slots:
    megatron's ``num_global_tokens_per_local_expert`` (summed over the last dim: ``output_splits``)."""
    P = plan.physical_slots_per_rank
    return plan.physical_split[:, rank * P : (rank + 1) * P]


# ---- routed (token, expert) pairs and their plans: the reroute's tests (planner and dispatchers) ----

# (R, E, S, k, T)
ROUTING_SHAPES = [
    (2, 4, 1, 1, 7),
    (2, 8, 1, 2, 16),
    (4, 16, 2, 3, 33),
    (8, 64, 2, 8, 64),
    (4, 32, 0, 4, 20),
    (8, 256, 3, 8, 48),
]
ROUTING_SEEDS = range(3)


def random_routing(T, E, k, hot, generator):
    """[T, k] distinct experts per token, skewed towards ``hot`` experts; (topk_ids, routing_map
    [T, E] bool, probs [T, E] zero off the routing)."""
    weights = torch.ones(E)
    weights[hot] = 20.0
    ids = torch.stack(
        [torch.multinomial(weights, k, replacement=False, generator=generator) for _ in range(T)]
    )
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    values = torch.rand(T, k, generator=generator)
    probs = torch.zeros(T, E).scatter_(1, ids, values / values.sum(1, keepdim=True))
    return ids, routing_map, probs


def routing_cases():
    """pytest params (R, E, S, k, T, seed) over ROUTING_SHAPES and ROUTING_SEEDS."""
    for R, E, S, k, T in ROUTING_SHAPES:
        for seed in ROUTING_SEEDS:
            yield pytest.param(R, E, S, k, T, seed, id=f"R{R}-E{E}-S{S}-k{k}-T{T}-seed{seed}")


def planned_routings(R, E, S, k, T, seed):
    """Every rank's routing (:func:`random_routing`), the load, and the plans to test: ultraep's (min
    quota 1, so skewed loads replicate), the identity and eplb-exact's."""
    generator = torch.Generator().manual_seed(seed)
    hot = [0, E // R] if E > 2 else [0]
    routings = [random_routing(T, E, k, hot, generator) for _ in range(R)]
    load = torch.stack([m.sum(0) for _, m, _ in routings])
    plans = [solve(load, S, min_quota=1), fixed_layout.identity_plan(load, S)]
    if S > 0:
        plans.append(fixed_layout.eplb_exact(load, S))
    return routings, load, plans


def host_balancer_cases(config, seeds: int = 4):
    """``(load, balances, plan)`` of the host balancer built from ``config``, for the loads of
    :func:`planned_routings` (R=4, E=16) and the all-zero and all-one loads of the same shape:
    whether its trigger balances the load, and its plan of it (a fresh balancer per load)."""
    for seed in range(seeds):
        _, load, _ = planned_routings(4, 16, 2, 3, 33 * (seed + 1), seed)
        for candidate in (load, torch.zeros_like(load), torch.ones_like(load)):
            host = config.build()
            balanced = host.balances(candidate)
            yield candidate, balanced, host.plan(candidate, balances=balanced)
