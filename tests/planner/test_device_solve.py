"""``planner.device_solve``: valid plans, no host read, the device's probes (Triton, the torch
lockstep) = the specification (``reference.greedy_replicas``) bit for bit, and balance within 0.2 %
of the host planner's on its quality grid."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from planner_helpers import SETTINGS, check_plan, domain_problems
from ultraep_megatron.planner import device_solve, metrics, solve
from ultraep_megatron.planner.device_solve import (
    lockstep_probe,
    probe_inputs,
    reference_probe,
    search_rounds,
)
from ultraep_megatron.traces.synthetic import zipf_load

REPO = Path(__file__).resolve().parents[2]
PLAN_TENSORS = ("slot_expert", "quota", "physical_split")


@settings(max_examples=300, **SETTINGS)
@given(domain_problems())
def test_device_plans_are_valid(problem):
    """Every invariant of ``check_plan`` (load routed exactly, quotas realized, floor, locality,
    replicas inside domains, bounds) on random and adversarial loads; threshold a 0-dim tensor."""
    load, S, min_quota, N = problem
    plan = device_solve(load, S, min_quota=min_quota, domain_size=N)
    assert isinstance(plan.threshold, torch.Tensor) and plan.threshold.dim() == 0
    assert plan.threshold.dtype == torch.int64 and plan.threshold.device == load.device
    check_plan(load, plan, S, min_quota=min_quota, domain_size=N)


@settings(max_examples=60, **SETTINGS)
@given(domain_problems(max_ranks=8, max_slots=3))
def test_specification_and_torch_calls_agree(problem):
    """The torch lockstep (the device path where Triton does not run: fixed step count, no host
    read) answers every probe as the specification does, ``reference.greedy_replicas`` run
    threshold by threshold: feasibility, and every output of a feasible probe, for 6 thresholds
    from the lower bound to past the initial max; whole solves give the same plan."""
    load, S, min_quota, N = problem
    expert_load, rank_load, order, lower, floor = probe_inputs(load, min_quota, N)
    taus = torch.linspace(int(lower), int(rank_load.max()) + 1, 6).long()
    args = (taus, expert_load, rank_load, order, floor, S, N, True)
    spec, lockstep = reference_probe(*args), lockstep_probe(*args)
    assert torch.equal(spec[0], lockstep[0])
    for a, b in zip(spec[1:], lockstep[1:]):
        assert torch.equal(a[spec[0]], b[spec[0]])
    # Whole solves: "torch" (what the CPU backend's device path runs) plans as "reference".
    spec_plan = device_solve(
        load, S, min_quota=min_quota, domain_size=N, implementation="reference"
    )
    torch_plan = device_solve(load, S, min_quota=min_quota, domain_size=N, implementation="torch")
    for field in ("slot_expert", "quota", "physical_split", "threshold"):
        assert torch.equal(getattr(spec_plan, field), getattr(torch_plan, field)), field


def test_a_probe_that_differs_from_the_specification_is_seen():
    """Negative control of the comparison above: the lockstep at thresholds one token higher, or
    with one replica's quota moved, disagrees with the specification on a load that replicates."""
    load = zipf_load(8, 32, 3.0, seed=4)
    expert_load, rank_load, order, lower, floor = probe_inputs(load, None, 8)
    taus = torch.linspace(int(lower), int(rank_load.max()) + 1, 6).long()
    args = (expert_load, rank_load, order, floor, 2, 8, True)
    spec = reference_probe(taus, *args)
    assert int((spec[2] > 0).sum()) > 0  # replicas to compare
    shifted = lockstep_probe(taus + 1, *args)
    moved = lockstep_probe(taus, *args)
    first = int(spec[0].nonzero()[0])
    cell = (moved[2][first] > 0).nonzero()[0]
    moved[2][first][tuple(cell)] -= 1
    for other in (shifted, moved):
        assert not (
            torch.equal(spec[0], other[0])
            and all(torch.equal(a[spec[0]], b[spec[0]]) for a, b in zip(spec[1:], other[1:]))
        )


@pytest.mark.parametrize("control", [False, True])
def test_check_plan_catches_a_broken_device_plan(control):
    """Negative control for the test above: moving one token between two instances' quotas
    breaks ``split.sum(0) == quota``."""
    load = zipf_load(8, 32, 3.0, seed=4)
    plan = device_solve(load, 2)
    if control:
        plan.quota[0, 0] += 1
        plan.quota[1, 1] -= 1
        with pytest.raises(AssertionError):
            check_plan(load, plan, 2)
    else:
        check_plan(load, plan, 2)


def test_no_host_read_on_the_meta_device():
    """On the meta device every host read of data raises (``.item()``, ``bool()``, indexing by a
    0-dim tensor, ``nonzero``): the whole solve runs there, default floor and domains included."""
    load = torch.empty(4, 8, dtype=torch.int64, device="meta")  # small: meta ops are slow
    plan = device_solve(load, 1, domain_size=2)
    assert plan.physical_split.shape == (4, 4 * 3) and plan.threshold.device.type == "meta"
    with pytest.raises(RuntimeError, match="meta"):  # control: a host read there raises
        bool((load > 0).any())


def test_search_rounds_reach_one_grid_step():
    """The fixed round count narrows the largest possible interval (2048 R grid steps) to one:
    recomputed by the exact worst case of a round (widths of the probe gaps)."""
    for R in (1, 4, 8, 64, 256):
        for probes in (2, 8, 32):
            width, rounds = 2048 * R + 1, 0
            while width > 1:
                k = [(width - 1) * i // probes for i in range(probes)]
                gaps = [1] + [b - a for a, b in zip(k, k[1:])] + [width - 1 - k[-1]]
                width, rounds = max(gaps), rounds + 1
            assert search_rounds(R, probes) == rounds


@pytest.mark.parametrize(
    "R,E,S,imbalance,N",
    [(8, 32, 1, 2.0, None), (32, 128, 2, 3.0, None), (64, 256, 4, 1.3, None), (64, 256, 2, 3.0, 8)],
)
def test_device_plan_is_the_host_plan_on_zipf_loads(R, E, S, imbalance, N):
    """The device planner runs the host planner's greedy; where both searches settle on the same
    threshold the plans agree bit for bit (these loads)."""
    load = zipf_load(R, E, imbalance, seed=1)
    host, device = solve(load, S, domain_size=N), device_solve(load, S, domain_size=N)
    for name in PLAN_TENSORS:
        assert torch.equal(getattr(host, name), getattr(device, name)), name
    assert host.threshold == int(device.threshold)


# The host planner's quality grid (test_solve.test_zipf_balance_quality) plus NVLink domains.
QUALITY_GRID = [
    (R, G, S, imbalance, None)
    for R, G in [(8, 4), (16, 4), (32, 4), (32, 8), (64, 2), (64, 4)]
    for S in (1, 2, 4)
    for imbalance in (1.3, 2.0, 4.0)
] + [
    (R, G, 2, imbalance, N)
    for R, G in [(32, 4), (64, 4)]
    for N in (8, 16)
    for imbalance in (1.3, 4.0)
]


def quality(planner, grid=QUALITY_GRID):
    """(imbalance after per setting, total replicas) of ``planner(load, S, N)`` over the grid."""
    imbalances, replicas = [], 0
    for R, G, S, imbalance, N in grid:
        load = zipf_load(R, R * G, imbalance, seed=R + G + S)
        m = metrics(load, planner(load, S, N), domain_size=N)
        imbalances.append(m["imbalance_after"])
        replicas += m["replicas"]
    return np.array(imbalances), replicas


@pytest.mark.parametrize("control", [False, True])
def test_device_balance_within_0_2_percent_of_the_host(control, monkeypatch):
    """Mean and worst imbalance after within 0.2 % of the host planner's, at most 10 % more
    replicas. Control: a device search cut to one round (so it stops on a grid of ~M/32 steps)
    must miss the bound."""
    host, host_replicas = quality(lambda load, S, N: solve(load, S, domain_size=N))
    if control:
        module = importlib.import_module("ultraep_megatron.planner.device_solve")
        monkeypatch.setattr(module, "search_rounds", lambda R, probes=1: 1)
    device, device_replicas = quality(lambda load, S, N: device_solve(load, S, domain_size=N))
    ok = (
        device.mean() <= 1.002 * host.mean()
        and device.max() <= 1.002 * host.max()
        and device_replicas <= 1.1 * host_replicas
    )
    print(
        f"host mean {host.mean():.5f} worst {host.max():.5f} replicas {host_replicas}; "
        f"device mean {device.mean():.5f} worst {device.max():.5f} replicas {device_replicas}"
    )
    assert ok != control


# ---- the Triton probe under the interpreter (a subprocess: TRITON_INTERPRET is read at import) ---

_TRITON_SCRIPT = r"""
import json, sys
import numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from planner_helpers import LOAD_KINDS, check_plan, make_load
from ultraep_megatron.planner import device_solve
from ultraep_megatron.planner.device_solve import probe_inputs, reference_probe
from ultraep_megatron.planner._triton_solve import probe

rng = np.random.default_rng(int(sys.argv[2]))
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
draw = lambda strategy: int(rng.integers(2**32))  # the seed make_load draws
summary = {"loads": 0, "probes": 0, "feasible": 0, "mismatches": 0, "shifted_mismatches": 0,
           "solves": 0}

def compare(a, b):
    same = torch.equal(a[0], b[0])
    for x, y in zip(a[1:], b[1:]):
        same = same and torch.equal(x[a[0]], y[a[0]])  # outputs of feasible probes
    return same

for case in range(int(sys.argv[3])):
    R = int(rng.choice([4, 8, 16])); G = int(rng.integers(1, 5))
    S = int(rng.integers(0, 5)); N = int(rng.choice([d for d in (1, 2, 4, 8, 16) if R % d == 0]))
    kind = str(rng.choice([k for k in LOAD_KINDS if k != "drawn"]))
    load = torch.from_numpy(make_load(draw, kind, R, G).astype(np.int64)).to(device)
    min_quota = [None, 1, int(rng.integers(1, 500))][case % 3]
    expert_load, rank_load, order, lower, floor = probe_inputs(load, min_quota, N)
    highest = int(rank_load.max()); low = int(lower)
    taus = torch.tensor(sorted(rng.integers(max(low - 2, 0), highest + 2, 8)), dtype=torch.int64, device=device)
    taus[0] = low
    args = (expert_load, rank_load, order, floor, S, N, True)
    ref, tri = reference_probe(taus, *args), probe(taus, *args)
    summary["loads"] += 1; summary["probes"] += 8; summary["feasible"] += int(ref[0].sum())
    summary["mismatches"] += not compare(ref, tri)
    # Control: the reference one token higher must disagree somewhere (the comparison sees it).
    summary["shifted_mismatches"] += not compare(reference_probe(taus + 1, *args), tri)

from ultraep_megatron.traces.synthetic import zipf_load
for R, G, S, N, min_quota in [(4, 2, 1, 2, None), (8, 2, 2, 8, 1), (4, 4, 3, 1, 200)]:
    load = zipf_load(R, R * G, 3.0, seed=R + S).to(device)  # whole solves: same plan, and a valid one
    a = device_solve(load, S, min_quota=min_quota, domain_size=N, implementation="triton")
    b = device_solve(load, S, min_quota=min_quota, domain_size=N, implementation="reference")
    check_plan(load, a, S, min_quota=min_quota, domain_size=N)
    for name in ("slot_expert", "quota", "physical_split", "threshold"):
        summary["mismatches"] += not torch.equal(getattr(a, name), getattr(b, name))
    summary["solves"] += 1
print(json.dumps(summary))
"""


def test_triton_probe_matches_reference_bit_for_bit():
    """The Triton kernel under ``TRITON_INTERPRET=1`` on CPU tensors: 48 random and adversarial
    loads (R 4-16, E <= 64, S 0-4, every domain size, floors None / 1 / random), 8 thresholds
    each from the lower bound to past the initial max: feasibility and every output of every
    feasible probe equal the reference's; three whole solves (R 4-8) give the same plan and a
    valid one. Control: the reference at thresholds one higher disagrees with the kernel on some
    loads."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT, str(REPO / "tests" / "planner"), "7", "48"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["loads"] == 48 and summary["solves"] == 3
    assert summary["feasible"] > 48  # the comparison covers outputs, not only failures
    assert summary["mismatches"] == 0
    assert summary["shifted_mismatches"] > 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_probe_on_cuda_matches_reference_bit_for_bit():
    """The same property set as the interpreter's, compiled for the GPU, on 160 loads."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRITON_SCRIPT,
            str(REPO / "tests" / "planner"),
            "11",
            "160",
            "cuda",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["loads"] == 160 and summary["solves"] == 3 and summary["feasible"] > 160
    assert summary["mismatches"] == 0
    assert summary["shifted_mismatches"] > 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_matches_reference_without_a_sync():
    """On a GPU: the default (Triton) plan equals the torch reference's and the host planner's
    balance, is valid, and the solve runs under ``set_sync_debug_mode("error")`` (any
    synchronizing host read raises)."""
    pytest.importorskip("triton")
    for R, E, S, imbalance, N in [
        (8, 64, 2, 3.0, None),
        (64, 256, 2, 4.0, None),
        (64, 256, 4, 1.3, 8),
        (16, 64, 1, 2.0, 4),
    ]:
        load = zipf_load(R, E, imbalance, seed=R + S).cuda()
        device_solve(load, S, domain_size=N)  # compile outside the sync check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fast = device_solve(load, S, domain_size=N)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        slow = device_solve(load, S, domain_size=N, implementation="reference")
        for name in (*PLAN_TENSORS, "threshold"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        check_plan(load, fast, S, domain_size=N)
        host = solve(load.cpu(), S, domain_size=N)
        assert int(fast.threshold) <= 1.002 * host.threshold


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"load": torch.zeros(3, 8, dtype=torch.int64)}, "E % R"),
        ({"load": torch.tensor([[1, -1], [0, 0]])}, "negative"),
        ({"load": torch.zeros(2, 4, dtype=torch.int32)}, "int64"),
        ({"num_slots": -1}, "num_slots"),
        ({"min_quota": 0}, "min_quota"),
        ({"domain_size": 3}, "domain_size"),
        ({"implementation": "compiled"}, "implementation"),
    ],
)
def test_bad_input_raises_value_error(kwargs, message):
    args = {"load": torch.zeros(2, 4, dtype=torch.int64), "num_slots": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        device_solve(args.pop("load"), args.pop("num_slots"), **args)
