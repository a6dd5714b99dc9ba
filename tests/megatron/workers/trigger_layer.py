"""Worker: --moe-balancer-trigger on megatron-core's MoELayer, on N gloo CPU ranks (EP=N).

One BalancedMoELayer (ultraep, 2 redundant slots, floor 1, ``--trigger``) runs microbatches whose
tokens are pushed towards two hot experts with growing strength, each forward then backward before
the next. Around each, the data plane's point-to-point calls are counted: every replica transfer
(weight distribution, re-materialization, gradient reduction) goes through
``torch.distributed.batch_isend_irecv``. Saved to ``<out-dir>/rank<r>.pt``, per microbatch: the exact
load, the plan's slot table and quotas, the P2P calls of the forward and of the backward, and the
rows the redundant slots received; and the layer's telemetry.

Run:  torchrun --standalone --nproc-per-node 4 trigger_layer.py --out-dir DIR --trigger 1.5
"""

import argparse
import os

import torch

from balanced_moe_layer import build_layer, global_weights, load_weights, rank_inputs, skew
from ultraep_megatron.megatron.cpu import backend as cpu_backend

#: How far each microbatch's tokens move towards the hot experts (1: the layer test's skew).
STRENGTHS = (0.0, 0.1, 0.2, 0.35, 0.6, 1.0)
NUM_SLOTS = 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--trigger", type=float, required=True)
    cli = parser.parse_args()
    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state

    from ultraep_megatron.planner import BalancerConfig

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = BalancerConfig("ultraep", num_slots=NUM_SLOTS, min_quota=1, trigger=cli.trigger)
    layer = build_layer(world, "ultraep", NUM_SLOTS, False, balancer_config=config)
    weights = global_weights()
    load_weights(layer, weights)
    layer.train()

    calls = [0]
    batch_isend_irecv = torch.distributed.batch_isend_irecv

    def counting(ops):
        calls[0] += 1
        return batch_isend_irecv(ops)

    torch.distributed.batch_isend_irecv = counting
    microbatches = []
    for mb, strength in enumerate(STRENGTHS):
        x, up = rank_inputs(rank, mb)
        x = (x + strength * (skew(x, weights) - x)).requires_grad_(True)
        before = calls[0]
        out, _ = layer(x)
        forward = calls[0] - before
        (out * up).sum().backward()
        invocation = layer.token_dispatcher.invocation
        microbatches.append(
            {
                "load": invocation.plan.load.clone(),
                "slot_expert": invocation.plan.slot_expert.clone(),
                "quota": invocation.plan.plan.quota.clone(),
                "p2p_forward": forward,
                "p2p_backward": calls[0] - before - forward,
                "replica_rows": list(invocation.plan.replica_rows),
            }
        )
    torch.distributed.batch_isend_irecv = batch_isend_irecv
    torch.save(
        {"microbatches": microbatches, "stats": layer.balancing.pop_stats()},
        os.path.join(cli.out_dir, f"rank{rank}.pt"),
    )
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
