#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining with UltraEP on 1-4 HGX H100 (or H200) nodes: EP 8 within each node
# (default, expert-DP = nodes) or EP 32 across 4 nodes (EP=32), expert replicas kept inside the
# node's NVLink domain (--moe-balancer-domain-size 8). Default 4 nodes (32 GPUs); on H100 it needs
# 2 nodes at least: one node's EP 8 holds every parameter once per GPU with its fp32 gradient and
# Adam state, 71.5 GiB before activations (docs/recipes.md); one H200 node fits (NNODES=1,
# --moe-balancer-hardware h200-hgx).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..3> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/qwen3_30b_a3b_ep8_hgx.sh [extra pretrain_gpt.py arguments]
#   EP=32 ...                  EP 32 across the 4 nodes (2 redundant slots per rank)
#   sbatch recipes/slurm_qwen3_30b_a3b_hgx.sbatch    (the same under Slurm)
#
# Shape: the published Qwen3-30B-A3B (HF config.json of Qwen/Qwen3-30B-A3B: 48 layers, all MoE;
# hidden 2048; 32 query heads in 4 KV groups of head dim 128 with QK-norm; 128 experts, top-8,
# expert FFN 768, no shared expert; softmax router renormalized over the top-8; vocabulary
# 151936). Load balancing: GShard auxiliary loss, weight 1e-3. Redundant slots by the slot rule
# (docs/recipes.md): max(2, ceil(128 experts / (2 x EP))): 8 at EP 8, 2 at EP 32.
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_*_V1 (scripts/performance/configs/qwen/
# qwen3_workload_base_configs.py): BF16 and FP8_CS; no recompute. Left out: HybridEP as the
# default (DISPATCHER=hybridep where DeepEP's hybrid_ep is built) and its TE graphs of moe_router
# and moe_preprocess (CUDA_GRAPH_MODULES="moe_router moe_preprocess" runs with the device planner
# on the alltoall dispatcher: recipes/common.sh).
# Check it without GPUs: ultraep check-recipe --env MASTER_ADDR=node0 <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=qwen3-30b-a3b-ep8-hgx
DEFAULT_NNODES=4                   # x 8 GPUs = 32 GPUs
DEFAULT_GPUS_PER_NODE=8            # an HGX node = one NVLink domain
PRECISIONS="bf16 fp8_cs fp8_sc"     # Hopper: no mxfp8 (Blackwell only)
HF_TOKENIZER=Qwen/Qwen3-30B-A3B
VOCAB_SIZE=151936                  # embedding rows of the released checkpoint
VOCAB_DIVISOR=1187                 # 151936 = 128 x 1187

EP=${EP:-8}
case "$EP" in
    8) SLOTS=8 ;;                  # max(2, ceil(128 / 16))
    32) SLOTS=2 ;;                 # max(2, ceil(128 / 64))
    *) ultraep_env_error "EP=$EP: expected 8 (within a node) or 32 (across 4 nodes)" ;;
esac

MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
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
    --moe-ffn-hidden-size 768
    --moe-router-topk 8
    --moe-router-score-function softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots "$SLOTS"
    --moe-balancer-domain-size 8        # the node's 8 GPUs: one NVLink domain
    --moe-balancer-hardware h100-hgx
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
