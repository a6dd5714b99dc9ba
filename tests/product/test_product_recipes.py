"""Every recipe passes `ultraep check-recipe`: Megatron's own argument validation for the full world
size, EP groups inside one 64-GPU rack (the HGX recipes: every balancer domain inside one 8-GPU
node), the published model shapes, and a per-rank memory estimate that agrees with Megatron's own
estimator, reproduces the paper's §4.1 slot figures and fits the GPU (186 GiB GB200, 80 GiB H100).

Reference values are independent of the checker: the models' published configs and parameter
counts, Table 3 of the paper (parallel layout, slots), §4.1 (36 MB / 72 MB per slot of
Qwen3-235B against 3.3 GB / 6.6 GB without cross-layer reuse) and
``megatron.training.theoretical_memory_usage.compute_weight_and_optimizer_memory``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ultraep_megatron.cli import main
from ultraep_megatron.megatron import recipe_check as check_recipe
from ultraep_megatron.megatron.recipe_check import model

REPO = Path(__file__).resolve().parents[2]

RECIPES = REPO / "recipes"
GIB, MIB = 1024**3, 1024**2

# Table 3 (+ §8.1): world size, EP, PP, expert-DP, redundant slots per rank (the slot rule's:
# test_every_recipe_follows_the_slot_rule).
LAYOUT = {
    "glm45_air_106b_a12b_ep64_dp2.sh": (128, 64, 1, 2, 2),
    "qwen3_235b_a22b_ep64_dp4.sh": (256, 64, 1, 4, 2),
    "deepseek_v3_671b_a37b_ep64_pp4.sh": (256, 64, 4, 1, 2),
    "refmoe_288b_a16b_ep32_pp4_dp20.sh": (2560, 32, 4, 20, 4),
    "tiny_cpu.sh": (4, 4, 1, 1, 2),  # ultraep by default (MOE_BALANCER), its default 2 slots
    # HGX H100/H200 nodes of 8 GPUs (docs/recipes.md): one node; EP32 across 4 nodes, TP2 x PP8.
    "deepseek_v2_lite_16b_a2b_ep8_hgx.sh": (8, 8, 1, 1, 4),  # the slot rule (8 experts per rank)
    "qwen3_235b_a22b_ep32_pp8_hgx.sh": (256, 32, 8, 1, 2),
    "qwen3_30b_a3b_ep8_hgx.sh": (32, 8, 1, 4, 8),  # 4 nodes, EP8 in each; the slot rule: 8
}
HGX = {name for name in LAYOUT if name.endswith("_hgx.sh")}

# Published configs (HF config.json of zai-org/GLM-4.5-Air, Qwen/Qwen3-235B-A22B,
# deepseek-ai/DeepSeek-V3; the paper for RefMoE): layers, first dense layers, hidden, query heads,
# experts, top-k, expert FFN, shared-expert FFN, router score function, load-balancing type and
# weight (§8.1), expert bias.
SHAPES = {
    "glm45_air_106b_a12b_ep64_dp2.sh": (
        46,
        1,
        4096,
        96,
        128,
        8,
        1408,
        1408,
        "sigmoid",
        "aux_loss",
        1e-2,
        False,
    ),
    "qwen3_235b_a22b_ep64_dp4.sh": (
        94,
        0,
        4096,
        64,
        128,
        8,
        1536,
        None,
        "softmax",
        "aux_loss",
        1e-2,
        False,
    ),
    "deepseek_v3_671b_a37b_ep64_pp4.sh": (
        61,
        3,
        7168,
        128,
        256,
        8,
        2048,
        2048,
        "sigmoid",
        "seq_aux_loss",
        1e-4,
        True,
    ),
    "refmoe_288b_a16b_ep32_pp4_dp20.sh": (
        46,
        1,
        None,
        None,
        256,
        8,
        None,
        None,
        "sigmoid",
        "seq_aux_loss",
        1e-4,
        True,
    ),
    "qwen3_235b_a22b_ep32_pp8_hgx.sh": (
        94,
        0,
        4096,
        64,
        128,
        8,
        1536,
        None,
        "softmax",
        "aux_loss",
        1e-2,
        False,
    ),
    # deepseek-ai/DeepSeek-V2-Lite: 2 shared experts of 1408 = one shared FFN of 2816; its
    # expert-level balance loss alpha 0.001.
    "deepseek_v2_lite_16b_a2b_ep8_hgx.sh": (
        27,
        1,
        2048,
        16,
        64,
        6,
        1408,
        2816,
        "softmax",
        "seq_aux_loss",
        1e-3,
        False,
    ),
}

# Published sizes in parameters: (total, active).
PUBLISHED = {
    "glm45_air_106b_a12b_ep64_dp2.sh": (106e9, 12e9),
    "qwen3_235b_a22b_ep64_dp4.sh": (235e9, 22e9),
    "deepseek_v3_671b_a37b_ep64_pp4.sh": (671e9, 37e9),
    "refmoe_288b_a16b_ep32_pp4_dp20.sh": (288e9, 16e9),
    "qwen3_235b_a22b_ep32_pp8_hgx.sh": (235e9, 22e9),
    "deepseek_v2_lite_16b_a2b_ep8_hgx.sh": (15.7e9, 2.4e9),
}


@pytest.fixture(scope="module")
def reports():
    """{recipe file name: RecipeReport} for every recipe, checked once."""
    return {
        name: check_recipe.check_launch(check_recipe.capture_launch(RECIPES / name))
        for name in LAYOUT
    }


def test_every_launch_recipe_is_covered():
    """A new recipe must be added here (record_trace_kjv.sh prepares a dataset and is a data
    recording job of the tiny model, not a layout recipe; common.sh is sourced)."""
    recipes = {p.name for p in RECIPES.glob("*.sh")} - {"common.sh", "record_trace_kjv.sh"}
    assert recipes == set(LAYOUT)


@pytest.mark.parametrize("name", list(LAYOUT))
def test_recipe_passes_checker_with_table3_layout(reports, name):
    report = reports[name]
    world, ep, pp, edp, slots = LAYOUT[name]
    a = report.args
    assert report.launch.world_size == world == a.world_size
    assert (a.expert_model_parallel_size, a.pipeline_model_parallel_size) == (ep, pp)
    assert a.world_size // (ep * pp * (a.expert_tensor_parallel_size or 1)) == edp
    assert a.moe_balancer == ("ultraep" if slots else "none")
    if slots:
        assert a.moe_balancer_num_slots == slots
    assert report.problems() == []
    # Independently of the checker's own test: each EP group lies in one rack of 64 (HGX: each
    # balancer domain of 8 EP ranks in one node of 8), each PP group's stages in distinct racks
    # (nodes).
    layout = report.layout
    domain, size = (8, a.moe_balancer_domain_size) if name in HGX else (64, ep)
    assert sorted(r for g in layout.ep_groups for r in g) == list(range(world))
    assert all(len(g) == ep for g in layout.ep_groups)
    assert all(
        len({r // domain for r in g[i : i + size]}) == 1
        for g in layout.ep_groups
        for i in range(0, ep, size)
    )
    assert all(len({r // domain for r in g}) == pp for g in layout.pp_groups)
    text = check_recipe.format_report(report)
    assert re.search(r"^  EP groups .*: yes$", text, re.M) and "passed" in text
    assert report.margin_bytes() > 0 and ": fits" in text


def test_the_docs_table_gives_the_balancer_and_slots_each_recipe_runs_with(reports):
    """docs/recipes.md's "slots / rank" column is what the recipe launches, as its user runs it (no
    MOE_BALANCER in the environment): `ultraep` with that many redundant slots ("(default)": the
    flag's default); the tiny CPU recipe included."""
    rows = re.findall(
        r"^\| `recipes/([\w.]+\.sh)` \|.*\| (\d+)( \(default\))? \|$",
        (REPO / "docs" / "recipes.md").read_text(),
        re.M,
    )
    assert "tiny_cpu.sh" in {name for name, *_ in rows}
    for name, slots, default in rows:
        launch = check_recipe.capture_launch(RECIPES / name, {"MOE_BALANCER": ""})
        checked = reports.get(name)
        args = (
            checked.args
            if checked is not None and checked.launch.args == launch.args
            else check_recipe.check_launch(launch).args
        )
        assert (args.moe_balancer, args.moe_balancer_num_slots) == ("ultraep", int(slots)), name
        assert ("--moe-balancer-num-slots" not in launch.args) == bool(default), name


@pytest.mark.parametrize("name", list(SHAPES))
def test_recipe_has_the_published_model_shape(reports, name):
    a = reports[name].args
    layers, dense, hidden, heads, experts, topk, ffn, shared, score, lb, coeff, bias = SHAPES[name]
    pattern = a.moe_layer_freq if isinstance(a.moe_layer_freq, list) else [1] * a.num_layers
    assert a.num_layers == layers and pattern == [0] * dense + [1] * (layers - dense)
    assert (a.num_experts, a.moe_router_topk) == (experts, topk)
    if hidden is not None:
        assert (a.hidden_size, a.num_attention_heads, a.moe_ffn_hidden_size) == (hidden, heads, ffn)
        assert a.moe_shared_expert_intermediate_size == shared
    assert (a.moe_router_score_function, a.moe_router_load_balancing_type) == (score, lb)
    assert a.moe_aux_loss_coeff == coeff and a.moe_router_enable_expert_bias == bias
    if bias:
        assert a.moe_router_bias_update_rate == 1e-3
    assert a.bf16 and a.transformer_impl == "transformer_engine" and a.moe_grouped_gemm


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_published_sizes(reports, name):
    total, active = PUBLISHED[name]
    memory = reports[name].memory
    assert abs(memory.total_params / total - 1) < 0.02, memory.total_params
    # Vendors count active parameters with or without the embeddings: accept both conventions.
    assert 0.95 * active < memory.active_params < 1.15 * active, memory.active_params


@pytest.mark.parametrize("name", ["glm45_air_106b_a12b_ep64_dp2.sh", "qwen3_235b_a22b_ep64_dp4.sh"])
def test_memory_estimate_agrees_with_megatrons_estimator(reports, name):
    """PP=1 recipes: a rank holds the whole non-expert model and 1/EP of the experts, which is
    what Megatron's estimator calls the most loaded shard (it counts neither QKV bias nor MTP
    projections, hence the small tolerance)."""
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    report = reports[name]
    expected = compute_weight_and_optimizer_memory(copy.copy(report.args))
    assert abs(report.memory.stages[0].model_states / expected - 1) < 0.005


def test_latent_moe_memory_agrees_with_megatrons_estimator(reports):
    """Qwen3-235B with --moe-latent-size 1024: the routed experts (and a redundant slot) at the
    latent size, the two latent projections per MoE layer, as Megatron's estimator counts them."""
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    plain = reports["qwen3_235b_a22b_ep64_dp4.sh"]
    args = copy.copy(plain.args)
    args.moe_latent_size = 1024
    expected = compute_weight_and_optimizer_memory(copy.copy(args))
    memory = check_recipe.estimate_memory(args)
    assert abs(memory.stages[0].model_states / expected - 1) < 0.005
    # A slot holds one latent-size expert: fc1 [2 x 1536, 1024] and fc2 [1024, 1536], bf16.
    assert memory.stages[0].slot_weight_bytes == 2 * 3 * 1536 * 1024
    assert plain.memory.stages[0].slot_weight_bytes == 2 * 3 * 1536 * 4096


def test_qwen3_slot_memory_reproduces_paper_section_4_1(reports):
    """§4.1: one redundant slot of Qwen3-235B is ~36 MB weights + ~72 MB fp32 gradients per rank
    with cross-layer reuse, against 3.3 GB + 6.6 GB without."""
    report = reports["qwen3_235b_a22b_ep64_dp4.sh"]
    stage = report.memory.stages[0]
    assert abs(stage.slot_weight_bytes / (36 * MIB) - 1) < 0.10
    assert abs(stage.slot_grad_bytes / (72 * MIB) - 1) < 0.10
    assert abs(stage.slot_weight_bytes * stage.moe_layers / (3.3 * GIB) - 1) < 0.10
    assert abs(stage.slot_grad_bytes * stage.moe_layers / (6.6 * GIB) - 1) < 0.10
    assert stage.slots_with_reuse == 2 * (stage.slot_weight_bytes + stage.slot_grad_bytes)
    text = check_recipe.format_report(report)
    assert "36.0 MiB weights + 72.0 MiB fp32 grads" in text and "3.30 GiB + 6.61 GiB" in text


def test_pipeline_stages_follow_the_recipe_split(reports):
    """DeepSeek-V3: 15/16/16/14 decoder layers; the first three (dense) on stage 0; MTP on the
    last stage (its MoE layer counts there)."""
    stages = reports["deepseek_v3_671b_a37b_ep64_pp4.sh"].memory.stages
    assert [len(s.layers) for s in stages] == [15, 16, 16, 14]
    assert [s.moe_layers for s in stages] == [12, 16, 16, 15]
    # Every stage holds 256/64 = 4 experts of each of its MoE layers.
    expert = 3 * 7168 * 2048
    assert [s.expert_params for s in stages] == [4 * expert * m for m in (12, 16, 16, 15)]


@pytest.mark.parametrize(
    "name,line",
    [
        # Published shapes: DeepSeek-V3 61 layers, the first 3 dense, one MTP layer; GLM-4.5-Air and
        # RefMoE 46 layers, the first dense, one MTP layer; Qwen3 94 MoE layers, no MTP.
        ("deepseek_v3_671b_a37b_ep64_pp4.sh", "58 decoder + 1 MTP, ids 4-62"),
        ("glm45_air_106b_a12b_ep64_dp2.sh", "45 decoder + 1 MTP, ids 2-47"),
        ("refmoe_288b_a16b_ep32_pp4_dp20.sh", "45 decoder + 1 MTP, ids 2-47"),
        ("qwen3_235b_a22b_ep64_dp4.sh", "94 decoder, ids 1-94"),
    ],
)
def test_mtp_layers_are_reported_as_balanced_moe_layers(reports, name, line):
    """The MTP block's MoE layer is balanced like the decoder's, numbered after the decoder."""
    assert f"balanced MoE layers (--moe-balancer ultraep): {line}" in check_recipe.format_report(
        reports[name]
    )


@pytest.mark.parametrize("repeated,ids", [(False, [2, 3, 4, 5, 6]), (True, [2, 3, 4, 5])])
def test_a_repeated_mtp_layer_is_one_balanced_layer(repeated, ids):
    """--mtp-use-repeated-layer: the MTP block holds one layer for all its depths (one id)."""
    args = types.SimpleNamespace(
        moe_balancer="ultraep",
        num_layers=4,
        num_experts=8,
        moe_layer_freq=[0, 1, 1, 1],
        mtp_num_layers=2,
        mtp_use_repeated_layer=repeated,
    )
    assert model.balanced_moe_layer_ids(args) == ids
    assert model.built_mtp_layers(args) == (1 if repeated else 2)


def test_checker_rejects_an_ep_group_larger_than_a_rack(reports):
    report = reports["qwen3_235b_a22b_ep64_dp4.sh"]
    layout = check_recipe.rank_layout(report.args, gpus_per_node=4, rack_size=32)
    assert any(
        "spans scale-up domains" in p and "--moe-balancer-domain-size 32" in p
        for p in layout.problems()
    )


def test_checker_reports_megatron_and_ultraep_rejections(capsys):
    tiny = check_recipe.capture_launch(RECIPES / "tiny_cpu.sh")
    with pytest.raises(check_recipe.RecipeError, match="num_experts|divisible|expert"):
        check_recipe.check_launch(
            check_recipe.Launch(4, 1, "pretrain_gpt.py", [*tiny.args, "--num-experts", "6"])
        )
    with pytest.raises(check_recipe.RecipeError, match="alltoall"):
        check_recipe.check_launch(
            check_recipe.Launch(
                4,
                1,
                "pretrain_gpt.py",
                [
                    *tiny.args,
                    "--moe-balancer",
                    "ultraep",
                    "--moe-token-dispatcher-type",
                    "allgather",
                ],
            )
        )
    # The command line: exit status 1 and the reason, for a bare-argument check.
    assert main(["check-recipe", "--world-size", "4", "--", *tiny.args, "--num-experts", "6"]) == 1
    assert "PROBLEM: " in capsys.readouterr().out
    assert main(["check-recipe", str(RECIPES / "tiny_cpu.sh")]) == 0
    assert "1/1 recipe(s) passed" in capsys.readouterr().out
    assert main(["check-recipe", str(RECIPES / "tiny_cpu.sh"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["passed"], report["failed"]) == (1, 0)
    tiny_report = report["recipes"][0]
    assert (tiny_report["world_size"], tiny_report["expert_model_parallel_size"]) == (4, 4)
    assert tiny_report["ep_groups"] == [[0, 1, 2, 3]]
    assert (
        main(["check-recipe", "--", "--num-layers", "2"]) == 2
    )  # bare arguments need --world-size
    assert "need --world-size" in capsys.readouterr().err


def test_readme_recipe_check_passes_every_recipe_and_only_recipes():
    """The README's command as a user types it in the repository, in a fresh process (where
    Megatron's import-time warnings would land in the report): exit 0, every launch script
    checked and passed, the sourced recipes/common.sh skipped, no warnings."""
    command = re.search(
        r"`(ultraep check-recipe recipes/\*\.sh)`", (REPO / "README.md").read_text()
    )[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    completed = subprocess.run(
        [
            "bash",
            "-c",
            command.replace("ultraep", f"{shlex.quote(sys.executable)} -m ultraep_megatron.cli", 1),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = completed.stdout + completed.stderr
    assert completed.returncode == 0, printed[-3000:]
    recipes = sorted(p.name for p in RECIPES.glob("*.sh") if p.name != "common.sh")
    assert sorted(re.findall(r"^== recipes/(\S+)", completed.stdout, re.M)) == sorted(
        recipes + ["common.sh"]
    )
    assert (
        f"{len(recipes)}/{len(recipes)} recipe(s) passed (recipes/common.sh skipped: not a recipe)"
        in printed
    )
    assert "warn" not in printed.lower() and "Traceback" not in printed


def _expert_grid_args(world: int, ep: int, pp: int) -> types.SimpleNamespace:
    """The validated-argument fields startup_problems reads, for TP = CP = ETP = 1."""
    return types.SimpleNamespace(
        world_size=world,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        expert_tensor_parallel_size=1,
        expert_model_parallel_size=ep,
        data_parallel_size=world // pp,
        global_batch_size=8 * world // pp,
        micro_batch_size=1,
        rampup_batch_size=None,
    )


def _megatron_builds_whole_ep_groups(world: int, ep: int, pp: int) -> bool:
    """Independent of the checker: Megatron's own RankGenerator, sized as initialize_model_parallel
    sizes it (expert-DP = world // (ETP x EP x PP)), puts every rank in exactly one EP group."""
    from megatron.core.parallel_state import RankGenerator

    try:
        groups = RankGenerator(
            tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
        ).get_ranks("ep")
    except ZeroDivisionError:
        return False
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("world", [16, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("ep, pp", [(8, 1), (64, 1), (32, 4), (64, 4)])
def test_expert_grid_check_agrees_with_megatrons_rank_generator(world, ep, pp):
    problems = check_recipe.startup_problems(_expert_grid_args(world, ep, pp))
    assert (not problems) == _megatron_builds_whole_ep_groups(world, ep, pp), problems


@pytest.mark.parametrize("nnodes", [20, 4])
def test_layouts_megatron_refuses_fail_with_one_problem_line(nnodes, capsys):
    """Qwen3's EP64 on 80 ranks (ranks 64-79 in no EP group) and on 16 (fewer ranks than one EP
    group: RankGenerator divided by zero): one PROBLEM line each, no traceback."""
    assert (
        main(
            [
                "check-recipe",
                "--env",
                f"NNODES={nnodes}",
                str(RECIPES / "qwen3_235b_a22b_ep64_dp4.sh"),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.strip().startswith("PROBLEM:")]
    assert len(problems) == 1, out
    assert (
        f"world size {4 * nnodes} is not divisible by expert-TP 1 x EP 64 x PP 1 = 64"
        in problems[0]
    )
    assert "Traceback" not in out and "0/1 recipe(s) passed" in out


def test_batch_problems_name_the_training_batch_unless_eval_batches_are_set(capsys):
    """12 ranks cannot split the tiny recipe's global batch 16 into micro-batches of 2: reported
    as the training batch whether eval is off (the recipe's --eval-iters 0) or on with default eval
    batches; Megatron's eval-batch message only for eval batches the user set."""
    tiny = check_recipe.capture_launch(RECIPES / "tiny_cpu.sh").args
    for extra in ([], ["--eval-iters", "2"], ["--eval-global-batch-size", "20"]):
        assert main(["check-recipe", "--world-size", "12", "--", *tiny, *extra]) == 1
        problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM:" in line]
        assert (
            len(problems) == 1
            and "--global-batch-size 16 is not divisible by --micro-batch-size 2 x "
            "data-parallel size 12"
            in problems[0]
        ), problems
    # Eval on, an eval batch of 20 on 4 ranks: 20 is not a multiple of 2 x 4.
    assert (
        main(
            [
                "check-recipe",
                "--world-size",
                "4",
                "--",
                *tiny,
                "--eval-iters",
                "2",
                "--eval-global-batch-size",
                "20",
            ]
        )
        == 1
    )
    problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM:" in line]
    assert len(problems) == 1 and "eval_global_batch_size (20)" in problems[0]


def test_recipes_switch_to_grouped_gemm_or_flex_as_the_docs_say():
    """docs/recipes.md: a recipe switches to TE's grouped-GEMM experts with --moe-grouped-gemm (the
    checker answers Megatron's compute-capability question as a Hopper GPU); the GB200 recipes run
    the flex dispatcher with HybridEP by default, the HGX ones alltoall (DISPATCHER switches). The
    checker judges the recipe for its GPU nodes: a backend not installed here is a NOTE naming it,
    not a problem (pretrain_gpt.py refuses it: recipe_check/test_environment.py)."""
    from megatron.core.transformer.moe import token_dispatcher

    launch = check_recipe.capture_launch(
        RECIPES / "qwen3_235b_a22b_ep64_dp4.sh", {"DISPATCHER": ""}
    )
    report = check_recipe.check_launch(
        check_recipe.Launch(4, 64, "pretrain_gpt.py", [*launch.args, "--moe-grouped-gemm"])
    )
    assert (
        report.args.moe_grouped_gemm
        and report.args.moe_balancer == "ultraep"
        and report.problems() == []
    )
    assert (report.args.moe_token_dispatcher_type, report.args.moe_flex_dispatcher_backend) == (
        "flex",
        "hybridep",
    )
    hgx = check_recipe.capture_launch(
        RECIPES / "qwen3_235b_a22b_ep32_pp8_hgx.sh", {"DISPATCHER": ""}
    )
    assert check_recipe.check_launch(hgx).args.moe_token_dispatcher_type == "alltoall"
    flex = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    report = check_recipe.check_launch(
        check_recipe.Launch(4, 64, "pretrain_gpt.py", [*launch.args, *flex])
    )
    assert report.problems() == []
    deepep_here = getattr(token_dispatcher, "fused_dispatch", None) is not None
    assert [n.split(" must be installed")[0] for n in report.notes] == (
        [] if deepep_here else ["DeepEP (deep_ep)"]
    )


@pytest.mark.parametrize("name", list(LAYOUT))
def test_every_recipe_follows_the_slot_rule(reports, name):
    """docs/recipes.md's slot rule, which `ultraep advise` applies to a trace: a recipe takes
    max(2, ceil(E / 2R)) redundant slots per rank, the fewest (at least two) with which the real
    planner balances the rule's design load (half of every NVLink domain's experts receive no
    tokens, their owners idle) to a rank imbalance of 1.0; one slot fewer leaves it above (the
    capacity bound, 2 - 2 S R / E, where the floor of two does not decide)."""
    from ultraep_megatron import planner
    from ultraep_megatron.analysis.advisor import half_cold_load, recipe_slots, slot_capacity_bound

    a = reports[name].args
    E, R, D = a.num_experts, a.expert_model_parallel_size, a.moe_balancer_domain_size
    S = a.moe_balancer_num_slots
    assert S == recipe_slots(E, R)
    load = half_cold_load(R, E, domain_size=D)
    after = {
        s: planner.metrics(load, planner.solve(load, s, domain_size=D), domain_size=D)[
            "imbalance_after"
        ]
        for s in (S - 1, S)
    }
    assert after[S] == pytest.approx(1.0, abs=1e-9) == slot_capacity_bound(load, S, D)
    if S > 2:
        assert (
            after[S - 1]
            == pytest.approx(2 - 2 * (S - 1) * R / E)
            == slot_capacity_bound(load, S - 1, D)
        )
