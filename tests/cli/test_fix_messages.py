"""Issue 52's smaller messages: each refusal gives a fix that works on the user's layout, checked by
applying it (the fixed launch passes ``ultraep check-recipe``'s checks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ultraep_megatron.cli import main
from ultraep_megatron.megatron import recipe_check as rc
from ultraep_megatron.megatron.recipe_check.report import layer_ranges

REPO = Path(__file__).resolve().parents[2]
HGX = REPO / "recipes" / "deepseek_v2_lite_16b_a2b_ep8_hgx.sh"


def problems_of(extra=(), **env) -> list[str]:
    launch = rc.capture_launch(HGX, {"GLOBAL_BATCH_SIZE": "64", **env}, extra_args=list(extra))
    try:
        return rc.check_launch(launch).problems()
    except rc.RecipeError as error:
        return error.problem.splitlines()


def test_negative_slots_name_the_default_and_the_slot_rule():
    (problem,) = problems_of(["--moe-balancer-num-slots", "-1"])
    assert problem.startswith("--moe-balancer-num-slots must be >= 0, got -1: use 2 (the default)")
    assert "max(2, ceil(experts / (2 x EP)))" in problem
    assert problems_of(["--moe-balancer-num-slots", "2"]) == []


def test_a_global_batch_that_does_not_divide_gets_values_that_do():
    (problem,) = problems_of(GLOBAL_BATCH_SIZE="60")
    suggested = re.search(r"use a multiple of 8: (\d+) or (\d+)", problem).groups()
    assert suggested == ("56", "64")
    for value in suggested:
        assert problems_of(GLOBAL_BATCH_SIZE=value) == []


def test_experts_that_do_not_divide_ep_get_an_ep_that_fits_the_gpus():
    (problem,) = problems_of(["--num-experts", "60"])
    ep = re.search(r"or --expert-model-parallel-size (\d+)$", problem).group(1)
    assert ep == "4"  # divides 60 experts and the node's 8 GPUs (6 divides 60, not 8)
    fixed = ["--num-experts", "60", "--expert-model-parallel-size", ep]
    assert problems_of([*fixed, "--moe-balancer-domain-size", ep]) == []


def test_an_unknown_hardware_name_gets_the_close_ones(capsys):
    trace = REPO / "tests" / "traces" / "data" / "kjv_tiny.uetrace"
    code = main(["replay", str(trace), "--moe-balancer-hardware", "h100hgx", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown hardware 'h100hgx' (did you mean h100-hgx or h200-hgx?)" in err
    code = main(["replay", str(trace), "--moe-balancer-hardware", "tpu", "--no-progress"])
    assert code == 2 and "did you mean" not in capsys.readouterr().err


def test_virtual_pipeline_stages_list_their_chunks():
    assert layer_ranges([1, 2, 3]) == "1-3"
    assert layer_ranges([1, 2, 24, 25, 26, 48, 74]) == "1-2, 24-26, 48, 74"
    launch = rc.capture_launch(
        REPO / "recipes" / "qwen3_235b_a22b_ep32_pp8_hgx.sh", {"MASTER_ADDR": "node0"}
    )
    text = rc.format_report(rc.check_launch(launch))
    assert "stage 0: layers 1-2, 24-26, 48-50, 72-74 (11 MoE)" in text
    assert "layers 1-74" not in text


@pytest.mark.parametrize("where", ["recipes/common.sh", "docs/recipes.md"])
def test_save_interval_and_building_data_path_are_documented(where):
    text = (REPO / where).read_text()
    assert "SAVE_INTERVAL" in text and "preprocess_data.py" in text
    assert "slurm_qwen3_30b_a3b_hgx.sbatch" in text
