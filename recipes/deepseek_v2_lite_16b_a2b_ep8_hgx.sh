#!/usr/bin/env bash
# DeepSeek-V2-Lite (16B-A2.4B) pretraining with UltraEP on one HGX node: EP8 on 8 H100 (or H200)
# GPUs joined by NVLink, 4 redundant expert slots per rank (the slot rule, docs/recipes.md: 8 experts
# per rank, max(2, 8 / 2) = 4). The first run on H100/H200 hardware
# (docs/first_gpu_run.md): one node, no MASTER_ADDR.
#
#   DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/deepseek_v2_lite_16b_a2b_ep8_hgx.sh \
#       [extra pretrain_gpt.py arguments]
#
# Shape: the published DeepSeek-V2-Lite (HF config.json of deepseek-ai/DeepSeek-V2-Lite: 27
# layers, the first dense (FFN 10944) and 26 MoE; hidden 2048; MLA with 16 heads, no query LoRA,
# kv LoRA rank 512, 128 + 64 (RoPE) query/key head dims, value head dim 128, YaRN x40, mscale
# 0.707; 64 routed experts + 2 shared, top-6, expert FFN 1408; softmax router over all experts,
# top-6 not renormalized; vocabulary 102400). Load balancing: its expert-level sequence auxiliary
# loss, weight 1e-3 (the device- and communication-level losses of DeepSeek-V2 have no
# megatron-core flag). The model fits 8 x 80 GB with EP 8 and plain fp32 Adam; Qwen3-30B-A3B
# does not (its 30B parameters' weights, fp32 gradients and optimizer states need ~71 GiB per
# GPU before activations: see docs/recipes.md). The node is one NVLink domain
# (--moe-balancer-domain-size 8, --moe-balancer-hardware h100-hgx: its quota floor, 80 GiB).
# Check it without GPUs: ultraep check-recipe <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=deepseek-v2-lite-16b-a2b-ep8-hgx
DEFAULT_NNODES=1
DEFAULT_GPUS_PER_NODE=8            # one HGX node = 8 GPUs = one NVLink domain
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's H100 perf recipes (none for DeepSeek-V2-Lite; their H100 MoE ones,
# src/megatron/bridge/perf_recipes/deepseek/h100/deepseek_v3.py,
# deepseek_v3_pretrain_1024gpu_h100_{bf16,fp8cs,fp8sc}_config, and scripts/performance/configs/
# qwen/qwen3_workload_base_configs.py QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_*_V1):
# BF16, FP8_CS (and FP8_SC for DeepSeek-V3); the flex dispatcher with HybridEP; CUDA graphs
# none (DeepSeek-V3, Qwen3-30B FP8_CS) or TE moe_router + moe_preprocess (Qwen3-30B BF16).
# Adopted: the precisions (PRECISION=bf16, the perf scripts' default; fp8_cs: hybrid tensorwise
# with --fp8-param-gather; fp8_sc: hybrid blockwise, the DeepSeek-V3 H100 FP8_SC preset), no
# CUDA graphs by default (CUDA_GRAPH_MODULES="moe_router moe_preprocess" is Qwen3-30B BF16's:
# moe_preprocess runs with the device planner on this recipe's alltoall dispatcher).
# Left out: HybridEP as the default, which Bridge's DeepSeek-V3 and Qwen3-30B-A3B H100 recipes
# use (DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1, QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_*_V1:
# moe_flex_dispatcher_backend="hybridep") but their Qwen3-235B H100 one does not
# (QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_*_V1: moe_token_dispatcher_type="alltoall"): this is the
# first GPU run (docs/first_gpu_run.md), on a stock megatron-core without DeepEP/HybridEP built,
# and its EP8 all-to-all stays inside one node's NVLink (DISPATCHER=hybridep where it is
# installed); activation offloading (none in these H100 recipes).
PRECISIONS="bf16 fp8_cs fp8_sc"     # Hopper: no mxfp8 (Blackwell only)
HF_TOKENIZER=deepseek-ai/DeepSeek-V2-Lite
VOCAB_SIZE=102400                  # embedding rows of the released checkpoint
VOCAB_DIVISOR=1024                 # 102400 = 1024 x 100

MODEL_ARGS=(
    --num-layers 27
    --hidden-size 2048
    --ffn-hidden-size 10944
    --num-attention-heads 16
    --kv-channels 128
    --multi-latent-attention
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --qk-layernorm
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --rotary-base 10000
    --rotary-percent 1.0
    --rotary-scaling-factor 40
    --mscale 0.707
    --mscale-all-dim 0.707
    --max-position-embeddings 163840
)

MOE_ARGS=(
    --num-experts 64
    --moe-layer-freq "([0]*1+[1]*26)"
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 2816
    --moe-router-topk 6
    --moe-router-score-function softmax
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots 4          # the slot rule: max(2, ceil(64 experts / (2 x EP 8)))
    --moe-balancer-domain-size 8        # the node's 8 GPUs: one NVLink domain
    --moe-balancer-hardware h100-hgx
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8      # one EP group = the node
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
