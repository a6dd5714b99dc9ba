"""--moe-balancer-trigger in megatron-core's MoELayer, on 4 gloo CPU ranks (EP=4)
(workers/trigger_layer.py): a layer-microbatch whose rank imbalance is below the trigger gets the
identity plan and no transfer at all — no point-to-point call of the data plane in its forward
(weight distribution) or backward (re-materialization, gradient reduction); one above it gets the
planner's usual plan and its transfers; every rank decides the same from the same exact load.
The counted calls above the trigger show the count sees the transfers (the negative control)."""

import pytest
import torch

from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 4
TRIGGER = 1.5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("trigger")
    launch_gloo_ranks(
        WORKERS / "trigger_layer.py", WORLD, ["--out-dir", out, "--trigger", TRIGGER], timeout_s=400
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_no_transfer_below_the_trigger_the_usual_plan_above(ranks):
    from ultraep_megatron import planner

    reference = ranks[0]["microbatches"]
    below = [planner.rank_imbalance(mb["load"]) < TRIGGER for mb in reference]
    assert any(below) and not all(below), [planner.rank_imbalance(mb["load"]) for mb in reference]
    for i, mb in enumerate(reference):
        # Identically on every rank: the same exact load, the same decision, the same plan.
        for other in ranks[1:]:
            for key in ("load", "slot_expert", "quota"):
                assert torch.equal(other["microbatches"][i][key], mb[key]), (i, key)
        calls = [
            (r["microbatches"][i]["p2p_forward"], r["microbatches"][i]["p2p_backward"])
            for r in ranks
        ]
        if below[i]:
            identity = planner.baselines.identity_plan(mb["load"], 2)
            assert torch.equal(mb["slot_expert"], identity.slot_expert) and torch.equal(
                mb["quota"], identity.quota
            )
            assert calls == [(0, 0)] * WORLD, (i, calls)
            assert all(sum(r["microbatches"][i]["replica_rows"]) == 0 for r in ranks)
        else:
            usual = planner.solve(mb["load"], 2, min_quota=1)
            assert torch.equal(mb["slot_expert"], usual.slot_expert) and torch.equal(
                mb["quota"], usual.quota
            )
            assert bool((usual.slot_expert >= 0).any()), i
            # Weights out in the forward; weights back and gradients home in the backward.
            assert all(f > 0 and b > 0 for f, b in calls if f or b) and any(
                f > 0 for f, _ in calls
            ), (i, calls)
            assert sum(sum(r["microbatches"][i]["replica_rows"]) for r in ranks) > 0


def test_telemetry_reports_how_often_balancing_ran(ranks):
    from ultraep_megatron import planner

    reference = ranks[0]["microbatches"]
    share = sum(planner.rank_imbalance(mb["load"]) >= TRIGGER for mb in reference) / len(reference)
    for result in ranks:
        assert result["stats"][1]["balanced_fraction"] == pytest.approx(share)
