"""The balanced MoE layer on a GPU: no synchronization beyond megatron's own, and the same results.

Needs a CUDA device (skipped without one; ``test_cuda_layer_dry_run`` runs the same worker on the
CPU so that the check itself keeps working). EP=2 and EP=4 ranks share the one GPU
(``cuda_staging``: NCCL refuses two ranks on one GPU, so their communication is staged through gloo
on the host, outside the sync check). ``workers/cuda_layer.py`` runs megatron-core's MoELayer and
UltraEP's BalancedMoELayer on the same weights and tokens under ``torch.cuda.set_sync_debug_mode``:
``warn`` records every synchronizing CUDA call with its place, ``error`` refuses every one but each
layer's designated wait (megatron's dispatcher's, the balancer's load copy).

Run on a GPU machine:  python -m pytest tests/megatron/test_cuda_layer.py
"""

import collections

import pytest
import torch

from equivalence import UNIT_ROUNDOFF, Comparison, failures, relative_difference, summary
from gloo_launch import WORKERS, launch_gloo_ranks

HOST_PLANNER = ("single", "pipelined", "recompute", "grouped")
DEVICE_PLANNER = ("device-planner", "device-planner-recompute")
SCENARIOS = HOST_PLANNER + DEVICE_PLANNER
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def launch(tmp_path_factory, world: int, device: str) -> list[dict]:
    out = tmp_path_factory.mktemp(f"cuda_layer_ep{world}_{device}")
    launch_gloo_ranks(
        WORKERS / "cuda_layer.py", world, ["--out-dir", out, "--device", device], timeout_s=180
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def cuda_ranks(request, tmp_path_factory):
    return launch(tmp_path_factory, request.param, "cuda")


def comparisons(rank_result: dict, scenario: str) -> list[Comparison]:
    """Balanced vs megatron's layer, each quantity's floor from megatron's layer on permuted tokens."""
    none, permuted, balanced = (
        rank_result[f"{scenario}/{key}"]["outputs"] for key in ("none", "none_permuted", "balanced")
    )
    pairs = [(f"out[{i}]", lambda r, i=i: r["out"][i]) for i in range(len(none["out"]))]
    pairs += [(f"dx[{i}]", lambda r, i=i: r["dx"][i]) for i in range(len(none["dx"]))]
    pairs += [("router_grad", lambda r: r["router_grad"])]
    pairs += [
        (f"expert{e}.{k}", lambda r, e=e, k=k: r["expert_grads"][e][k])
        for e in none["expert_grads"]
        for k in range(2)
    ]
    return [
        Comparison(
            what,
            relative_difference(get(balanced), get(none)),
            max(relative_difference(get(permuted), get(none)), UNIT_ROUNDOFF),
        )
        for what, get in pairs
    ]


def sync_places(result: dict) -> collections.Counter:
    return collections.Counter(result["warn"]["syncs"])


MICROBATCHES = {
    "single": 1,
    "pipelined": 3,
    "recompute": 2,
    "grouped": 2,
    "device-planner": 3,
    "device-planner-recompute": 2,
}


def places_in(places: collections.Counter, function: str) -> int:
    return sum(n for place, n in places.items() if place.endswith(f"({function})"))


@needs_cuda
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_synchronization_beyond_megatrons(cuda_ranks, scenario):
    """megatron's layer waits only at its dispatcher's sync point, at least once per microbatch; the
    balanced layer only at its one host wait (``PlanHandle.wait``: the load, or with the device
    planner the plan's record), exactly once per microbatch (a recompute replay reuses the plan),
    and under ``error`` each passes with its own designated wait alone."""
    for rank, result in enumerate(cuda_ranks):
        none, balanced = result[f"{scenario}/none"], result[f"{scenario}/balanced"]
        theirs, ours = sync_places(none), sync_places(balanced)
        print(f"rank {rank} {scenario}: megatron {dict(theirs)}, balanced {dict(ours)}")
        assert balanced["warn"]["replicas"] > 0, f"rank {rank} {scenario}: no replica was made"
        assert none["error"]["error"] is None, (
            f"megatron's own layer synchronizes beyond its designated wait: {none['error']['error']}"
        )
        assert (
            places_in(theirs, "_maybe_dtoh_and_synchronize")
            == sum(theirs.values())
            >= MICROBATCHES[scenario]
        )
        assert balanced["error"]["error"] is None, (
            f"rank {rank} {scenario}: the balanced layer synchronizes: {balanced['error']['error']}"
        )
        assert places_in(ours, "wait") == sum(ours.values()) == MICROBATCHES[scenario], (
            f"rank {rank} {scenario}: balanced {dict(ours)} vs megatron {dict(theirs)}"
        )


@needs_cuda
def test_a_deliberate_read_is_caught(cuda_ranks):
    """The negative control: a ``.tolist()`` of the routing in the balanced dispatcher."""
    for rank, result in enumerate(cuda_ranks):
        faulty, clean = result["single-tolist/balanced"], result["single/balanced"]
        assert faulty["error"]["error"] is not None and "synchroniz" in faulty["error"]["error"], (
            f"rank {rank}: the deliberate read was not refused: {faulty['error']['error']}"
        )
        assert sum(sync_places(faulty).values()) > sum(sync_places(clean).values()), (
            f"rank {rank}: the deliberate read was not recorded: {faulty['warn']['syncs']}"
        )


@needs_cuda
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_results_as_megatron_on_cuda(cuda_ranks, scenario):
    for rank, result in enumerate(cuda_ranks):
        compared = comparisons(result, scenario)
        print(f"rank {rank} {scenario}:\n{summary(compared)}")
        assert not failures(compared), f"rank {rank} {scenario}: {failures(compared)}"


@needs_cuda
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_replica_transfers_ran_on_the_stream_path(cuda_ranks, scenario):
    """Every transfer of the balanced layer took the data plane's NCCL path (a CUDA stream)."""
    for rank, result in enumerate(cuda_ranks):
        staged = result[f"{scenario}/balanced"]["error"]["staged"]
        assert staged.get("batch_isend_irecv", 0) > 0, (rank, staged)
        assert staged.get("transfers on a CUDA stream", 0) > 0, (rank, staged)
        assert staged.get("transfers on the host", 0) == 0, (rank, staged)


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CUDA tests above run the worker for real"
)
def test_cuda_layer_dry_run(tmp_path_factory):
    """The GPU check's worker and staging on the CPU (EP=2): it runs, replicates, stages the
    transfers, and its results match megatron's layer (no sync debug mode without a GPU)."""
    ranks = launch(tmp_path_factory, 2, "cpu")
    for rank, result in enumerate(ranks):
        assert result["single/balanced"]["warn"]["replicas"] > 0
        staged = result["single/balanced"]["error"]["staged"]
        assert (
            staged.get("batch_isend_irecv", 0) > 0 and staged.get("transfers on the host", 0) > 0
        ), staged
        for scenario in HOST_PLANNER + DEVICE_PLANNER:
            compared = comparisons(result, scenario)
            assert not failures(compared), f"rank {rank} {scenario}: {failures(compared)}"
