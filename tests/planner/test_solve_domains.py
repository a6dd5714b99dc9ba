"""``solve(..., domain_size=N)``: replicas stay inside their home's NVLink domain.

Bounds used below (N ranks per domain, G experts per rank, total_d = load of domain d's experts):

- lower: a replica of e lives only in home(e)'s domain, so domain d's load stays on its N ranks and
  every such plan has max rank load >= LB_N = max_d ceil(total_d / N) (``domain_bound``);
- upper: the plan is never worse than no balancing (initial max rank load);
- exact: with ``min_quota = 1`` and S >= (N - 1) * G the planner reaches LB_N exactly. At
  tau = LB_N an overloaded rank r with excess left always finds room: its domain's other ranks
  carry less than (N - 1) * tau, so one of them has slack >= 1; either it already holds a
  replica of r's expert with the most load left (then r tops it up) or it has a free slot (it
  holds at most one replica of each of the (N - 1) * G experts of the domain's other ranks, and
  not this one). Every step moves >= 1 token, so the oracle succeeds at the first probe.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_helpers import check_plan, domain_bound
from planner_helpers import domain_problems, make_load
from ultraep_megatron.planner import domain_lower_bound, solve
from ultraep_megatron.traces.synthetic import zipf_load

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_TENSORS = ("slot_expert", "quota", "physical_split")


def assert_same_plan(a, b):
    for name in PLAN_TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.threshold == b.threshold


@settings(max_examples=800, **SETTINGS)
@given(domain_problems())
def test_domain_invariants_hold(problem):
    """Every replica inside its home's domain, load conserved, LB_N <= threshold <= initial max."""
    load, S, min_quota, N = problem
    plan = solve(load, S, min_quota=min_quota, domain_size=N)
    check_plan(load, plan, S, min_quota=min_quota, domain_size=N)
    assert domain_lower_bound(load, N) == domain_bound(load.numpy(), N)


@settings(max_examples=400, **SETTINGS)
@given(domain_problems())
def test_domain_compiled_matches_reference_bit_for_bit(problem):
    load, S, min_quota, N = problem
    fast = solve(load, S, min_quota=min_quota, domain_size=N)
    slow = solve(load, S, min_quota=min_quota, domain_size=N, implementation="reference")
    assert_same_plan(fast, slow)


@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_one_domain_is_the_plain_planner(problem):
    load, S, min_quota, _ = problem
    plain = solve(load, S, min_quota=min_quota)
    assert_same_plan(solve(load, S, min_quota=min_quota, domain_size=load.shape[0]), plain)
    assert_same_plan(solve(load, S, min_quota=min_quota, domain_size=None), plain)


@settings(max_examples=300, **SETTINGS)
@given(st.data())
def test_enough_slots_reach_the_domain_bound_exactly(data):
    """min_quota = 1, S >= (N - 1) * G: threshold == LB_N (proof in the module docstring)."""
    R = data.draw(st.sampled_from([2, 4, 6, 8, 12]))
    G = data.draw(st.integers(1, 3))
    N = data.draw(st.sampled_from([d for d in range(1, R + 1) if R % d == 0]))
    kind = data.draw(
        st.sampled_from(
            [
                "uniform",
                "zipf",
                "sparse",
                "one_expert",
                "one_rank_hot",
                "empty_rank",
                "binary",
                "huge",
            ]
        )
    )
    load = torch.from_numpy(make_load(data.draw, kind, R, G).astype(np.int64))
    S = (N - 1) * G + data.draw(st.integers(0, 1))
    plan = solve(load, S, min_quota=1, domain_size=N)
    check_plan(load, plan, S, min_quota=1, domain_size=N)
    assert plan.threshold == domain_bound(load.numpy(), N)


def test_one_hot_domain_by_hand():
    """R=4, N=2, G=1: expert 0 (home rank 0) takes all 800 tokens. Its only possible host is rank
    1, so the best is 400 per rank of domain 0 and ranks 2, 3 stay idle; without domains the
    planner spreads it over all four ranks."""
    load = torch.zeros(4, 4, dtype=torch.int64)
    load[:, 0] = 200
    plan = solve(load, 1, min_quota=1, domain_size=2)
    check_plan(load, plan, 1, min_quota=1, domain_size=2)
    assert plan.slot_expert.flatten().tolist() == [-1, 0, -1, -1]
    assert plan.quota[0].tolist() == [400, 400, 0, 0] and plan.threshold == 400
    # Tokens still come from every source, including those of the other domain.
    assert plan.split[:, 0].sum(1).tolist() == [200, 200, 200, 200]
    free = solve(load, 1, min_quota=1)
    assert free.threshold == 200 and (free.slot_expert[2:] == 0).all()


def test_negative_control_plain_plan_crosses_domains():
    """The domain check in ``check_plan`` is not vacuous: on a load whose hot rank's domain cannot
    absorb its excess, the unconstrained plan uses other domains' ranks and fails it."""
    load = zipf_load(8, 32, 4.0, seed=4)
    hot = int(load.sum(0).view(8, 4).sum(1).argmax())
    load[:, hot * 4 : (hot + 1) * 4] *= 4
    free = solve(load, 2)
    check_plan(load, free, 2)
    with pytest.raises(AssertionError, match="outside its domain"):
        check_plan(load, free, 2, domain_size=2)
    assert free.threshold < domain_bound(load.numpy(), 2)  # it beats the domain bound
    bound = solve(load, 2, domain_size=2)
    check_plan(load, bound, 2, domain_size=2)


@pytest.mark.parametrize("R,G,N", [(16, 4, 4), (32, 4, 8), (32, 8, 16), (64, 4, 8), (64, 4, 16)])
@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("imbalance", [1.3, 4.0])
def test_zipf_domain_balance_quality(R, G, N, S, imbalance):
    """Near the domain bound on the benchmark's loads (measured worst 1.003 over its settings)."""
    load = zipf_load(R, R * G, imbalance, seed=R + G + N + S)
    plan = solve(load, S, domain_size=N)
    check_plan(load, plan, S, domain_size=N)
    assert plan.threshold <= 1.01 * domain_bound(load.numpy(), N)


@pytest.mark.parametrize(
    "R,E,S,N,imbalance,seed",
    [(64, 256, 2, 8, 3.0, 0), (32, 128, 1, 16, 4.0, 1), (64, 128, 4, 16, 2.0, 2)],
)
def test_zipf_domain_loads_match_reference(R, E, S, N, imbalance, seed):
    load = zipf_load(R, E, imbalance, seed=seed)
    assert_same_plan(
        solve(load, S, domain_size=N), solve(load, S, domain_size=N, implementation="reference")
    )


@pytest.mark.parametrize("domain_size", [3, 0, -2, 16, 1.5, True, "8"])
def test_bad_domain_size_raises(domain_size):
    load = torch.zeros(8, 16, dtype=torch.int64)
    for implementation in ("compiled", "reference"):
        with pytest.raises(ValueError, match="domain_size"):
            solve(load, 1, domain_size=domain_size, implementation=implementation)
    with pytest.raises(ValueError, match="domain_size"):
        domain_lower_bound(load, domain_size)
