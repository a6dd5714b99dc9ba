"""The model a recipe builds, from its validated arguments: which layers are MoE and balanced,
parameters per layer (split by how Megatron shards them), and Megatron's own FLOPs count.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

from ultraep_megatron.megatron.recipe_check.launch import RecipeError
from ultraep_megatron.planner.baselines import registry


def moe_layer_pattern(args: argparse.Namespace) -> list[bool]:
    """[num_layers] True where the 1-based layer (index + 1) is an MoE layer."""
    if args.num_experts is None:
        return [False] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(args.num_layers)]
    if len(freq) != args.num_layers:
        raise RecipeError(f"--moe-layer-freq has {len(freq)} entries for {args.num_layers} layers")
    return [bool(x) for x in freq]


def built_mtp_layers(args: argparse.Namespace) -> int:
    """MTP layers the model holds: one per depth, or one shared by all (``--mtp-use-repeated-layer``)."""
    depths = args.mtp_num_layers or 0
    return min(depths, 1) if getattr(args, "mtp_use_repeated_layer", False) else depths


def balanced_moe_layer_ids(args: argparse.Namespace) -> list[int]:
    """Ids of the MoE layers ``--moe-balancer`` balances (``layer_ids.moe_layer_id``): the
    decoder's MoE layers, then the MTP block's (built from the last decoder layer's spec, numbered
    after the decoder). Empty for ``--moe-balancer none``."""
    if args.moe_balancer == registry.NONE:
        return []
    pattern = moe_layer_pattern(args)
    mtp = range(args.num_layers + 1, args.num_layers + 1 + built_mtp_layers(args))
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe] + (
        list(mtp) if pattern[-1] else []
    )


@dataclass
class LayerParams:
    """Parameters of one transformer layer, split by how Megatron shards them."""

    attention: int  # sharded by TP, replicated over DP
    mlp: int  # dense MLP or shared expert + router + norms: TP / replicated
    experts: int  # routed experts of the layer, all of them: sharded by EP x ETP
    expert_numel: int  # one routed expert (the unit a redundant slot holds)


def norm_params(args) -> int:
    return 1 if args.normalization == "RMSNorm" else 2


def attention_params(args: argparse.Namespace) -> int:
    """Self-attention block incl. its input norm (and QK norms / MLA latent norms)."""
    h, norm = args.hidden_size, norm_params(args)
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            q = h * heads * qk
        else:  # down-projection, latent norm, up-projection
            q = h * args.q_lora_rank + norm * args.q_lora_rank + args.q_lora_rank * heads * qk
        kv = (
            h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
            + norm * args.kv_lora_rank
            + args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
        )
        out = heads * args.v_head_dim * h
        return q + kv + out + norm * h
    kv_channels = args.kv_channels or h // args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    q_width = args.num_attention_heads * kv_channels
    kv_width = groups * kv_channels
    params = h * (q_width + 2 * kv_width) + q_width * h
    if args.add_bias_linear:
        params += q_width + 2 * kv_width + h
    elif args.add_qkv_bias:
        params += q_width + 2 * kv_width
    if args.qk_layernorm:
        params += 2 * norm * kv_channels
    return params + norm * h


def linear_weight_params(args: argparse.Namespace, is_moe: bool) -> tuple[int, int]:
    """(non-expert, one routed expert's) weights of one decoder layer's linear layers: what
    Transformer Engine quantizes with ``--fp8-param-gather`` (attention projections, the dense MLP
    or shared expert, the latent projections, the routed experts); norms, biases and the router stay
    high precision."""
    h = args.hidden_size
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        q = (
            h * heads * qk
            if args.q_lora_rank is None
            else h * args.q_lora_rank + args.q_lora_rank * heads * qk
        )
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim) + args.kv_lora_rank * heads * (
            args.qk_head_dim + args.v_head_dim
        )
        attention = q + kv + heads * args.v_head_dim * h
    else:
        kv_channels = args.kv_channels or h // args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        q_width = args.num_attention_heads * kv_channels
        attention = h * (q_width + 2 * groups * kv_channels) + q_width * h

    def weights(ffn: int, width: int = h) -> int:
        return width * (2 * ffn if args.swiglu else ffn) + ffn * width

    if not is_moe:
        return attention + weights(args.ffn_hidden_size), 0
    shared = args.moe_shared_expert_intermediate_size
    latent = moe_latent_size(args)
    projections = 2 * h * latent if latent else 0
    return attention + (weights(shared) if shared else 0) + projections, weights(
        args.moe_ffn_hidden_size, latent or h
    )


def moe_latent_size(args: argparse.Namespace):
    """``--moe-latent-size`` (``None`` without latent MoE): the routed experts' input and output
    width, the tokens projected hidden -> latent before the dispatch and back after the combine."""
    return getattr(args, "moe_latent_size", None)


def _mlp_params(args, ffn: int, width: int = None) -> int:
    """An MLP of FFN ``ffn`` on tokens of ``width`` (the hidden size by default)."""
    h = width or args.hidden_size
    up = 2 * ffn if args.swiglu else ffn
    bias = (up + h) if args.add_bias_linear else 0
    return h * up + ffn * h + bias


def layer_params(args: argparse.Namespace, is_moe: bool) -> LayerParams:
    """Parameters of one decoder layer (dense or MoE)."""
    h, norm = args.hidden_size, norm_params(args)
    attention = attention_params(args)
    if not is_moe:
        return LayerParams(attention, _mlp_params(args, args.ffn_hidden_size) + norm * h, 0, 0)
    latent = moe_latent_size(args)
    expert = _mlp_params(
        args, args.moe_ffn_hidden_size, latent
    )  # routed experts at the latent size
    shared = (
        _mlp_params(args, args.moe_shared_expert_intermediate_size)
        if args.moe_shared_expert_intermediate_size
        else 0
    )
    if shared and args.moe_shared_expert_gate:
        shared += h
    router = h * args.num_experts + (args.num_experts if args.add_bias_linear else 0)
    # fc1_latent_proj [latent, h] and fc2_latent_proj [h, latent], duplicated over TP.
    projections = 2 * h * latent + ((latent + h) if args.add_bias_linear else 0) if latent else 0
    return LayerParams(
        attention, shared + router + projections + norm * h, expert * args.num_experts, expert
    )


def flops_per_iteration(args: argparse.Namespace) -> float:
    """Megatron's own model-FLOPs count of one global batch (what its TFLOP/s/GPU divides)."""
    from megatron.training.training import num_floating_point_operations

    return float(num_floating_point_operations(copy.copy(args), args.global_batch_size))
