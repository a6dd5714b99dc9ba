"""Peers (DeepSeek's re-placing EPLB, LLEP), the comparison metrics and the memory spread."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_invariants import check_plan
from planner_strategies import domain_problems, problems
from ultraep_megatron.planner import baselines, policy, metrics, solve
from ultraep_megatron.planner.peers import (
    Placement,
    cross_domain_copies,
    deepseek_eplb,
    llep,
    main_moves,
    placement_metrics,
    weight_copies,
)
from ultraep_megatron.planner.synthetic import zipf_load

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


def minimax_per_copy(lam: np.ndarray, num_physical: int) -> float:
    """min over copy counts c_e >= 1 with sum c = num_physical of max_e lam_e / c_e (no cap), by
    trying every candidate value lam_e / c."""
    if lam.max() == 0:
        return 0.0
    for value in sorted({x / c for x in lam.tolist() for c in range(1, num_physical + 1) if x}):
        needed = sum(max(1, math.ceil(x / value - 1e-9)) for x in lam.tolist())
        if needed <= num_physical:
            return value
    raise AssertionError


# ---- DeepSeek's re-placing EPLB --------------------------------------------------------------

@settings(max_examples=300, **SETTINGS)
@given(domain_problems(max_ranks=8))
def test_deepseek_eplb_places_all_physical_experts_and_computes_the_load(problem):
    load, S, _, N = problem
    R, E = load.shape
    G = E // R
    placement = deepseek_eplb(load, S)
    layout = placement.physical_expert.numpy()
    split = placement.split.numpy()
    # every rank holds exactly G + S physical experts, every expert at least one copy
    assert layout.shape == (R, G + S) and (layout >= 0).all() and (layout < E).all()
    ranks = holdings(layout, E)
    assert all(ranks[e] for e in range(E))
    # conservation, and tokens only where the expert's weights are
    assert np.array_equal(split.sum(2), load.numpy()) and (split >= 0).all()
    for e in range(E):
        assert split[:, e, [t for t in range(R) if t not in ranks[e]]].sum() == 0
    # round-robin over the copies in physical order: source s's i-th copy gets load // n + extra
    for s in range(R):
        for e in range(E):
            n = len(ranks[e])
            expected = np.zeros(R, np.int64)
            for i, t in enumerate(ranks[e]):
                expected[t] += load[s, e].item() // n + ((i - s) % n < load[s, e].item() % n)
            assert np.array_equal(split[s, e], expected)
    # EPLB's replication minimizes the largest load per copy
    lam = load.sum(0).numpy()
    counts = np.array([len(ranks[e]) for e in range(E)])
    assert max(lam / counts) == pytest.approx(minimax_per_copy(lam, R * (G + S)))
    # the copy counters agree with plain loops
    copies, moves, cross = copy_counts(layout, E, N)
    assert (weight_copies(placement), main_moves(placement),
            cross_domain_copies(placement, N)) == (copies, moves, cross)


def test_deepseek_eplb_by_hand():
    """R=2, G=2, S=1: 6 physical experts. Replication: expert 0 (100) gets both extra copies
    (100/2 = 50 > 40). Copies by descending load per copy: e3 (40) -> rank 0; the three e0 copies
    (33.3): rank 1, rank 1 (33.3 < 40), rank 0 (40 < 66.7); e1 (10) -> rank 1 (66.7 < 73.3); e2 ->
    rank 0, the only one with room. Rank 1 holds expert 0 twice; experts 1, 2 and 3 left home."""
    load = torch.tensor([[100, 10, 10, 40], [0, 0, 0, 0]])
    placement = deepseek_eplb(load, 1)
    assert placement.physical_expert.tolist() == [[3, 0, 2], [0, 0, 1]]
    # source 0's 100 tokens of expert 0 round-robin over its copies (rank 0, rank 1, rank 1)
    assert placement.split[0, 0].tolist() == [34, 66]
    assert (weight_copies(placement), main_moves(placement)) == (4, 3)
    m = placement_metrics(load, placement)
    assert m["imbalance_after"] == pytest.approx(84 / 80) and m["max_fanout"] == 2


def test_deepseek_hierarchical_keeps_groups_inside_nodes():
    """4 groups of 2 experts packed to 2 nodes of 2 ranks by descending group load: groups 3 (90)
    -> node 0, 0 (60) -> node 1, 1 (40) -> node 1, 2 (10) -> node 0. All copies of a group's
    experts stay in its node; the global policy is free to cross."""
    lam = [50, 10, 20, 20, 5, 5, 45, 45]  # groups: 60, 40, 10, 90
    load = torch.tensor([lam, [0] * 8, [0] * 8, [0] * 8])
    placement = deepseek_eplb(load, 2, num_groups=4, num_nodes=2)
    node_of_group = {3: 0, 0: 1, 1: 1, 2: 0}
    layout = placement.physical_expert.numpy()
    for e, ranks in enumerate(holdings(layout, 8)):
        assert {t // 2 for t in ranks} == {node_of_group[e // 2]}
    assert cross_domain_copies(placement, 2) == copy_counts(layout, 8, 2)[2] > 0  # groups moved
    # num_groups not a multiple of num_nodes: EPLB falls back to the global policy
    assert torch.equal(deepseek_eplb(load, 2, num_groups=3, num_nodes=2).physical_expert,
                       deepseek_eplb(load, 2).physical_expert)


# ---- LLEP ---------------------------------------------------------------------------------------

def test_llep_by_hand():
    """R=2, G=2, capacity 1.0 * 1000 / 2 = 500, m = 50. Expert 0 (500, home 0): rank 0 still has
    expert 1 (300) pending, so it takes 200 and spills 300 to rank 1 (room 500 - 200 pending).
    Experts 1, 2, 3 fit at home. Source order fills the chunks: source 0's first 200 tokens of
    expert 0 stay on rank 0, its last 50 and all of source 1's go to rank 1."""
    load = torch.tensor([[250, 150, 50, 50], [250, 150, 50, 50]])
    plan = llep(load, capacity_factor=1.0, min_tokens_per_gemm=50)
    check_plan(load, plan, 1, check_min_quota=False, check_locality=False)
    assert plan.slot_expert.tolist() == [[-1], [0]]
    assert plan.quota.tolist() == [[200, 300], [300, 0], [0, 100], [0, 100]]
    assert plan.split[:, 0].tolist() == [[200, 50], [0, 250]]


def test_llep_floor_is_not_hard_for_the_last_chunk():
    """m = 400 > the 300-token spill: LLEP skips chunks below m only when more remains, so the last
    one goes through anyway."""
    load = torch.tensor([[250, 150, 50, 50], [250, 150, 50, 50]])
    plan = llep(load, capacity_factor=1.0, min_tokens_per_gemm=400)
    assert plan.quota[0].tolist() == [200, 300]


def test_llep_trigger():
    """Rank loads 625 / 375 (imbalance 1.25): below lambda = 1.3 nothing moves; with lambda = 1.2
    LLEP balances to its capacity."""
    load = torch.tensor([[300, 325, 200, 175]])
    load = torch.cat([load, torch.zeros_like(load)])
    identity = llep(load, trigger=1.3)
    assert identity.slot_expert.shape == (2, 0)
    assert torch.equal(identity.quota, baselines.identity_plan(load, 0).quota)
    balanced = llep(load, trigger=1.2, min_tokens_per_gemm=1)
    assert balanced.threshold == int(1.1 * 500) and balanced.slot_expert.numel() > 0
    assert torch.equal(llep(load, trigger=None, min_tokens_per_gemm=1).quota, balanced.quota)


@settings(max_examples=300, **SETTINGS)
@given(problems(max_ranks=8), st.sampled_from([0.8, 1.0, 1.1, 1.5]), st.sampled_from([0, 1, 7, 50]))
def test_llep_conserves_load_keeps_mains_and_respects_its_limits(problem, alpha, m):
    load, _, _ = problem
    R, E = load.shape
    plan = llep(load, capacity_factor=alpha, min_tokens_per_gemm=m, trigger=None)
    # conservation, tokens only to instances, one instance per rank, mains at home
    check_plan(load, plan, plan.num_slots, check_min_quota=False, check_locality=False,
               check_no_worse=False)
    assert main_moves(Placement.from_plan(plan)) == 0
    total = int(load.sum())
    capacity = max(int(alpha * (total // R)) if total // R else total, 1)
    quota, slot_expert = plan.quota.numpy(), plan.slot_expert.numpy()
    # the floor binds all but the last spilled chunk of an expert
    for e in range(E):
        small = [t for t in range(R) if e in slot_expert[t] and quota[e, t] < m]
        assert len(small) <= 1
    # the capacity binds whenever it can hold the load and no chunk below m must be skipped
    if m <= 1 and capacity * R >= total:
        assert plan.threshold <= capacity


# ---- comparison metrics and memory spread -------------------------------------------------------

@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_placement_metrics_agree_with_plan_metrics(problem):
    load, S, min_quota, N = problem
    for plan in (solve(load, S, min_quota=min_quota, domain_size=N), baselines.eplb_exact(load, S)):
        m, p = metrics(load, plan, domain_size=N), placement_metrics(
            load, Placement.from_plan(plan), domain_size=N)
        for key in ("imbalance_before", "imbalance_after", "memory_spread_before",
                    "memory_spread_after", "max_fanout", "inflight_ratio"):
            assert p[key] == pytest.approx(m[key]), key
        assert (p["weight_copies"], p["main_moves"], p["cross_domain_copies"]) == (
            m["replicas"], 0, m["cross_domain_replicas"])


@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_memory_spread_against_plain_loops(problem):
    """Rows received per rank recomputed from ``physical_split`` and the load with loops; equal to
    the compute imbalance (a rank computes exactly the rows it receives)."""
    load, S, min_quota, N = problem
    plan = solve(load, S, min_quota=min_quota, domain_size=N)
    R, E = load.shape
    G, L = E // R, plan.physical_slots_per_rank
    physical = plan.physical_split.numpy()
    after = [sum(int(physical[s, t * L + j]) for s in range(R) for j in range(L)) for t in range(R)]
    before = [sum(int(load[s, e]) for s in range(R) for e in range(t * G, (t + 1) * G))
              for t in range(R)]
    total = int(load.sum())
    m = metrics(load, plan, domain_size=N)
    for key, rows in (("memory_spread_before", before), ("memory_spread_after", after)):
        assert m[key] == (pytest.approx(max(rows) * R / total) if total else 1.0)
    assert m["memory_spread_after"] == pytest.approx(m["imbalance_after"])
    assert m["cross_domain_replicas"] == 0


def test_memory_spread_and_copies_of_the_peers_on_zipf_load():
    """The peers on one benchmark load: DeepSeek's EPLB re-places nearly every expert (copies ~
    the physical slots off home), UltraEP copies only its replicas; every balancer's memory spread
    drops with its imbalance."""
    load = zipf_load(32, 128, 3.0, seed=2)
    ultra = Placement.from_plan(solve(load, 2))
    deepseek = deepseek_eplb(load, 2)
    lazy = Placement.from_plan(llep(load))
    fixed = Placement.from_plan(baselines.eplb_exact(load, 2))
    for placement in (ultra, deepseek, lazy, fixed):
        m = placement_metrics(load, placement, domain_size=8)
        assert m["memory_spread_after"] < m["memory_spread_before"]
        assert (m["weight_copies"], m["main_moves"], m["cross_domain_copies"]) == copy_counts(
            placement.physical_expert.numpy(), 128, 8)
    assert main_moves(fixed) == main_moves(ultra) == main_moves(lazy) == 0
    assert weight_copies(deepseek) > 4 * weight_copies(ultra)


def test_fixed_layout_labels_and_aliases():
    assert baselines.eplb_fixed is baselines.eplb
    assert baselines.eplb_exact_fixed is baselines.eplb_exact
    assert all("mains at home" in policy.LABELS[k] for k in (policy.EPLB, policy.EPLB_EXACT))


@pytest.mark.parametrize("call", [
    lambda l: deepseek_eplb(l, -1), lambda l: deepseek_eplb(l - 1, 1),
    lambda l: deepseek_eplb(l, 1, num_groups=0), lambda l: deepseek_eplb(l, 1, num_groups=3),
    lambda l: llep(l - 1), lambda l: llep(l, capacity_factor=0),
    lambda l: llep(l, min_tokens_per_gemm=-1), lambda l: cross_domain_copies(
        Placement.from_plan(baselines.identity_plan(l, 1)), 3),
    lambda l: placement_metrics(l + 1, Placement.from_plan(baselines.identity_plan(l, 1)))])
def test_peers_reject_bad_input(call):
    with pytest.raises(ValueError):
        call(torch.zeros(2, 4, dtype=torch.int64))
