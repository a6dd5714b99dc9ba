"""What a balanced MoE layer cannot run (``megatron/capabilities.py``) fails at startup with a
message naming the flag, as in pretrain_gpt.py: UltraEP's startup checks on Megatron's parse of the
command line, then Megatron's own parser and validation (one subprocess for all command lines, no
distributed setup). What production runs is accepted.
"""

import pytest

from megatron_runs import argument_verdicts, check_verdict, tiny_moe_args

BASE = tiny_moe_args(ep=1, train_iters=2)
ULTRAEP = ["--moe-balancer", "ultraep"]
DENSE = None  # the tiny model without its MoE flags

COMMAND_LINES = {
    # name: (extra argv, substring the error must contain; None = must pass)
    "dense_model": (DENSE, "--num-experts"),
    "domain_not_dividing_ep": ([*ULTRAEP, "--moe-balancer-domain-size", "2"], "--moe-balancer-domain-size 2"),
    "capacity_factor": ([*ULTRAEP, "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor"),
    "allgather": ([*ULTRAEP, "--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type"),
    # DeepEP / HybridEP are GPU-only: on this machine the flex dispatcher must be refused cleanly.
    "flex_without_deepep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                             "--moe-flex-dispatcher-backend", "deepep"],
                            "--moe-flex-dispatcher-backend deepep"),
    "flex_without_hybridep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                               "--moe-flex-dispatcher-backend", "hybridep"],
                              "--moe-flex-dispatcher-backend hybridep needs HybridEP"),
    "flex_ncclep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                     "--moe-flex-dispatcher-backend", "ncclep"], "--moe-flex-dispatcher-backend ncclep"),
    "te_op_fuser": ([*ULTRAEP, "--use-transformer-engine-op-fuser"], "--use-transformer-engine-op-fuser"),
    # FSDP gathers an expert only in its own hooks; the replica transfers read and write it outside.
    "megatron_fsdp": ([*ULTRAEP, "--use-megatron-fsdp", "--use-distributed-optimizer",
                       "--data-parallel-sharding-strategy", "optim_grads_params"], "--use-megatron-fsdp"),
    "torch_fsdp2": ([*ULTRAEP, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"], "--use-torch-fsdp2"),
    "tensor_parallel_experts": ([*ULTRAEP, "--tensor-model-parallel-size", "2"],
                                "--expert-tensor-parallel-size"),
    # What production runs (the distributed optimizer, overlapped reduction and gather, buckets
    # smaller than an expert, several instances) is accepted.
    "valid_production_ddp": ([*ULTRAEP, "--use-distributed-optimizer", "--overlap-grad-reduce",
                              "--overlap-param-gather", "--ddp-bucket-size", "2000",
                              "--ddp-average-in-collective"], None),
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
ENVELOPE = {
    **{f"fp8_{recipe}{'_param_gather' if gather else ''}": ([*ULTRAEP, *FP8, recipe, *gather], None)
       for recipe in ("tensorwise", "blockwise", "mxfp8") for gather in ([], ["--fp8-param-gather"])
       if (recipe, gather) != ("mxfp8", ["--fp8-param-gather"])},
    # MXFP8 parameters are gathered through the gradient buffer: megatron cannot map them into its
    # parameter buffer (TE's replace_raw_data refuses MXFP8), so the flag is required, and it is
    # only for them.
    "fp8_mxfp8_param_gather_reuse_grad_buf": ([*ULTRAEP, *FP8, "mxfp8", "--fp8-param-gather", REUSE], None),
    "fp8_mxfp8_param_gather_without_reuse": ([*ULTRAEP, *FP8, "mxfp8", "--fp8-param-gather"], f"needs {REUSE}"),
    "fp8_reuse_grad_buf_tensorwise": ([*ULTRAEP, *FP8, "tensorwise", "--fp8-param-gather", REUSE],
                                      f"{REUSE} is only for MXFP8"),
    "fp8_reuse_grad_buf_without_fp8_params": ([*ULTRAEP, *FP8, "mxfp8", REUSE], f"{REUSE} is only for MXFP8"),
    "fp8_e4m3_tensorwise": ([*ULTRAEP, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], None),
    # One shared replica module would mix every layer's amax history.
    "fp8_delayed": ([*ULTRAEP, *FP8, "delayed"], "--fp8-recipe delayed"),
    "fp8_delayed_by_default": ([*ULTRAEP, "--fp8-format", "hybrid"], "--fp8-recipe delayed"),
    "fp8_custom": ([*ULTRAEP, *FP8, "custom"], "--fp8-recipe custom"),
    # Plain experts in the bf16 layers, quantized ones elsewhere: one replica-slot layout cannot hold both.
    "fp8_params_bf16_ends": ([*ULTRAEP, *FP8, "tensorwise", "--fp8-param-gather", "--first-last-layers-bf16"],
                             "--first-last-layers-bf16 with --fp8-param-gather"),
    "fp8_bf16_ends": ([*ULTRAEP, *FP8, "tensorwise", "--first-last-layers-bf16"], None),
    "fp4": ([*ULTRAEP, "--fp4-format", "e2m1"], "--fp4-format e2m1"),
    "graphs_attn": ([*ULTRAEP, *GRAPHS, "attn"], None),
    "graphs_te_attn_router": ([*ULTRAEP, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                               "attn", "moe_router"], None),
    # megatron's local partial capture of the router runs the MoE preprocessing too.
    "graphs_local_attn_router": ([*ULTRAEP, *GRAPHS, "attn", "moe_router"],
                                 "--cuda-graph-modules moe_router with --cuda-graph-impl local"),
    "graphs_te_attn_router_mlp": ([*ULTRAEP, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                                   "attn", "moe_router", "mlp"], None),
    "graphs_older_spelling_attn": ([*ULTRAEP, "--external-cuda-graph", "--cuda-graph-scope", "attn"], None),
    # Graphs that would capture the plan's host wait or the transfers it sizes.
    "graphs_moe_preprocess": ([*ULTRAEP, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                               "attn", "moe_router", "moe_preprocess"], "--cuda-graph-modules moe_preprocess"),
    "graphs_moe": ([*ULTRAEP, *GRAPHS, "moe"], "--cuda-graph-modules moe "),
    "graphs_whole_layer": ([*ULTRAEP, "--cuda-graph-impl", "local"], "whole-layer capture"),
    "graphs_whole_layer_older_spelling": ([*ULTRAEP, "--enable-cuda-graph"], "--enable-cuda-graph"),
    "graphs_full_iteration": ([*ULTRAEP, "--cuda-graph-impl", "full_iteration"],
                              "--cuda-graph-impl full_iteration"),
    "graphs_full_iteration_module": ([*ULTRAEP, *GRAPHS, "full_iteration"], "--cuda-graph-modules full_iteration"),
    # The replica experts are built without offloading; the main experts' activations offload as usual.
    "offload_experts": ([*ULTRAEP, "--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
                         "expert_fc1", "moe_act"], None),
    # Latent MoE: the balanced part runs on latent tokens, the replica experts at the latent size
    # (test_balanced_moe_layer.py's latent scenario).
    "latent_moe": ([*ULTRAEP, "--moe-latent-size", "32"], None),
    "hybridep_rank_capacity": ([*ULTRAEP, "--moe-expert-rank-capacity-factor", "1.5"],
                               "--moe-expert-rank-capacity-factor"),
}


def command_line(extra):
    if extra is not DENSE:
        return [*BASE, *extra]
    argv = list(BASE)
    for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                 "--moe-token-dispatcher-type", "--expert-model-parallel-size"):
        i = argv.index(flag)
        del argv[i:i + 2]
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
        assert len(verdict["warnings"]) == 1, verdict["warnings"]  # EP=1: nothing to balance
        return
    refusals = [e for e in verdict["errors"] if expected in e]
    assert len(refusals) == 1, verdict["errors"]
    assert ": " in refusals[0].split(expected, 1)[1], f"no reason given: {refusals[0]}"
    if name.startswith(("fp8_delayed", "fp8_custom", "fp4")):
        assert "tensorwise, blockwise or mxfp8" in refusals[0], refusals[0]
    if name == "graphs_local_attn_router":
        assert "use --cuda-graph-impl transformer_engine" in refusals[0], refusals[0]
    elif "graphs" in name:
        assert "capture only attn, moe_router, mlp, mamba" in refusals[0], refusals[0]
