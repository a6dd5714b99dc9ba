"""``ultraep check-recipe`` on the Megatron-Bridge recipes (``recipes/bridge/*.py``): NVIDIA's perf
recipes from Bridge 0.6.2 with real routing and UltraEP, built here (no training), checked by
``enable_ultraep``'s checks on their fields, with the launch scripts' rank layout and memory.

One ``check-recipe --json`` run (a subprocess: the recipes point Hugging Face at their shipped
configs before it is imported) checks the shipped recipes, the ``FILE.py:FUNCTION`` form and the
``module:function`` variants of tests/bridge/bridge_recipe_variants.py, with the hub offline
(``HF_HUB_OFFLINE=1``) and its endpoint unreachable: nothing loads from a hub.

Skipped (one reason line) where megatron-bridge is not installed, except the test that
check-recipe says so: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bridge_helpers import needs_bridge

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "recipes/bridge/deepseek_v3_gb200.py": dict(
        world=256, nodes=64, per_node=4, tp=1, pp=4, ep=64, dp=256 // 4, rack=64, memory=186
    ),
    "recipes/bridge/deepseek_v3_h100.py": dict(
        world=1024, nodes=128, per_node=8, tp=2, pp=8, ep=64, dp=1024 // 16, rack=8, memory=80
    ),
    "recipes/bridge/qwen3_235b_a22b_h100.py": dict(
        world=256, nodes=32, per_node=8, tp=2, pp=8, ep=32, dp=256 // 16, rack=8, memory=80
    ),
}
VARIANTS = "bridge_recipe_variants"
FILE_FUNCTION = "recipes/bridge/qwen3_235b_a22b_h100.py:config"
TARGETS = [
    *SHIPPED,
    FILE_FUNCTION,
    f"{VARIANTS}:qwen3_real_routing",
    f"{VARIANTS}:qwen3_capacity_factor_after_enable",
    f"{VARIANTS}:qwen3_capacity_factor_before_enable",
    f"{VARIANTS}:qwen3_nvidia_unchanged",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")  # no hub, and none reachable
    return env


@pytest.fixture(scope="module")
def checked():
    """check-recipe's JSON reports, by source, and its exit status."""
    run = subprocess.run(
        [sys.executable, "-m", "ultraep_megatron.cli", "check-recipe", "--json", *TARGETS],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.stdout.strip(), run.stderr[-3000:]
    document = json.loads(run.stdout)
    return {r["source"]: r for r in document["recipes"]}, run.returncode


@needs_bridge
@pytest.mark.parametrize("recipe", list(SHIPPED))
def test_each_shipped_recipe_passes_with_layout_and_memory(checked, recipe):
    reports, _ = checked
    report, want = reports[recipe], SHIPPED[recipe]
    assert report["passed"], report["text"]
    text = report["text"]
    assert "cfg.model.moe_router_force_load_balancing: True -> False" in text  # what it changed
    assert "enable_ultraep's checks on the ConfigContainer (config_problems)" in text
    assert "rank layout (global ranks):" in text and "memory per rank" in text
    assert (report["world_size"], report["nnodes"], report["nproc_per_node"]) == (
        want["world"],
        want["nodes"],
        want["per_node"],
    )
    assert (
        report["tensor_model_parallel_size"],
        report["pipeline_model_parallel_size"],
        report["expert_model_parallel_size"],
        report["data_parallel_size"],
    ) == (want["tp"], want["pp"], want["ep"], want["dp"])
    assert (report["moe_balancer"], report["rack_size"], report["gpu_memory_gb"]) == (
        "ultraep",
        want["rack"],
        want["memory"],
    )
    assert report["margin_bytes"] > 0 and "fits" in text
    # In a Bridge user's terms: enable_ultraep's arguments and config fields, no pretrain_gpt flag.
    assert "--" not in text, [line for line in text.splitlines() if "--" in line]
    assert "enable_ultraep(balancer=ultraep)" in text and "enable_ultraep(hardware=" in text
    # Every EP group is ep consecutive ranks; the layout line names TP/PP/VPP/EP/ETP/CP/DP.
    assert all(len(g) == want["ep"] for g in report["ep_groups"])
    assert f"TP{want['tp']} PP{want['pp']} VPP4 EP{want['ep']} ETP1 CP1 DP{want['dp']}" in text
    # Every decoder layer on exactly one pipeline stage.
    layers = sorted(layer for stage in report["stages"] for layer in stage["layers"])
    assert layers == list(range(1, len(layers) + 1))


@needs_bridge
def test_the_gb200_recipe_prints_its_one_change_beyond_real_routing(checked):
    """Its CUDA graphs without HybridEP's preprocessing (enable_ultraep refuses capturing it), one
    line as printed; the HybridEP the GPU nodes need is a note, not a problem, here."""
    report = checked[0]["recipes/bridge/deepseek_v3_gb200.py"]
    changed = "cfg.model.cuda_graph_scope: ['attn', 'moe_router', 'moe_preprocess'] -> ['attn', 'moe_router']"
    assert changed in report["text"]
    assert any("HybridEP" in note and "GPU nodes" in note for note in report["notes"])


@needs_bridge
def test_the_deepseek_h100_pipeline_layout_places_layers_as_written(checked):
    """``Et|(tt|)*30mL`` over PP8 x VPP4: 32 chunks, chunk c on pipeline rank c % 8; chunk 0 holds
    layer 1, chunks 1-30 two layers each: rank 0 holds chunks 0, 8, 16, 24."""
    stages = checked[0]["recipes/bridge/deepseek_v3_h100.py"]["stages"]
    assert stages[0]["layers"] == [1, 16, 17, 32, 33, 48, 49]
    assert stages[7]["layers"] == [14, 15, 30, 31, 46, 47]  # chunk 31 holds MTP and the loss


@needs_bridge
def test_file_function_and_module_function_forms(checked):
    reports, _ = checked
    shipped = reports["recipes/bridge/qwen3_235b_a22b_h100.py"]
    for source in (FILE_FUNCTION, f"{VARIANTS}:qwen3_real_routing"):
        report = reports[source]
        assert report["passed"], report["text"]
        assert report["stages"] == shipped["stages"] and report["ep_groups"] == shipped["ep_groups"]


@needs_bridge
@pytest.mark.parametrize("variant", ["after", "before"])
def test_a_refused_setting_fails_naming_its_config_field(checked, variant):
    """Token dropping set after enable_ultraep (check-recipe's own check of the fields) and before
    it (enable_ultraep's refusal while the recipe is built): both fail naming the field."""
    reports, status = checked
    report = reports[f"{VARIANTS}:qwen3_capacity_factor_{variant}_enable"]
    assert not report["passed"] and status == 1
    assert any("cfg.model.moe_expert_capacity_factor" in p for p in report["problems"])
    assert "--moe-" not in " ".join(report["problems"])


@needs_bridge
def test_nvidias_recipe_unchanged_is_reported_force_balanced_and_unbalanced(checked):
    """No enable_ultraep, so no hardware named: the report says the routing is force-balanced and
    unbalanced, and (as for a launch script) refuses EP across nodes of unnamed hardware."""
    report = checked[0][f"{VARIANTS}:qwen3_nvidia_unchanged"]
    assert report["moe_balancer"] == "none" and report["hardware"] is None
    notes = " ".join(report["notes"])
    assert "enable_ultraep was not called" in notes and "force-balanced" in notes
    assert len(report["problems"]) == 1 and "no hardware is named" in report["problems"][0]


def test_without_bridge_check_recipe_says_so():
    """megatron.bridge made unimportable (as where it is not installed): a .py recipe fails with one
    line naming ULTRAEP_BRIDGE=1."""
    code = (
        "import sys; sys.modules['megatron.bridge'] = None\n"
        "from ultraep_megatron.cli import main\n"
        "sys.exit(main(['check-recipe', 'recipes/bridge/deepseek_v3_h100.py']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    problems = [line for line in run.stdout.splitlines() if "PROBLEM:" in line]
    assert len(problems) == 1 and "megatron-bridge is not installed" in problems[0]
    assert "ULTRAEP_BRIDGE=1" in problems[0]
