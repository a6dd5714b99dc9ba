"""The checker's verdict on HGX (H100/H200) layouts: the shipped HGX recipes pass for their full
world size on 80 GB GPUs, EP across nodes without a node-sized balancer domain fails naming
``--moe-balancer-domain-size``, and each rank's estimated peak (model states, replica slots,
activations, runtime allowance) is held against the GPU memory budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from ultraep_megatron.megatron import recipe_check as rc
from ultraep_megatron.megatron.recipe_check import activations, memory

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
HGX = {
    "deepseek_v2_lite_16b_a2b_ep8_hgx.sh": (8, 1, 8),
    "qwen3_235b_a22b_ep32_pp8_hgx.sh": (256, 32, 32),
}
GIB = 1024**3


@pytest.fixture(scope="module")
def launches():
    return {name: rc.capture_launch(RECIPES / name) for name in HGX}


@pytest.fixture(scope="module")
def reports(launches):
    return {name: rc.check_launch(launch, gpu_memory_gb=80) for name, launch in launches.items()}


@pytest.mark.parametrize("name", list(HGX))
def test_hgx_recipes_pass_for_their_full_world_size_on_80_gb(reports, name):
    report = reports[name]
    world, nodes, ep = HGX[name]
    a = report.args
    assert (report.launch.world_size, report.launch.nnodes, report.launch.nproc_per_node) == (
        world,
        nodes,
        8,
    )
    assert a.expert_model_parallel_size == ep and a.moe_balancer_domain_size == 8
    assert a.moe_balancer_hardware == "h100-hgx" and a.moe_grouped_gemm and a.bf16
    assert a.use_distributed_optimizer and a.overlap_grad_reduce and a.overlap_param_gather
    assert report.problems() == []
    assert report.layout.rack_size == 8 and report.gpu_memory_gb == 80
    assert report.margin_bytes() > 4 * GIB  # a real margin, beyond the runtime allowance
    text = rc.format_report(report)
    assert "budget 80 GiB per GPU (--gpu-memory-gb)" in text and ": fits" in text
    # Every balancer domain (8 consecutive EP ranks) on one node, checked on the global ranks.
    for group in report.layout.ep_groups:
        assert all(len({r // 8 for r in group[i : i + 8]}) == 1 for i in range(0, ep, 8))


def test_hardware_preset_sets_the_domain_and_the_budget(launches):
    """Without --rack-size / --gpu-memory-gb the recipe's --moe-balancer-hardware h100-hgx gives
    8-GPU NVLink domains and 80 GiB, h200-hgx the same domains and 141 GiB, a rack recipe's
    paper-rack 64 and a GB200's 186; none of them is an assumption."""
    report = rc.check_launch(launches["qwen3_235b_a22b_ep32_pp8_hgx.sh"])
    assert (report.layout.rack_size, report.gpu_memory_gb, report.assumed) == (8, 80, [])
    text = rc.format_report(report)
    assert (
        "hardware: h100-hgx (--moe-balancer-hardware): NVLink domains of 8 GPUs, 80 GiB per GPU"
        in text
    )
    assert "32 nodes x 8 GPUs in 32 scale-up domains of 8 GPUs" in text and "ASSUMED" not in text
    assert (
        "EP groups span scale-up domains; balancer domains of --moe-balancer-domain-size 8 inside one: yes"
        in text
    )
    launch = launches["qwen3_235b_a22b_ep32_pp8_hgx.sh"]
    h200 = rc.check_launch(
        rc.Launch(8, 32, launch.script, [*launch.args, "--moe-balancer-hardware", "h200-hgx"])
    )
    assert (h200.layout.rack_size, h200.gpu_memory_gb, h200.problems()) == (8, 141, [])
    rack = rc.check_launch(rc.capture_launch(RECIPES / "glm45_air_106b_a12b_ep64_dp2.sh"))
    assert (rack.layout.rack_size, rack.gpu_memory_gb, rack.assumed) == (64, 186, [])
    assert (
        "hardware: paper-rack (--moe-balancer-hardware): NVLink domains of 64 GPUs"
        in rc.format_report(rack)
    )


def test_a_contradicting_rack_size_or_node_size_is_a_problem(launches):
    launch = launches["qwen3_235b_a22b_ep32_pp8_hgx.sh"]
    report = rc.check_launch(launch, rack_size=64)
    assert any(
        "--rack-size 64 contradicts --moe-balancer-hardware h100-hgx" in p
        for p in report.problems()
    )
    half = rc.Launch(4, 64, launch.script, launch.args)
    problems = rc.check_launch(half).problems()
    assert any("runs 4 processes per node" in p and "GPUS_PER_NODE=8" in p for p in problems)


def test_ep_across_nodes_without_a_node_sized_domain_fails_naming_the_flag(launches):
    """DeepSeek-V2-Lite at EP16 on two HGX nodes: passes with the recipe's domain of 8, fails
    without a domain and with one of 16, each time naming --moe-balancer-domain-size."""
    args = list(launches["deepseek_v2_lite_16b_a2b_ep8_hgx.sh"].args)
    i = args.index("--moe-balancer-domain-size")
    without = args[:i] + args[i + 2 :]
    ep16 = ["--expert-model-parallel-size", "16"]
    assert rc.check_launch(rc.Launch(8, 2, "pretrain_gpt.py", [*args, *ep16])).problems() == []
    for extra, named in (
        ([], "--moe-balancer-domain-size 8"),
        (
            ["--moe-balancer-domain-size", "16"],
            "--moe-balancer-domain-size 16: balancer domain [0-15]",
        ),
    ):
        problems = rc.check_launch(
            rc.Launch(8, 2, "pretrain_gpt.py", [*without, *ep16, *extra])
        ).problems()
        assert len(problems) == 1 and named in problems[0], problems


def test_peak_is_model_states_slots_activations_and_the_allowance(reports):
    report = reports["qwen3_235b_a22b_ep32_pp8_hgx.sh"]
    stages = memory.stage_layers(report.args)
    expected = activations.estimate_activations(report.args, stages)
    for stage, acts in zip(report.memory.stages, expected):
        assert stage.activations == acts.total > 0
        assert stage.peak == stage.model_states + stage.slots_with_reuse + acts.total + int(
            activations.RUNTIME_RESERVE_GIB * GIB
        )
    # Interleaved (PP 8, VP 4), overlapped: megatron's warm-up 2 (PP - stage - 1) + (VP - 1) PP, one
    # more for the overlapped schedule, plus the model chunk running, in whole stages.
    pp, vp = 8, 4
    assert [a.in_flight for a in report.memory.activations] == [
        (2 * (pp - s - 1) + (vp - 1) * pp + 2) / vp for s in range(pp)
    ]
    assert report.memory.activations[-1].logits > 0 == report.memory.activations[0].logits
    assert report.margin_bytes() == 80 * GIB - max(s.peak for s in report.memory.stages)


def test_memory_budget_pass_and_fail(launches):
    """The same recipe against budgets around its largest peak: it passes at the peak and fails
    one GiB below it, with one PROBLEM per stage over budget naming the figures."""
    launch = launches["deepseek_v2_lite_16b_a2b_ep8_hgx.sh"]
    peak = max(s.peak for s in rc.check_launch(launch, gpu_memory_gb=80).memory.stages)
    fits = rc.check_launch(launch, gpu_memory_gb=peak / GIB)
    assert fits.problems() == [] and fits.margin_bytes() >= -1
    short = rc.check_launch(launch, gpu_memory_gb=peak / GIB - 1)
    problems = short.problems()
    assert len(problems) == 1 and problems[0].startswith("stage 0: estimated peak")
    assert "budget (--gpu-memory-gb) by 1.00 GiB" in problems[0]
    assert "DOES NOT FIT" in rc.format_report(short)
    # Without sequence parallelism (each TP rank keeping every token's activations) the Qwen3-235B
    # HGX layout does not fit 80 GB; the recipe's --sequence-parallel is what makes it fit.
    qwen = launches["qwen3_235b_a22b_ep32_pp8_hgx.sh"]
    plain = rc.Launch(8, 32, qwen.script, [a for a in qwen.args if a != "--sequence-parallel"])
    assert any("exceeds the 80 GiB budget" in p for p in rc.check_launch(plain).problems())
