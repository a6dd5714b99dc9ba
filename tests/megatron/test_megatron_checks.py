"""Mistakes Megatron meets with a bare assertion, argparse's usage dump or a failure after the job
started, refused by pretrain_gpt.py's startup check in one line naming the flag and the fix
(``megatron/run/megatron_checks.py``, ``arguments.startup_problems``); balancing that would do nothing
warned about. Each command line runs through pretrain_gpt.py's checks in its order
(``argument_verdicts``: one process for all of them). The same inputs through ``ultraep
check-recipe``: tests/cli/test_check_recipe.py."""

from __future__ import annotations

import argparse

import pytest

from megatron_runs import argument_verdicts, tiny_moe_args

from ultraep_megatron.megatron.run.megatron_checks import megatron_arg_problems, parser_error_hint

TRACE_FIX = "use a directory the training job can write (the ranks that record it are each EP group's first)"
BASE = [*tiny_moe_args(ep=1, train_iters=200), "--moe-balancer", "ultraep"]
#: name -> (extra arguments, the one error line pretrain_gpt.py prints, or None and the warning).
CASES = {
    "num_slots_0": (
        ["--moe-balancer-num-slots", "0"],
        None,
        "--moe-balancer-num-slots 0 with --moe-balancer ultraep: no redundant slot, so no replica: "
        "balancing does nothing (every layer is still planned); use --moe-balancer-num-slots 2 or "
        "more (the slot rule: docs/recipes.md) or --moe-balancer none",
    ),
    "train_iters_below_warmup": (
        ["--lr-warmup-iters", "100", "--train-iters", "50"],
        "--train-iters 50 does not reach past the learning-rate warm-up (--lr-warmup-iters "
        "100): Megatron's learning-rate scheduler refuses it once the model is built (the "
        "warm-up must end before the decay); use --train-iters above 100 or a shorter "
        "--lr-warmup-iters",
        None,
    ),
    "unwritable_trace_dir": (
        ["--moe-balancer-trace-dir", "/proc/ultraep_trace"],
        "--moe-balancer-trace-dir /proc/ultraep_trace: cannot create the directory (No such "
        f"file or directory); {TRACE_FIX}",
        None,
    ),
    "experts_not_a_multiple_of_ep": (
        ["--num-experts", "60", "--expert-model-parallel-size", "8"],
        "--num-experts 60 is not a multiple of --expert-model-parallel-size 8: every EP "
        "rank holds the same number of experts (Megatron asserts it); use 56 or 64 "
        # one process: the EP suggested must divide its 1 rank too (on 8 GPUs: 4, test_fix_messages)
        "experts, or --expert-model-parallel-size 1",
        None,
    ),
    "pp2_over_27_layers": (
        ["--num-layers", "27", "--pipeline-model-parallel-size", "2"],
        "--num-layers 27 does not split evenly over --pipeline-model-parallel-size 2 stages "
        "(Megatron refuses it); give the first stage its own count, e.g. "
        "--decoder-first-pipeline-num-layers 13 (or the last stage, "
        "--decoder-last-pipeline-num-layers)",
        None,
    ),
    "misspelt_balancer": (
        ["--moe-balancer", "ultrep"],
        "argument --moe-balancer: invalid choice: 'ultrep' (choose from 'none', 'ultraep', 'eplb', "
        "'eplb-exact'); did you mean --moe-balancer ultraep?",
        None,
    ),
    "misspelt_flag": (
        ["--moe-balancer-slots", "2"],
        "unrecognized arguments: --moe-balancer-slots 2 (--moe-balancer-slots: did you mean "
        "--moe-balancer-num-slots?)",
        None,
    ),
    "fp4": (
        ["--fp4-format", "e2m1"],
        "--moe-balancer ultraep: --fp4-format e2m1 (--fp4-recipe nvfp4) is not supported: the replica experts' "
        "fp4 path (re-quantization, scales, the replica weight transfer) has not been checked yet; use "
        "--fp8-format with --fp8-recipe tensorwise, blockwise or mxfp8",
        None,
    ),
}


@pytest.fixture(scope="module")
def verdicts():
    return argument_verdicts({name: [*BASE, *extra] for name, (extra, _, _) in CASES.items()})


@pytest.mark.parametrize("name", list(CASES))
def test_each_mistake_is_one_line_naming_the_flag_and_the_fix(verdicts, name):
    _, error, warning = CASES[name]
    verdict = verdicts[name]
    if error is not None:
        assert verdict["errors"] == [error], verdict
        assert verdict["error"].startswith(f"ValueError: {error}"), verdict["error"]
    else:
        assert verdict["errors"] == [] and verdict["error"] is None, verdict
        assert warning in verdict["warnings"], verdict["warnings"]


def namespace(**values) -> argparse.Namespace:
    defaults = dict(
        num_experts=None,
        expert_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        num_layers=4,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        pipeline_model_parallel_layout=None,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None,
        hybrid_layer_pattern=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        lr_warmup_fraction=None,
        train_iters=10,
        lr_warmup_iters=0,
        lr_decay_iters=None,
        train_samples=None,
    )
    return argparse.Namespace(**{**defaults, **values})


def test_what_megatron_accepts_passes():
    """The settings Megatron builds pass: the uneven split the HGX Qwen3 recipe uses, a warm-up
    shorter than the decay (or given as a fraction), experts that split."""
    assert (
        megatron_arg_problems(
            namespace(
                num_layers=94,
                pipeline_model_parallel_size=4,
                decoder_first_pipeline_num_layers=23,
                decoder_last_pipeline_num_layers=23,
            )
        )
        == []
    )
    assert (
        megatron_arg_problems(namespace(train_iters=50, lr_warmup_iters=100, lr_decay_iters=200))
        == []
    )
    assert (
        megatron_arg_problems(
            namespace(train_iters=50, lr_warmup_iters=100, lr_warmup_fraction=0.1)
        )
        == []
    )
    assert megatron_arg_problems(namespace(num_experts=64, expert_model_parallel_size=8)) == []
    # A first/last count on a single stage: Megatron would build that many layers, not 94.
    assert megatron_arg_problems(
        namespace(num_layers=94, decoder_first_pipeline_num_layers=23)
    ) == [
        "--decoder-first-pipeline-num-layers 23 put 23 layers on the 1 pipeline stage(s), --num-layers is 94 "
        "(Megatron refuses it)"
    ]


def test_did_you_mean_only_when_one_is_close():
    options = ["--moe-balancer", "--moe-balancer-num-slots", "--num-layers", "--micro-batch-size"]
    assert parser_error_hint("unrecognized arguments: --num-layer 2 --frobnicate", options) == (
        "unrecognized arguments: --num-layer 2 --frobnicate (--num-layer: did you mean --num-layers?)"
    )
    assert (
        parser_error_hint("unrecognized arguments: --frobnicate=3", options)
        == "unrecognized arguments: --frobnicate=3"
    )
    assert parser_error_hint(
        "argument --moe-balancer: invalid choice: 'quux' (choose from 'none', 'ultraep')", options
    ).endswith("(choose from 'none', 'ultraep')")
