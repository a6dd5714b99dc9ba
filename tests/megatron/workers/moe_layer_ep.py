"""Worker: megatron-core's MoELayer on N gloo CPU ranks at several expert-parallel sizes.

Every rank builds the same global expert weights (a fixed seed), loads its local slice into a
real ``MoELayer`` (alltoall dispatcher, SequentialMLP experts), runs forward and backward on
its own tokens, and saves output, input gradient and parameter gradients per EP size to
``<out-dir>/rank<r>.pt``. The test compares the EP sizes with each other and with an
independent pure-torch computation. ``--permute-experts`` loads the EP>1 layers with
experts in a rolled order: the negative control.

Run:  torchrun --standalone --nproc-per-node 4 moe_layer_ep.py --out-dir DIR
"""

import argparse
import os
import sys

import torch

# tests/megatron, where the modules the workers share live (also for the workers importing this one)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_setup import load_moe_weights, moe_inputs, moe_weights
from ultraep_megatron.megatron.cpu import backend as cpu_backend

NUM_EXPERTS = 8
HIDDEN = 32
FFN = 48
TOPK = 2
SEQ, BATCH = 16, 2


def global_weights() -> dict[str, torch.Tensor]:
    return moe_weights(NUM_EXPERTS, HIDDEN, FFN, seed=1234)


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and upstream gradient, both [SEQ, BATCH, H]; different per rank."""
    return moe_inputs(100 + rank, SEQ, BATCH, HIDDEN)


def build_layer(ep_size: int):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron_setup import model_parallel, moe_config

    model_parallel(ep_size)
    config = moe_config(hidden=HIDDEN, ffn=FFN, experts=NUM_EXPERTS, topk=TOPK, ep=ep_size)
    # In 0.19 the MoE "spec" is an MlpBuilder: a partial of MoELayer with its submodules.
    builder = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    layer = builder(
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        is_mtp_layer=False,
    )
    layer.set_layer_number(1)
    return layer


def run(layer, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return {
        "out": out.detach().clone(),
        "dx": x.grad.detach().clone(),
        "router_grad": layer.router.weight.grad.detach().clone(),
        "expert_grads": {
            int(idx): (
                mlp.linear_fc1.weight.grad.detach().clone(),
                mlp.linear_fc2.weight.grad.detach().clone(),
            )
            for idx, mlp in zip(layer.local_expert_indices, layer.experts.local_experts)
        },
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--ep-sizes", default="1,2,4")
    parser.add_argument("--permute-experts", action="store_true")
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    weights = global_weights()
    x, upstream = rank_inputs(rank)
    results = {"x": x, "upstream": upstream, "weights": weights, "runs": {}}
    for ep_size in (int(s) for s in cli.ep_sizes.split(",")):
        if world % ep_size:
            continue
        identity = list(range(NUM_EXPERTS))
        orders = {"": identity}
        if cli.permute_experts and ep_size > 1:
            orders["-permuted"] = identity[1:] + identity[:1]
        for suffix, order in orders.items():
            layer = build_layer(ep_size)
            loaded = load_moe_weights(layer, weights, order)
            record = run(layer, x, upstream)
            record["loaded_experts"] = loaded
            record["ep_group"] = torch.distributed.get_process_group_ranks(
                parallel_state.get_expert_model_parallel_group()
            )
            results["runs"][f"ep{ep_size}{suffix}"] = record
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
