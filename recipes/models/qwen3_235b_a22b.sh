# Qwen3-235B-A22B's shape (HF config.json of Qwen/Qwen3-235B-A22B: 94 layers, all MoE; hidden 4096;
# 64 query heads in 4 KV groups of head dim 128 with QK-norm; 128 experts, top-8, expert FFN 1536,
# no shared expert; softmax router renormalized over the top-8) and its load balancing (GShard
# auxiliary loss, weight 1e-2), shared by the recipes that train it (sourced, not run): they add
# their layout and balancer settings to MOE_ARGS and set PARALLEL_ARGS.

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
