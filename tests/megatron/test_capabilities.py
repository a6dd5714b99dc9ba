"""What a balanced MoE layer cannot run (``megatron/release/capabilities.py``) fails at startup with a
message naming the flag, as in pretrain_gpt.py: UltraEP's startup checks on Megatron's parse of the
command line, then Megatron's own parser and validation (one subprocess for all command lines, no
distributed setup). What production runs is accepted.
"""

import pytest

from megatron_runs import argument_verdicts, check_verdict, tiny_moe_args
from ultraep_megatron.megatron.release import compat

BASE = tiny_moe_args(ep=1, train_iters=2)
ULTRAEP = ["--moe-balancer", "ultraep"]
DENSE = None  # the tiny model without its MoE flags
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]

COMMAND_LINES = {
    # name: (extra argv, substring the error must contain; None = must pass)
    "dense_model": (DENSE, "--num-experts"),
    "domain_not_dividing_ep": (
        [*ULTRAEP, "--moe-balancer-domain-size", "2"],
        "--moe-balancer-domain-size 2",
    ),
    "capacity_factor": (
        [*ULTRAEP, "--moe-expert-capacity-factor", "1.0"],
        "--moe-expert-capacity-factor",
    ),
    "allgather": (
        [*ULTRAEP, "--moe-token-dispatcher-type", "allgather"],
        "--moe-token-dispatcher-type",
    ),
    # DeepEP / HybridEP are GPU-only: on this machine the flex dispatcher must be refused cleanly.
    "flex_without_deepep": (
        [
            *ULTRAEP,
            "--moe-token-dispatcher-type",
            "flex",
            "--moe-flex-dispatcher-backend",
            "deepep",
        ],
        "--moe-flex-dispatcher-backend deepep",
    ),
    "flex_without_hybridep": (
        [
            *ULTRAEP,
            "--moe-token-dispatcher-type",
            "flex",
            "--moe-flex-dispatcher-backend",
            "hybridep",
        ],
        "--moe-flex-dispatcher-backend hybridep needs HybridEP",
    ),
    "flex_ncclep": (
        [
            *ULTRAEP,
            "--moe-token-dispatcher-type",
            "flex",
            "--moe-flex-dispatcher-backend",
            "ncclep",
        ],
        # megatron-core 0.18 has no ncclep backend: its own parser refuses the value.
        "--moe-flex-dispatcher-backend: invalid choice: 'ncclep'"
        if compat.is_018()
        else "--moe-flex-dispatcher-backend ncclep",
    ),
    "te_op_fuser": (
        [*ULTRAEP, "--use-transformer-engine-op-fuser"],
        "--use-transformer-engine-op-fuser",
    ),
    # FSDP gathers an expert only in its own hooks; the replica transfers read and write it outside.
    "megatron_fsdp": (
        [
            *ULTRAEP,
            "--use-megatron-fsdp",
            "--use-distributed-optimizer",
            "--data-parallel-sharding-strategy",
            "optim_grads_params",
        ],
        "--use-megatron-fsdp",
    ),
    "torch_fsdp2": (
        [*ULTRAEP, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"],
        "--use-torch-fsdp2",
    ),
    "tensor_parallel_experts": (
        [*ULTRAEP, "--tensor-model-parallel-size", "2"],
        "--expert-tensor-parallel-size",
    ),
    # What production runs (the distributed optimizer, overlapped reduction and gather, buckets
    # smaller than an expert, several instances) is accepted.
    "valid_production_ddp": (
        [
            *ULTRAEP,
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "2000",
            "--ddp-average-in-collective",
        ],
        None,
    ),
}
# Every command line runs at EP=1: a balancer whose settings are valid is warned about it.
WARNED = {"valid_production_ddp"}

# The production envelope (issue 35), judged by UltraEP's startup check alone (arguments.startup_problems
# on Megatron's parse, as pretrain_gpt.py runs it): Megatron's own validation of fp8 or CUDA graphs needs
# Transformer Engine and a GPU, which this machine lacks. name: (extra argv, substring one of UltraEP's
# errors must contain; None = UltraEP accepts it).
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules"]
REUSE = "--reuse-grad-buf-for-mxfp8-param-ag"
TE_PREPROCESS = [
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
]
ENVELOPE = {
    **{
        f"fp8_{recipe}{'_param_gather' if gather else ''}": (
            [*ULTRAEP, *FP8, recipe, *gather],
            None,
        )
        for recipe in ("tensorwise", "blockwise", "mxfp8")
        for gather in ([], ["--fp8-param-gather"])
        if (recipe, gather) != ("mxfp8", ["--fp8-param-gather"])
    },
    # MXFP8 parameters are gathered through the gradient buffer: megatron cannot map them into its
    # parameter buffer (TE's replace_raw_data refuses MXFP8), so the flag is required, and it is
    # only for them.
    "fp8_mxfp8_param_gather_reuse_grad_buf": (
        [*ULTRAEP, *FP8, "mxfp8", "--fp8-param-gather", REUSE],
        None,
    ),
    "fp8_mxfp8_param_gather_without_reuse": (
        [*ULTRAEP, *FP8, "mxfp8", "--fp8-param-gather"],
        f"needs {REUSE}",
    ),
    "fp8_reuse_grad_buf_tensorwise": (
        [*ULTRAEP, *FP8, "tensorwise", "--fp8-param-gather", REUSE],
        f"{REUSE} is only for MXFP8",
    ),
    "fp8_reuse_grad_buf_without_fp8_params": (
        [*ULTRAEP, *FP8, "mxfp8", REUSE],
        f"{REUSE} is only for MXFP8",
    ),
    "fp8_e4m3_tensorwise": ([*ULTRAEP, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], None),
    # One shared replica module would mix every layer's amax history.
    "fp8_delayed": ([*ULTRAEP, *FP8, "delayed"], "--fp8-recipe delayed"),
    "fp8_delayed_by_default": ([*ULTRAEP, "--fp8-format", "hybrid"], "--fp8-recipe delayed"),
    "fp8_custom": ([*ULTRAEP, *FP8, "custom"], "--fp8-recipe custom"),
    # Plain experts in the bf16 layers, quantized ones elsewhere: one replica-slot layout cannot hold both.
    "fp8_params_bf16_ends": (
        [*ULTRAEP, *FP8, "tensorwise", "--fp8-param-gather", "--first-last-layers-bf16"],
        "--first-last-layers-bf16 with --fp8-param-gather",
    ),
    "fp8_bf16_ends": ([*ULTRAEP, *FP8, "tensorwise", "--first-last-layers-bf16"], None),
    "fp4": ([*ULTRAEP, "--fp4-format", "e2m1"], "--fp4-format e2m1"),
    # megatron's local graphs: no test runs them with a balanced layer.
    "graphs_local_attn": (
        [*ULTRAEP, *GRAPHS, "attn"],
        "--cuda-graph-impl local (--cuda-graph-modules attn)",
    ),
    "graphs_te_attn": (
        [*ULTRAEP, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn"],
        None,
    ),
    "graphs_te_attn_router": (
        [
            *ULTRAEP,
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-modules",
            "attn",
            "moe_router",
        ],
        None,
    ),
    # megatron's local partial capture of the router runs the MoE preprocessing too.
    "graphs_local_attn_router": (
        [*ULTRAEP, *GRAPHS, "attn", "moe_router"],
        "--cuda-graph-modules moe_router with --cuda-graph-impl local",
    ),
    "graphs_te_attn_router_mlp": (
        [
            *ULTRAEP,
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-modules",
            "attn",
            "moe_router",
            "mlp",
        ],
        None,
    ),
    "graphs_older_spelling_attn": (
        [*ULTRAEP, "--external-cuda-graph", "--cuda-graph-scope", "attn"],
        None,
    ),
    # TE's graph of the preprocessing: with the device planner (whose plan needs no host read:
    # test_graph_capture.py), not with the host planner, whose plan it would capture, nor where the
    # planner is left to its default (host on this machine).
    "graphs_moe_preprocess": ([*ULTRAEP, *TE_PREPROCESS], None),  # the default planner: device
    "graphs_moe_preprocess_host_planner": (
        [*ULTRAEP, *TE_PREPROCESS, "--moe-balancer-planner", "host"],
        "--cuda-graph-modules moe_preprocess",
    ),
    "graphs_moe_preprocess_device_planner": (
        [*ULTRAEP, *TE_PREPROCESS, "--moe-balancer-planner", "device"],
        None,
    ),
    "graphs_moe_preprocess_permute_fusion": (
        [*ULTRAEP, *TE_PREPROCESS, "--moe-balancer-planner", "device", "--moe-permute-fusion"],
        "--cuda-graph-modules moe_preprocess",
    ),
    # Graphs that would capture the transfers the plan sizes.
    "graphs_moe": ([*ULTRAEP, *GRAPHS, "moe"], "--cuda-graph-modules moe "),
    "graphs_whole_layer": ([*ULTRAEP, "--cuda-graph-impl", "local"], "whole-layer capture"),
    "graphs_whole_layer_older_spelling": ([*ULTRAEP, "--enable-cuda-graph"], "--enable-cuda-graph"),
    "graphs_full_iteration": (
        [*ULTRAEP, "--cuda-graph-impl", "full_iteration"],
        "--cuda-graph-impl full_iteration",
    ),
    "graphs_full_iteration_module": (
        [*ULTRAEP, *GRAPHS, "full_iteration"],
        "--cuda-graph-modules full_iteration",
    ),
    # Megatron offloads CUDA tensors only: no CPU test runs its offloading with a balanced layer.
    "offload_experts": (
        [
            *ULTRAEP,
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "attn_norm",
            "expert_fc1",
            "moe_act",
        ],
        "--fine-grained-activation-offloading",
    ),
    # Latent MoE: the balanced part runs on latent tokens, the replica experts at the latent size
    # (test_balanced_moe_layer.py's latent scenario).
    "latent_moe": ([*ULTRAEP, "--moe-latent-size", "32"], None),
    "hybridep_rank_capacity": (
        [*ULTRAEP, "--moe-expert-rank-capacity-factor", "1.5"],
        "--moe-expert-rank-capacity-factor",
    ),
    # megatron's overlapped 1F1B schedule and its delayed weight gradients (test_overlapped_schedule.py);
    # not with CUDA graphs, whose replay runs the MoE layer's routing from inside the replayed layer.
    "ep_overlap": ([*ULTRAEP, "--bf16", "--overlap-moe-expert-parallel-comm"], None),
    "ep_overlap_delay_wgrad": (
        [*ULTRAEP, "--bf16", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
        None,
    ),
    "ep_overlap_cuda_graph_impl": (
        [
            *ULTRAEP,
            "--bf16",
            "--overlap-moe-expert-parallel-comm",
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-modules",
            "attn",
        ],
        "--overlap-moe-expert-parallel-comm with --cuda-graph-impl transformer_engine",
    ),
    "dispatch_backward_wgrad": (
        [*ULTRAEP, "--overlap-dispatch-backward-with-experts-wgrad"],
        "--overlap-dispatch-backward-with-experts-wgrad",
    ),
    # megatron-core 0.18's MTP layer fails under full recompute (compat.REFUSED_ON_018); 0.19 runs it
    # (test_balanced_training.py's PP 2 layout), and selective recompute runs on both.
    "mtp_full_recompute": (
        [
            *ULTRAEP,
            *MTP,
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        "--mtp-num-layers with --recompute-granularity full is not supported on megatron-core 0.18"
        if compat.is_018()
        else None,
    ),
    "mtp_selective_recompute": (
        [*ULTRAEP, *MTP, "--recompute-granularity", "selective", "--recompute-modules", "moe"],
        None,
    ),
}


def command_line(extra):
    if extra is not DENSE:
        return [*BASE, *extra]
    argv = list(BASE)
    for flag in (
        "--num-experts",
        "--moe-router-topk",
        "--moe-ffn-hidden-size",
        "--moe-token-dispatcher-type",
        "--expert-model-parallel-size",
    ):
        i = argv.index(flag)
        del argv[i : i + 2]
    return argv + ULTRAEP


@pytest.fixture(scope="module")
def verdicts():
    cases = {**COMMAND_LINES, **{f"envelope/{name}": case for name, case in ENVELOPE.items()}}
    return argument_verdicts({name: command_line(extra) for name, (extra, _) in cases.items()})


@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_command_line(verdicts, name):
    check_verdict(verdicts[name], name, COMMAND_LINES[name][1], warned=name in WARNED)


@pytest.mark.parametrize("name", list(ENVELOPE))
def test_production_envelope(verdicts, name):
    """UltraEP's startup check accepts the envelope's settings and refuses the rest, each refusal
    naming its flag and saying why with the settings that work."""
    verdict, expected = verdicts[f"envelope/{name}"], ENVELOPE[name][1]
    if expected is None:
        assert verdict["errors"] == [], verdict["errors"]
        # EP=1: nothing to balance (and, without triton, the device planner's warning)
        warnings = [w for w in verdict["warnings"] if "needs triton for its kernel" not in w]
        assert len(warnings) == 1, verdict["warnings"]
        return
    refusals = [e for e in verdict["errors"] if expected in e]
    assert len(refusals) == 1, verdict["errors"]
    assert ": " in refusals[0].split(expected, 1)[1], f"no reason given: {refusals[0]}"
    if name.startswith(("fp8_delayed", "fp8_custom", "fp4")):
        assert "tensorwise, blockwise or mxfp8" in refusals[0], refusals[0]
    if name in ("graphs_local_attn_router", "graphs_local_attn"):
        assert "use --cuda-graph-impl transformer_engine" in refusals[0], refusals[0]
    elif name.startswith("graphs_moe_preprocess"):
        why = (
            "--moe-permute-fusion"
            if name.endswith("fusion")
            else "leave --moe-balancer-planner out or pass device"
        )
        assert why in refusals[0], refusals[0]
    elif "graphs" in name:
        assert "capture only attn, moe_router, mlp, mamba" in refusals[0], refusals[0]


def test_preprocess_graph_needs_the_device_planner():
    """The balanced layer's own check (on its TransformerConfig, with its context's resolved
    planner) agrees with the startup check: TE's graph of the preprocessing with the device planner
    (the default planner when the preprocessing is captured, host otherwise) and the all-to-all
    dispatcher's unfused permutation (what test_graph_capture.py runs); refused, each naming its
    flag, with the host planner, the flex dispatcher or the fused permutation."""
    import enum
    from types import SimpleNamespace

    from ultraep_megatron.megatron.release.capabilities import (
        default_planner,
        preprocess_graphed,
        unsupported_moe_settings,
    )

    # A TransformerConfig holds megatron's CudaGraphModule members (an Enum; not imported here:
    # importing megatron-core costs this process seconds).
    CudaGraphModule = enum.Enum("CudaGraphModule", ["attn", "moe_router", "moe_preprocess"])
    modules = [CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
    config = dict(
        moe_token_dispatcher_type="alltoall",
        cuda_graph_impl="transformer_engine",
        cuda_graph_modules=modules,
    )
    assert unsupported_moe_settings(SimpleNamespace(**config), planner="device") == []
    assert unsupported_moe_settings(SimpleNamespace(**config, moe_balancer_planner="device")) == []
    assert unsupported_moe_settings(SimpleNamespace(**config)) == []  # the default: device
    assert preprocess_graphed(SimpleNamespace(**config))
    assert not preprocess_graphed(SimpleNamespace(**{**config, "cuda_graph_modules": modules[:2]}))
    assert not preprocess_graphed(SimpleNamespace(**{**config, "cuda_graph_impl": "local"}))
    assert [
        default_planner(b, g)
        for b, g in (("ultraep", True), ("ultraep", False), ("eplb-exact", True))
    ] == ["device", "host", "host"]
    refusals = {
        "host planner": unsupported_moe_settings(SimpleNamespace(**config), planner="host"),
        "eplb-exact": unsupported_moe_settings(
            SimpleNamespace(**config, moe_balancer="eplb-exact")
        ),
        "flex": unsupported_moe_settings(
            SimpleNamespace(
                **{**config, "moe_token_dispatcher_type": "flex"},
                moe_flex_dispatcher_backend="hybridep",
            ),
            environment=False,
            planner="device",
        ),
        "fusion": unsupported_moe_settings(
            SimpleNamespace(**config, moe_permute_fusion=True), planner="device"
        ),
    }
    for case, problems in refusals.items():
        assert len(problems) == 1 and problems[0].startswith(
            "--cuda-graph-modules moe_preprocess"
        ), (case, problems)
    assert "--moe-balancer-planner host" in refusals["host planner"][0]
    assert "leave --moe-balancer-planner out or pass device" in refusals["eplb-exact"][0]
    assert "--moe-token-dispatcher-type alltoall" in refusals["flex"][0]
    assert "--moe-permute-fusion" in refusals["fusion"][0]
