"""Pretrain a GPT (dense or MoE) with megatron-core's training loop (0.19 or 0.18), plus UltraEP.

megatron-core's wheel has no ``pretrain_gpt.py``; this is ours, on the training API
(``parse_and_validate_args`` -> the GPT model's config -> ``pretrain_cfg_container_from_args`` ->
``pretrain``; 0.19 builds the model from ``gpt_config_from_args``, 0.18 from a model provider:
``ultraep_megatron/megatron/release/compat.py`` says what differs). On top of Megatron's arguments it takes
the ``moe balancer`` and ``ultraep telemetry`` groups (see ``ultraep_megatron/megatron/run/arguments.py``).

Without a CUDA device the CPU backend (``ultraep_megatron.megatron.cpu``) runs the
same loop on CPU processes over gloo; the flags it needs (``cpu.flags.CPU_FLAGS``) are applied
when missing, with a log line, and refused when given otherwise. See recipes/tiny_cpu.sh.

    torchrun --nproc-per-node 4 pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer ...
"""

import logging
import os
import resource
import sys
import warnings
from functools import partial

# Megatron's import-time warnings (no TE/Apex, deprecations) would repeat on every rank; `--help`
# prints the arguments alone (no warnings, no CPU-backend banner).
HELP_ONLY = not {"-h", "--help"}.isdisjoint(sys.argv[1:])
if os.environ.get("RANK", "0") != "0" or HELP_ONLY:
    warnings.filterwarnings("ignore")
if HELP_ONLY:
    logging.disable(logging.WARNING)
# torch's note that it found CUDA_HOME but no CUDA runtime, once per rank: on a CPU run (the only
# place it appears) that is the point, and the CPU backend's own line says so.
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: "No CUDA runtime is found" not in str(record.msg)
)

import torch

from ultraep_megatron.megatron.cpu import backend as cpu_backend
from ultraep_megatron.megatron.cpu.megatron_patches import skip_dataset_helper_build

# Before any Megatron module is built; a no-op (with a log line) when CUDA is present.
cpu_backend.activate()
# The wheel's compile_helpers() runs `make` without a Makefile: skip it on any machine.
skip_dataset_helper_build()

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import (
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_tokenizer, print_rank_0
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from ultraep_megatron.megatron.release import compat
from ultraep_megatron.megatron.run import telemetry
from ultraep_megatron.megatron.run.arguments import add_ultraep_args, balancing_context_from_args
from ultraep_megatron.megatron.run.layer_spec import balance_moe_layers
from ultraep_megatron.megatron.run.startup import startup_checks_or_exit

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: tokens, labels, loss_mask [b, s], attention_mask [b, 1, s, s]
    or None, position_ids [b, s]; None entries on middle pipeline stages."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {
            key: (batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None)
            for key in BATCH_KEYS
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        False,  # no packed sequences (0.19 calls it has_cu_seqlens, 0.18 is_sft)
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=args.mtp_num_layers is not None,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return tuple(batch.get(key) for key in BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, token count, and the 'lm loss' report Megatron averages over the
    global batch. loss_mask, output_tensor: [b, s]."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine = get_rerun_state_machine()
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Forward one micro-batch; returns the per-token losses and the function reducing them.

    With ``--overlap-moe-expert-parallel-comm`` megatron's combined 1F1B schedule
    (``pipeline_parallel/combined_1f1b.py``) asks for the micro-batch's schedule plan instead
    (``return_schedule_plan=True``, ``model`` then the unwrapped GPT model): the model chunk cut into
    per-layer nodes (attention and pre-dispatch, dispatch, experts, combine) that megatron runs
    interleaved with another micro-batch's backward. Its loss goes through the same function."""
    # The model chunk may be wrapped (DDP, Float16Module): ask the innermost module.
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, vp_stage=get_attr_wrapped_model(model, "vp_stage")
    )
    if return_schedule_plan:
        schedule_plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return schedule_plan, partial(loss_func, loss_mask)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (or MockGPTDataset with --mock-data) of the given sizes."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation, and test datasets ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron's core datasets are built on every rank that needs them (no broadcast).
train_valid_test_datasets_provider.is_distributed = True


def report_peak_memory() -> None:
    """Print this rank's peak resident memory (Linux ru_maxrss is in KiB)."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"[rank {rank}] peak RSS {peak_mib:.0f} MiB", flush=True)


def main() -> None:
    # UltraEP's checks (and the CPU flags) first: one line on rank 0, before Megatron's
    # validation prints the arguments, wandb starts or the model is built.
    sys.argv[1:] = startup_checks_or_exit(sys.argv[1:])
    args = parse_and_validate_args(
        extra_args_provider=add_ultraep_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
    )
    model_cfg = compat.gpt_model_from_args(args)
    # The model's balancing context (None for --moe-balancer none), handed to its balanced MoE
    # layers through Megatron's default layer spec (decoder and MTP block).
    balancing = balancing_context_from_args(args)
    balance_moe_layers(model_cfg, balancing)
    telemetry.install(model_cfg, args, balancing)
    compat.pretrain(args, model_cfg, train_valid_test_datasets_provider, forward_step)
    if balancing is not None:
        balancing.close()
    report_peak_memory()


if __name__ == "__main__":
    main()
    sys.exit(0)
