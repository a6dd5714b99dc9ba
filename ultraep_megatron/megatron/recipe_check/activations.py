"""Step 4b of the recipe checker: activation memory per rank and pipeline stage.

An estimate of what autograd keeps for the backward, counted tensor by tensor from the recipe's
arguments (no Megatron import). For one microbatch of one layer on one rank, with ``T`` = sequence
x micro-batch / CP tokens, ``t`` = TP, ``T/t`` where sequence parallelism shards a tensor over
TP (``T`` without it), bf16 elements (2 bytes) unless said:

attention block, per token
    * the layer's input (the input norm's input): ``h`` sequence-sharded;
    * the input norm's output (the QKV projection's input): ``h`` sequence-sharded (dropped by
      ``--recompute-modules layernorm``);
    * Q, K and V as the fused attention saves them: ``(query + 2 x key/value width) / t``; with
      multi-latent attention Q, K (each ``heads x (qk + rope head dim)``) and V (``heads x v head
      dim``) / t, dropped by ``mla_up_proj``, plus the latent down-projections and their norms
      (``2 x (q LoRA + kv LoRA rank) + rope head dim``, not TP-sharded);
    * the attention output (the output projection's input): ``heads x value head dim / t``;
      flash attention keeps no score matrix (its softmax statistics are not counted);
    * a dropout mask (1 byte) of ``h`` sequence-sharded after the block when ``--hidden-dropout`` > 0;

MLP / MoE block, per token
    * the pre-MLP norm's input and output: ``2 h`` sequence-sharded (the output dropped by
      ``layernorm``), and the dropout mask as above;
    * dense MLP: fc1 output (``2 x FFN`` gated) and activation output, ``/ t`` (dropped by ``mlp``);
    * MoE router: logits and scores, ``2 x experts`` in ``--moe-router-dtype`` (fp32: 4 bytes);
    * routed experts: ``top-k`` rows per token reach the experts, spread evenly over the EP ranks
      (what balancing aims at; an unbalanced layer's hottest rank holds more): each row keeps the
      dispatched input ``h`` (``latent`` with ``--moe-latent-size``), fc1's output (``2 x expert
      FFN`` gated), the activation output (``expert FFN``; dropped by ``moe_act``) and its router
      probability (fp32: megatron weighs the activation by it, so the combine keeps nothing);
      expert TP gathers rows and shards widths alike;
    * shared expert: fc1 output and activation output ``/ t`` (dropped by ``shared_experts``);
    * latent MoE (``--moe-latent-size``): the back-projection's input, ``latent`` sequence-sharded
      (the down-projection's input is the pre-MLP norm's output, counted above);
    * ``--recompute-modules moe`` keeps of the MoE layer only its input.

Full recompute (``--recompute-granularity full``) keeps only each checkpointed chunk's input:
``uniform`` with N layers per chunk keeps one input per chunk and rematerializes one chunk (N
layers) at a time in the backward; ``block`` recomputes the first N layers of each (virtual)
stage one by one and keeps the others whole.

Per stage: one microbatch's layers times the microbatches in flight (1F1B: ``PP - stage``;
interleaved: Megatron's warm-up ``2 (PP - stage - 1) + (VPP - 1) PP`` plus one model chunk; never
more than the microbatches of the iteration; megatron's overlapped 1F1B schedule,
``--overlap-moe-expert-parallel-comm``, runs one microbatch's forward before another's backward
ends: one more, two without a pipeline), plus, on the last stage, one microbatch's logits
(``T x vocabulary / t``: the bf16 logits and the cross entropy's fp32 copy, 6 bytes, and 4 bytes
for each MTP depth's). Not counted: CUDA context, NCCL and all-to-all buffers, allocator
fragmentation (:data:`RUNTIME_RESERVE_GIB`, a fixed allowance) and transient workspaces.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ultraep_megatron.megatron.recipe_check.model import (
    built_mtp_layers,
    moe_latent_size,
    moe_layer_pattern,
)

BF16 = 2
#: GiB per GPU not modeled (CUDA context, NCCL and communication buffers, allocator
#: fragmentation): added to every rank's estimate as a fixed allowance.
RUNTIME_RESERVE_GIB = 4.0


@dataclass
class StageActivations:
    """Activation bytes of one rank of a pipeline stage."""

    stage: int
    per_microbatch: int  # all layers of the stage, one microbatch
    in_flight: float  # microbatches whose activations are alive at once (in units of a whole
    # stage's layers: an interleaved chunk counts 1/VPP)
    recompute_working: int  # one recompute chunk rematerialized in the backward
    logits: int  # last stage: one microbatch's logits (+ MTP)

    @property
    def total(self) -> int:
        return int(self.per_microbatch * self.in_flight) + self.recompute_working + self.logits


def _tokens(args: argparse.Namespace) -> tuple[float, float]:
    """(tokens per rank of one microbatch, the same sequence-sharded where SP shards it)."""
    tokens = args.seq_length * args.micro_batch_size / args.context_parallel_size
    sp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return tokens, tokens / sp


def layer_activation_bytes(args: argparse.Namespace, is_moe: bool) -> int:
    """Bytes one decoder layer keeps for one microbatch without full recompute (module docstring)."""
    tokens, seq_tokens = _tokens(args)
    t = args.tensor_model_parallel_size
    h = args.hidden_size
    modules = (
        set(args.recompute_modules or []) if args.recompute_granularity == "selective" else set()
    )
    mask = 1 if args.hidden_dropout > 0 else 0

    # Attention block.
    seq = BF16 * h * (1 if "layernorm" in modules else 2) + mask * h  # input, norm output, mask
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        qkv = heads * (2 * qk + args.v_head_dim)
        latent = 2 * ((args.q_lora_rank or 0) + args.kv_lora_rank) + args.qk_pos_emb_head_dim
        values = heads * args.v_head_dim
        attention = BF16 * ((0 if "mla_up_proj" in modules else qkv) + values) / t + BF16 * latent
    else:
        kv_channels = args.kv_channels or h // args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        query = args.num_attention_heads * kv_channels
        attention = BF16 * (query + 2 * groups * kv_channels + query) / t
    per_token = seq * seq_tokens + attention * tokens

    # MLP / MoE block.
    pre_mlp = BF16 * h * (1 if "layernorm" in modules else 2) + mask * h
    gate = 2 if args.swiglu else 1
    if not is_moe:
        mlp = 0 if "mlp" in modules else BF16 * (gate + 1) * args.ffn_hidden_size / t * tokens
        return int(per_token + pre_mlp * seq_tokens + mlp)
    if "moe" in modules:
        return int(per_token + BF16 * h * seq_tokens + mask * h * seq_tokens)
    router_bytes = (
        4 if args.moe_router_dtype == "fp32" else (8 if args.moe_router_dtype == "fp64" else BF16)
    )
    router = router_bytes * 2 * args.num_experts
    ffn = args.moe_ffn_hidden_size
    act = 0 if "moe_act" in modules else ffn
    latent = moe_latent_size(args)
    routed = args.moe_router_topk * (BF16 * ((latent or h) + gate * ffn + act) + 4)
    back_projection = BF16 * latent if latent else 0  # fc2_latent_proj's input
    shared = 0
    if args.moe_shared_expert_intermediate_size and "shared_experts" not in modules:
        shared = BF16 * (gate + 1) * args.moe_shared_expert_intermediate_size / t * tokens
    # Routed rows: the rank's sequence-sharded tokens' top-k copies (an EP rank receives, on
    # average, as many rows as its tokens send).
    return int(per_token + (pre_mlp + router + routed + back_projection) * seq_tokens + shared)


def layer_input_bytes(args: argparse.Namespace) -> int:
    """A full-recompute checkpoint's input: the hidden states, sequence-sharded."""
    return int(BF16 * args.hidden_size * _tokens(args)[1])


def in_flight_microbatches(args: argparse.Namespace, stage: int) -> float:
    """Microbatches whose activations a rank of ``stage`` holds at its peak, in whole stages."""
    pp = args.pipeline_model_parallel_size
    dp = args.data_parallel_size
    microbatches = max(1, args.global_batch_size // (args.micro_batch_size * dp))
    overlapped = int(bool(getattr(args, "overlap_moe_expert_parallel_comm", False)))
    if pp == 1:
        return float(min(1 + overlapped, microbatches))
    vpp = args.virtual_pipeline_model_parallel_size
    if not vpp:
        return float(min(pp - stage + overlapped, microbatches))
    chunks = min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1 + overlapped, microbatches * vpp)
    return chunks / vpp


def logits_bytes(args: argparse.Namespace) -> int:
    """One microbatch's logits on the last stage: bf16 logits + the cross entropy's fp32 copy, and
    the fp32 copy of each MTP depth's."""
    tokens = _tokens(args)[0]
    vocab = args.padded_vocab_size / args.tensor_model_parallel_size
    return int(tokens * vocab * (BF16 + 4 + 4 * (args.mtp_num_layers or 0)))


def estimate_activations(
    args: argparse.Namespace, stages: list[list[int]]
) -> list[StageActivations]:
    """Activation bytes per rank of each pipeline stage (``stages``: 1-based decoder layers per
    stage, from :func:`.memory.stage_layers`)."""
    pattern = moe_layer_pattern(args)
    full = {is_moe: layer_activation_bytes(args, is_moe) for is_moe in {False, *pattern}}
    checkpoint = layer_input_bytes(args)
    recompute = args.recompute_granularity == "full"
    method, chunk = args.recompute_method, args.recompute_num_layers or 1
    vpp = args.virtual_pipeline_model_parallel_size or 1
    out = []
    for stage, layers in enumerate(stages):
        kinds = [pattern[l - 1] for l in layers]
        if stage == len(stages) - 1:  # MTP layers: built like the last decoder layer
            kinds += [pattern[-1]] * built_mtp_layers(args)
        sizes = [full[k] for k in kinds]
        working = 0
        if not recompute:
            per_mb = sum(sizes)
        elif method == "block":
            per_chunk = math.ceil(len(sizes) / vpp)
            per_mb, working = 0, max(sizes, default=0)
            for start in range(0, len(sizes), per_chunk):
                part = sizes[start : start + per_chunk]
                n = min(chunk, len(part))
                per_mb += n * checkpoint + sum(part[n:])
        else:  # uniform: one checkpoint input per chunk of `chunk` layers
            per_mb = math.ceil(len(sizes) / chunk) * checkpoint
            working = max(
                (sum(sizes[i : i + chunk]) for i in range(0, len(sizes), chunk)), default=0
            )
        logits = logits_bytes(args) if stage == len(stages) - 1 else 0
        out.append(
            StageActivations(
                stage=stage,
                per_microbatch=per_mb,
                in_flight=in_flight_microbatches(args, stage),
                recompute_working=working,
                logits=logits,
            )
        )
    return out
