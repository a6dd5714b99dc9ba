"""``enable_ultraep(cfg, num_slots=2, ...)``: UltraEP on a Megatron-Bridge ``ConfigContainer``.

Swaps the MoE layer inside the provider's own layer spec (a ``ModuleSpec`` or a callable of
``(config[, vp_stage])``, TE or local), refuses a model whose MoE layers were built some other
way (a post-wrap hook), and returns the callbacks for ``pretrain(..., callbacks=)``: the iteration
boundary installed at ``on_train_start`` on ``get_model_config(model[0])`` (Bridge's
``training/setup.py`` sets ``finalize_model_grads_func`` after the post-wrap hooks run), numbered
by Bridge's ``train_state.step``; and the per-layer imbalance before and after balancing to
Bridge's own tensorboard and wandb writers and the console (``UltraEPImbalanceLog``).

The knobs are the ``--moe-balancer*`` flags' (same names without the prefix, same defaults). Before
anything is changed, the startup checks ``pretrain_gpt.py`` runs on UltraEP's arguments
(``run.arguments.ultraep_arg_problems``: every knob, the MoE model, the settings a balanced layer
cannot run) run on a namespace read from the ``ConfigContainer``'s fields; a refusal is a
``ValueError`` naming the config field (``cfg.model.moe_expert_capacity_factor``) or
``enable_ultraep``'s argument instead of the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import functools
import inspect
import re
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


#: The ConfigContainer sections the checks read, in lookup order (a name in two, such as
#: ``use_distributed_optimizer``, is read from the first).
SECTIONS = ("model", "ddp", "dist", "optimizer", "train", "checkpoint", "mixed_precision")
#: Megatron's argument names that Bridge's model provider spells otherwise.
MODEL_RENAMES = {"num_experts": "num_moe_experts"}
#: Megatron's names whose deprecated spelling a Bridge recipe sets on the provider (NVIDIA's perf
#: recipes: ``cuda_graph_scope``), migrated when the provider is finalized: read where it is set.
DEPRECATED_MODEL_FIELDS = {"cuda_graph_modules": "cuda_graph_scope"}


class ConfigNamespace:
    """Megatron's args namespace as the startup checks read it, from a ``ConfigContainer``: the
    balancer's flags from ``knobs`` (an ``argparse.Namespace`` of the ``--moe-balancer*`` flags),
    every other name from the first section of :data:`SECTIONS` that has it (``num_experts`` is
    ``cfg.model.num_moe_experts``). A name no section has is missing (``getattr``'s default)."""

    def __init__(self, cfg: Any, knobs: argparse.Namespace):
        self._cfg, self._knobs = cfg, knobs

    def field(self, name: str) -> str | None:
        """Where ``name`` is read: ``cfg.<section>.<field>``, or ``None``."""
        model = getattr(self._cfg, "model", None)
        deprecated = DEPRECATED_MODEL_FIELDS.get(name)
        if deprecated and getattr(model, deprecated, None) is not None:
            return f"cfg.model.{deprecated}"
        # Bridge's CommOverlapConfig: a value it sets is copied onto the provider and DDP config
        # when training starts (its setup), over theirs.
        if getattr(getattr(self._cfg, "comm_overlap", None), name, None) is not None:
            return f"cfg.comm_overlap.{name}"
        name = MODEL_RENAMES.get(name, name)
        for section in SECTIONS:
            holder = getattr(self._cfg, section, None)
            if holder is not None and hasattr(holder, name):
                return f"cfg.{section}.{name}"
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if hasattr(self._knobs, name):
            return getattr(self._knobs, name)
        where = self.field(name)
        if where is None:
            raise AttributeError(name)
        section, field = where.split(".")[1:]
        return getattr(getattr(self._cfg, section), field)


def named_by_field(problem: str, namespace: ConfigNamespace) -> str:
    """``problem`` with each flag named as what sets it here: ``--moe-balancer-X`` as
    ``enable_ultraep(X=)``, ``--moe-balancer`` as ``enable_ultraep(balancer=)``, any other flag as
    its ConfigContainer field (left as it is where no section has it)."""

    from ultraep_megatron.planner.baselines.registry import BALANCERS
    from ultraep_megatron.settings.hardware import HARDWARE_PRESETS

    values = {*BALANCERS, *HARDWARE_PRESETS}

    def name(match: re.Match) -> str:
        flag, value = match.group(1), match.group(2)
        if not flag.startswith("--moe-balancer"):
            return (namespace.field(flag[2:].replace("-", "_")) or flag) + (value or "")
        argument = "balancer" if flag == "--moe-balancer" else flag[len("--moe-balancer-") :]
        argument = argument.replace("-", "_")
        # A flag's value follows it ("--moe-balancer-hardware h100-hgx"): the argument's, where it
        # is one (a number or a choice), not the next word of the sentence.
        given = (value or "").strip()
        if given and (given in values or re.fullmatch(r"\d+(\.\d+)?", given)):
            return f"enable_ultraep({argument}={given})"
        return f"enable_ultraep({argument}=)" + (value or "")

    return re.sub(
        r"(--[a-z][a-z0-9-]*[a-z0-9])( [A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z0-9]|( \d))?", name, problem
    )


def config_problems(cfg: Any, knobs: argparse.Namespace, environment: bool = True) -> list[str]:
    """``pretrain_gpt.py``'s startup checks of UltraEP's arguments on ``cfg``'s fields, one line
    each naming the config field (or ``enable_ultraep``'s argument). ``environment``: also what
    this machine lacks to run them (``False`` inside :func:`for_other_machines`)."""
    from ultraep_megatron.megatron.run.arguments import ultraep_arg_problems

    namespace = ConfigNamespace(cfg, knobs)
    environment = environment and _CHECK_ENVIRONMENT.get()
    return [named_by_field(p, namespace) for p in ultraep_arg_problems(namespace, environment)]


_CHECK_ENVIRONMENT = contextvars.ContextVar("ultraep_check_environment", default=True)


@contextlib.contextmanager
def for_other_machines():
    """Inside it, ``enable_ultraep`` checks the config for the machines it targets, not this one
    (``ultraep check-recipe`` building a recipe: a flex backend this machine cannot import is no
    refusal; the recipe's report notes it)."""
    token = _CHECK_ENVIRONMENT.set(False)
    try:
        yield
    finally:
        _CHECK_ENVIRONMENT.reset(token)


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
    problems = config_problems(cfg, namespace)
    if problems:
        raise ValueError("enable_ultraep refuses this ConfigContainer:\n  " + "\n  ".join(problems))
    balancing = balancing_context_from_args(namespace)
    provider = cfg.model
    provider._ultraep_own_spec = provider.transformer_layer_spec

    def balanced_spec(config, vp_stage=None):
        return layer_spec.apply_moe_balancer(_provider_spec(provider, config, vp_stage), balancing)

    provider.transformer_layer_spec = balanced_spec
    provider._ultraep_knobs = namespace  # the --moe-balancer* flags, for ultraep check-recipe

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
        after balancing, averaged over the microbatches since the last log and over the ranks that
        hold the layer (every pipeline stage's layers; data-parallel replicas averaged), to
        Bridge's own tensorboard and wandb writers (``state.tensorboard_logger`` /
        ``state.wandb_logger``, set on the last rank when ``cfg.logger`` names them) as
        ``ultraep/layer_N/imbalance_before`` and ``.../imbalance_after``, and one console line.

        The figures are the host plans' (no device read in the layers); the average is one small
        reduce to the last rank per log (every rank runs the callback). ``last_stats`` keeps this
        rank's latest ``{layer: {metric: mean}}``, ``last_logged`` the last rank's average."""

        def __init__(self, balancing):
            self.balancing = balancing
            self.last_stats: dict[int, dict[str, float]] = {}
            self.last_logged: dict[int, dict[str, float]] = {}

        def on_train_step_end(self, context):
            state = context.state
            step = state.train_state.step + 1  # the iteration ending (Bridge counts it after)
            interval = state.cfg.logger.log_interval or 1
            if step % interval:
                return
            self.last_stats = self.balancing.pop_stats()
            stats = _ranks_average(self.last_stats, state.cfg.model)
            if not stats:
                return
            self.last_logged = stats
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
                wandb_writer.log(scalars, step=step)
            from megatron.bridge.utils.common_utils import print_rank_last

            print_rank_last(
                f" [ultraep] iteration {step}: imbalance before -> after "
                + " | ".join(
                    f"layer {layer} {f['imbalance_before']:.3f} -> {f['imbalance_after']:.3f}"
                    for layer, f in stats.items()
                )
            )

    return UltraEPImbalanceLog


def _ranks_average(stats: dict, model: Any) -> dict | None:
    """``stats`` of every rank averaged on the last (``None`` on the others); one process alone:
    ``stats``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return stats
    from ultraep_megatron.megatron.run.telemetry import reduce_layer_stats

    num_layers = model.num_layers + (getattr(model, "mtp_num_layers", None) or 0)
    return reduce_layer_stats(stats, num_layers, dst_rank=dist.get_world_size() - 1)


#: The per-layer figures :class:`UltraEPImbalanceLog` writes (``BalancerStats`` names).
IMBALANCE_KEYS = ("imbalance_before", "imbalance_after")


def UltraEPImbalanceLog(balancing):  # noqa: N802 (a class, built once Bridge is importable)
    """The imbalance-logging callback for ``balancing`` (see ``_imbalance_log_class``)."""
    return _imbalance_log_class()(balancing)
