"""The balanced MoE layer reads no more device data on the host than megatron-core's own MoELayer.

A GPU's host waits for its queue whenever it reads device memory (``.item()``, ``.tolist()``,
``nonzero``, a blocking copy, an event synchronization). ``device_reads.DeviceReadCounter`` models
which tensors would live on the GPU and counts such reads while the layer runs on gloo CPU ranks;
the worker measures megatron's MoELayer and UltraEP's BalancedMoELayer on the same weights and
tokens, forward and backward, two microbatches, EP=2 and EP=4, with skewed routing (so replicas are
really created and moved) and with MoE activation recompute; and with megatron's flex dispatcher over
``deepep_gloo``'s HybridEP and DeepEP stand-ins, which report where the real libraries make the host
wait. The replica transfers run on the
caller's thread, as on CUDA, so their host code is counted too.
"""

import collections
import json

import pytest

from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 4
# ep4-hybridep: the flex dispatcher over HybridEP's stand-in (deepep_gloo reports its host waits).
LAYOUTS = (
    "ep2",
    "ep4",
    "ep2-recompute",
    "ep4-recompute",
    "ep4-hybridep",
    "ep2-device",
    "ep4-device",
    "ep4-recompute-device",
)
NEGATIVE_CONTROLS = (
    "ep4-tolist",
    "ep4-item-in-backward",
    "ep4-item-in-transfer",
    "ep4-hybridep-unmodified",
    "ep4-device-item-in-plan",
)
PLAN_WAIT = "Event.synchronize"  # the plan's one wait (invocation.PlanHandle.wait)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_reads")
    launch_gloo_ranks(WORKERS / "host_reads_layer.py", WORLD, ["--out-dir", out], timeout_s=400)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def planner_counts(balanced: dict) -> dict:
    """The balanced layer's read counts, by kind (kinds counted zero left out)."""
    return {kind: n for kind, n in collections.Counter(balanced["counts"]).items() if n}


def added_reads(measured: dict) -> dict:
    """Host reads the balanced layer makes beyond megatron's, by kind: blocking reads (``sync``)
    and all reads (``sync`` + asynchronous copies)."""
    none, balanced = measured["none"]["counts"], planner_counts(measured["balanced"])
    total = lambda counts: counts.get("sync", 0) + counts.get("copy", 0)  # noqa: E731
    return {
        "sync": balanced.get("sync", 0) - none.get("sync", 0),
        "all": total(balanced) - total(none),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_balanced_layer_adds_no_host_read(ranks, layout):
    for rank, result in enumerate(ranks):
        measured = result[layout]
        assert measured["balanced"]["replicas"] > 0, f"rank {rank} {layout}: no replica was made"
        assert measured["none"]["counts"].get("sync", 0) > 0, (
            "the counter must see megatron's own wait"
        )
        added = added_reads(measured)
        assert added["sync"] <= 0 and added["all"] <= 0, (
            f"rank {rank} {layout}: the balanced layer adds host reads {added}: "
            f"{measured['balanced']['events']} (megatron: {measured['none']['events']})"
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_host_wait_per_planned_forward(ranks, layout):
    """The load crosses to the host once per microbatch; a recompute replay reuses the plan."""
    for result in ranks:
        counts = planner_counts(result[layout]["balanced"])
        assert counts == {"copy": 2, "sync": 2}, counts  # two microbatches


def test_plan_checks_read_the_device_only_when_asked(ranks):
    """--moe-balancer-check-plans compares the routing with the plan's load in every forward and
    recompute replay (a host read each, two microbatches), and finds them equal."""
    for result in ranks:
        checked = result["ep4-recompute-check-plans"]
        added = added_reads(checked)
        assert checked["balanced"]["replicas"] > 0
        assert added["sync"] > 0, "the checks are device reads: the counter must see them"
        reads = [e for e in checked["balanced"]["events"] if e[1] in ("equal", "cpu")]
        assert len(reads) >= 4, reads


@pytest.mark.parametrize("control", NEGATIVE_CONTROLS)
def test_negative_control_one_deliberate_read_is_caught(ranks, control):
    for rank, result in enumerate(ranks):
        added = added_reads(result[control])
        assert added["sync"] > 0, f"rank {rank} {control}: the deliberate read went unnoticed"


def test_negative_control_reads_inside_the_transfers_are_counted(ranks):
    """Each deliberate read inside a weight distribution's program is counted: the transfers' host
    code runs where the counter sees it (on the HostCommStream's thread it would not)."""
    made = [result["ep4-item-in-transfer"]["balanced"]["deliberate_reads"] for result in ranks]
    assert min(made) > 0, f"the distribution's program never ran on some rank: {made}"
    for rank, result in enumerate(ranks):
        added = added_reads(result["ep4-item-in-transfer"])
        assert added["sync"] >= made[rank], (
            f"rank {rank}: {made[rank]} deliberate reads in the transfers, {added['sync']} counted"
        )


def _waits(counts_and_events: dict) -> list[str]:
    return [operation for kind, operation, _ in counts_and_events["events"] if kind == "sync"]


def test_hybridep_layer_waits_once_megatrons_path_twice(ranks):
    """With HybridEP the balanced layer's one host wait per microbatch is the plan's: HybridEP is told
    the permuted size and per-slot counts from the plan. megatron's own HybridEP path waits twice (the
    dispatch reads the permuted size from the GPU; the experts read the device counts)."""
    for rank, result in enumerate(ranks):
        measured = result["ep4-hybridep"]
        assert _waits(measured["balanced"]) == [PLAN_WAIT] * 2, measured["balanced"]["events"]
        megatron = _waits(measured["none"])
        assert len(megatron) == 4 and sum("HybridEP dispatch" in w for w in megatron) == 2, megatron


def test_negative_control_megatrons_hybridep_dispatch_waits_more(ranks):
    """The balanced layer with megatron's own fused dispatch (no counts handed to HybridEP) waits
    more than once per microbatch: the one-wait test above would fail."""
    for rank, result in enumerate(ranks):
        waits = _waits(result["ep4-hybridep-unmodified"]["balanced"])
        assert len(waits) >= 6 and waits.count(PLAN_WAIT) == 2, waits


def test_deepep_layer_waits_for_the_plan_and_deepeps_own_dispatch(ranks):
    """DeepEP's normal dispatch polls for its received counts on the host whatever it is told
    (megatron's fused_dispatch has no way to skip it): the balanced layer waits for its plan and
    there, one wait more than megatron's DeepEP path."""
    for rank, result in enumerate(ranks):
        measured = result["ep4-deepep"]
        waits = _waits(measured["balanced"])
        assert waits.count(PLAN_WAIT) == 2 and len(waits) == 4, waits
        assert all(w == PLAN_WAIT or w.startswith("DeepEP dispatch") for w in waits), waits
        assert len(_waits(measured["none"])) == 2, measured["none"]["events"]
