#!/usr/bin/env bash
# Qwen3-235B-A22B pretraining with UltraEP: EP64-DP4 on 256 GPUs (4 racks of 64), 2 redundant
# expert slots per rank (UltraEP paper, Table 3 and §8.1).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..63> DATA_PATH=<megatron data prefix> \
#       bash recipes/qwen3_235b_a22b_ep64_dp4.sh [extra pretrain_gpt.py arguments]
#
# Shape: the published Qwen3-235B-A22B (94 layers, all MoE; hidden 4096; 64 query heads in 4 KV
# groups of head dim 128 with QK-norm; 128 experts, top-8, expert FFN 1536, no shared expert;
# softmax router renormalized over the top-8). Load balancing as trained in §8.1: GShard
# auxiliary loss, weight 1e-2. Check it without GPUs: ultraep check-recipe <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=qwen3-235b-a22b-ep64-dp4
DEFAULT_NNODES=64                  # x 4 GPUs = 256 GPUs
HF_TOKENIZER=Qwen/Qwen3-235B-A22B
VOCAB_SIZE=151936                  # embedding rows of the released checkpoint
VOCAB_DIVISOR=1187                 # 151936 = 128 x 1187

MODEL_ARGS=(
    --num-layers 94
    --hidden-size 4096
    --ffn-hidden-size 12288
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 4
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
    --max-position-embeddings 40960
)

MOE_ARGS=(
    --num-experts 128
    --moe-ffn-hidden-size 1536
    --moe-router-topk 8
    --moe-router-score-function softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots 2
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 64     # one EP group = one rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
