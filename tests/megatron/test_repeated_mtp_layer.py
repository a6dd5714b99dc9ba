"""The MTP block's shared layer (``--mtp-use-repeated-layer``), which one model forward runs once per
MTP depth, balanced with MoE activation recompute on real launches (EP=2, gloo).

Every invocation of it holds its own ring slot, and every recompute replay must reuse the plan of
the run it replays: the depths are replayed in reverse (each feeds the next), so taking the parked
runs oldest first hands a depth another depth's plan. ``--moe-balancer-check-plans`` compares each
replay's recomputed routing with the load its plan was solved for; the negative control takes the
parked runs oldest first (workers/pretrain_grad_dump.FAULTS) and must be caught by that check.
"""

import pytest

from gloo_launch import WORKERS, launch_gloo_ranks
from megatron_runs import SKEWED_EXPERT_BIAS, read_metrics, recipe_moe_args

pytestmark = pytest.mark.slow

ITERATIONS = 3
MTP_DEPTHS = 2
MTP_LAYER_ID = 5  # after the decoder's 4 layers (layer_ids.moe_layer_id)


#: MoE activation recompute, and full-layer recompute (megatron checkpoints each MTP depth).
RECOMPUTE = {
    "moe": ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
    "full": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],
}


def launch(run_dir, faults="", recompute="moe"):
    args = [
        *recipe_moe_args(ep=2, train_iters=ITERATIONS),
        "--mtp-num-layers",
        str(MTP_DEPTHS),
        "--mtp-use-repeated-layer",
        *RECOMPUTE[recompute],
        "--moe-balancer",
        "ultraep",
        "--moe-balancer-check-plans",
        "--metrics-jsonl",
        str(run_dir / "metrics.jsonl"),
    ]
    env = {
        "ULTRAEP_GRAD_DUMP_DIR": str(run_dir),
        "ULTRAEP_EXPERT_BIAS": SKEWED_EXPERT_BIAS,
        "ULTRAEP_FAULTS": faults,
    }
    return launch_gloo_ranks(WORKERS / "pretrain_grad_dump.py", 2, args, env=env, timeout_s=400)


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_repeated_mtp_layer_replays_reuse_each_depths_plan(tmp_path, recompute):
    log = launch(tmp_path, recompute=recompute)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    balanced = [line for line in log.splitlines() if "balanced rank imbalance" in line]
    assert len(balanced) == ITERATIONS, log[-3000:]
    # The shared MTP layer is balanced, with replicas.
    assert all(f"layer {MTP_LAYER_ID}: " in line for line in balanced), balanced
    mtp = [line.split(f"layer {MTP_LAYER_ID}: ")[1] for line in balanced]
    assert any("(0.0 replicas" not in part for part in mtp), mtp


def test_negative_control_replaying_oldest_first_is_caught(tmp_path):
    with pytest.raises(RuntimeError) as failed:
        launch(tmp_path, faults="replays_in_forward_order")
    assert f"MoE layer {MTP_LAYER_ID}: the routing differs from the load" in str(failed.value)
