"""One rank of Megatron-Bridge's own ``pretrain()`` on a tiny MoE GPT, on the CPU over gloo.

Run under the rank launchers of tests/ (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
``python bridge_pretrain.py OUT_DIR [--ep N] [--iters N] [--overlap]``. Writes ``OUT_DIR/losses_rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--ultraep", action="store_true", help="enable_ultraep(cfg, num_slots=2)")
    parser.add_argument(
        "--overlap", action="store_true", help="overlapped grad reduce, param gather"
    )
    args = parser.parse_args()

    from ultraep_megatron.megatron.cpu import backend

    backend.activate()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig

    seq, vocab = 32, 128
    model = GPTModelProvider(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        seq_length=seq,
        vocab_size=vocab,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=args.ep,
        bf16=False,
        params_dtype=__import__("torch").float32,
        transformer_layer_spec=lambda config, vp_stage=None: get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False
        ),
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        make_vocab_size_divisible_by=128,
        add_bias_linear=False,
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(
            micro_batch_size=2, global_batch_size=2 * world, train_iters=args.iters
        ),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-3,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=True,
        ),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=args.overlap,
            overlap_param_gather=args.overlap,
            bucket_size=4096 if args.overlap else None,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=seq,
            random_seed=1234,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            num_workers=0,
            dataloader_type="single",
        ),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab - 1),
        checkpoint=CheckpointConfig(save=None),
        dist=DistributedInitConfig(distributed_backend="gloo", use_gloo_process_groups=True),
        rng=RNGConfig(seed=1234),
    )
    losses, ended, moe_layers = [], [], []

    class Record(Callback):
        def on_train_start(self, context):
            for chunk in context.model:
                for name, module in chunk.named_modules():
                    if name.endswith(".mlp") and "experts" in dict(module.named_children()):
                        moe_layers.append(type(module).__name__)

        def on_train_step_end(self, context):
            losses.append({k: float(v) for k, v in (context.loss_dict or {}).items()})

    callbacks = [Record()]
    if args.ultraep:
        from ultraep_megatron.megatron.bridge.enable import enable_ultraep

        callbacks += enable_ultraep(cfg, num_slots=2)
        balancing = callbacks[-1].balancing
        end_iteration = balancing.end_iteration

        def counted_end(iteration):
            ended.append(iteration)
            return end_iteration(iteration)

        balancing.end_iteration = counted_end
    pretrain(cfg, forward_step, callbacks=callbacks)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    record = {"ended_iterations": ended, "moe_layers": moe_layers}
    (args.out / f"record_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
