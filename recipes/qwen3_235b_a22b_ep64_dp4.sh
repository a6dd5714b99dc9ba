#!/usr/bin/env bash
# Qwen3-235B-A22B pretraining with UltraEP: EP64-DP4 on 256 GPUs (4 racks of 64), 2 redundant
# expert slots per rank (UltraEP paper, Table 3 and §8.1).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..63> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
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
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3_235b_a22b.sh"

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 64     # one EP group = one rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
