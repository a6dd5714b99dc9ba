"""``enable_ultraep(cfg, num_slots=2, ...)``: UltraEP on a Megatron-Bridge ``ConfigContainer``.

Swaps the MoE layer inside the provider's own layer spec (a ``ModuleSpec`` or a callable of
``(config[, vp_stage])``, TE or local), refuses a model whose MoE layers were built some other
way (a post-wrap hook), and returns the callbacks for ``pretrain(..., callbacks=)``: the iteration
boundary installed at ``on_train_start`` on ``get_model_config(model[0])`` (Bridge's
``training/setup.py`` sets ``finalize_model_grads_func`` after the post-wrap hooks run), numbered
by Bridge's ``train_state.step``; and the per-layer imbalance before and after balancing to
Bridge's own tensorboard and wandb writers and the console (``UltraEPImbalanceLog``).

Work in progress (issue 51): the knobs are the ``--moe-balancer*`` flags' (same names without the
prefix, same defaults); the startup checks against the ConfigContainer are not wired yet.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from typing import Any

from ultraep_megatron.planner.baselines import registry


def _flags_namespace(balancer: str, knobs: dict[str, Any]) -> argparse.Namespace:
    from ultraep_megatron.megatron.run.arguments import add_ultraep_args

    parser = add_ultraep_args(argparse.ArgumentParser(add_help=False))
    namespace = parser.parse_args(["--moe-balancer", balancer])
    for name, value in knobs.items():
        dest = f"moe_balancer_{name}"
        if not hasattr(namespace, dest):
            raise TypeError(f"enable_ultraep: no knob {name!r} (the --moe-balancer-* flags' names)")
        setattr(namespace, dest, value)
    return namespace


def _provider_spec(provider: Any, config: Any, vp_stage: int | None):
    spec = provider.__dict__.get("_ultraep_own_spec")
    if callable(spec) and not hasattr(spec, "submodules"):
        takes_vp = "vp_stage" in inspect.signature(spec).parameters
        return spec(config, vp_stage=vp_stage) if takes_vp else spec(config)
    return spec


def enable_ultraep(
    cfg: Any, num_slots: int = 2, balancer: str = registry.ULTRAEP, **knobs: Any
) -> list:
    """Balance every MoE layer of ``cfg.model`` (a Bridge GPT provider) with UltraEP; return the
    callbacks to pass to Bridge's ``pretrain``."""
    from megatron.bridge.training.callbacks import Callback

    from ultraep_megatron.megatron.run import layer_spec
    from ultraep_megatron.megatron.run.arguments import balancing_context_from_args

    namespace = _flags_namespace(balancer, {"num_slots": num_slots, **knobs})
    balancing = balancing_context_from_args(namespace)
    provider = cfg.model
    provider._ultraep_own_spec = provider.transformer_layer_spec

    def balanced_spec(config, vp_stage=None):
        return layer_spec.apply_moe_balancer(_provider_spec(provider, config, vp_stage), balancing)

    provider.transformer_layer_spec = balanced_spec

    def refuse_unbalanced(model_chunks):
        unbalanced = layer_spec.unbalanced_moe_layers(model_chunks)
        if unbalanced:
            raise RuntimeError(
                f"enable_ultraep: these MoE layers were built without the balancer: "
                f"{', '.join(unbalanced)}; refusing to train them unbalanced"
            )
        return model_chunks

    provider.register_post_wrap_hook(refuse_unbalanced)

    class UltraEPIterations(Callback):
        """The model's iteration boundary, numbered by Bridge's ``train_state.step``."""

        def on_train_start(self, context):
            state = context.state
            layer_spec.end_model_iterations(
                context.model, balancing, functools.partial(lambda s: s.train_state.step + 1, state)
            )

    iterations = UltraEPIterations()
    iterations.balancing = balancing  # the model's balancing context, for callers that read it
    return [iterations, UltraEPImbalanceLog(balancing)]


def _imbalance_log_class():
    from megatron.bridge.training.callbacks import Callback

    class UltraEPImbalanceLog(Callback):
        """Every ``cfg.logger.log_interval`` steps: each balanced layer's imbalance before and
        after balancing, averaged over the microbatches since the last log, to Bridge's own
        tensorboard and wandb writers (``state.tensorboard_logger`` / ``state.wandb_logger``, set
        on the last rank when ``cfg.logger`` names them) as ``ultraep/layer_N/imbalance_before``
        and ``.../imbalance_after``, and one console line. The figures are the host plan's (no
        device read); ``last_stats`` keeps the latest ``{layer: {metric: mean}}``."""

        def __init__(self, balancing):
            self.balancing = balancing
            self.last_stats: dict[int, dict[str, float]] = {}

        def on_train_step_end(self, context):
            state = context.state
            step = state.train_state.step + 1  # the iteration ending (Bridge counts it after)
            interval = state.cfg.logger.log_interval or 1
            if step % interval:
                return
            stats = self.balancing.pop_stats()
            self.last_stats = stats
            if not stats:
                return
            scalars = {
                f"ultraep/layer_{layer}/{key}": figures[key]
                for layer, figures in stats.items()
                for key in IMBALANCE_KEYS
            }
            writer = state.tensorboard_logger
            if writer is not None:
                for tag, value in scalars.items():
                    writer.add_scalar(tag, value, step)
            wandb_writer = state.wandb_logger
            if wandb_writer is not None:
                wandb_writer.log(scalars, step)
            from megatron.bridge.utils.common_utils import print_rank_last

            print_rank_last(
                f" [ultraep] iteration {step}: imbalance before -> after "
                + " | ".join(
                    f"layer {layer} {f['imbalance_before']:.3f} -> {f['imbalance_after']:.3f}"
                    for layer, f in stats.items()
                )
            )

    return UltraEPImbalanceLog


#: The per-layer figures :class:`UltraEPImbalanceLog` writes (``BalancerStats`` names).
IMBALANCE_KEYS = ("imbalance_before", "imbalance_after")


def UltraEPImbalanceLog(balancing):  # noqa: N802 (a class, built once Bridge is importable)
    """The imbalance-logging callback for ``balancing`` (see ``_imbalance_log_class``)."""
    return _imbalance_log_class()(balancing)
