"""The rack recipes' environment (``recipes/common.sh``), on the launch line each recipe would run:
the recipe runs with the checker's python shim (``recipe_check.capture_launch``), nothing is
launched.

* wandb only when ``WANDB_PROJECT`` is set, and never with ``WANDB_MODE=disabled``;
* ``DATA_PATH`` needs ``TOKENIZER_MODEL`` (no hub-id default that fails late on a cluster without
  internet): refused before torchrun, one line naming it;
* a malformed ``NNODES`` / ``GPUS_PER_NODE`` / ``NODE_RANK`` / ``MASTER_PORT`` is one line naming
  the variable, exit status 2, also through ``ultraep check-recipe --env``;
* the production envelope (docs/recipes.md): ``PRECISION`` (bf16 by default; the recipe's
  ``PRECISIONS`` map to Megatron-Bridge's presets, others are refused naming it),
  ``CUDA_GRAPH_MODULES`` (the recipe's default; never the balanced part) and ``DISPATCHER`` (the
  GB200 recipes' default hybridep, the HGX ones' alltoall).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ultraep_megatron.cli import main
from ultraep_megatron.megatron import recipe_check

REPO = Path(__file__).resolve().parents[2]
#: Every recipe that sources common.sh (the rack and node recipes).
RECIPES = sorted(
    p.name
    for p in (REPO / "recipes").glob("*.sh")
    if re.search(r"^source .*/common\.sh", p.read_text(), re.M)
)
#: The GB200 rack recipes (4 GPUs per node), whose default dispatcher is flex with HybridEP.
GB200 = {
    "deepseek_v3_671b_a37b_ep64_pp4.sh",
    "glm45_air_106b_a12b_ep64_dp2.sh",
    "qwen3_235b_a22b_ep64_dp4.sh",
    "refmoe_288b_a16b_ep32_pp4_dp20.sh",
}
#: The variables under test, cleared whatever the test's own environment holds.
CLEAN = {
    name: ""
    for name in (
        "WANDB_PROJECT",
        "WANDB_MODE",
        "WANDB_EXP_NAME",
        "WANDB_SAVE_DIR",
        "DATA_PATH",
        "TOKENIZER_MODEL",
        "NNODES",
        "GPUS_PER_NODE",
        "NODE_RANK",
        "SLURM_NODEID",
        "MASTER_PORT",
        "PRECISION",
        "CUDA_GRAPH_MODULES",
        "DISPATCHER",
    )
}


def launch_args(recipe: str, **env: str) -> list[str]:
    return recipe_check.capture_launch(REPO / "recipes" / recipe, {**CLEAN, **env}).args


def refusal(recipe: str, **env: str) -> recipe_check.RecipeError:
    with pytest.raises(recipe_check.RecipeError) as raised:
        recipe_check.capture_launch(REPO / "recipes" / recipe, {**CLEAN, **env})
    return raised.value


def refusal_lines(recipe: str, **env: str) -> list[str]:
    """What the checker says of a recipe that stops on a variable: the recipe's own line (exit
    status 2, one line on stderr naming the variable) as the problem, nothing else."""
    error = refusal(recipe, **env)
    assert error.details == "", error.details
    return error.problem.splitlines()


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_the_recipes_source_common_sh():
    assert "qwen3_235b_a22b_ep64_dp4.sh" in RECIPES and len(RECIPES) >= 4, RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_wandb_only_when_a_project_is_given_and_not_disabled(recipe):
    assert not [a for a in launch_args(recipe) if a.startswith("--wandb")]
    args = launch_args(recipe, WANDB_PROJECT="moe", WANDB_SAVE_DIR="/runs/w")
    assert flag_value(args, "--wandb-project") == "moe"
    assert flag_value(args, "--wandb-exp-name")  # the recipe's name
    assert flag_value(args, "--wandb-save-dir") == "/runs/w"
    assert (
        flag_value(
            launch_args(recipe, WANDB_PROJECT="moe", WANDB_EXP_NAME="first"), "--wandb-exp-name"
        )
        == "first"
    )
    offline = launch_args(recipe, WANDB_PROJECT="moe", WANDB_MODE="offline")
    assert flag_value(offline, "--wandb-project") == "moe"
    disabled = launch_args(
        recipe, WANDB_PROJECT="moe", WANDB_MODE="disabled", WANDB_SAVE_DIR="/runs/w"
    )
    assert not [a for a in disabled if a.startswith("--wandb")], disabled


@pytest.mark.parametrize("recipe", RECIPES)
def test_data_path_needs_a_tokenizer_model(recipe):
    lines = refusal_lines(recipe, DATA_PATH="/data/corpus_text_document")
    assert len(lines) == 1 and lines[0].startswith(
        f"{recipe}: DATA_PATH is set but TOKENIZER_MODEL is not"
    ), lines
    args = launch_args(
        recipe, DATA_PATH="/data/corpus_text_document", TOKENIZER_MODEL="/models/tok"
    )
    assert flag_value(args, "--tokenizer-model") == "/models/tok"
    assert flag_value(args, "--data-path") == "/data/corpus_text_document"
    assert "--mock-data" in launch_args(recipe)  # without DATA_PATH: mock data, no tokenizer asked


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"NNODES": "abc"}, "NNODES=abc: expected a whole number >= 1"),
        ({"NNODES": "0"}, "NNODES=0: expected a whole number >= 1"),
        ({"GPUS_PER_NODE": "8x"}, "GPUS_PER_NODE=8x: expected a whole number >= 1"),
        ({"NODE_RANK": "-1"}, "NODE_RANK=-1: expected a whole number >= 0"),
        ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: expected less than NNODES=2"),
        ({"NNODES": "2", "SLURM_NODEID": "5"}, "NODE_RANK=5: expected less than NNODES=2"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT=http: expected a whole number >= 1"),
    ],
)
def test_a_malformed_layout_variable_is_one_line_naming_it(env, needle):
    lines = refusal_lines("qwen3_235b_a22b_ep64_dp4.sh", **env)
    assert len(lines) == 1 and needle in lines[0], lines


def test_check_recipe_names_the_variable_instead_of_a_raw_int_error(capsys, monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)
    assert (
        main(
            [
                "check-recipe",
                "--env",
                "NNODES=abc",
                str(REPO / "recipes" / "qwen3_235b_a22b_ep64_dp4.sh"),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "NNODES=abc: expected a whole number >= 1 (nodes in the job)" in out, out
    assert "invalid literal for int()" not in out and "Traceback" not in out


#: PRECISION -> the flags docs/recipes.md gives it.
PRECISION_FLAGS = {
    "bf16": [],
    "fp8_cs": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
    "fp8_sc": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
    "fp8_mx": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather"],
}


def fp8_flags(args: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--fp8"):
            out += [arg] + ([args[i + 1]] if arg != "--fp8-param-gather" else [])
    return out


def last_value(args: list[str], flag: str) -> str | None:
    """Megatron keeps a flag's last occurrence."""
    return args[len(args) - 1 - args[::-1].index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("recipe", RECIPES)
def test_precision_maps_to_the_bridge_presets_and_refuses_others(recipe):
    supported = (
        re.search(r'^PRECISIONS="([^"]+)"', (REPO / "recipes" / recipe).read_text(), re.M)
        .group(1)
        .split()
    )
    assert "bf16" in supported and ("fp8_mx" in supported) != ("fp8_sc" in supported), supported
    assert fp8_flags(launch_args(recipe)) == []  # bf16 unless asked
    for precision in supported:
        assert fp8_flags(launch_args(recipe, PRECISION=precision)) == PRECISION_FLAGS[precision]
    for precision in [p for p in PRECISION_FLAGS if p not in supported] + ["nvfp4", "fp16"]:
        lines = refusal_lines(recipe, PRECISION=precision)
        assert len(lines) == 1 and f"PRECISION={precision}:" in lines[0], lines


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graphs_and_dispatcher_switches(recipe):
    default = launch_args(recipe)
    graphs = launch_args(recipe, CUDA_GRAPH_MODULES="attn moe_router")
    i = graphs.index("--cuda-graph-modules")
    assert (
        graphs[i + 1 : i + 3] == ["attn", "moe_router"]
        and flag_value(graphs, "--cuda-graph-impl") == "transformer_engine"
    )
    assert "--cuda-graph-impl" not in launch_args(recipe, CUDA_GRAPH_MODULES="none")
    if (
        "--cuda-graph-impl" in default
    ):  # a GB200 recipe: NVIDIA's per-layer graphs, less moe_preprocess
        assert default == graphs
    for module in ("moe", "full_iteration"):
        lines = refusal_lines(recipe, CUDA_GRAPH_MODULES=f"attn {module}")
        assert len(lines) == 1 and lines[0].startswith(
            f"{recipe}: CUDA_GRAPH_MODULES=attn {module}: {module} "
            "is refused: its graph would capture "
        ), lines
    # moe_preprocess: one answer with pretrain_gpt.py and the checker (balanced_layer/
    # capabilities.py): with the alltoall dispatcher (the device planner), never with flex.
    preprocess = launch_args(
        recipe, CUDA_GRAPH_MODULES="moe_router moe_preprocess", DISPATCHER="alltoall"
    )
    i = preprocess.index("--cuda-graph-modules")
    assert preprocess[i + 1 : i + 3] == ["moe_router", "moe_preprocess"]
    lines = refusal_lines(
        recipe, CUDA_GRAPH_MODULES="moe_router moe_preprocess", DISPATCHER="hybridep"
    )
    assert len(lines) == 1 and lines[0].startswith(
        f"{recipe}: CUDA_GRAPH_MODULES=moe_router moe_preprocess: moe_preprocess is refused: with "
        "DISPATCHER=hybridep (the flex dispatcher)"
    ), lines
    # Megatron-Bridge's GB200 recipes run HybridEP, and so do ours; the HGX ones keep alltoall.
    gb200 = recipe in GB200
    assert gb200 != recipe.endswith("_hgx.sh")
    assert last_value(default, "--moe-token-dispatcher-type") == ("flex" if gb200 else "alltoall")
    assert flag_value(default, "--moe-flex-dispatcher-backend") == ("hybridep" if gb200 else None)
    for dispatcher in ("hybridep", "deepep"):
        flex = launch_args(recipe, DISPATCHER=dispatcher)
        assert last_value(flex, "--moe-token-dispatcher-type") == "flex"
        assert flag_value(flex, "--moe-flex-dispatcher-backend") == dispatcher
    alltoall = launch_args(recipe, DISPATCHER="alltoall")
    assert last_value(alltoall, "--moe-token-dispatcher-type") == "alltoall"
    assert "--moe-flex-dispatcher-backend" not in alltoall
    lines = refusal_lines(recipe, DISPATCHER="ncclep")
    assert len(lines) == 1 and "DISPATCHER=ncclep:" in lines[0], lines


@pytest.mark.parametrize("dispatcher", ["alltoall", "hybridep"])
def test_moe_preprocess_graphs_get_the_same_answer_from_the_checker(dispatcher):
    """The HGX recipe's own launch with moe_preprocess captured (built with the alltoall
    dispatcher, which the recipe accepts), then with the flex dispatcher appended: the checker
    (pretrain_gpt.py's startup checks) passes the first and refuses the second, as the recipe does."""
    args = launch_args(
        "deepseek_v2_lite_16b_a2b_ep8_hgx.sh",
        CUDA_GRAPH_MODULES="moe_router moe_preprocess",
        GLOBAL_BATCH_SIZE="64",
    )
    if dispatcher != "alltoall":
        args += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", dispatcher]
    launch = recipe_check.Launch(8, 1, "pretrain_gpt.py", args)
    if dispatcher == "alltoall":
        report = recipe_check.check_launch(launch)
        assert report.problems() == [] and report.args.moe_balancer_planner in (
            None,
            "device",
        )  # unset: device there
    else:
        with pytest.raises(recipe_check.RecipeError) as refused:
            recipe_check.check_launch(launch)
        (problem,) = refused.value.problem.splitlines()
        assert "--cuda-graph-modules moe_preprocess" in problem and "the flex dispatcher" in problem
