#!/usr/bin/env bash
# A 288B-A16B-class MoE (the shape class of the paper's in-house RefMoE-288B-A16B) pretraining
# with UltraEP: EP32-PP4-DP20 on 2560 GPUs (40 racks of 64), 4 redundant expert slots per rank
# (UltraEP paper, Table 3 and §8.1).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..639> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/refmoe_288b_a16b_ep32_pp4_dp20.sh [extra pretrain_gpt.py arguments]
#
# Shape: RefMoE itself is unpublished; the paper gives 46 layers (the first dense, 45 MoE), 256
# experts, top-8, and the DeepSeek load-balancing recipe. The rest is chosen to land on 288B total
# / 16B active parameters in the style of the open models above: hidden 5120, 64 query heads in 8
# KV groups of head dim 128, 1 shared expert, expert FFN 1584, one MTP layer (not counted in the
# 288B, as for DeepSeek-V3's 671B). Load balancing as in §8.1: expert-bias update rate 1e-3 and
# sequence-level auxiliary loss, weight 1e-4. Two EP groups share a rack; pipeline stages (11/12/
# 12/11 decoder layers) and data-parallel replicas span racks.
# Check it without GPUs: ultraep check-recipe <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=refmoe-288b-a16b-ep32-pp4-dp20
DEFAULT_NNODES=640                 # x 4 GPUs = 2560 GPUs
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's perf recipes (none for this in-house shape; this GB200 rack recipe follows their
# GB200 MoE ones, src/megatron/bridge/perf_recipes/deepseek/gb200/deepseek_v3.py and
# qwen/gb200/qwen3_moe.py):
# DeepSeek-V3 and Qwen3-235B on GB200: BF16, FP8_CS, FP8_MX; HybridEP; TE CUDA graphs of
# attn, moe_router and moe_preprocess (FP8_MX: full_iteration).
# Adopted: the precisions (PRECISION=bf16, the perf scripts' default; fp8_cs: hybrid tensorwise
# with --fp8-param-gather; fp8_mx: e4m3 mxfp8 with --fp8-param-gather and
# --reuse-grad-buf-for-mxfp8-param-ag, as Bridge's bf16_with_mxfp8_mixed), the flex dispatcher with
# HybridEP (default on: HybridEP must be installed on the GPU nodes, pretrain_gpt.py refuses to
# start without it; DISPATCHER=alltoall where it is not) and TE per-layer CUDA graphs of attn and
# moe_router (default on). Left out: the moe_preprocess graph and fp8_mx's
# full_iteration graph (they capture the balanced layer's plan wait: refused), nvfp4 and
# activation offloading (none in these recipes; DeepSeek-V3 GB200's non-default
# fp8mx_partial_cg variant offloads expert_fc1: append --fine-grained-activation-offloading
# --offload-modules expert_fc1).
PRECISIONS="bf16 fp8_cs fp8_mx"     # Blackwell: mxfp8 needs it; fp8_sc is Bridge's H100 preset
DEFAULT_CUDA_GRAPH_MODULES="attn moe_router"
DEFAULT_DISPATCHER=hybridep        # Bridge's GB200 moe_flex_dispatcher_backend
HF_TOKENIZER=zai-org/GLM-4.5-Air   # any 151552-row tokenizer; set TOKENIZER_MODEL for yours
VOCAB_SIZE=151552
VOCAB_DIVISOR=1184

MODEL_ARGS=(
    --num-layers 46
    --hidden-size 5120
    --ffn-hidden-size 12288
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --qk-layernorm
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --rotary-percent 1.0
    --rotary-base 1000000
    --max-position-embeddings 131072
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)

MOE_ARGS=(
    --num-experts 256
    --moe-layer-freq "([0]*1+[1]*45)"
    --moe-ffn-hidden-size 1584
    --moe-shared-expert-intermediate-size 1584
    --moe-router-topk 8
    --moe-router-score-function sigmoid
    --moe-router-topk-scaling-factor 2.5
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots 4
    --moe-balancer-hardware paper-rack  # a GB200 NVL72 rack (64 GPUs in use): quota floor, 186 GiB, the rack is the NVLink domain
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4    # stages across racks
    --decoder-first-pipeline-num-layers 11
    --decoder-last-pipeline-num-layers 11
    --expert-model-parallel-size 32     # two EP groups per rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
