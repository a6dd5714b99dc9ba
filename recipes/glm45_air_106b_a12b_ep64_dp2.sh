#!/usr/bin/env bash
# GLM-4.5-Air (106B-A12B) pretraining with UltraEP: EP64-DP2 on 128 GPUs (2 racks of 64), 2
# redundant expert slots per rank (UltraEP paper, Table 3 and §8.1).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..31> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/glm45_air_106b_a12b_ep64_dp2.sh [extra pretrain_gpt.py arguments]
#
# Shape: the published GLM-4.5-Air (46 layers, the first dense and 45 MoE; hidden 4096; 96
# query heads in 8 KV groups of head dim 128, QKV bias, RoPE on half of each head; 128 routed
# experts + 1 shared, top-8, expert FFN 1408; sigmoid router renormalized over the top-8; one
# MTP layer). Load balancing as trained in §8.1: GShard auxiliary loss, weight 1e-2.
# Check it without GPUs: ultraep check-recipe <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=glm45-air-106b-a12b-ep64-dp2
DEFAULT_NNODES=32                  # x 4 GPUs = 128 GPUs
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's perf recipes (none for GLM-4.5-Air; this GB200 rack recipe follows their
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
HF_TOKENIZER=zai-org/GLM-4.5-Air
VOCAB_SIZE=151552                  # embedding rows of the released checkpoint
VOCAB_DIVISOR=1184                 # 151552 = 128 x 1184

MODEL_ARGS=(
    --num-layers 46
    --hidden-size 4096
    --ffn-hidden-size 10944
    --num-attention-heads 96
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --add-qkv-bias
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --rotary-percent 0.5
    --rotary-base 1000000
    --max-position-embeddings 131072
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)

MOE_ARGS=(
    --num-experts 128
    --moe-layer-freq "([0]*1+[1]*45)"
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 1408
    --moe-router-topk 8
    --moe-router-score-function sigmoid
    --moe-router-topk-scaling-factor 1.0
    --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots 2
    --moe-balancer-hardware paper-rack  # a GB200 NVL72 rack (64 GPUs in use): quota floor, 186 GiB, the rack is the NVLink domain
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 64     # one EP group = one rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
