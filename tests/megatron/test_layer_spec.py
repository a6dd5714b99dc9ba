"""The layer-spec hook (``megatron/run/layer_spec.py``), on a real launch: when a balancer is selected,
an MoE layer built without it (here: the MTP block left to Megatron's own spec, a fault of
workers/pretrain_grad_dump.py) stops training at startup, named. (Every other test that trains a
balanced model goes through the hook too.)
"""

import pytest

from gloo_launch import WORKERS
from megatron_runs import recipe_moe_args, torchrun

pytestmark = pytest.mark.slow


def test_an_unbalanced_moe_layer_stops_training_naming_it(tmp_path):
    """The MTP block built from Megatron's own spec (fault ``unbalanced_mtp_layer``) at EP=1,
    which also draws the nothing-to-balance warning."""
    args = [*recipe_moe_args(ep=1, train_iters=1), "--moe-balancer", "ultraep"]
    status, output = torchrun(
        WORKERS / "pretrain_grad_dump.py",
        1,
        args,
        env={"ULTRAEP_GRAD_DUMP_DIR": str(tmp_path), "ULTRAEP_FAULTS": "unbalanced_mtp_layer"},
    )
    assert status != 0
    assert (
        "these MoE layers were built without the balancer: "
        "mtp.layers.0.mtp_model_layer.mlp (MoELayer)" in output
    ), output[-3000:]
    assert "decoder.layers" not in output.split("built without the balancer:")[1].splitlines()[0]
    warnings = [
        line for line in output.splitlines() if line.startswith("pretrain_gpt.py: warning:")
    ]
    assert len(warnings) == 1 and "--expert-model-parallel-size 1" in warnings[0], warnings
    assert " iteration        1/" not in output, "training must not start"
