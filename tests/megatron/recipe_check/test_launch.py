"""A recipe checked with the user's overrides: arguments given to the recipe reach the training
script after the recipe's own (the recipes end in ``ultraep_launch "$@"``), where Megatron's parser
keeps the last value of a flag."""

from __future__ import annotations

from pathlib import Path

from ultraep_megatron.megatron import recipe_check as rc

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
RECIPE = RECIPES / "deepseek_v2_lite_16b_a2b_ep8_hgx.sh"


def test_overrides_are_appended_as_the_recipe_receives_them():
    plain = rc.capture_launch(RECIPE)
    launch = rc.capture_launch(RECIPE, extra_args=["--moe-balancer-num-slots", "3"])
    assert launch.args == [*plain.args, "--moe-balancer-num-slots", "3"]
    assert (launch.nproc_per_node, launch.nnodes) == (8, 1)
    report = rc.check_launch(launch)
    assert report.args.moe_balancer_num_slots == 3
    assert report.memory.stages[0].num_slots == 3
    assert report.problems() == []


def test_recipes_set_their_gpus_per_node_default():
    """common.sh: DEFAULT_GPUS_PER_NODE (8 on HGX recipes, 4 otherwise), GPUS_PER_NODE wins."""
    assert rc.capture_launch(RECIPE).nproc_per_node == 8
    assert rc.capture_launch(RECIPES / "qwen3_235b_a22b_ep64_dp4.sh").nproc_per_node == 4
    assert rc.capture_launch(RECIPE, {"GPUS_PER_NODE": "4", "NNODES": "2"}).nproc_per_node == 4


def test_bare_launch_gpus_per_node_follows_the_hardware_preset():
    assert rc.default_gpus_per_node(["--num-layers", "2", "--moe-balancer-hardware", "h100-hgx"]) == 8
    assert rc.default_gpus_per_node(["--moe-balancer-hardware=h100-hgx"]) == 8
    assert rc.default_gpus_per_node(["--moe-balancer-hardware", "paper-rack"]) == 4
    assert rc.default_gpus_per_node(["--moe-balancer-hardware", "tpu-pod"]) == 4  # validation names it
    assert rc.default_gpus_per_node([]) == 4
