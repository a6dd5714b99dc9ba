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
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's perf recipes (src/megatron/bridge/perf_recipes/qwen/gb200/qwen3_moe.py,
# qwen3_235b_a22b_pretrain_*gpu_gb200_{bf16,fp8cs,fp8mx}_config; scripts/performance/configs/
# qwen/qwen3_workload_base_configs.py, QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_*_V2):
# 256 GB200 GPUs in PP8 with EP8 (BF16) or EP32 (FP8); BF16, FP8_CS, FP8_MX; the flex
# dispatcher with HybridEP; TE CUDA graphs of attn, moe_router and moe_preprocess (FP8_MX:
# full_iteration).
# Adopted: the precisions (PRECISION=bf16, the perf scripts' default; fp8_cs: hybrid tensorwise
# with --fp8-param-gather; fp8_mx: e4m3 mxfp8 with --fp8-param-gather and
# --reuse-grad-buf-for-mxfp8-param-ag, as Bridge's bf16_with_mxfp8_mixed), the flex dispatcher with
# HybridEP (default on: HybridEP must be installed on the GPU nodes, pretrain_gpt.py refuses to
# start without it; DISPATCHER=alltoall where it is not) and TE per-layer CUDA graphs of attn and
# moe_router (default on). Left out: the moe_preprocess graph and fp8_mx's
# full_iteration graph (they capture the balanced layer's plan wait: refused), nvfp4, their
# PP8 layouts (this recipe is the paper's EP64-DP4) and
# activation offloading (none in these recipes; DeepSeek-V3 GB200's non-default
# fp8mx_partial_cg variant offloads expert_fc1: append --fine-grained-activation-offloading
# --offload-modules expert_fc1).
PRECISIONS="bf16 fp8_cs fp8_mx"     # Blackwell: mxfp8 needs it; fp8_sc is Bridge's H100 preset
DEFAULT_CUDA_GRAPH_MODULES="attn moe_router"
DEFAULT_DISPATCHER=hybridep        # Bridge's GB200 moe_flex_dispatcher_backend
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3_235b_a22b.sh"
MOE_ARGS+=(
    --moe-balancer-hardware paper-rack  # a GB200 NVL72 rack (64 GPUs in use): quota floor, 186 GiB, the rack is the NVLink domain
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 64     # one EP group = one rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
