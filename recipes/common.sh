# Shared launch conventions of the rack-scale recipes (sourced, not run). In the style of
# Megatron-LM's examples/: one bash array per argument group, torchrun on every node.
#
# Environment (all optional; MASTER_ADDR is needed as soon as there is more than one node):
#   (A Slurm job running a recipe on every node: recipes/slurm_qwen3_30b_a3b_hgx.sbatch.)
#   MASTER_ADDR, MASTER_PORT   rendezvous host/port (default port 6000; host: localhost on one
#                              node; on several, node 0 of Slurm's SLURM_JOB_NODELIST, else the
#                              recipe stops naming MASTER_ADDR rather than guess localhost)
#   NNODES, NODE_RANK          nodes in the job and this node's index (defaults: the recipe's
#                              layout; $SLURM_NODEID or 0)
#   GPUS_PER_NODE              processes per node (default: the recipe's DEFAULT_GPUS_PER_NODE,
#                              else 4: a GB200/GB300 compute tray, 16 trays in use per 64-GPU
#                              rack; the HGX recipes set 8: an H100/H200 node, its NVLink domain)
#   PRETRAIN_SCRIPT            pretrain_gpt.py to run (default: this repository's; a Megatron-LM
#                              checkout patched with patches/ works the same)
#   ULTRAEP_PYTHON             python with torch + megatron-core + ultraep_megatron
#   DATA_PATH                  Megatron --data-path (a blend "w1 p1 w2 p2" or one prefix); unset:
#                              --mock-data with a NullTokenizer of the model's vocabulary size.
#                              Build a prefix with Megatron-LM's tools/preprocess_data.py (--input
#                              JSONL --output-prefix P --tokenizer-type HuggingFaceTokenizer
#                              --tokenizer-model TOKENIZER_MODEL --append-eod): DATA_PATH=P_text_document
#   SAVE_INTERVAL              --save-interval with CHECKPOINT_DIR (default 500 iterations)
#   TOKENIZER_MODEL            HuggingFace tokenizer DATA_PATH was made with: a local directory
#                              (a cluster without internet) or a hub id (needs the hub from every
#                              node). Required with DATA_PATH: the recipe refuses to start without
#                              it rather than fail on the hub after the job has started
#   CHECKPOINT_DIR             --load and --save directory (unset: neither)
#   SAVE_CHECKPOINTS           0: load from CHECKPOINT_DIR but never save (the resume experiment)
#   MOE_BALANCER               default --moe-balancer (default ultraep); extra arguments win
#   WANDB_PROJECT              wandb logging (Megatron's --wandb-project) only when set; unset or
#                              WANDB_MODE=disabled: no wandb flag (WANDB_MODE=offline: log to disk)
#   WANDB_EXP_NAME, WANDB_SAVE_DIR   (default run name: the recipe's); TENSORBOARD_DIR, METRICS_JSONL
#   GLOBAL_BATCH_SIZE, MICRO_BATCH_SIZE, SEQ_LENGTH, TRAIN_ITERS
#   PRECISION                  bf16 (default, as Megatron-Bridge's perf scripts' --compute_dtype),
#                              fp8_cs, fp8_sc or fp8_mx: Megatron-Bridge's mixed-precision presets
#                              (utils/precision.py, training/mixed_precision.py); the ones the
#                              recipe's GPU runs are in its PRECISIONS (Hopper: fp8_cs fp8_sc;
#                              Blackwell: fp8_cs fp8_mx). nvfp4 is refused: --moe-balancer
#                              ultraep refuses fp4 (docs/integration.md)
#   CUDA_GRAPH_MODULES         per-layer CUDA graphs (--cuda-graph-impl transformer_engine
#                              --cuda-graph-modules ...) within attn moe_router mlp mamba, and
#                              moe_preprocess with DISPATCHER=alltoall (the device planner); none: no
#                              graphs (default: the recipe's DEFAULT_CUDA_GRAPH_MODULES, else none)
#   DISPATCHER                 alltoall, hybridep or deepep: --moe-token-dispatcher-type alltoall, or
#                              flex with that backend (needs DeepEP / HybridEP installed on the GPU
#                              nodes: pretrain_gpt.py refuses it without; the recipe checker notes
#                              it, the CPU variants run alltoall). Default: the recipe's
#                              DEFAULT_DISPATCHER (the GB200 recipes: hybridep), else alltoall
#
# A malformed value (NNODES=abc, NODE_RANK >= NNODES, DATA_PATH without TOKENIZER_MODEL) stops the
# recipe before torchrun with one line naming the variable, exit status 2.
#
# A recipe sets RECIPE_NAME, DEFAULT_NNODES, HF_TOKENIZER, VOCAB_SIZE, VOCAB_DIVISOR (and, if not
# 4, DEFAULT_GPUS_PER_NODE), PRECISIONS (what its GPU runs), optionally DEFAULT_CUDA_GRAPH_MODULES
# and DEFAULT_DISPATCHER, and its MODEL_ARGS / MOE_ARGS / PARALLEL_ARGS arrays, then calls
# `ultraep_launch "$@"`.
# A PRECISION outside PRECISIONS, an unknown CUDA graph module or DISPATCHER is one line naming the
# variable, exit status 2.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# One line naming the environment variable, exit status 2 (before torchrun starts).
ultraep_env_error() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

# ultraep_env_int NAME VALUE MIN WHAT: VALUE must be a whole number >= MIN.
ultraep_env_int() {
    if ! [[ "$2" =~ ^[0-9]+$ ]] || (( 10#$2 < $3 )); then
        ultraep_env_error "$1=$2: expected a whole number >= $3 ($4)"
    fi
}

ultraep_launch() {
    local python=${ULTRAEP_PYTHON:-$(command -v python3 || command -v python)}
    local script=${PRETRAIN_SCRIPT:-$REPO/pretrain_gpt.py}
    local gpus_per_node=${GPUS_PER_NODE:-${DEFAULT_GPUS_PER_NODE:-4}}
    local nnodes=${NNODES:-$DEFAULT_NNODES}
    local node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}

    ultraep_env_int NNODES "$nnodes" 1 "nodes in the job"
    ultraep_env_int GPUS_PER_NODE "$gpus_per_node" 1 "processes per node"
    ultraep_env_int NODE_RANK "$node_rank" 0 "this node's index"
    (( 10#$node_rank < 10#$nnodes )) || ultraep_env_error "NODE_RANK=$node_rank: expected less than NNODES=$nnodes"
    ultraep_env_int MASTER_PORT "${MASTER_PORT:-6000}" 1 "the rendezvous port"
    local master_addr
    ultraep_master_addr "$nnodes"

    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

    local distributed_args=(
        --nproc-per-node "$gpus_per_node"
        --nnodes "$nnodes"
        --node-rank "$node_rank"
        --master-addr "$master_addr"
        --master-port "${MASTER_PORT:-6000}"
    )

    # GPU training defaults shared by every recipe (bf16, Transformer Engine layers, the
    # distributed optimizer with overlapped gradient reduction).
    local system_args=(
        --transformer-impl transformer_engine
        --bf16
        --use-distributed-optimizer
        --overlap-grad-reduce
        --overlap-param-gather
        --distributed-timeout-minutes 60
        --attention-dropout 0.0
        --hidden-dropout 0.0
        --init-method-std 0.02
        --clip-grad 1.0
        --weight-decay 0.1
        --adam-beta1 0.9
        --adam-beta2 0.95
        --lr 3.0e-4
        --min-lr 3.0e-5
        --lr-decay-style cosine
        --lr-warmup-iters 100
        --micro-batch-size "${MICRO_BATCH_SIZE:-1}"
        --global-batch-size "${GLOBAL_BATCH_SIZE:-5120}"
        --seq-length "${SEQ_LENGTH:-4096}"
        --train-iters "${TRAIN_ITERS:-4500}"
        --seed 1234
    )

    local data_args
    if [[ -n "${DATA_PATH:-}" ]]; then
        # No default: the data was tokenized with a tokenizer the user holds, and the model's hub
        # id would only fail later, on every rank, on a cluster without internet.
        [[ -n "${TOKENIZER_MODEL:-}" ]] || ultraep_env_error "DATA_PATH is set but TOKENIZER_MODEL is not:" \
            "set it to the tokenizer DATA_PATH was made with, a local directory on every node (a cluster" \
            "without internet) or a HuggingFace hub id (this model's: $HF_TOKENIZER)"
        # --vocab-size is what NullTokenizer uses; a HuggingFace tokenizer brings its own and
        # pads it to a multiple of VOCAB_DIVISOR, i.e. to the model's embedding size.
        data_args=(
            --data-path $DATA_PATH
            --split 99,1,0
            --tokenizer-type HuggingFaceTokenizer
            --tokenizer-model "$TOKENIZER_MODEL"
            --make-vocab-size-divisible-by "$VOCAB_DIVISOR"
            --vocab-size "$VOCAB_SIZE"
        )
    else
        data_args=(
            --mock-data
            --tokenizer-type NullTokenizer
            --make-vocab-size-divisible-by "$VOCAB_DIVISOR"
            --vocab-size "$VOCAB_SIZE"
        )
    fi

    local checkpoint_args=()
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        checkpoint_args+=(--load "$CHECKPOINT_DIR" --ckpt-format torch_dist --auto-detect-ckpt-format)
        if [[ "${SAVE_CHECKPOINTS:-1}" != 0 ]]; then
            checkpoint_args+=(--save "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-500}")
        fi
    fi

    local logging_args=(
        --log-interval 1
        --log-throughput
        --eval-interval 1000
        --eval-iters 0
    )
    # wandb only when asked for: unset WANDB_PROJECT or WANDB_MODE=disabled start no wandb run.
    if [[ -n "${WANDB_PROJECT:-}" && "${WANDB_MODE:-}" != disabled ]]; then
        logging_args+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-$RECIPE_NAME}")
        [[ -n "${WANDB_SAVE_DIR:-}" ]] && logging_args+=(--wandb-save-dir "$WANDB_SAVE_DIR")
    fi
    [[ -n "${TENSORBOARD_DIR:-}" ]] && logging_args+=(--tensorboard-dir "$TENSORBOARD_DIR")
    [[ -n "${METRICS_JSONL:-}" ]] && logging_args+=(--metrics-jsonl "$METRICS_JSONL")

    local balancer_args=(--moe-balancer "${MOE_BALANCER:-ultraep}")

    local precision_args
    ultraep_precision_args "${PRECISION:-bf16}"
    local cuda_graph_args
    ultraep_cuda_graph_args "${CUDA_GRAPH_MODULES:-${DEFAULT_CUDA_GRAPH_MODULES:-none}}" \
        "${DISPATCHER:-${DEFAULT_DISPATCHER:-alltoall}}"
    local dispatcher_args
    ultraep_dispatcher_args "${DISPATCHER:-${DEFAULT_DISPATCHER:-alltoall}}"

    exec "$python" -m ultraep_megatron.megatron.run.torchrun "${distributed_args[@]}" "$script" \
        "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${system_args[@]}" \
        "${precision_args[@]}" "${cuda_graph_args[@]}" "${dispatcher_args[@]}" \
        "${data_args[@]}" "${checkpoint_args[@]}" "${logging_args[@]}" "${balancer_args[@]}" "$@"
}

# NNODES -> master_addr (the caller's variable): MASTER_ADDR; one node: localhost; several nodes
# without it: node 0 of Slurm's SLURM_JOB_NODELIST (scontrol show hostnames), else one line naming
# MASTER_ADDR, exit status 2. Every node must name the same host: localhost on four nodes is four
# rendezvous that never meet, a hang rather than an error.
ultraep_master_addr() {
    master_addr=${MASTER_ADDR:-}
    [[ -n "$master_addr" ]] && return
    if (( 10#$1 == 1 )); then
        master_addr=localhost
        return
    fi
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        master_addr=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1 || true)
        [[ -n "$master_addr" ]] && return
    fi
    ultraep_env_error "MASTER_ADDR is not set and NNODES=$1: set it to node 0's address, the same" \
        "on every node (under Slurm: export MASTER_ADDR=\$(scontrol show hostnames" \
        "\"\$SLURM_JOB_NODELIST\" | head -n1); see recipes/slurm_qwen3_30b_a3b_hgx.sbatch)"
}

# PRECISION -> precision_args (the caller's array): Megatron-Bridge's presets (training/
# mixed_precision.py), as its perf scripts apply them (utils/precision.py: fp8_cs without the bf16
# first and last layers).
ultraep_precision_args() {
    [[ "$1" != nvfp4 ]] || ultraep_env_error "PRECISION=nvfp4: --moe-balancer ultraep refuses fp4" \
        "(docs/integration.md); use bf16 or an fp8 preset"
    local supported=" ${PRECISIONS:-bf16} "
    [[ "$supported" == *" $1 "* ]] || ultraep_env_error "PRECISION=$1: expected one of${supported% }" \
        "(what this recipe's GPU runs)"
    case "$1" in
        bf16) precision_args=() ;;
        # bf16_with_fp8_current_scaling_mixed: hybrid, tensorwise, fp8 parameters gathered
        fp8_cs) precision_args=(--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather) ;;
        # bf16_with_fp8_subchannel_scaling_mixed: hybrid, blockwise (128x128 weights, 1x128
        # activations), bf16 parameters
        fp8_sc) precision_args=(--fp8-format hybrid --fp8-recipe blockwise) ;;
        # bf16_with_mxfp8_mixed: e4m3, mxfp8, fp8 parameters gathered through the gradient
        # buffer (reuse_grad_buf_for_mxfp8_param_ag; without it megatron cannot map MXFP8
        # parameters into its parameter buffer)
        fp8_mx) precision_args=(--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather
                                --reuse-grad-buf-for-mxfp8-param-ag) ;;
        *) ultraep_env_error "PRECISION=$1: no such preset (bf16, fp8_cs, fp8_sc, fp8_mx)" ;;
    esac
}

# CUDA_GRAPH_MODULES DISPATCHER -> cuda_graph_args: per-layer graphs only of modules that end
# before the balanced part of a MoE layer (moe and full_iteration capture the transfers the plan
# sizes); moe_preprocess with the alltoall dispatcher only, where the balanced layer plans on the
# device (its default under that graph: no host read to capture), as pretrain_gpt.py and
# ultraep check-recipe decide (balanced_layer/capabilities.py); refused with the flex dispatcher.
ultraep_cuda_graph_args() {
    cuda_graph_args=()
    [[ "$1" == none ]] && return
    local module why
    for module in $1; do
        case "$module" in
            attn|moe_router|mlp|mamba) continue ;;
            moe_preprocess)
                [[ "$2" == alltoall ]] && continue
                why="with DISPATCHER=$2 (the flex dispatcher) its preprocessing has not been checked under capture yet; use DISPATCHER=alltoall, or leave moe_preprocess out" ;;
            moe) why="its graph would capture the balanced MoE layer's transfers, whose sizes the plan sets, which a replayed graph cannot redo" ;;
            full_iteration) why="its graph would capture the whole iteration, the balanced layers' transfers included" ;;
            *) why="not one of megatron's per-layer CUDA-graph modules" ;;
        esac
        ultraep_env_error "CUDA_GRAPH_MODULES=$1: $module is refused: $why; use modules within attn moe_router mlp mamba (moe_preprocess with DISPATCHER=alltoall), or none"
    done
    cuda_graph_args=(--cuda-graph-impl transformer_engine --cuda-graph-modules $1)
}

# DISPATCHER -> dispatcher_args: the recipe's alltoall dispatcher, or the flex one with a backend.
ultraep_dispatcher_args() {
    case "$1" in
        alltoall) dispatcher_args=() ;;
        hybridep|deepep)
            dispatcher_args=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "$1") ;;
        *) ultraep_env_error "DISPATCHER=$1: expected alltoall, hybridep or deepep" ;;
    esac
}
