"""The fused plan op (``planner/fused_plan.py``, ``triton_plan.py``, ``record_layout.py``): the
host planner's record and table equal what ``solve``, ``rank_reroute`` and ``metrics`` say on the
property set and on large seeded grids; the Triton kernel under ``TRITON_INTERPRET=1`` writes the
same record and table bit for bit; the op is one op to dispatch modes and fake tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from planner_helpers import REPO, SETTINGS, domain_problems, run_interpreted
from ultraep_megatron.planner import BalancerConfig, metrics, rank_reroute
from ultraep_megatron.planner.fused_plan import host_plan, plan_invocation
from ultraep_megatron.planner.record_layout import (
    INT32_MAX,
    STATUS_INT32_OVERFLOW,
    STATUS_NEGATIVE_LOAD,
    STATUS_OK,
    record_length,
    table_columns,
    unpack_record,
)
from ultraep_megatron.traces.synthetic import zipf_load


def compact_table(plan, load, rank) -> np.ndarray:
    """The reroute table of ``record_layout`` built from ``rank_reroute``'s [4, E*R+1] table: its
    instance columns kept (expert-major, rank minor), padding and a sentinel appended."""
    R, E = load.shape
    S = plan.num_slots
    old = rank_reroute(plan, load, rank).reroute_table
    present = np.flatnonzero(plan.instance_slot.numpy().reshape(-1) >= 0)
    C = table_columns(R, E, S)
    out = np.zeros((4, C), np.int64)
    k = present.size
    out[0, :k], out[1, :k], out[3, :k] = old[0, present], old[1, present], old[3, present]
    out[0, k:] = old[0, E * R - 1] if E * R else 0
    out[0, C - 1] = INT32_MAX
    out[1, k:] = R * plan.physical_slots_per_rank
    out[3, k:] = int(load[rank].sum()) + 1
    out[2, :E] = old[2, :E] + 1
    return out.astype(np.int32)


def check_against_host_planner(load, config, rank):
    """``host_plan``'s record and table against the planner they pack (``LayerBalancer``'s plan,
    ``rank_reroute``, ``metrics``), computed independently."""
    R, E = load.shape
    S = config.num_slots
    record, table = host_plan(load, config, rank)
    view = unpack_record(record, R, E, S)
    balancer = config.build()
    assert view.status == STATUS_OK
    assert view.balanced == balancer.balances(load)
    plan = balancer.plan(load)
    reroute = rank_reroute(plan, load, rank)
    assert np.array_equal(view.slot_expert, plan.slot_expert.numpy())
    assert np.array_equal(view.input_splits, reroute.input_splits)
    assert np.array_equal(view.output_splits, reroute.output_splits)
    assert np.array_equal(view.rows_per_source_slot, reroute.rows_per_source_slot)
    assert view.threshold == plan.threshold and view.rank == rank
    assert view.send_rows == int(load[rank].sum())
    assert view.metrics() == metrics(load, plan, domain_size=config.domain_size)
    assert np.array_equal(table, compact_table(plan, load, rank))
    return record, table


@given(domain_problems())
@settings(max_examples=150, **SETTINGS)
def test_host_record_is_the_host_planners_plan(problem):
    load, S, min_quota, N = problem
    R = load.shape[0]
    config = BalancerConfig("ultraep", num_slots=S, min_quota=min_quota, domain_size=N)
    if int(load.sum()) > INT32_MAX:
        record, table = host_plan(load, config, 0)
        assert record[0] == STATUS_INT32_OVERFLOW and not table.any()
        return
    check_against_host_planner(load, config, int(load.sum()) % R)


@pytest.mark.parametrize(
    "R,E,S,N,min_quota,trigger",
    [
        (64, 256, 2, None, None, None),
        (64, 512, 4, None, None, None),
        (64, 512, 4, 8, None, None),
        (64, 512, 4, 8, 300, None),
        (32, 512, 3, 4, 1, 1.1),
        (64, 256, 2, None, None, 50.0),  # below the trigger: the identity plan
    ],
)
def test_host_record_on_large_grids(R, E, S, N, min_quota, trigger):
    config = BalancerConfig(
        "ultraep", num_slots=S, min_quota=min_quota, domain_size=N, trigger=trigger
    )
    for seed in range(2):
        load = zipf_load(R, E, 1.5 + seed, seed=seed)
        record, _ = check_against_host_planner(load, config, (7 * seed + 3) % R)
        assert bool(record[3]) == (trigger != 50.0)


def test_record_fits_8_kb_at_ep64():
    assert record_length(64, 256, 2) * 8 == 5248 <= 8192
    assert table_columns(64, 256, 2) * 4 * 4 <= 8192


def test_bad_loads_give_a_status():
    config = BalancerConfig("ultraep", num_slots=2)
    load = torch.ones(4, 8, dtype=torch.int64)
    load[1, 3] = -1
    assert host_plan(load, config, 0)[0][0] == STATUS_NEGATIVE_LOAD
    load = torch.full((4, 8), 2**27, dtype=torch.int64)
    assert host_plan(load, config, 0)[0][0] == STATUS_INT32_OVERFLOW


def test_the_op_is_one_op_with_a_fake_impl():
    """A dispatch mode sees one ``ultraep::plan_invocation``; under fake tensors it gives the
    documented shapes and dtypes; the op equals ``host_plan``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    config = BalancerConfig("ultraep", num_slots=2)
    load = zipf_load(8, 32, 2.0, seed=3)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        fused = plan_invocation(load, config, 2)
    assert seen.ops == ["ultraep.plan_invocation.default"]
    record, table = host_plan(load, config, 2)
    assert np.array_equal(fused.record.numpy(), record)
    assert np.array_equal(fused.table.numpy(), table)
    with FakeTensorMode() as mode:
        fake = plan_invocation(mode.from_tensor(load), config, 2)
    assert fake.record.shape == (record_length(8, 32, 2),) and fake.record.dtype == torch.int64
    assert fake.table.shape == (4, table_columns(8, 32, 2)) and fake.table.dtype == torch.int32


# ---- the Triton kernel under the interpreter (a subprocess: TRITON_INTERPRET is read at import) --

_TRITON_SCRIPT = r"""
import json, sys
import numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from planner_helpers import LOAD_KINDS, make_load
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.fused_plan import host_plan, plan_invocation
from ultraep_megatron.planner.record_layout import H_BALANCED, H_REPLICAS

rng = np.random.default_rng(int(sys.argv[2]))
draw = lambda strategy: int(rng.integers(2**32))  # the seed make_load draws
out = {"cases": 0, "mismatches": 0, "balanced": 0, "replicas": 0, "stale_caught": 0,
       "floor_caught": 0, "status": 0}
for case in range(int(sys.argv[3])):
    R = int(rng.choice([1, 2, 4, 4, 8, 8, 16])); G = int(rng.integers(1, 5))
    S = int(rng.choice([0, 1, 2, 2, 3, 4])); N = int(rng.choice([d for d in (1, 2, 4, 8, 16) if R % d == 0]))
    kind = str(rng.choice([k for k in LOAD_KINDS if k != "drawn"]))
    load = torch.from_numpy(make_load(draw, kind, R, G).astype(np.int64))
    min_quota = [None, 1, int(rng.integers(1, 500))][case % 3]
    trigger = [None, None, 1.05, 1.5][case % 4]
    config = BalancerConfig("ultraep", num_slots=S, min_quota=min_quota, domain_size=N,
                            trigger=trigger)
    rank = int(rng.integers(R))
    fused = plan_invocation(load, config, rank)  # the op: the Triton kernel, interpreted
    record, table = host_plan(load, config, rank)
    same = np.array_equal(fused.record.numpy(), record) and np.array_equal(fused.table.numpy(), table)
    out["cases"] += 1; out["mismatches"] += not same
    out["status"] += int(record[0] != 0)
    out["balanced"] += int(record[H_BALANCED]); out["replicas"] += int(record[H_REPLICAS] > 0)
    if record[0] == 0 and record[H_REPLICAS] > 0:
        # Controls: a plan of a stale load (one pair moved), and of a mis-sized floor.
        stale = load.clone(); stale[0, 0] += 1; stale[-1, -1] = max(int(stale[-1, -1]) - 1, 0)
        srec, stab = host_plan(stale, config, rank)
        out["stale_caught"] += not (np.array_equal(fused.record.numpy(), srec)
                                    and np.array_equal(fused.table.numpy(), stab))
        floor = int(record[11]) + 1
        frec, ftab = host_plan(load, config.replace(min_quota=floor), rank)
        out["floor_caught"] += not (np.array_equal(fused.record.numpy(), frec)
                                    and np.array_equal(fused.table.numpy(), ftab))
print(json.dumps(out))
"""


def test_triton_kernel_matches_the_host_planner_bit_for_bit():
    """The fused kernel under ``TRITON_INTERPRET=1`` on CPU tensors, through the op: 60 random and
    adversarial loads (R 1-16, G 1-4, S 0-4, every domain size, floors None / 1 / random, triggers
    default / 1.05 / 1.5, a random rank): record and table equal ``host_plan``'s bit for bit.
    Controls: the host plan of a stale load (one pair moved) and of a floor one higher differ
    from the kernel's on most loads with replicas."""
    summary = run_interpreted(_TRITON_SCRIPT, str(REPO / "tests" / "planner"), "11", "60")
    assert summary["cases"] == 60 and summary["mismatches"] == 0
    assert 10 <= summary["replicas"] <= summary["balanced"]
    assert summary["stale_caught"] >= summary["replicas"] - 2
    assert summary["floor_caught"] >= 1


_TRITON_GRID_SCRIPT = r"""
import json, sys
import numpy as np, torch
torch.set_num_threads(1)
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.fused_plan import host_plan, plan_invocation
from ultraep_megatron.planner.record_layout import H_REPLICAS
from ultraep_megatron.traces.synthetic import zipf_load

out = []
for R, E, S, N, floor, rank in json.loads(sys.argv[1]):
    load = torch.as_tensor(zipf_load(R, E, 1.5, seed=R + E + S))
    config = BalancerConfig("ultraep", num_slots=S, domain_size=N, min_quota=floor)
    fused = plan_invocation(load, config, rank)  # the op: the Triton kernel, interpreted
    record, table = host_plan(load, config, rank)
    stale = load.clone(); stale[rank, 0] += 1; stale[-1, -1] = max(int(stale[-1, -1]) - 1, 0)
    srec, stab = host_plan(stale, config, rank)
    same = lambda r, t: np.array_equal(fused.record.numpy(), r) and np.array_equal(fused.table.numpy(), t)
    out.append({"same": same(record, table), "stale_same": same(srec, stab),
                "replicas": int(record[H_REPLICAS])})
print(json.dumps(out))
"""

# EP64 at the defaults (no domains, the default floor) and at the largest grid (E 512, S 4)
# with domains of 8 and a floor of 300.
_GRIDS = [(64, 256, 2, None, None, 5), (64, 512, 4, 8, 300, 63)]


def test_triton_kernel_matches_the_host_planner_on_ep64_grids():
    """The interpreted kernel at EP64 (a few seconds a case): record and table equal
    ``host_plan``'s bit for bit on every grid; the control, the host plan of the load with one of
    this rank's pairs moved, differs from the kernel's on every grid."""
    cases = run_interpreted(_TRITON_GRID_SCRIPT, json.dumps(_GRIDS))
    assert len(cases) == len(_GRIDS)
    assert all(case["same"] and not case["stale_same"] and case["replicas"] > 0 for case in cases)


def test_self_check_on_the_host_and_a_broken_device(monkeypatch):
    """The self-check passes where the op is the host planner itself, and reports a device whose
    record differs (a control: the op's record off by one in the threshold)."""
    from ultraep_megatron.planner import fused_plan, self_check

    config = BalancerConfig("ultraep", num_slots=2, domain_size=2)
    assert self_check.self_check(torch.device("cpu"), config) == []
    real = fused_plan.plan_invocation

    def broken(load, config, rank):
        fused = real(load, config, rank)
        record = fused.record.clone()
        record[1] += 1
        return fused_plan.FusedPlan(record, fused.table)

    monkeypatch.setattr(self_check, "plan_invocation", broken)
    other = config.replace(min_quota=3)  # not cached yet
    assert any("plan record" in p for p in self_check.self_check(torch.device("cpu"), other))
