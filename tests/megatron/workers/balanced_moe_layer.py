"""Worker: megatron-core's MoELayer vs UltraEP's BalancedMoELayer on N gloo CPU ranks.

Both layers get the same global weights and tokens; the router is skewed (a large bias on a few
experts' router rows) so the balancer must replicate. Scenarios, each saved to
``<out-dir>/rank<r>.pt``:

* ``single``: one microbatch, forward + backward;
* ``pipelined``: three microbatches forwarded before any backward, backwards in forward order
  (what 1F1B does on a stage), so three plans are in flight in the ring at once;
* ``recompute``: MoE activation recompute (``recompute_modules=['moe']``);
* ``eplb`` / ``eplb-exact``: the baselines through the same dispatcher.

Run:  torchrun --standalone --nproc-per-node 4 balanced_moe_layer.py --out-dir DIR
"""

import argparse
import functools
import os

import torch

from ultraep_megatron.megatron import cpu_backend

NUM_EXPERTS = 8
HIDDEN = 32
FFN = 48
TOPK = 2
SEQ, BATCH = 16, 2
HOT_EXPERTS = (0, 1)  # both on EP rank 0 at EP=4: rank 0 is the straggler without balancing


def global_weights() -> dict[str, torch.Tensor]:
    """Shapes: router [E, H], fc1 [E, F, H], fc2 [E, H, F]."""
    gen = torch.Generator().manual_seed(4321)
    return {
        "router": torch.randn(NUM_EXPERTS, HIDDEN, generator=gen) * 0.5,
        "fc1": torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=gen) * HIDDEN ** -0.5,
        "fc2": torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=gen) * FFN ** -0.5,
    }


def rank_inputs(rank: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [SEQ, BATCH, H] (shifted towards the hot experts' router rows) and upstream grad."""
    gen = torch.Generator().manual_seed(1000 * microbatch + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=gen)


def build_layer(ep_size: int, balancer: str | None, num_slots: int, recompute: bool):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ultraep_megatron.megatron.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.runtime import BalancerConfig, reset_runtime

    reset_runtime()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size)
    model_parallel_cuda_manual_seed(123)
    extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_attention_heads=4, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep_size,
        moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, **extra,
    )
    builder = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    if balancer is not None:
        builder = functools.partial(
            BalancedMoELayer, submodules=builder.keywords["submodules"],
            balancer_config=BalancerConfig(name=balancer, num_slots=num_slots, min_quota=1,
                                           eplb_window=2, eplb_interval=2, ring_size=4),
        )
    layer = builder(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                    is_mtp_layer=False)
    layer.set_layer_number(1)
    return layer


def load_weights(layer, weights):
    with torch.no_grad():
        router = weights["router"].clone()
        layer.router.weight.copy_(router)
        for local, expert_index in enumerate(layer.local_expert_indices):
            mlp = layer.experts.local_experts[local]
            mlp.linear_fc1.weight.copy_(weights["fc1"][expert_index])
            mlp.linear_fc2.weight.copy_(weights["fc2"][expert_index])


def skew(x: torch.Tensor, weights) -> torch.Tensor:
    """Push tokens towards the hot experts' router rows so they win the top-k most of the time."""
    direction = weights["router"][list(HOT_EXPERTS)].sum(0)
    return x + 0.6 * direction / direction.norm() * x.shape[-1] ** 0.5


def run(layer, weights, rank, microbatches: int) -> dict:
    from ultraep_megatron.megatron.runtime import get_runtime

    layer.zero_grad(set_to_none=True)
    layer.train()
    # Rows each rank's experts receive after the token all-to-all: the real per-rank load,
    # observed independently of the planner's own bookkeeping.
    received_rows = []
    compute = layer.routed_experts_compute

    def counting_compute(hidden_states, probs):
        if not torch._C._current_graph_task_id() != -1:  # count first forwards, not recompute replays
            received_rows.append(hidden_states.shape[0])
        return compute(hidden_states, probs)

    layer.routed_experts_compute = counting_compute
    xs, outs, ups = [], [], []
    for mb in range(microbatches):
        x, up = rank_inputs(rank, mb)
        x = skew(x, weights).requires_grad_(True)
        out, _ = layer(x)
        xs.append(x), outs.append(out), ups.append(up)
    ring_live = get_runtime().ring.live if getattr(layer, "balancer_config", None) else 0
    for out, up in zip(outs, ups):  # backwards in forward order, as a 1F1B stage does
        (out * up).sum().backward()
    stats = get_runtime().pop_stats() if getattr(layer, "balancer_config", None) else {}
    return {
        "out": [o.detach().clone() for o in outs],
        "dx": [x.grad.detach().clone() for x in xs],
        "router_grad": layer.router.weight.grad.detach().clone(),
        "expert_grads": {
            int(idx): (mlp.linear_fc1.weight.grad.detach().clone(), mlp.linear_fc2.weight.grad.detach().clone())
            for idx, mlp in zip(layer.local_expert_indices, layer.experts.local_experts)
        },
        "ring_live_before_backward": ring_live,
        "ring_live_after_backward": get_runtime().ring.live if getattr(layer, "balancer_config", None) else 0,
        "stats": stats,
        "received_rows": received_rows,
        "replica_buffer_numel": (get_runtime().slots.replica_weights.numel()
                                 if getattr(layer, "balancer_config", None) else 0),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-slots", type=int, default=1)
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    weights = global_weights()
    results = {}
    scenarios = {
        "single": dict(microbatches=1, recompute=False, balancer="ultraep"),
        "pipelined": dict(microbatches=3, recompute=False, balancer="ultraep"),
        "recompute": dict(microbatches=2, recompute=True, balancer="ultraep"),
        "eplb": dict(microbatches=3, recompute=False, balancer="eplb"),
        "eplb-exact": dict(microbatches=1, recompute=False, balancer="eplb-exact"),
    }
    for name, sc in scenarios.items():
        for which in ("none", sc["balancer"]):
            layer = build_layer(world, None if which == "none" else which, cli.num_slots, sc["recompute"])
            load_weights(layer, weights)
            results[f"{name}/{'none' if which == 'none' else 'balanced'}"] = run(
                layer, weights, rank, sc["microbatches"])
    results["local_expert_indices"] = list(range(rank * NUM_EXPERTS // world, (rank + 1) * NUM_EXPERTS // world))
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
