"""Variants of the shipped Bridge recipes (``recipes/bridge``) for ``ultraep check-recipe``'s
``module:function`` form (tests/bridge/test_bridge_recipes.py puts this directory on
``PYTHONPATH``). Each returns a ``ConfigContainer``; the cluster is this module's ``NUM_GPUS``,
``GPUS_PER_NODE`` (the Qwen3 recipe's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "bridge"
NUM_GPUS, GPUS_PER_NODE = 256, 8


def _shipped(name: str):
    """The shipped recipe ``recipes/bridge/<name>.py`` as a module (it points Hugging Face at the
    shipped configs when loaded)."""
    spec = importlib.util.spec_from_file_location(f"shipped_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen3_real_routing():
    """The shipped Qwen3-235B-A22B recipe, as it is."""
    return _shipped("qwen3_235b_a22b_h100").config()


def qwen3_capacity_factor_after_enable():
    """The shipped recipe, then a capacity factor (token dropping) set after enable_ultraep."""
    cfg = _shipped("qwen3_235b_a22b_h100").config()
    cfg.model.moe_expert_capacity_factor = 1.0
    return cfg


def qwen3_capacity_factor_before_enable():
    """NVIDIA's recipe with a capacity factor, then real routing + enable_ultraep (which refuses)."""
    from ultraep_megatron.megatron.bridge import recipes

    shipped = _shipped("qwen3_235b_a22b_h100")
    cfg = recipes.perf_recipe(*shipped.PERF_RECIPE)()
    cfg.model.moe_expert_capacity_factor = 1.0
    recipes.real_routing(cfg, **shipped.KNOBS)
    return cfg


def qwen3_nvidia_unchanged():
    """NVIDIA's recipe as it is: force-balanced routing, no enable_ultraep."""
    from ultraep_megatron.megatron.bridge import recipes

    shipped = _shipped("qwen3_235b_a22b_h100")
    return recipes.perf_recipe(*shipped.PERF_RECIPE)()
