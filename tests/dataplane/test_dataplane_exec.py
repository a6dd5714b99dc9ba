"""Weight distribution and gradient reduction on real gloo worlds of 4 and 8 ranks.

One process spawn per world size runs every case (see _dataplane_cases.py): direct, relay and
adaptive schedules, fan-out R-1, odd chunk counts (90 elements in chunks of 13 = 7 chunks), one chunk,
local replicas, empty plans, bf16 weights, bf16 and fp32 main grads, strided main weights and
hosted gradients, bad inputs, and the asynchronous
handle API (transfers in flight together, waited out of order).
"""

from __future__ import annotations

import pytest

from _dataplane_cases import plan_cases, run_all
from _dataplane_world import run_world


@pytest.mark.parametrize("world_size", [4, 8])
def test_distribution_and_reduction(world_size):
    per_rank = run_world(world_size, run_all)
    expected_cases = {c["name"] for c in plan_cases(world_size)} | {"bad-inputs", "replica-buffer", "replica-buffer-async", "tensor-layouts", "handles",
                                                                 "handles-host-comm-stream"}
    for rank, results in enumerate(per_rank):
        assert set(results) == expected_cases
        failures = {name: f for name, f in results.items() if f}
        assert not failures, f"rank {rank}: {failures}"
