#!/usr/bin/env bash
# DeepSeek-V3 (671B-A37B) pretraining with UltraEP: EP64-PP4 on 256 GPUs (4 racks of 64; one
# pipeline stage per rack), 2 redundant expert slots per rank (UltraEP paper, Table 3 and §8.1).
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..63> DATA_PATH=<megatron data prefix> TOKENIZER_MODEL=<tokenizer> \
#       bash recipes/deepseek_v3_671b_a37b_ep64_pp4.sh [extra pretrain_gpt.py arguments]
#
# Shape: the published DeepSeek-V3 (61 layers, the first 3 dense and 58 MoE; hidden 7168; MLA
# with 128 heads, q LoRA rank 1536, kv LoRA rank 512, 128 + 64 (RoPE) query/key head dims, value
# head dim 128, YaRN x40; 256 routed experts + 1 shared, top-8 in 4 of 8 groups, expert FFN 2048,
# sigmoid router scaled by 2.5; one MTP layer). Load balancing as in §8.1 (the DeepSeek recipe):
# expert-bias update rate 1e-3 and sequence-level auxiliary loss, weight 1e-4.
# Pipeline stages hold 15/16/16/14 decoder layers: the first also holds the embedding, the last
# the output layer and the MTP layer. Check it without GPUs: ultraep check-recipe <this file>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE_NAME=deepseek-v3-671b-a37b-ep64-pp4
DEFAULT_NNODES=64                  # x 4 GPUs = 256 GPUs
# Production envelope (env PRECISION, CUDA_GRAPH_MODULES, DISPATCHER: recipes/common.sh), after
# Megatron-Bridge's perf recipes (src/megatron/bridge/perf_recipes/deepseek/gb200/deepseek_v3.py,
# deepseek_v3_pretrain_256gpu_gb200_{bf16,fp8cs,fp8mx}_config; scripts/performance/configs/
# deepseek/deepseek_workload_base_configs.py, DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_*_V2):
# 256 GB200 GPUs in PP4 (VP4) x EP64 as here; BF16, FP8_CS and FP8_MX; the flex dispatcher
# with HybridEP; TE CUDA graphs of attn, moe_router and moe_preprocess (FP8_MX: full_iteration).
# Adopted: the precisions (PRECISION=bf16, the perf scripts' default; fp8_cs: hybrid tensorwise
# with --fp8-param-gather; fp8_mx: e4m3 mxfp8 with --fp8-param-gather and
# --reuse-grad-buf-for-mxfp8-param-ag, as Bridge's bf16_with_mxfp8_mixed), the flex dispatcher with
# HybridEP (default on: HybridEP must be installed on the GPU nodes, pretrain_gpt.py refuses to
# start without it; DISPATCHER=alltoall where it is not) and TE per-layer CUDA graphs of attn and
# moe_router (default on). Left out: the moe_preprocess graph and fp8_mx's
# full_iteration graph (they capture the balanced layer's plan wait: refused), nvfp4, VP4,
# the recompute choices (mlp, mla_up_proj) and
# activation offloading (none in these recipes; DeepSeek-V3 GB200's non-default
# fp8mx_partial_cg variant offloads expert_fc1: append --fine-grained-activation-offloading
# --offload-modules expert_fc1).
PRECISIONS="bf16 fp8_cs fp8_mx"     # Blackwell: mxfp8 needs it; fp8_sc is Bridge's H100 preset
DEFAULT_CUDA_GRAPH_MODULES="attn moe_router"
DEFAULT_DISPATCHER=hybridep        # Bridge's GB200 moe_flex_dispatcher_backend
HF_TOKENIZER=deepseek-ai/DeepSeek-V3
VOCAB_SIZE=129280                  # embedding rows of the released checkpoint
VOCAB_DIVISOR=1280                 # 129280 = 1280 x 101

MODEL_ARGS=(
    --num-layers 61
    --hidden-size 7168
    --ffn-hidden-size 18432
    --num-attention-heads 128
    --kv-channels 128
    --multi-latent-attention
    --q-lora-rank 1536
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
    --mscale 1.0
    --mscale-all-dim 1.0
    --max-position-embeddings 163840
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)

MOE_ARGS=(
    --num-experts 256
    --moe-layer-freq "([0]*3+[1]*58)"
    --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --moe-router-topk 8
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-score-function sigmoid
    --moe-router-pre-softmax
    --moe-router-topk-scaling-factor 2.5
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm                  # Transformer Engine's grouped-GEMM experts (TEGroupedMLP)
    --moe-balancer-num-slots 2
    --moe-balancer-hardware paper-rack  # a GB200 NVL72 rack (64 GPUs in use): quota floor, 186 GiB, the rack is the NVLink domain
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4    # one stage per rack
    --decoder-first-pipeline-num-layers 15
    --decoder-last-pipeline-num-layers 14
    --expert-model-parallel-size 64     # one EP group = one rack
    --expert-tensor-parallel-size 1
)

ultraep_launch "$@"
