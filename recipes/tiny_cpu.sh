#!/usr/bin/env bash
# Tiny MoE GPT on 4 CPU ranks over gloo, expert parallel EP=4: megatron-core's own GPT model and
# training loop (pretrain_gpt.py), run on CPU by ultraep_megatron's CPU backend.
#
#   bash recipes/tiny_cpu.sh [extra pretrain_gpt.py arguments, e.g. --moe-balancer none]
#
# Balances with --moe-balancer ultraep and its default 2 redundant slots per rank, as the rack
# recipes do (MOE_BALANCER below; extra arguments win). Logs loss and, per MoE layer, the
# expert-load imbalance (max/mean tokens per EP rank) to the console and to wandb (offline, under
# $RUN_DIR/wandb). Routing is kept visibly skewed by megatron's --moe-router-force-biased (a fixed
# per-layer bias on the router logits).
# Environment: ULTRAEP_PYTHON (python with torch + megatron-core; default: python on PATH),
# RUN_DIR (default: runs/tiny_cpu), TRAIN_ITERS (default 40), MOE_BALANCER (default --moe-balancer:
# ultraep, as in recipes/common.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${ULTRAEP_PYTHON:-$(command -v python3 || command -v python)}
RUN_DIR=${RUN_DIR:-$REPO/runs/tiny_cpu}
TRAIN_ITERS=${TRAIN_ITERS:-40}
MOE_BALANCER=${MOE_BALANCER:-ultraep}
NPROC=4
mkdir -p "$RUN_DIR"

# One thread per rank: two ranks with two threads each ran 5x slower on a 2-core machine.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# No blanket warning filter: the CPU backend filters only what a CPU machine alone causes

DISTRIBUTED_ARGS=(
    --standalone
    --nproc-per-node "$NPROC"
)

# What a CPU run needs (ultraep_megatron/megatron/cpu/flags.py CPU_FLAGS; pretrain_gpt.py adds
# missing ones itself, with a log line).
CPU_ARGS=(
    --distributed-backend gloo
    --transformer-impl local
    --no-gradient-accumulation-fusion
    --no-persist-layer-norm
    --no-bias-gelu-fusion
    --no-bias-dropout-fusion
    --no-rope-fusion
    --no-masked-softmax-fusion
)

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

MOE_ARGS=(
    --num-experts 16
    --moe-router-topk 2
    --moe-ffn-hidden-size 64
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-router-force-biased -1.0
    --moe-balancer "$MOE_BALANCER"
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 4
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 16
    --train-iters "$TRAIN_ITERS"
    --lr 3e-3
    --min-lr 3e-4
    --lr-decay-style cosine
    --lr-warmup-iters 4
    --weight-decay 0.1
    --clip-grad 1.0
    --seed 1234
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 1024
    --data-cache-path "$RUN_DIR/data_cache"  # the mock dataset's indices (megatron warns without)
)

LOGGING_ARGS=(
    --log-interval 1
    --eval-interval 1000
    --eval-iters 0
    --wandb-project ultraep-tiny-cpu
    --wandb-exp-name "tiny-cpu-ep4"
    --wandb-save-dir "$RUN_DIR/wandb"
    --metrics-jsonl "$RUN_DIR/metrics.jsonl"
)

exec "$PYTHON" -m ultraep_megatron.megatron.run.torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${CPU_ARGS[@]}" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
