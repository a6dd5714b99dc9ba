"""The one place where ``--moe-balancer`` chooses the MoE layers of a GPT model.

``pretrain_gpt.py`` calls :func:`balance_moe_layers` on what its GPT model is built from (0.19's
``GPTModelConfig``, 0.18's model provider: ``compat.gpt_model_from_args``) with the model's
``BalancingContext``. That sets ``transformer_layer_spec`` to
``functools.partial(moe_balanced_layer_spec, balancing=context)``; Megatron's ``GPTModelBuilder``
(0.18: the provider) then calls it per (virtual) pipeline stage. The layer spec is
Megatron's own default (the local, non-TE spec on CPU; the Transformer Engine spec when
``--transformer-impl transformer_engine``), and :func:`apply_moe_balancer` may swap the MoE
``mlp`` builder of every MoE layer. In megatron-core 0.19 that builder is
``functools.partial(MoELayer, submodules=MoESubmodules(...))``.

Megatron builds the multi-token-prediction (MTP) block from its own decoder layer specs, not from
``transformer_layer_spec``; :func:`balance_moe_layers` balances that block too, and adds a startup
check that every MoE layer of the built model is balanced, so a layer Megatron builds some other
way fails loudly instead of training unbalanced.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext


def _balanced_mlp(mlp: Any, balancing: BalancingContext) -> Any:
    """The MoE ``mlp`` builder with ``BalancedMoELayer`` in place of megatron's ``MoELayer``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    if (
        isinstance(mlp, functools.partial)
        and isinstance(mlp.func, type)
        and issubclass(mlp.func, MoELayer)
    ):
        return functools.partial(BalancedMoELayer, *mlp.args, **mlp.keywords, balancing=balancing)
    module = getattr(mlp, "module", None)  # a ModuleSpec(module=MoELayer, ...)
    if isinstance(module, type) and issubclass(module, MoELayer):
        spec = copy.copy(mlp)
        spec.module = BalancedMoELayer
        spec.params = {**(mlp.params or {}), "balancing": balancing}
        return spec
    return mlp  # a dense MLP


def _balanced_layer(layer_spec: Any, balancing: BalancingContext) -> Any:
    """A transformer layer spec, or an MTP layer spec (whose ``mtp_model_layer`` is one)."""
    submodules = getattr(layer_spec, "submodules", None)
    if hasattr(submodules, "mtp_model_layer"):
        field, new = "mtp_model_layer", _balanced_layer(submodules.mtp_model_layer, balancing)
    elif hasattr(submodules, "mlp"):
        field, new = "mlp", _balanced_mlp(submodules.mlp, balancing)
    else:
        return layer_spec
    if new is getattr(submodules, field):
        return layer_spec
    layer_spec = copy.copy(layer_spec)
    layer_spec.submodules = dataclasses.replace(submodules, **{field: new})
    return layer_spec


def apply_moe_balancer(spec: Any, balancing: Optional[BalancingContext]) -> Any:
    """Return ``spec`` with its MoE layers balanced in ``balancing``.

    Args:
        spec: a layer spec (ModuleSpec of a TransformerLayer or of an MTP layer) or a block
            spec (TransformerBlockSubmodules or MultiTokenPredictionBlockSubmodules, with
            ``layer_specs``), as Megatron builds them.
        balancing: the model's balancing context; ``None`` for ``--moe-balancer none``.

    Returns:
        The spec to build the model from; for ``None``, ``spec`` itself, unchanged. Megatron's
        specs are not modified in place.
    """
    if balancing is None:
        return spec
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(
            spec, layer_specs=[_balanced_layer(s, balancing) for s in spec.layer_specs]
        )
    return _balanced_layer(spec, balancing)


def moe_balanced_layer_spec(
    config: Any, vp_stage: int | None = None, *, balancing: Optional[BalancingContext] = None
):
    """``GPTModelConfig.transformer_layer_spec`` callable: Megatron's default spec for
    ``config`` (a GPTModelConfig; on 0.18 the model provider) and ``vp_stage``, with the MoE layers
    balanced by ``balancing`` (``None``: unchanged)."""
    from ultraep_megatron.megatron.release import compat

    return apply_moe_balancer(compat.default_layer_spec(config, vp_stage), balancing)


def _balancing_of(model_cfg: Any) -> Optional[BalancingContext]:
    """The balancing context :func:`balance_moe_layers` put on ``model_cfg``; ``None`` if none."""
    spec = getattr(model_cfg, "transformer_layer_spec", None)
    if isinstance(spec, functools.partial) and spec.func is moe_balanced_layer_spec:
        return spec.keywords.get("balancing")
    return None


def _balanced_mtp_block_spec(megatron_mtp_block_spec):
    """Megatron's ``mtp_block_spec(config, transformer_layer_spec, vp_stage)`` with the MoE layers
    of the MTP block balanced like the decoder's (by the config's ``transformer_layer_spec``)."""

    @functools.wraps(megatron_mtp_block_spec)
    def mtp_block_spec(config, transformer_layer_spec, vp_stage=None):
        spec = megatron_mtp_block_spec(config, transformer_layer_spec, vp_stage=vp_stage)
        balancing = _balancing_of(config)
        return spec if spec is None or balancing is None else apply_moe_balancer(spec, balancing)

    mtp_block_spec.ultraep_balanced = True
    return mtp_block_spec


def unbalanced_moe_layers(model_chunks: Sequence[Any]) -> list[str]:
    """Module paths (wrappers' ``module.`` prefixes dropped) of the MoE layers in ``model_chunks``
    that are not ``BalancedMoELayer``s."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    found = []
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, BaseMoELayer) and not isinstance(module, BalancedMoELayer):
                while name.startswith("module."):
                    name = name[len("module.") :]
                found.append(f"{name} ({type(module).__name__})")
    return found


def megatron_training_iteration() -> int:
    """The iteration megatron.training's loop is running (``pretrain_gpt.py``'s entry): its
    ``args.curr_iteration + 1``, the number its ``training_log`` gets. Megatron-Bridge's loop sets
    none of megatron.training's globals; its entry (``bridge/enable.py``) numbers by its own
    ``train_state.step``."""
    from megatron.training.global_vars import get_args

    return get_args().curr_iteration + 1


def balance_moe_layers(
    model_cfg: Any,
    balancing: Optional[BalancingContext],
    current_iteration: Callable[[], int] = megatron_training_iteration,
) -> None:
    """Build every MoE layer of ``model_cfg``'s GPT model balanced in ``balancing``.

    Sets ``model_cfg.transformer_layer_spec`` (the decoder), has Megatron's MTP block spec
    balanced the same way, and adds a post-wrap hook that refuses to train when any MoE layer of
    the built model is not balanced, naming it. ``None`` (``--moe-balancer none``) changes nothing.

    Args:
        model_cfg: the ``GPTModelConfig`` handed to ``pretrain`` (0.18: the model provider,
            ``compat.gpt_model_from_args``).
        balancing: the model's balancing context, or ``None``.
        current_iteration: the number of the iteration the training loop is running (see
            :func:`end_model_iterations`); by default megatron.training's, whose loop
            ``pretrain_gpt.py`` runs.
    """
    if balancing is None:
        return
    from ultraep_megatron.megatron.release import compat

    model_cfg.transformer_layer_spec = functools.partial(
        moe_balanced_layer_spec, balancing=balancing
    )
    # The builder calls a module-level mtp_block_spec, which rebuilds the MTP layer from Megatron's
    # decoder specs; the wrapper leaves models without a balancer alone.
    compat.wrap_mtp_block_spec(_balanced_mtp_block_spec)

    def refuse_unbalanced_moe_layers(model_chunks):
        unbalanced = unbalanced_moe_layers(model_chunks)
        if unbalanced:
            raise RuntimeError(
                f"--moe-balancer {balancing.config.name}: these MoE layers were built without "
                f"the balancer: {', '.join(unbalanced)}. Megatron built them outside the layer "
                "spec UltraEP selects; refusing to train them unbalanced"
            )
        return model_chunks

    model_cfg.post_wrap_hooks.append(refuse_unbalanced_moe_layers)

    def end_iterations_with_model_grads(model_chunks):
        return end_model_iterations(model_chunks, balancing, current_iteration)

    model_cfg.post_wrap_hooks.append(end_iterations_with_model_grads)


def end_model_iterations(
    model_chunks: Sequence[Any],
    balancing: BalancingContext,
    current_iteration: Callable[[], int],
) -> Sequence[Any]:
    """A post-wrap hook: ``balancing`` ends its iterations where the model's gradients are final.

    Megatron's schedules call the model config's ``finalize_model_grads_func`` once per training
    iteration, after the last backward, never in evaluation. This hook sets it to megatron's
    ``finalize_model_grads`` followed by the context's end of iteration
    (:meth:`BalancingContext.ending_iterations`): the boundary belongs to the model, so two models in
    one process each end theirs. megatron-core 0.19 keeps a function a builder set; 0.18 replaces it
    when training starts, so there each chunk's first forward wraps what is set then.

    ``current_iteration()``, from the caller, is the number of the iteration the training loop is
    running, as its log numbers it (:func:`megatron_training_iteration` under ``pretrain_gpt.py``;
    Bridge's ``train_state.step + 1``): it numbers the iteration that ends, and the context's trace
    recorder follows it (a resumed run's first iteration too). Nothing here reads
    megatron.training's globals.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    iteration = current_iteration
    if balancing.trace is not None:
        balancing.trace.follow(iteration)

    def ensure_wrapped(config) -> None:
        finalize = config.finalize_model_grads_func or finalize_model_grads
        if getattr(finalize, "ends_iterations_of", None) is not balancing:
            config.finalize_model_grads_func = balancing.ending_iterations(finalize, iteration)

    def first_forward(config, handles):
        def pre_hook(*_):
            ensure_wrapped(config)
            for handle in handles:
                handle.remove()

        return pre_hook

    for chunk in model_chunks:
        config = get_model_config(chunk)
        ensure_wrapped(config)
        handles: list = []
        handles.append(chunk.register_forward_pre_hook(first_forward(config, handles)))
    return model_chunks
