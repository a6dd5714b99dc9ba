"""Per-layer expert-load imbalance, logged with Megatron's own training log.

Every training iteration, for every MoE layer: the tokens the router sends to each expert
(from its routing map, all micro-batches, all ranks) are summed on the last rank, turned into
the load of each expert-parallel rank (the tokens its local experts receive), and reported as
``max / mean`` over the EP ranks (1.0 = perfectly balanced). The figure goes to Megatron's
tensorboard and wandb writers (``moe/load_imbalance/layer_NN``) every iteration and to the
console every ``--log-interval``; ``--metrics-jsonl`` also records it, with the loss and grad
norm, one JSON line per iteration.

Wiring (``pretrain_gpt.py``)::

    telemetry.install(model_cfg, args)    # router hooks after model build + training_log hook

The integration adds "after balancing" figures through :meth:`ExpertLoadTracker.record`.

Megatron-core 0.19 writes the loss, learning rate and grad norm to wandb only inside its
tensorboard block, and the iteration time and throughput only with ``--log-timers-to-tensorboard``:
where it does not, this hook logs them under Megatron's own names (:func:`megatron_scalars`), so a
wandb-only run has them in the same run as the balancing figures.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import torch

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
from ultraep_megatron.megatron.balanced_layer.layer_ids import moe_layer_id
from ultraep_megatron.megatron.balanced_layer.observers import BalancerStats
from ultraep_megatron.planner import load_imbalance

#: Metric-name prefix in tensorboard / wandb.
METRIC_PREFIX = "moe/load_imbalance"


def per_rank_load(tokens_per_expert: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Tokens each expert-parallel rank receives, with experts laid out contiguously per rank.

    Args:
        tokens_per_expert: [L, E] tokens routed to each expert of L layers.
        ep_size: expert-parallel size; E must be a multiple of it.

    Returns:
        [L, ep_size] load per EP rank.
    """
    if tokens_per_expert.dim() != 2:
        raise ValueError(f"tokens_per_expert must be [L, E], got {tuple(tokens_per_expert.shape)}")
    num_layers, num_experts = tokens_per_expert.shape
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over {ep_size} EP ranks")
    return tokens_per_expert.reshape(num_layers, ep_size, num_experts // ep_size).sum(dim=-1)


class ExpertLoadTracker:
    """Tokens routed to each expert of each MoE layer during the current training iteration.

    Counts come from forward hooks on megatron's routers; only grad-enabled forwards count,
    as in megatron's own expert-bias bookkeeping: evaluation runs under no_grad, and with
    activation recomputation the first forward runs under no_grad and the recompute counts.

    Args:
        num_layers: layers of the model (global layer numbers are 1..num_layers).
        num_experts: experts per MoE layer.
        ep_size: expert-parallel size.
        count_this_rank: False on ranks whose tokens another rank already counts
            (tensor-parallel ranks > 0 without sequence parallelism).
    """

    def __init__(
        self, num_layers: int, num_experts: int, ep_size: int, count_this_rank: bool = True
    ):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need num_layers, num_experts >= 1, got {num_layers}, {num_experts}")
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {ep_size} EP ranks")
        self.num_layers, self.num_experts, self.ep_size = num_layers, num_experts, ep_size
        self.count_this_rank = count_this_rank
        # [L, E], on the routers' device once the first routing map arrives.
        self.tokens_per_expert: torch.Tensor | None = None
        self._hooks: list[Any] = []

    def attach(self, model_chunks: list[torch.nn.Module]) -> int:
        """Hook every megatron router in ``model_chunks``; returns how many were hooked."""
        from megatron.core.transformer.moe.router import Router

        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, Router):
                    self._hooks.append(module.register_forward_hook(self._on_routed))
        return len(self._hooks)

    def _on_routed(self, router, inputs, output) -> None:
        if not torch.is_grad_enabled():
            return
        _, routing_map = output
        if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            return  # dense [tokens, topk] indices: the inference-only router path
        self.record(moe_layer_id(router), routing_map.sum(dim=0))

    def record(self, layer_number: int, tokens_per_expert: torch.Tensor) -> None:
        """Add [E] routed-token counts of the 1-based ``layer_number`` (MTP layers after the
        decoder's, see ``layer_ids.moe_layer_id``)."""
        if self.tokens_per_expert is None:
            self.tokens_per_expert = torch.zeros(
                self.num_layers,
                self.num_experts,
                dtype=torch.float64,
                device=tokens_per_expert.device,
            )
        self.tokens_per_expert[layer_number - 1] += tokens_per_expert.to(torch.float64)

    def reduce_and_reset(self, dst_rank: int) -> torch.Tensor | None:
        """Sum the counts of all ranks on ``dst_rank`` (a collective: every rank calls it).

        Returns:
            [L, E] global token counts on ``dst_rank`` (rows of dense layers are zero), None
            on the other ranks.
        """
        device = (
            self.tokens_per_expert.device
            if self.tokens_per_expert is not None
            else _collective_device()
        )
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device)
        if self.tokens_per_expert is not None and self.count_this_rank:
            counts += self.tokens_per_expert
        torch.distributed.reduce(counts, dst=dst_rank)
        self.tokens_per_expert = None
        return counts if torch.distributed.get_rank() == dst_rank else None

    def imbalance_by_layer(self, counts: torch.Tensor) -> dict[int, float]:
        """{1-based layer number: max/mean per-EP-rank load} for the layers that routed tokens."""
        routed = counts.sum(dim=-1) > 0
        imbalance = load_imbalance(per_rank_load(counts, self.ep_size))
        return {
            layer + 1: float(imbalance[layer]) for layer in torch.nonzero(routed).flatten().tolist()
        }


#: Per-layer balancing figures the balanced MoE layers record.
BALANCER_METRICS = BalancerStats.RECORDED
#: Those logged as ``ultraep/<name>/layer_NN``: one name per quantity. The load before balancing is
#: the router's ``moe/load_imbalance/layer_NN`` (the balancer's own figure fills in only for a layer
#: the router hook did not count). The memory spread (max/mean of the rows each rank receives, i.e.
#: of its expert activations, paper Fig. 14) is the imbalance itself, before and after, since a rank
#: computes exactly the rows it receives: it stays in ``--metrics-jsonl`` and the replay reports,
#: not as two more charts of the same numbers.
LOGGED_BALANCER_METRICS = tuple(
    m
    for m in BALANCER_METRICS
    if m not in ("imbalance_before", "memory_spread_before", "memory_spread_after")
)


def megatron_owned_scalars(args, writer) -> frozenset[str]:
    """Which of Megatron's training figures Megatron itself writes in this run: the losses,
    ``learning-rate`` and ``grad-norm`` with a tensorboard writer (to it and to wandb),
    ``iteration-time`` with ``--log-timers-to-tensorboard``, ``throughput`` with that and
    ``--log-throughput``."""
    owned = {"losses", "learning-rate", "grad-norm"} if writer else set()
    if getattr(args, "log_timers_to_tensorboard", False):
        owned.add("iteration-time")
        if getattr(args, "log_throughput", False):
            owned.add("throughput")
    return frozenset(owned)


def megatron_scalars(
    loss_dict,
    learning_rate,
    grad_norm,
    iteration_time: float | None,
    flops: float | None,
    world_size: int,
    owned: frozenset[str],
) -> dict[str, float]:
    """Megatron's own training figures, under Megatron's names, except those Megatron writes
    itself (``owned``, see :func:`megatron_owned_scalars`).

    Args:
        loss_dict: the iteration's reduced losses (``lm loss``, ...), tensors or floats.
        learning_rate, grad_norm: as ``training_log`` receives them (``None`` when absent).
        iteration_time: seconds of the iteration (``None``: not measured; the run's first
            iteration holds the start-up, and Megatron leaves it out too).
        flops: model FLOPs of the iteration (Megatron's formula), for ``throughput`` in
            TFLOP/s/GPU as Megatron computes it.
    """
    out: dict[str, float] = {}
    if "losses" not in owned:
        out.update({key: float(value) for key, value in loss_dict.items()})
    if learning_rate is not None and "learning-rate" not in owned:
        out["learning-rate"] = float(learning_rate)
    if grad_norm is not None and "grad-norm" not in owned:
        out["grad-norm"] = float(grad_norm)
    if iteration_time is not None:
        if "iteration-time" not in owned:
            out["iteration-time"] = iteration_time
        if flops and "throughput" not in owned:
            out["throughput"] = flops / (iteration_time * 1e12 * world_size)
    return out


def keep_earlier_records(path: str, first_iteration: int) -> None:
    """Start a run's ``--metrics-jsonl``: keep the records of iterations before ``first_iteration``
    (a resumed run continues the file of the run it resumes), drop the others (a fresh run starting
    at iteration 1 starts an empty file; a resume from an earlier checkpoint replaces what followed
    it)."""
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return
    kept = [
        line for line in lines if line.strip() and json.loads(line)["iteration"] < first_iteration
    ]
    with open(path, "w") as handle:
        handle.write("".join(line + "\n" for line in kept))


def reduce_balancer_stats(
    balancing: BalancingContext, num_layers: int, dst_rank: int
) -> dict[int, dict[str, float]] | None:
    """This iteration's per-layer balancing figures of every rank, averaged on ``dst_rank``
    (:func:`reduce_layer_stats` of what ``balancing`` recorded since the last call)."""
    return reduce_layer_stats(balancing.pop_stats(), num_layers, dst_rank)


def reduce_layer_stats(
    stats: dict[int, dict[str, float]], num_layers: int, dst_rank: int
) -> dict[int, dict[str, float]] | None:
    """Every rank's per-layer balancing figures (``BalancerStats.pop``), averaged on ``dst_rank``.

    A collective over the default group (every rank calls it). Each rank holds the figures of its
    own MoE layers (pipeline stages differ; EP peers agree; data-parallel replicas are averaged).

    Returns:
        {1-based layer: {metric: value}} on ``dst_rank``, None elsewhere.
    """
    table = torch.zeros(
        num_layers, len(BALANCER_METRICS) + 1, dtype=torch.float64, device=_collective_device()
    )
    for layer, values in stats.items():
        table[layer - 1, :-1] = torch.tensor(
            [values[m] for m in BALANCER_METRICS], dtype=torch.float64
        )
        table[layer - 1, -1] = 1.0
    torch.distributed.reduce(table, dst=dst_rank)
    if torch.distributed.get_rank() != dst_rank:
        return None
    out = {}
    for layer in torch.nonzero(table[:, -1] > 0).flatten().tolist():
        row = (table[layer, :-1] / table[layer, -1]).tolist()
        out[layer + 1] = dict(zip(BALANCER_METRICS, row))
    return out


def _format_balancer_console(iteration: int, stats: dict[int, dict[str, float]]) -> str:
    layers = " | ".join(
        f"layer {layer}: {v['imbalance_before']:.3f} -> {v['imbalance_after']:.3f} "
        f"({v['replicas']:.1f} replicas, plan {v['plan_ms']:.2f} ms)"
        for layer, v in stats.items()
    )
    return f" [iteration {iteration}] balanced rank imbalance (before -> after) | {layers}"


def _collective_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def _format_console(iteration: int, imbalance: dict[int, float]) -> str:
    layers = " | ".join(f"layer {layer}: {value:.3f}" for layer, value in imbalance.items())
    return (
        f" [iteration {iteration}] expert-load imbalance (max/mean tokens per EP rank) | {layers}"
    )


class _TrainingLogHook:
    """Wraps megatron.training.training.training_log (``pretrain_gpt.py``'s entry alone): after
    Megatron's own log line, reduce the iteration's expert counts, write them to Megatron's writers,
    and append the JSONL record. Megatron's writers are read where its ``training_log`` is called
    (:meth:`__call__`); :meth:`after_iteration` gets them, the arguments and the iteration from its
    caller, and reads none of megatron.training's globals."""

    def __init__(
        self,
        original,
        tracker: ExpertLoadTracker | None,
        metrics_path: str | None,
        balancing=None,
        args=None,
    ):
        self.original, self.tracker, self.metrics_path = original, tracker, metrics_path
        self.balancing = balancing
        self.args = args  # Megatron's parsed arguments (install's)
        self.dashboard = None  # dashboards.Dashboard, set by install()
        self._last_time = time.perf_counter()
        self._first_logged: int | None = None  # the run's first iteration (it holds the start-up)

    def __call__(
        self,
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        *args,
        **kwargs,
    ):
        result = self.original(
            loss_dict,
            total_loss_dict,
            learning_rate,
            iteration,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            *args,
            **kwargs,
        )
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        self.after_iteration(
            iteration,
            loss_dict,
            grad_norm,
            skipped_iter,
            learning_rate,
            writer=get_tensorboard_writer(),
            wandb_writer=get_wandb_writer(),
        )
        return result

    def after_iteration(
        self,
        iteration,
        loss_dict,
        grad_norm,
        skipped_iter,
        learning_rate=None,
        *,
        writer=None,
        wandb_writer=None,
    ) -> None:
        """The iteration's telemetry; ``writer``, ``wandb_writer``: the tensorboard and wandb
        writers (on the last rank; ``None``: none)."""
        now = time.perf_counter()
        iteration_time, self._last_time = now - self._last_time, now
        first = self._first_logged is None
        if first:
            self._first_logged = int(iteration)
        last_rank = torch.distributed.get_world_size() - 1
        imbalance: dict[int, float] = {}
        if self.tracker is not None:
            counts = self.tracker.reduce_and_reset(dst_rank=last_rank)
            if counts is not None:
                imbalance = self.tracker.imbalance_by_layer(counts)
        args = self.args
        balancer_stats = None
        if self.balancing is not None:  # its iteration ended in finalize_model_grads (layer_spec)
            balancer_stats = reduce_balancer_stats(
                self.balancing, args.num_layers + (args.mtp_num_layers or 0), dst_rank=last_rank
            )
        if torch.distributed.get_rank() != last_rank:
            return
        from ultraep_megatron.megatron.run.dashboards import log_scalars

        before = {layer: v["imbalance_before"] for layer, v in (balancer_stats or {}).items()}
        before.update(imbalance)
        scalars = {
            f"{METRIC_PREFIX}/layer_{layer:02d}": value for layer, value in sorted(before.items())
        }
        scalars.update(
            {
                f"ultraep/{metric}/layer_{layer:02d}": values[metric]
                for layer, values in (balancer_stats or {}).items()
                for metric in LOGGED_BALANCER_METRICS
            }
        )
        log_scalars(scalars, iteration, writer, wandb_writer)
        if imbalance and iteration % args.log_interval == 0:
            print(_format_console(iteration, imbalance), flush=True)
        if balancer_stats and iteration % args.log_interval == 0:
            print(_format_balancer_console(iteration, balancer_stats), flush=True)
        # Dashboards (dashboards.py): all-layer summaries, heatmap image, model FLOPs.
        extra = (
            self.dashboard.after_iteration(
                iteration, imbalance, balancer_stats, writer, wandb_writer
            )
            if self.dashboard
            else {}
        )
        losses = {key: float(value) for key, value in loss_dict.items()}  # read once
        log_scalars(
            megatron_scalars(
                losses,
                learning_rate,
                grad_norm,
                None if first else iteration_time,
                extra.get("flops_per_iteration"),
                args.world_size,
                megatron_owned_scalars(args, writer),
            ),
            iteration,
            writer,
            wandb_writer,
        )
        if self.metrics_path:
            if first:
                keep_earlier_records(self.metrics_path, iteration)
            record = {
                "iteration": int(iteration),
                "losses": losses,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "learning_rate": None if learning_rate is None else float(learning_rate),
                "skipped": int(skipped_iter),
                "load_imbalance": {str(layer): value for layer, value in imbalance.items()},
                "iteration_time_s": iteration_time,
            }
            if balancer_stats is not None:
                record["balancer"] = {str(layer): v for layer, v in balancer_stats.items()}
            record.update(extra)
            with open(self.metrics_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")


def install(model_cfg: Any, args: Any, balancing: Optional[BalancingContext] = None) -> None:
    """Hook expert-load telemetry and the per-iteration JSONL record into Megatron's training.

    Args:
        model_cfg: the GPTModelConfig given to ``pretrain`` (0.18: the model provider,
            ``compat.gpt_model_from_args``); a post-wrap hook attaches the router hooks once the
            model is built.
        args: Megatron's parsed arguments (``--moe-load-telemetry``, ``--metrics-jsonl``).
        balancing: the model's ``BalancingContext`` (``None`` for ``--moe-balancer none``): its
            per-layer figures are logged too, and it is told when an iteration ends.
    """
    from megatron.core import parallel_state
    from megatron.training import training

    tracker = None
    if args.num_experts is not None and args.moe_load_telemetry:
        tracker = ExpertLoadTracker(
            num_layers=args.num_layers + (args.mtp_num_layers or 0),
            num_experts=args.num_experts,
            ep_size=args.expert_model_parallel_size,
        )

        def attach_routers(model_chunks):
            tracker.count_this_rank = (
                args.sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
            )
            tracker.attach(model_chunks)
            return model_chunks

        model_cfg.post_wrap_hooks.append(attach_routers)
    if tracker is None and args.metrics_jsonl is None and balancing is None:
        return
    if not isinstance(training.training_log, _TrainingLogHook):
        training.training_log = _TrainingLogHook(
            training.training_log, tracker, args.metrics_jsonl, balancing, args
        )
        from ultraep_megatron.megatron.run.dashboards import Dashboard

        training.training_log.dashboard = Dashboard(args)
