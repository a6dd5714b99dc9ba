"""The one place where ``--moe-balancer`` chooses the MoE layer of a GPT model's layer spec.

``pretrain_gpt.py`` sets ``GPTModelConfig.transformer_layer_spec`` to
``functools.partial(moe_balanced_layer_spec, balancing=context)`` (the model's
``BalancingContext``, or ``None`` for ``--moe-balancer none``); Megatron's
``GPTModelBuilder`` then calls it per (virtual) pipeline stage. The layer spec is Megatron's
own default (the local, non-TE spec on CPU; the Transformer Engine spec when
``--transformer-impl transformer_engine``), and :func:`apply_moe_balancer` may swap the MoE
``mlp`` builder of every MoE layer. In megatron-core 0.19 that builder is
``functools.partial(MoELayer, submodules=MoESubmodules(...))``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Optional


def _balanced_mlp(mlp: Any, balancing: Any) -> Any:
    """The MoE ``mlp`` builder with ``BalancedMoELayer`` in place of megatron's ``MoELayer``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ultraep_megatron.megatron.balanced_moe import BalancedMoELayer

    if isinstance(mlp, functools.partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        return functools.partial(BalancedMoELayer, *mlp.args, **mlp.keywords,
                                 balancing=balancing)
    module = getattr(mlp, "module", None)  # a ModuleSpec(module=MoELayer, ...)
    if isinstance(module, type) and issubclass(module, MoELayer):
        spec = copy.copy(mlp)
        spec.module = BalancedMoELayer
        spec.params = {**(mlp.params or {}), "balancing": balancing}
        return spec
    return mlp  # a dense MLP


def _balanced_layer(layer_spec: Any, balancing: Any) -> Any:
    submodules = getattr(layer_spec, "submodules", None)
    if submodules is None or not hasattr(submodules, "mlp"):
        return layer_spec
    new_mlp = _balanced_mlp(submodules.mlp, balancing)
    if new_mlp is submodules.mlp:
        return layer_spec
    layer_spec = copy.copy(layer_spec)
    layer_spec.submodules = dataclasses.replace(submodules, mlp=new_mlp)
    return layer_spec


def apply_moe_balancer(spec: Any, balancing: Optional[Any]) -> Any:
    """Return ``spec`` with its MoE layers balanced in ``balancing``.

    Args:
        spec: a layer spec (ModuleSpec of a TransformerLayer) or a block spec
            (TransformerBlockSubmodules with ``layer_specs``), as Megatron builds them.
        balancing: the model's ``context.BalancingContext``; ``None`` for ``--moe-balancer none``.

    Returns:
        The spec to build the model from; for ``None``, ``spec`` itself, unchanged. Megatron's
        specs are not modified in place.
    """
    if balancing is None:
        return spec
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(
            spec, layer_specs=[_balanced_layer(s, balancing) for s in spec.layer_specs])
    return _balanced_layer(spec, balancing)


def moe_balanced_layer_spec(config: Any, vp_stage: int | None = None, *,
                            balancing: Optional[Any] = None):
    """``GPTModelConfig.transformer_layer_spec`` callable: Megatron's default spec for
    ``config`` (a GPTModelConfig) and ``vp_stage``, with the MoE layers balanced by
    ``balancing`` (``None``: unchanged)."""
    from megatron.training.models.gpt import default_layer_spec

    return apply_moe_balancer(default_layer_spec(config, vp_stage), balancing)
