"""The recipe checker's activation estimate against a hand computation of one small config.

The config: 8 tokens x micro batch 2 = 16 tokens per rank, hidden 16, 4 query heads in 2 KV groups
of head dim 4, 8 experts top-2 with a gated expert FFN of 8, fp32 router, 2 MoE layers, vocabulary
128, no dropout. Every figure below is written out tensor by tensor, in bytes per token, from what
Megatron keeps for the backward (bf16 activations, 2 bytes; fp32 router tensors, 4 bytes).
"""

from __future__ import annotations

import types

import pytest

from ultraep_megatron.megatron.recipe_check import activations as act

TOKENS = 8 * 2

# Attention block, per token: the layer input (16) and the input norm's output (16); Q (4 heads x
# 4 = 16), K (2 groups x 4 = 8), V (8); the attention output (16).
ATTENTION = 2 * (16 + 16) + 2 * (16 + 8 + 8) + 2 * 16  # 160
# MoE block, per token: the pre-MLP norm's input and output (2 x 16); router logits and scores in
# fp32 (2 x 8 experts x 4 bytes); 2 routed rows, each: dispatched input (16), fc1 output
# (2 x 8), activation output (8) in bf16 and its fp32 router probability.
MOE = 2 * (16 + 16) + 4 * 2 * 8 + 2 * (2 * (16 + 16 + 8) + 4)  # 64 + 64 + 168 = 296
LAYER = (ATTENTION + MOE) * TOKENS  # 7296
INPUT = 2 * 16 * TOKENS  # a checkpoint's input: 512
LOGITS = TOKENS * 128 * (2 + 4)  # bf16 logits + fp32 copy: 12288


def small_args(**overrides) -> types.SimpleNamespace:
    args = dict(
        seq_length=8,
        micro_batch_size=2,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        hidden_size=16,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=4,
        multi_latent_attention=False,
        swiglu=True,
        ffn_hidden_size=32,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=None,
        moe_router_dtype="fp32",
        hidden_dropout=0.0,
        recompute_granularity=None,
        recompute_modules=None,
        recompute_method=None,
        recompute_num_layers=None,
        num_layers=2,
        moe_layer_freq=1,
        mtp_num_layers=None,
        mtp_use_repeated_layer=False,
        padded_vocab_size=128,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=1,
        global_batch_size=64,
    )
    args.update(overrides)
    return types.SimpleNamespace(**args)


def test_layer_and_stage_match_the_hand_computation():
    args = small_args()
    assert act.layer_activation_bytes(args, True) == LAYER == 7296
    (stage,) = act.estimate_activations(args, [[1, 2]])
    assert (stage.per_microbatch, stage.in_flight, stage.recompute_working, stage.logits) == (
        2 * LAYER,
        1.0,
        0,
        LOGITS,
    )
    assert stage.total == 2 * 7296 + 12288 == 26880


def test_dense_layer_and_shared_expert():
    """A dense layer keeps its MLP's fc1 output (2 x 32) and activation output (32); a shared
    expert of FFN 8 adds 2 x 8 + 8 per token to an MoE layer."""
    args = small_args(moe_shared_expert_intermediate_size=8)
    dense = (ATTENTION + 2 * (16 + 16) + 2 * (2 * 32 + 32)) * TOKENS
    assert act.layer_activation_bytes(args, False) == dense
    assert act.layer_activation_bytes(args, True) == LAYER + 2 * (2 * 8 + 8) * TOKENS


def test_latent_moe_rows_carry_the_latent_width():
    """--moe-latent-size 8: each of the 2 routed rows keeps an 8-wide dispatched input instead of
    16 (2 x 2 x (16 - 8) bytes less per token), and the back-projection keeps its 8-wide input
    (2 x 8 bytes more)."""
    args = small_args(moe_latent_size=8)
    assert act.layer_activation_bytes(args, True) == LAYER + (-2 * 2 * (16 - 8) + 2 * 8) * TOKENS


@pytest.mark.parametrize(
    "modules, expected",
    [
        (["moe"], (ATTENTION + 2 * 16) * TOKENS),  # the MoE layer keeps its input
        (["moe_act"], LAYER - 2 * 2 * 8 * TOKENS),  # 2 rows' activation output
        (["layernorm"], LAYER - 2 * (16 + 16) * TOKENS),  # both norms' outputs
        (["core_attn"], LAYER),  # flash attention: nothing
    ],
)
def test_selective_recompute_drops_what_it_recomputes(modules, expected):
    args = small_args(recompute_granularity="selective", recompute_modules=modules)
    assert act.layer_activation_bytes(args, True) == expected


def test_full_recompute_keeps_chunk_inputs_and_rematerializes_one_chunk():
    uniform = act.estimate_activations(
        small_args(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        [[1, 2]],
    )[0]
    assert (uniform.per_microbatch, uniform.recompute_working) == (2 * INPUT, LAYER)
    both = act.estimate_activations(
        small_args(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
        ),
        [[1, 2]],
    )[0]
    assert (both.per_microbatch, both.recompute_working) == (INPUT, 2 * LAYER)
    block = act.estimate_activations(
        small_args(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        [[1, 2]],
    )[0]
    assert (block.per_microbatch, block.recompute_working) == (INPUT + LAYER, LAYER)


def test_tensor_and_sequence_parallelism_shard_what_they_shard():
    """TP 2 with SP: the norms' tensors, router and routed rows follow the 8 sequence-sharded
    tokens; Q/K/V and the attention output are split over TP for all 16."""
    args = small_args(tensor_model_parallel_size=2, sequence_parallel=True)
    expected = 2 * (16 + 16) * 8 + 2 * (16 + 8 + 8 + 16) // 2 * 16 + MOE * 8
    assert act.layer_activation_bytes(args, True) == expected == 3648
    assert act.logits_bytes(args) == LOGITS // 2
    cp = small_args(context_parallel_size=2)
    assert act.layer_activation_bytes(cp, True) == LAYER // 2


def test_pipeline_microbatches_in_flight():
    """1F1B: stage i holds PP - i microbatches (never more than the iteration has); interleaved
    with VPP 2 on PP 2: 2 (PP - i - 1) + (VPP - 1) PP + 1 model chunks of half a stage each."""
    args = small_args(pipeline_model_parallel_size=2, global_batch_size=64)
    assert [act.in_flight_microbatches(args, s) for s in (0, 1)] == [2, 1]
    one = small_args(pipeline_model_parallel_size=4, global_batch_size=2, micro_batch_size=2)
    assert act.in_flight_microbatches(one, 0) == 1
    vpp = small_args(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert [act.in_flight_microbatches(vpp, s) for s in (0, 1)] == [5 / 2, 3 / 2]
    stages = act.estimate_activations(args, [[1], [2]])
    assert [s.total for s in stages] == [2 * LAYER, LAYER + LOGITS]


def test_mtp_depths_add_a_layer_and_their_logits_to_the_last_stage():
    args = small_args(mtp_num_layers=1)
    (stage,) = act.estimate_activations(args, [[1, 2]])
    assert stage.per_microbatch == 3 * LAYER
    assert stage.logits == TOKENS * 128 * (2 + 4 + 4)


def test_hidden_dropout_keeps_one_byte_masks():
    args = small_args(hidden_dropout=0.1)
    assert act.layer_activation_bytes(args, True) == LAYER + 2 * 16 * TOKENS
