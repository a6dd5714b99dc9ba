"""One rank of Megatron-Bridge's own ``pretrain()`` on a tiny MoE GPT, on the CPU over gloo.

Run under the rank launchers of tests/ (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
``python bridge_pretrain.py OUT_DIR [--ep N] [--iters N] [--overlap] ...`` (the options below).
Writes ``OUT_DIR/losses_rank{R}.json``, ``OUT_DIR/record_rank{R}.json`` and, with ``--lr0-iters``,
``OUT_DIR/rank{R}.pt``: ``{"grads": {iteration: {global name: (gradient, owned)}}}`` in the format
of tests/megatron/workers/pretrain_grad_dump.py (its ``megatron_records`` helpers), for the
iterations run at learning rate 0 (each computes gradients from the same parameters on a new batch).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path


def _local_spec(stages, config, vp_stage=None):
    """The provider's own layer spec (megatron-core's local spec); ``stages``: a list that records
    the ``vp_stage`` of each call (``None``: not recorded)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if stages is not None:
        stages.append(vp_stage)
    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)


def tiny_config(args, world: int, **model_overrides):
    """The tiny MoE GPT's ConfigContainer (CPU, gloo) for ``args`` (``ep``, ``iters``,
    ``microbatches``, ``overlap``, ``expert_bias``, optionally ``pp``, ``vpp`` and ``spec_stages``:
    the options of :func:`main`), ``world`` ranks; ``model_overrides``: provider fields. With
    pipeline parallelism the model has one decoder layer per (virtual) pipeline chunk."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
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
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    seq, vocab = 32, 128
    pp, vpp = getattr(args, "pp", 1), getattr(args, "vpp", None)
    own_spec = functools.partial(_local_spec, getattr(args, "spec_stages", None))
    model = GPTModelProvider(
        num_layers=max(2, pp * (vpp or 1)),  # one layer per pipeline chunk
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
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Over gloo, a batched isend/irecv matches messages between two ranks by posting order:
        # with PP 2 both neighbours are the same rank, and the interleaved schedule's combined
        # forward-and-backward exchange would hand an activation to a gradient's receive (same
        # shape, no error). Megatron's unbatched path orders them by rank parity.
        batch_p2p_comm=pp != 2,
        bf16=False,
        params_dtype=torch.float32,
        transformer_layer_spec=own_spec,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        make_vocab_size_divisible_by=128,
        add_bias_linear=False,
        hidden_dropout=0.0,  # the microbatch order must not change which tokens are dropped
        attention_dropout=0.0,
        **(
            {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
            if args.expert_bias
            else {}
        ),
    )
    for name, value in model_overrides.items():  # as Bridge recipes set them
        setattr(model, name, value)
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(
            micro_batch_size=2,
            global_batch_size=2 * (world // pp) * args.microbatches,  # per data-parallel rank
            train_iters=args.iters,
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
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--vpp", type=int, help="virtual_pipeline_model_parallel_size")
    parser.add_argument("--trace-dir", help="enable_ultraep(trace_dir=): the load trace")
    parser.add_argument("--ultraep", action="store_true", help="enable_ultraep(cfg, num_slots=2)")
    parser.add_argument(
        "--overlap", action="store_true", help="overlapped grad reduce, param gather"
    )
    parser.add_argument("--microbatches", type=int, default=1, help="per rank and iteration")
    parser.add_argument("--lr0-iters", type=int, default=0, help="iterations 1..K at lr 0, dumped")
    parser.add_argument(
        "--reverse-microbatches",
        action="store_true",
        help="each iteration's microbatches in reverse order (the noise-floor run)",
    )
    parser.add_argument(
        "--expert-bias", help="comma-separated router expert bias set before iteration 1 (skew)"
    )
    parser.add_argument("--fault", help="a fault of pretrain_grad_dump.FAULTS, the whole run")
    parser.add_argument(
        "--fake-writer",
        action="store_true",
        help="Bridge's tensorboard and wandb writers on the last rank are recording stand-ins",
    )
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron" / "workers"))
    import torch
    from megatron_records import global_parameter_names, reduced_gradients, set_expert_bias
    from pretrain_grad_dump import FAULTS

    from ultraep_megatron.megatron.cpu import backend

    backend.activate()
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from megatron.training import global_vars

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.spec_stages = []  # the vp_stage of each call of the provider's own layer spec
    cfg = tiny_config(args, world)
    if args.lr0_iters:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        scheduler_lr = OptimizerParamScheduler.get_lr
        lr0_samples = args.lr0_iters * cfg.train.global_batch_size

        def get_lr(self, param_group):
            # The lr of iteration i is set after iteration i - 1, at num_steps = (i - 1) * batch.
            return 0.0 if self.num_steps < lr0_samples else scheduler_lr(self, param_group)

        OptimizerParamScheduler.get_lr = get_lr
    losses, ended, moe_layers, stats, scalars = [], [], [], {}, []
    layer_numbers, training_args, wandb_logs = [], [], []  # per chunk; each step; each log
    dump, names = {"grads": {}}, {}
    rank = int(os.environ.get("RANK", "0"))

    class FakeWriter:
        """Bridge's tensorboard writer interface (``SummaryWriter.add_scalar``), recorded."""

        def add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
            scalars.append([tag, float(scalar_value), global_step])

        def __getattr__(self, name):  # the writer's other methods Bridge may call: no-ops
            return lambda *args, **kwargs: None

    class FakeWandb:
        """Bridge's wandb logger interface (the ``wandb`` module: ``log(data, step=None,
        commit=None)``, which Bridge calls as ``log(dict, iteration)``), recorded."""

        def log(self, data, step=None, commit=None):
            numbers = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
            wandb_logs.append([numbers, step])

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    class Record(Callback):
        def on_train_start(self, context):
            if args.expert_bias:
                set_expert_bias(context.model, [float(b) for b in args.expert_bias.split(",")])
            if args.fake_writer and rank == world - 1:
                context.state._tensorboard_logger = FakeWriter()
                context.state._wandb_logger = FakeWandb()
            for chunk in context.model:
                layer_numbers.append([])
                for name, module in chunk.named_modules():
                    if name.endswith(".mlp") and "experts" in dict(module.named_children()):
                        moe_layers.append(type(module).__name__)
                        layer_numbers[-1].append(module.layer_number)

        def on_train_step_end(self, context):
            training_args.append(global_vars._GLOBAL_ARGS is not None)
            losses.append({k: float(v) for k, v in (context.loss_dict or {}).items()})
            step = context.state.train_state.step + 1  # the iteration ending
            if step <= args.lr0_iters:
                if not names:
                    names.update(global_parameter_names(context.model))
                dump["grads"][step] = reduced_gradients(context.model, names)

    class Reversed:
        """A data iterator giving each iteration's microbatches in reverse order."""

        def __init__(self, iterator, n):
            self.iterator, self.n, self.buffer = iterator, n, []

        def __iter__(self):
            return self

        def __next__(self):
            if not self.buffer:
                self.buffer = [next(self.iterator) for _ in range(self.n)]
            return self.buffer.pop()

    reversed_iterators = {}

    def reversed_forward_step(state, data_iterator, model, return_schedule_plan=False):
        if data_iterator is not None:
            key = id(data_iterator)
            if key not in reversed_iterators:
                reversed_iterators[key] = Reversed(data_iterator, args.microbatches)
            data_iterator = reversed_iterators[key]
        return forward_step(state, data_iterator, model, return_schedule_plan)

    callbacks = [Record()]
    if args.ultraep:
        from ultraep_megatron.megatron.bridge.enable import enable_ultraep

        knobs = {"trace_dir": args.trace_dir} if args.trace_dir else {}
        callbacks += enable_ultraep(cfg, num_slots=2, **knobs)
        balancing = callbacks[-1].balancing
        end_iteration = balancing.end_iteration

        def counted_end(iteration):
            ended.append(iteration)
            return end_iteration(iteration)

        balancing.end_iteration = counted_end
        imbalance_log = callbacks[-1]

        class Stats(Callback):  # after the imbalance log: what it popped this step
            def on_train_step_end(self, context):
                stats[context.state.train_state.step + 1] = imbalance_log.last_stats

        callbacks.append(Stats())
    step_func = reversed_forward_step if args.reverse_microbatches else forward_step
    import contextlib

    with FAULTS[args.fault]() if args.fault else contextlib.nullcontext():
        pretrain(cfg, step_func, callbacks=callbacks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    if args.lr0_iters:
        torch.save(dump, args.out / f"rank{rank}.pt")
    record = {
        "ended_iterations": ended,
        "moe_layers": moe_layers,
        "moe_layer_numbers": layer_numbers,  # [chunk][MoE layer]: each layer's layer_number
        "spec_vp_stages": args.spec_stages,
        "megatron_training_args_set": training_args,
        "stats": {step: stats[step] for step in sorted(stats)},
        "scalars": scalars,
        "wandb": wandb_logs,
    }
    (args.out / f"record_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
