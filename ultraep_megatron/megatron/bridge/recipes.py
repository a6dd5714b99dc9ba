"""What the Bridge recipes (``recipes/bridge/*.py``) share: NVIDIA's perf recipe function from
Megatron-Bridge 0.6.2, unchanged, with real routing and UltraEP switched on.

* :func:`use_local_hf_configs`: the Hugging Face config a perf recipe reads
  (``AutoBridge.from_hf_pretrained("deepseek-ai/DeepSeek-V3")`` in Bridge's recipe, through
  ``models/hf_pretrained/safe_config_loader.py``: ``AutoConfig``) comes from a local directory laid
  out as a Hugging Face hub cache (``models--<org>--<name>/snapshots/<rev>/config.json``), with the
  hub offline: ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``, read by ``huggingface_hub`` when it is
  first imported. Nothing is loaded from a hub.
* :func:`perf_recipe`: the recipe function, imported by name. Bridge 0.6.2's
  ``megatron/bridge/recipes/__init__.py`` imports every model family's recipes, the diffusion ones
  (flux) among them, which import ``diffusers``; where ``diffusers`` is not installed (this
  project's layered environment) that index is left unrun and the package's modules import as
  usual (only the index's re-exports are missing).
* :func:`real_routing`: ``moe_router_force_load_balancing=False`` (every MoE perf recipe
  force-balances its routing to publish its numbers), then ``enable_ultraep``; returns the
  callbacks for ``pretrain(..., callbacks=)`` and what changed, one ``field: old -> new`` line each.

Importing this module imports neither torch, megatron nor Bridge.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def use_local_hf_configs(directory: str | Path) -> None:
    """Read Hugging Face configs from ``directory`` (a hub cache's layout), offline. Must run
    before ``huggingface_hub`` is imported (before Bridge is): it fixes its cache at import. If it
    was imported already with another cache or online, a ``RuntimeError`` says so."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"no Hugging Face config directory {directory}")
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        if Path(constants.HF_HUB_CACHE).resolve() == directory and constants.HF_HUB_OFFLINE:
            return
        raise RuntimeError(
            f"huggingface_hub was imported before the recipe (its cache {constants.HF_HUB_CACHE}, "
            f"offline={constants.HF_HUB_OFFLINE}): load the recipe first, or set "
            f"HF_HUB_CACHE={directory} HF_HUB_OFFLINE=1"
        )
    os.environ["HF_HUB_CACHE"] = str(directory)
    os.environ["HF_HUB_OFFLINE"] = "1"


RECIPE_INDEX = "megatron.bridge.recipes"


def perf_recipe(module: str, name: str):
    """NVIDIA's recipe function ``name`` of ``module`` (``megatron.bridge.perf_recipes...``)."""
    if RECIPE_INDEX not in sys.modules and importlib.util.find_spec("diffusers") is None:
        spec = importlib.util.find_spec(RECIPE_INDEX)
        sys.modules[RECIPE_INDEX] = importlib.util.module_from_spec(spec)  # __init__ not run
        setattr(importlib.import_module("megatron.bridge"), "recipes", sys.modules[RECIPE_INDEX])
    return getattr(importlib.import_module(module), name)


def _fields(cfg: Any) -> dict[str, Any]:
    """``cfg.<section>.<field>`` (and top-level ``cfg.<field>``) -> value, one level deep."""
    out = {}
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                out[f"cfg.{section.name}.{f.name}"] = getattr(value, f.name)
        else:
            out[f"cfg.{section.name}"] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if callable(a) or callable(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (a value without a plain truth value: compare by identity)
        return False


def show(value: Any) -> str:
    """A field's value for a change line: a function by its name, anything else by ``repr``."""
    if isinstance(value, functools.partial):
        given = [show(a) for a in value.args] + [f"{k}={v!r}" for k, v in value.keywords.items()]
        return f"partial({', '.join([show(value.func), *given])})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}".replace(".<locals>", "")
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def real_routing(
    cfg: Any, num_slots: int = 2, model_overrides: dict[str, Any] | None = None, **knobs: Any
) -> tuple[list, list[str]]:
    """Real routing and UltraEP on NVIDIA's perf recipe ``cfg``, in place: returns
    ``(callbacks, changes)``, ``changes`` one ``cfg.section.field: old -> new`` line per field
    changed (and the post-wrap hook registered). ``model_overrides``: provider fields a balancer
    cannot run as the perf recipe sets them (``enable_ultraep`` would refuse them), set first;
    ``knobs``: ``enable_ultraep``'s."""
    from ultraep_megatron.megatron.bridge.enable import enable_ultraep

    before = _fields(cfg)
    hooks = list(getattr(cfg.model, "_post_wrap_hooks", []))
    for name, value in (model_overrides or {}).items():
        if not hasattr(cfg.model, name):
            raise AttributeError(f"{type(cfg.model).__name__} has no field {name!r}")
        setattr(cfg.model, name, value)
    cfg.model.moe_router_force_load_balancing = False
    callbacks = enable_ultraep(cfg, num_slots=num_slots, **knobs)
    changes = [
        f"{name}: {show(before[name])} -> {show(value)}"
        for name, value in _fields(cfg).items()
        if name in before and not _same(before[name], value)
    ]
    changes += [
        f"cfg.model post-wrap hook added: {show(hook)}"
        for hook in getattr(cfg.model, "_post_wrap_hooks", [])
        if hook not in hooks
    ]
    return callbacks, changes
