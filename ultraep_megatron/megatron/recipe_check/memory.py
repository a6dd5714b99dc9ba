"""Step 4 of the recipe checker: memory per rank and pipeline stage.

bf16 weights (under fp8 the linear layers' weights as Transformer Engine keeps them for training:
see :data:`FP8_WEIGHT_BYTES`), fp32 main gradients, the distributed optimizer's fp32 master weights
and Adam moments (sharded over data parallelism, expert parameters over expert data parallelism;
unchanged by fp8), and UltraEP's
redundant expert slots with cross-layer buffer reuse (one weight + fp32 gradient buffer per
redundant slot for all MoE layers, no optimizer state; paper §4.1) against the same slots without
reuse (one set per MoE layer). Activations (:mod:`.activations`: recomputation, sequence and
pipeline schedule) and a fixed runtime allowance are added per stage; the sum is the rank's peak,
which the report holds against the GPU's memory.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass, field

from ultraep_megatron.megatron.recipe_check.activations import (
    RUNTIME_RESERVE_GIB,
    StageActivations,
    estimate_activations,
)
from ultraep_megatron.megatron.recipe_check.launch import RecipeError
from ultraep_megatron.megatron.recipe_check.model import (
    built_mtp_layers,
    layer_params,
    linear_weight_params,
    moe_layer_pattern,
    norm_params,
)
from ultraep_megatron.planner.baselines import registry


def stage_layers(args: argparse.Namespace) -> list[list[int]]:
    """1-based global decoder layers of every pipeline stage (all virtual stages together),
    from megatron-core's own ``get_num_layers_to_build`` / ``get_transformer_layer_offset``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if args.pipeline_model_parallel_layout is not None:
        return layout_stage_layers(args)
    # The fields these two functions read, from the validated arguments (a TransformerConfig
    # would refuse the GPU-only fusions of a GPU recipe on this machine).
    config = types.SimpleNamespace(
        num_layers=args.num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=None,
    )
    vp_stages = [None]
    if config.virtual_pipeline_model_parallel_size:
        vp_stages = list(range(config.virtual_pipeline_model_parallel_size))
    stages = []
    for pp_rank in range(args.pipeline_model_parallel_size):
        layers = []
        for vp in vp_stages:
            count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank)
            layers += list(range(offset + 1, offset + count + 1))
        stages.append(layers)
    built = sorted(layer for stage in stages for layer in stage)
    if built != list(range(1, args.num_layers + 1)):
        raise RecipeError(f"pipeline stages build layers {built}, not 1..{args.num_layers}")
    return stages


def layout_stage_layers(args: argparse.Namespace) -> list[list[int]]:
    """:func:`stage_layers` of a ``--pipeline-model-parallel-layout`` (a string such as
    ``Et|(tt|)*30mL``, a list of lists, or megatron-core's ``PipelineParallelLayerLayout``): the
    decoder layers (``t``) of every stage's virtual stages, numbered in megatron-core's order
    (virtual stage by virtual stage, pipeline rank by rank)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    layout = args.pipeline_model_parallel_layout
    pp = args.pipeline_model_parallel_size
    if not isinstance(layout, PipelineParallelLayerLayout):
        try:
            layout = PipelineParallelLayerLayout(layout, pp)
        except AssertionError as error:
            raise RecipeError(f"--pipeline-model-parallel-layout {layout}: {error}") from None
    stages: list[list[int]] = [[] for _ in range(pp)]
    built = 0
    for vp in range(layout.virtual_pipeline_model_parallel_size):
        for pp_rank in range(pp):
            count = layout.layout[pp_rank][vp].count(LayerType.decoder)
            stages[pp_rank] += range(built + 1, built + count + 1)
            built += count
    if built != args.num_layers:
        raise RecipeError(
            f"--pipeline-model-parallel-layout {layout} places {built} decoder layers, not "
            f"{args.num_layers}"
        )
    return stages


@dataclass
class StageMemory:
    """Bytes per rank of one pipeline stage (all ranks of a stage hold the same shares)."""

    stage: int
    layers: list[int]
    moe_layers: int  # MoE layers on the rank (decoder + MTP)
    dense_params: int  # this rank's share of non-expert parameters
    expert_params: int  # this rank's share of routed-expert parameters
    model_states: int  # weights + main grads + optimizer states
    slot_weight_bytes: int  # one redundant slot's weight buffer
    slot_grad_bytes: int  # one redundant slot's fp32 gradient buffer
    num_slots: int
    activations: int = 0  # activations at the stage's peak (.activations)
    runtime_reserve: int = int(RUNTIME_RESERVE_GIB * 1024**3)

    @property
    def slots_with_reuse(self) -> int:
        """Replica slots shared by all MoE layers of the rank (§4.1)."""
        return self.num_slots * (self.slot_weight_bytes + self.slot_grad_bytes)

    @property
    def slots_without_reuse(self) -> int:
        """The same slots, one set per MoE layer."""
        return self.slots_with_reuse * self.moe_layers

    @property
    def total(self) -> int:
        """Model states and replica slots (what does not depend on the batch)."""
        return self.model_states + self.slots_with_reuse

    @property
    def peak(self) -> int:
        """The rank's estimated peak: model states, slots, activations, runtime allowance."""
        return self.total + self.activations + self.runtime_reserve


@dataclass
class MemoryEstimate:
    total_params: int
    active_params: int
    stages: list[StageMemory] = field(default_factory=list)
    activations: list[StageActivations] = field(default_factory=list)  # the detail, per stage


def _bytes_per_param(args) -> tuple[int, int, int]:
    """(weight, main gradient, optimizer state) bytes per parameter, as Megatron allocates
    them: bf16/fp16 weights, fp32 main grads (``--accumulate-allreduce-grads-in-fp32``, the
    bf16 default) and Adam's fp32 master copy + two moments (the master copy only with bf16/fp16)."""
    half = args.bf16 or args.fp16
    weight = 2 if half else 4
    grad = 4 if (not half or args.accumulate_allreduce_grads_in_fp32) else 2
    optimizer = (4 if half else 0) + (8 if args.optimizer == "adam" else 4)
    return weight, grad, optimizer


#: Bytes of one linear weight element Transformer Engine keeps in fp8 for training: the row-wise
#: copy the forward reads and the column-wise (``blockwise``, ``mxfp8``) or transposed
#: (``tensorwise`` on Hopper) copy the backward's input gradient reads, one byte each. With
#: ``--fp8-param-gather`` these are the parameter (the distributed optimizer gathers the row-wise
#: bytes; the redundant slots hold both copies, as their main experts); with fp8 GEMMs on
#: high-precision parameters TE keeps them as a cast cached across microbatches, on top of the
#: parameter (the replica experts cache nothing). Scales (under 4 % for ``mxfp8``'s 1 x 32 blocks,
#: less for the others) are not counted; Blackwell's ``tensorwise`` needs no transposed copy, so
#: this is an upper bound there.
FP8_WEIGHT_BYTES = 2


def estimate_memory(args: argparse.Namespace) -> MemoryEstimate:
    """Parameters of the model and the model-state memory of one rank per pipeline stage.

    A stage's rank holds: its decoder layers (non-expert parts / TP; routed experts / (EP x
    ETP)); the word embedding on the first stage, the final norm and untied output layer on the
    last; MTP layers (and, with PP > 1, a copy of the word embedding) on the last stage.
    """
    h = args.hidden_size
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    ep, pp = args.expert_model_parallel_size, args.pipeline_model_parallel_size
    pattern = moe_layer_pattern(args)
    per_layer = {is_moe: layer_params(args, is_moe) for is_moe in {False, *pattern}}
    embedding = args.padded_vocab_size * h
    output = embedding if args.untie_embeddings_and_output_weights else 0
    final_norm = norm_params(args) * h
    mtp_layers = built_mtp_layers(args)
    mtp_is_moe = pattern[-1]
    mtp_extra = (
        2 * norm_params(args) * h + 2 * h * h + norm_params(args) * h
    )  # enorm, hnorm, eh_proj, norm

    def main_model_params(active: bool) -> int:
        # Published totals leave MTP out (DeepSeek-V3's 671B), and so does this count.
        count = embedding + output + final_norm
        for is_moe in pattern:
            p = per_layer[is_moe]
            experts = p.expert_numel * args.moe_router_topk if (active and is_moe) else p.experts
            count += p.attention + p.mlp + experts
        return count

    estimate = MemoryEstimate(
        total_params=main_model_params(False), active_params=main_model_params(True)
    )
    weight_b, grad_b, optim_b = _bytes_per_param(args)
    # Under fp8 a linear layer's weight weighs FP8_WEIGHT_BYTES instead of weight_b (fp8
    # parameters) or on top of it (TE's cached cast of high-precision ones); main gradients and the
    # fp32 master shards stay as they are. A negative saving is a cost.
    fp8_params = bool(getattr(args, "fp8", None)) and getattr(args, "fp8_param_gather", False)
    fp8_saving = (
        weight_b - FP8_WEIGHT_BYTES
        if fp8_params
        else -FP8_WEIGHT_BYTES
        if getattr(args, "fp8", None)
        else 0
    )
    slot_fp8_saving = fp8_saving if fp8_params else 0  # the replica experts cache no cast
    linear = {is_moe: linear_weight_params(args, is_moe) for is_moe in per_layer}
    dense_shard = args.data_parallel_size * args.context_parallel_size
    expert_shard = args.world_size // (etp * ep * pp)
    if not args.use_distributed_optimizer:
        dense_shard = expert_shard = 1
    num_slots = args.moe_balancer_num_slots if args.moe_balancer != registry.NONE else 0
    expert_numel = per_layer[True].expert_numel if True in per_layer else 0
    stages = stage_layers(args)
    activations = estimate_activations(args, stages)
    estimate.activations = activations
    for stage, layers in enumerate(stages):
        dense = (
            sum(per_layer[pattern[l - 1]].attention + per_layer[pattern[l - 1]].mlp for l in layers)
            / tp
        )
        experts = sum(per_layer[pattern[l - 1]].experts for l in layers) / (ep * etp)
        quantized = sum(linear[pattern[l - 1]][0] for l in layers) / tp + sum(
            linear[True][1] * args.num_experts for l in layers if pattern[l - 1]
        ) / (ep * etp)
        moe_layers = sum(pattern[l - 1] for l in layers)
        if stage == 0:
            dense += embedding / tp
        if stage == pp - 1:
            dense += (output + final_norm) / tp
            if mtp_layers:
                p = per_layer[mtp_is_moe]
                dense += mtp_layers * (p.attention + p.mlp + mtp_extra) / tp
                experts += mtp_layers * p.experts / (ep * etp)
                quantized += (
                    mtp_layers * linear[mtp_is_moe][0] / tp
                )  # eh_proj counted high precision
                if mtp_is_moe:
                    quantized += mtp_layers * linear[True][1] * args.num_experts / (ep * etp)
                moe_layers += mtp_layers * mtp_is_moe
                if pp > 1:
                    dense += embedding / tp  # MTP embeds the shifted tokens itself
            if pp > 1 and not args.untie_embeddings_and_output_weights:
                dense += embedding / tp
        model_states = (
            dense * (weight_b + grad_b + optim_b / dense_shard)
            + experts * (weight_b + grad_b + optim_b / expert_shard)
            - quantized * fp8_saving
        )
        # A redundant slot holds what its main expert holds: fp8 weights where those are.
        expert_linear = linear[True][1] if True in linear else 0
        estimate.stages.append(
            StageMemory(
                stage=stage,
                layers=layers,
                moe_layers=int(moe_layers),
                dense_params=int(dense),
                expert_params=int(experts),
                model_states=int(model_states),
                slot_weight_bytes=(expert_numel * weight_b - expert_linear * slot_fp8_saving)
                // etp,
                slot_grad_bytes=expert_numel // etp * 4,
                num_slots=num_slots,
                activations=activations[stage].total,
            )
        )
    return estimate
