"""Property tests of ``ultraep_megatron.planner.solve`` (invariants, equivalence, determinism)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_helpers import check_plan, expected_min_quota
from planner_helpers import problems
from ultraep_megatron.planner import solve
from ultraep_megatron.traces.synthetic import zipf_load

REPO = Path(__file__).resolve().parents[2]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=1500, **SETTINGS)
@given(problems())
def test_invariants_hold(problem):
    load, S, min_quota = problem
    check_plan(load, solve(load, S, min_quota=min_quota), S, min_quota=min_quota)


@settings(max_examples=500, **SETTINGS)
@given(problems(max_ranks=12, max_experts_per_rank=4, max_slots=4))
def test_compiled_matches_reference_bit_for_bit(problem):
    load, S, min_quota = problem
    fast = solve(load, S, min_quota=min_quota)
    slow = solve(load, S, min_quota=min_quota, implementation="reference")
    check_plan(load, slow, S, min_quota=min_quota)
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.threshold == slow.threshold


@pytest.mark.parametrize(
    "R,E,S,imbalance,seed",
    [(32, 128, 1, 3.0, 0), (16, 64, 2, 2.0, 1), (8, 64, 1, 4.0, 2), (64, 256, 2, 4.0, 3)],
)
def test_zipf_loads_match_reference(R, E, S, imbalance, seed):
    load = zipf_load(R, E, imbalance, seed=seed)
    fast, slow = solve(load, S), solve(load, S, implementation="reference")
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


@pytest.mark.parametrize("R,G", [(8, 4), (16, 4), (32, 4), (32, 8), (64, 2), (64, 4)])
@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("imbalance", [1.3, 2.0, 4.0])
def test_zipf_balance_quality(R, G, S, imbalance):
    """Near-optimal on paper-like loads: within 1 % of the average bound (the paper's greedy
    leaves 4-7 % with one slot and 3-4x skew)."""
    load = zipf_load(R, R * G, imbalance, seed=R + G + S)
    plan = solve(load, S)
    check_plan(load, plan, S)
    mean = load.sum().item() / R
    after = plan.quota.sum(0).max().item()
    assert after <= 1.01 * mean, after / mean


def _optimum_threshold(load: np.ndarray, num_slots: int) -> int:
    """Exhaustive optimum over all slot placements (tiny problems). For a fixed placement the
    best threshold is max over expert sets X of ceil(load(X) / |ranks hosting X|) (Hall's
    condition for the transportation problem)."""
    import itertools

    R, E = load.shape
    G = E // R
    lam = load.sum(0)
    per_rank = []
    for t in range(R):
        others = [e for e in range(E) if e // G != t]
        per_rank.append(
            [c for k in range(num_slots + 1) for c in itertools.combinations(others, k)]
        )
    subsets = [[e for e in range(E) if m >> e & 1] for m in range(1, 1 << E)]
    best = None
    for placement in itertools.product(*per_rank):
        hosts = [{e // G} for e in range(E)]
        for t, chosen in enumerate(placement):
            for e in chosen:
                hosts[e].add(t)
        tau = max(
            -(-int(lam[X].sum()) // len(set().union(*(hosts[e] for e in X)))) for X in subsets
        )
        best = tau if best is None else min(best, tau)
    return best


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_tiny_problems_reach_the_exhaustive_optimum(data):
    R = data.draw(st.integers(2, 3))
    G = data.draw(st.integers(1, 2))
    E = R * G
    values = data.draw(st.lists(st.integers(0, 40), min_size=R * E, max_size=R * E))
    load = np.array(values, np.int64).reshape(R, E)
    plan = solve(torch.from_numpy(load), 1, min_quota=1)
    assert plan.threshold == _optimum_threshold(load, 1)


# ---- degenerate inputs -------------------------------------------------------------------------


def test_all_zero_load_gives_empty_plan():
    load = torch.zeros(4, 8, dtype=torch.int64)
    plan = solve(load, 2)
    check_plan(load, plan, 2)
    assert (plan.slot_expert == -1).all() and plan.threshold == 0
    assert plan.quota.sum() == 0 and plan.physical_split.sum() == 0


def test_one_expert_takes_every_token():
    R, G, S = 8, 2, 1
    load = torch.zeros(R, R * G, dtype=torch.int64)
    load[:, 5] = 1000  # 8000 tokens on expert 5 (home rank 2); the average is 1000 per rank
    plan = solve(load, S, min_quota=1)
    check_plan(load, plan, S, min_quota=1)
    assert plan.threshold == 1000  # one instance per rank carries exactly the average
    assert set(plan.slot_expert.flatten().tolist()) == {5, -1}
    assert (plan.slot_expert == 5).sum() == R - 1


def test_single_rank_is_identity():
    load = torch.tensor([[5, 0, 7, 1]], dtype=torch.int64)
    plan = solve(load, 3)
    check_plan(load, plan, 3)
    assert (plan.slot_expert == -1).all() and plan.threshold == 13
    assert plan.quota.flatten().tolist() == [5, 0, 7, 1]


def test_more_slots_than_experts():
    load = zipf_load(4, 8, 3.0, seed=5)
    plan = solve(load, 50, min_quota=1)
    check_plan(load, plan, 50, min_quota=1)
    assert plan.threshold == -(-int(load.sum()) // 4)


def test_no_slots_is_identity():
    load = zipf_load(8, 32, 3.0, seed=7)
    plan = solve(load, 0)
    check_plan(load, plan, 0)
    assert plan.slot_expert.shape == (8, 0)
    assert plan.threshold == load.sum(0).view(8, 4).sum(1).max()


def test_source_without_tokens_and_rank_without_load():
    load = zipf_load(8, 16, 3.0, seed=3)
    load[2] = 0  # source rank 2 sends nothing
    load[:, 10:12] = 0  # rank 5's experts receive nothing: all slack
    plan = solve(load, 1)
    split = check_plan(load, plan, 1)
    assert split[2].sum() == 0
    assert plan.quota.sum(0)[5] > 0  # the idle rank hosts a replica


def test_ties_everywhere():
    load = torch.full((6, 12), 7, dtype=torch.int64)  # already balanced
    plan = solve(load, 2)
    check_plan(load, plan, 2)
    assert (plan.slot_expert == -1).all() and plan.threshold == 6 * 7 * 2
    tied = torch.zeros(4, 4, dtype=torch.int64)
    tied[:, 0] = tied[:, 1] = 100  # two equally hot experts on two ranks, two idle ranks
    plan = solve(tied, 1, min_quota=1)
    check_plan(tied, plan, 1, min_quota=1)
    assert plan.threshold == 200  # 800 tokens over 4 ranks
    # Ties broken by rank id: rank 0 sheds first, to the lowest idle rank.
    assert plan.slot_expert.flatten().tolist() == [-1, -1, 0, 1]


def test_min_quota_remainder_is_shed_anyway():
    """Rank 0 (2000 tokens) must shed 1100 at threshold 900; host 1 takes 900 and leaves a
    100-token remainder below min_quota 300. Algorithm 1 as written gives up on 900 there (and
    settles for 1000, one replica). The planner sheds 300 to rank 2 instead: rank 0 ends at 800,
    below the threshold, and 900 is the optimum (a replica on rank 2 needs 600 + 300 <= tau)."""
    load = torch.tensor([[2000, 0, 0], [0, 0, 0], [0, 0, 600]], dtype=torch.int64)
    plan = solve(load, 1, min_quota=300)
    check_plan(load, plan, 1, min_quota=300)
    assert plan.threshold == 900
    assert plan.slot_expert.flatten().tolist() == [-1, 0, 0]
    assert plan.quota[0].tolist() == [800, 900, 300]


def test_default_min_quota_is_one_percent_of_mean():
    load = zipf_load(16, 64, 3.0, seed=11)
    floor = expected_min_quota(load.numpy(), None)
    assert floor == -(-int(load.sum()) // 1600)
    plan = solve(load, 2)
    check_plan(load, plan, 2)  # checks every replica against that floor
    replicas = plan.slot_expert >= 0
    quotas = plan.quota[plan.slot_expert[replicas], replicas.nonzero()[:, 0]]
    assert quotas.numel() > 0 and quotas.min() >= floor


def test_plan_lives_on_load_device_and_load_is_untouched():
    load = zipf_load(4, 8, 2.0, seed=0)
    before = load.clone()
    plan = solve(load, 1)
    assert torch.equal(load, before)
    assert all(
        getattr(plan, n).device == load.device for n in ("slot_expert", "quota", "physical_split")
    )
    transposed = load.t().contiguous().t()  # non-contiguous input is accepted
    assert torch.equal(solve(transposed, 1).physical_split, plan.physical_split)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "load,slots,min_quota,message",
    [
        (torch.zeros(3, 8, dtype=torch.int64), 1, None, "E % R"),
        (torch.zeros(0, 0, dtype=torch.int64), 1, None, "R >= 1"),
        (torch.tensor([[1, -1], [0, 0]]), 1, None, "negative"),
        (torch.zeros(2, 4, dtype=torch.int32), 1, None, "int64"),
        (torch.zeros(2, 4), 1, None, "int64"),
        (torch.zeros(2, 2, 2, dtype=torch.int64), 1, None, r"\[R, E\]"),
        (np.zeros((2, 4), np.int64), 1, None, "torch.Tensor"),
        (torch.zeros(2, 4, dtype=torch.int64), -1, None, "num_slots"),
        (torch.zeros(2, 4, dtype=torch.int64), 1.5, None, "num_slots"),
        (torch.zeros(2, 4, dtype=torch.int64), 1, 0, "min_quota"),
        (torch.zeros(2, 4, dtype=torch.int64), 1, None, "implementation"),
    ],
)
def test_bad_input_raises_value_error(load, slots, min_quota, message):
    implementation = "gpu" if message == "implementation" else "compiled"
    with pytest.raises(ValueError, match=message):
        solve(load, slots, min_quota=min_quota, implementation=implementation)
    if isinstance(load, torch.Tensor) and "negative" in message:
        with pytest.raises(ValueError, match=message):
            solve(load, slots, implementation="reference")


# ---- determinism -------------------------------------------------------------------------------

_DIGEST_SCRIPT = """
import hashlib, sys, torch
from ultraep_megatron.planner import solve
from ultraep_megatron.traces.synthetic import zipf_load
h = hashlib.sha256()
for R, E, S, imb, seed, N in [(64, 256, 2, 3.0, 0, None), (32, 160, 1, 4.0, 1, None),
                              (40, 160, 4, 1.3, 2, None), (8, 8, 1, 2.0, 3, None),
                              (64, 256, 2, 3.0, 0, 8), (32, 128, 1, 4.0, 1, 16)]:
    plan = solve(zipf_load(R, E, imb, seed=seed), S, domain_size=N)
    for t in (plan.slot_expert, plan.quota, plan.physical_split):
        h.update(t.numpy().tobytes())
    h.update(str(plan.threshold).encode())
print(h.hexdigest())
"""


def test_same_plan_bit_for_bit_in_a_fresh_process():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    fresh = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
    ).stdout.strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_DIGEST_SCRIPT, {})
    assert len(fresh) == 64 and fresh == out.getvalue().strip()
