#!/usr/bin/env bash
# Qwen3-235B-A22B pretraining with UltraEP on HGX H100 nodes, in Megatron-Bridge's H100 layout:
# TP2 x PP8 (VP4) x EP32 on 256 GPUs (32 nodes of 8), megatron's overlapped 1F1B schedule with
# delayed weight gradients. Each EP group spans 4 nodes; NVLink ends at the node, so ultraep
# balances within node-sized domains (--moe-balancer-domain-size 8): an expert's replicas live on
# its home node, no expert weight or replica gradient crosses InfiniBand, only the tokens'
# all-to-all does. 2 redundant expert slots per rank.
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..31> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/qwen3_235b_a22b_ep32_pp8_hgx.sh [extra pretrain_gpt.py arguments]
#
# Shape: the published Qwen3-235B-A22B (HF config.json of Qwen/Qwen3-235B-A22B: 94 layers, all
# MoE; hidden 4096; 64 query heads in 4 KV groups of head dim 128 with QK-norm; 128 experts,
# top-8, expert FFN 1536, no shared expert; softmax router renormalized over the top-8), as the
# rack recipe qwen3_235b_a22b_ep64_dp4.sh. Load balancing: GShard auxiliary loss, weight 1e-2.
# Check it without GPUs: ultraep check-recipe <this file> (H200 nodes: --gpu-memory-gb 141).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=qwen3-235b-a22b-ep32-pp8-hgx
DEFAULT_NNODES=32                  # x 8 GPUs = 256 GPUs
DEFAULT_GPUS_PER_NODE=8            # an HGX node = one NVLink domain
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's H100 perf recipes (src/megatron/bridge/perf_recipes/qwen/h100/qwen3_moe.py,
# qwen3_235b_a22b_pretrain_256gpu_h100_{bf16,fp8cs}_config):
# 256 H100 GPUs in TP2 (sequence parallel) x PP8 (VP4) x EP32; the embedding and the loss counted
# in the pipeline split (96 = 32 virtual stages x 3); BF16 and FP8_CS; the alltoall dispatcher with
# megatron's overlapped 1F1B schedule (overlap_moe_expert_parallel_comm) and delayed weight
# gradients (delay_wgrad_compute); no activation recompute; no CUDA graphs; no offloading.
# Adopted: all of it, with the precisions (PRECISION=bf16, the perf scripts' default; fp8_cs: hybrid
# tensorwise with --fp8-param-gather; fp8_sc: hybrid blockwise, the DeepSeek-V3 H100 FP8_SC preset)
# and the alltoall dispatcher (QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_*_V1: moe_token_dispatcher_type=
# "alltoall"; HybridEP, the GB200 recipes' default, stays DISPATCHER=hybridep here: it needs
# DeepEP's hybrid_ep built on the nodes). Expert TP 1 (ultraep replicates whole experts; megatron's
# default would be the TP size). Left out: Bridge's global batch (8192; common.sh's 5120 here) and
# overlap_param_gather_with_optimizer_step (not run with a balancer yet: docs/integration.md).
PRECISIONS="bf16 fp8_cs fp8_sc"     # Hopper: no mxfp8 (Blackwell only)
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3_235b_a22b.sh"
MOE_ARGS+=(
    --moe-balancer-domain-size 8        # EP ranks per node = per NVLink domain
    --moe-balancer-hardware h100-hgx
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 8
    --num-virtual-stages-per-pipeline-rank 4
    --account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split
    --expert-model-parallel-size 32     # one EP group = 4 nodes
    --expert-tensor-parallel-size 1
    --overlap-moe-expert-parallel-comm  # megatron's overlapped 1F1B schedule
    --delay-wgrad-compute               # the experts' weight gradients in backward_dw()
)

ultraep_launch "$@"
