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
    "flex_ncclep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                     "--moe-flex-dispatcher-backend", "ncclep"], "--moe-flex-dispatcher-backend ncclep"),
    "te_op_fuser": ([*ULTRAEP, "--use-transformer-engine-op-fuser"], "--use-transformer-engine-op-fuser"),
    # The replica experts share one module across layers: TE's cached fp8 weights would leak.
    "fp8": ([*ULTRAEP, "--fp8-format", "hybrid"], "--fp8-format"),
    # Its saved-tensor hooks would keep the shared replica weights as a later layer leaves them.
    "offload_experts": ([*ULTRAEP, "--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
                         "expert_fc1"], "--offload-modules expert_fc1"),
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
    return argument_verdicts({name: command_line(extra) for name, (extra, _) in COMMAND_LINES.items()})


@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_command_line(verdicts, name):
    check_verdict(verdicts[name], name, COMMAND_LINES[name][1], warned=name in WARNED)
