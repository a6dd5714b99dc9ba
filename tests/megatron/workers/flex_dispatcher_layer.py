"""Worker: megatron-core's flex (DeepEP) token dispatcher on N gloo CPU ranks, via deepep_gloo.

Two parts, saved to ``<out-dir>/rank<r>.pt``:

* ``unit``: :func:`deepep_gloo.fused_dispatch` / ``fused_combine`` alone, on random top-k indices
  with masked (-1) slots and same-rank expert pairs. Inputs, outputs and gradients are saved so the
  test can recompute them with plain Python loops; also the ValueErrors of three bad inputs.
* ``alltoall`` / ``flex`` / ``flex-detached-probs``: megatron-core's MoELayer (SequentialMLP
  experts, skewed top-2 of 8 routing) with the alltoall dispatcher, with the flex dispatcher
  (``moe_flex_dispatcher_backend="deepep"``, through the gloo stand-in), and, as the negative
  control, the flex dispatcher with routing probabilities detached before dispatch (no gradient
  back to the router through the dispatch). The ``flex`` run logs (received rows, expert
  assignments) of every dispatch.

Run:  torchrun --standalone --nproc-per-node 4 flex_dispatcher_layer.py --out-dir DIR
"""

import argparse
import os
import sys

import torch

from ultraep_megatron.megatron.cpu import backend as cpu_backend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deepep_gloo  # noqa: E402  (tests/megatron is not a package)

# The same layer, weights and skew as the balanced-layer worker (this script's folder is on sys.path).
from balanced_moe_layer import (  # noqa: E402
    BATCH,
    HIDDEN,
    HOT_EXPERTS,
    NUM_EXPERTS,
    SEQ,
    TOPK,
    build_layer,
    global_weights,
    load_weights,
)
from megatron_setup import expert_linears, moe_inputs  # noqa: E402

UNIT_TOKENS, UNIT_HIDDEN = 24, 5


def rank_inputs(rank: int, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [SEQ, BATCH, H], pushed towards the hot experts' router rows, and upstream grad."""
    x, upstream = moe_inputs(77 + rank, SEQ, BATCH, HIDDEN)
    direction = weights["router"][list(HOT_EXPERTS)].sum(0)
    return x + 0.6 * direction / direction.norm() * HIDDEN**0.5, upstream


def unit_dispatch(rank: int, group) -> dict:
    """Dispatch/combine alone. Each rank scales the rows it receives by (rank + 1) before combine,
    so combined[t] = x[t] * sum over destination ranks r of (r + 1); the loss adds
    10 * (rank + 1) * recv_probs, so d loss / d probs[t, k] = 10 * (host rank of slot k + 1)."""
    gen = torch.Generator().manual_seed(500 + rank)
    indices = torch.stack(
        [torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK] for _ in range(UNIT_TOKENS)]
    )
    indices[torch.rand(UNIT_TOKENS, TOPK, generator=gen) < 0.15] = -1  # masked slots
    indices[0] = -1  # a token sent nowhere
    indices[1] = torch.tensor([2 * rank % NUM_EXPERTS, 2 * rank % NUM_EXPERTS + 1])  # same rank
    x = torch.randn(UNIT_TOKENS, UNIT_HIDDEN, generator=gen, requires_grad=True)
    probs = torch.rand(UNIT_TOKENS, TOPK, generator=gen, requires_grad=True)
    upstream = torch.randn(UNIT_TOKENS, UNIT_HIDDEN, generator=gen)
    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = deepep_gloo.fused_dispatch(
        x, indices, probs, NUM_EXPERTS, group
    )
    combined, none = deepep_gloo.fused_combine(recv_x * (rank + 1), group, handle)
    loss = (combined * upstream).sum() + (recv_probs * 10.0 * (rank + 1)).sum()
    loss.backward()
    errors = []
    for bad in (
        dict(num_experts=NUM_EXPERTS - 2),  # not a multiple of the group size
        dict(num_experts=NUM_EXPERTS, token_probs=probs[:-1]),  # shapes disagree
        dict(num_experts=4),
    ):  # expert id >= num_experts
        args = {**dict(x=x, token_indices=indices, token_probs=probs, group=group), **bad}
        try:
            deepep_gloo.fused_dispatch(**args)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return {
        "value_errors": errors,
        "indices": indices,
        "x": x.detach(),
        "probs": probs.detach(),
        "upstream": upstream,
        "recv_x": recv_x.detach(),
        "recv_indices": recv_indices,
        "recv_probs": recv_probs.detach(),
        "tokens_per_expert": tokens_per_expert,
        "combined": combined.detach(),
        "combine_second": none,
        "x_grad": x.grad,
        "probs_grad": probs.grad,
    }


def run(layer, weights, rank) -> dict:
    layer.zero_grad(set_to_none=True)
    layer.train()
    x, upstream = rank_inputs(rank, weights)
    x.requires_grad_(True)
    out, _ = layer(x)
    (out * upstream).sum().backward()
    router_grad = layer.router.weight.grad
    return {
        "out": out.detach().clone(),
        "dx": x.grad.detach().clone(),
        "router_grad": (
            torch.zeros_like(layer.router.weight)
            if router_grad is None
            else router_grad.detach().clone()
        ),
        "expert_grads": {
            int(idx): tuple(w.grad.detach().clone() for w in expert_linears(layer, local))
            for local, idx in enumerate(layer.local_expert_indices)
        },
    }


def recording_dispatch(log: list):
    """The stand-in's dispatch, logging (received rows, sum of tokens_per_expert) per call."""

    def dispatch(*args, **kwargs):
        result = deepep_gloo.fused_dispatch(*args, **kwargs)
        log.append((result[0].shape[0], int(result[3].sum())))
        return result

    return dispatch


def dispatch_with_detached_probs(x, token_indices, token_probs, *args, **kwargs):
    """Negative control: the probabilities reach the experts but carry no gradient back."""
    return deepep_gloo.fused_dispatch(x, token_indices, token_probs.detach(), *args, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import token_dispatcher

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {"unit": unit_dispatch(rank, torch.distributed.group.WORLD)}

    uninstall = deepep_gloo.install()
    weights = global_weights()
    for name, dispatcher in (
        ("alltoall", "alltoall"),
        ("flex", "flex"),
        ("flex-detached-probs", "flex"),
    ):
        dispatch_log = []
        if name == "flex":
            token_dispatcher.fused_dispatch = recording_dispatch(dispatch_log)
        if name == "flex-detached-probs":
            token_dispatcher.fused_dispatch = dispatch_with_detached_probs
        layer = build_layer(world, None, 0, False, dispatcher)
        load_weights(layer, weights)
        results[name] = run(layer, weights, rank)
        if dispatcher == "flex":
            results[name]["dispatcher_class"] = type(layer.token_dispatcher).__name__
            results[name]["manager_class"] = type(layer.token_dispatcher._comm_manager).__name__
            results[name]["dispatch_log"] = dispatch_log
    results["num_sms"] = deepep_gloo.NUM_SMS
    uninstall()
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
