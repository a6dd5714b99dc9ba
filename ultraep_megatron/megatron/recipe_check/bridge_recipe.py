"""``ultraep check-recipe`` on a Megatron-Bridge recipe: a Python file (its ``config()``, or
``FILE.py:FUNCTION``) or ``module:function`` returning a ``ConfigContainer``.

The recipe's function runs here (it builds a config; nothing trains). Then the checks the launch
scripts get, on the ``ConfigContainer``'s fields:

1. ``enable_ultraep``'s startup checks (:func:`~ultraep_megatron.megatron.bridge.enable.config_problems`:
   ``pretrain_gpt.py``'s checks of UltraEP's arguments, each refusal naming its config field) with
   the knobs the recipe passed to ``enable_ultraep``, and what Megatron refuses when it starts (the
   expert grid against the world size, the global batch against micro batch x DP);
2. the rank layout and memory per rank and pipeline stage, by the launch scripts' code
   (``recipe_check.report_for_args``) on a Megatron argument namespace read from the
   ``ConfigContainer`` (:func:`megatron_args`).

The world size is the cluster the recipe is sized for: its module's ``NUM_GPUS`` and
``GPUS_PER_NODE`` (or check-recipe's ``--world-size`` / ``--gpus-per-node``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from unittest import mock

from ultraep_megatron.megatron.recipe_check.launch import Launch, RecipeError

#: The function a recipe file is checked by when none is named (``FILE.py:FUNCTION``).
DEFAULT_FUNCTION = "config"
#: What check-recipe says where megatron-bridge is not installed.
NO_BRIDGE = (
    "megatron-bridge is not installed in this environment: a Bridge recipe ({source}) is built "
    "with it. Run in the layered environment: ULTRAEP_BRIDGE=1 bash tools/ensure_env.sh prints its "
    "python (ULTRAEP_BRIDGE=1 bash tools/run_tests.sh ... uses it)"
)


def is_bridge_recipe(target: str) -> bool:
    """A Bridge recipe: a ``.py`` file (``FILE.py`` or ``FILE.py:FUNCTION``) or
    ``module:function``; a launch script (``.sh``) is not."""
    if target.endswith(".py") or ".py:" in target:
        return True
    return ":" in target and not Path(target).exists() and not target.endswith(".sh")


def recipe_file(target: str) -> Optional[Path]:
    """The file a recipe names (``FILE.py:FUNCTION``'s ``FILE.py``); ``None`` for
    ``module:function``."""
    if ".py:" in target:
        return Path(target.split(".py:")[0] + ".py")
    if is_bridge_recipe(target) and not target.endswith(".py"):
        return None
    return Path(target)


def bridge_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class BridgeRecipe:
    """A Bridge recipe's config, built: where from, the cluster, what it printed."""

    source: str
    cfg: Any
    knobs: argparse.Namespace
    world_size: int
    gpus_per_node: int
    cluster_source: str
    printed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpus_per_node_assumed: bool = False


def _load_function(target: str):
    """(function, its module) for ``FILE.py``, ``FILE.py:FUNCTION`` or ``module:function``."""
    if target.endswith(".py") or ".py:" in target:
        path, _, name = target.partition(".py:") if ".py:" in target else (target[:-3], "", "")
        file = Path(path + ".py")
        if not file.is_file():
            raise RecipeError(f"no such recipe file: {file}")
        spec = importlib.util.spec_from_file_location(f"ultraep_bridge_recipe_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        name = name or DEFAULT_FUNCTION
    else:
        module_name, _, name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise RecipeError(f"{target}: cannot import {module_name}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError(
            f"{target}: {module.__name__} has no function {name!r} (a recipe file's is "
            f"{DEFAULT_FUNCTION}(); or name it: FILE.py:FUNCTION, module:function)"
        )
    return function, module


def load_recipe(
    target: str, world_size: Optional[int] = None, gpus_per_node: Optional[int] = None
) -> BridgeRecipe:
    """Build ``target``'s ``ConfigContainer`` and read what the checks need.

    Raises:
        RecipeError: Bridge is not installed; the recipe does not load or its function fails;
            ``enable_ultraep`` refused the config (its problems, one per line, naming the field).
    """
    if not bridge_installed():
        raise RecipeError(NO_BRIDGE.format(source=target))
    from ultraep_megatron.megatron.bridge.enable import for_other_machines
    from ultraep_megatron.megatron.recipe_check.validate import quiet_megatron

    printed = io.StringIO()
    try:
        with quiet_megatron(), for_other_machines(), contextlib.redirect_stdout(printed):
            function, module = _load_function(target)
            cfg = function()
    except RecipeError:
        raise
    except ValueError as error:
        text = str(error)
        if text.startswith("enable_ultraep refuses"):
            problems = [line.strip() for line in text.splitlines()[1:] if line.strip()]
            raise RecipeError("\n".join(problems), printed.getvalue()) from None
        raise RecipeError(f"{target} failed: ValueError: {text}", printed.getvalue()) from None
    except Exception as error:  # noqa: BLE001 (the recipe's own failure, reported as a problem)
        raise RecipeError(
            f"{target} failed: {type(error).__name__}: {' '.join(str(error).split())}",
            printed.getvalue(),
        ) from None
    from megatron.bridge.training.config import ConfigContainer

    if not isinstance(cfg, ConfigContainer):
        raise RecipeError(f"{target} returned {type(cfg).__name__}, not a ConfigContainer")
    notes = []
    knobs = getattr(cfg.model, "_ultraep_knobs", None)
    if knobs is None:
        from ultraep_megatron.megatron.run.arguments import add_ultraep_args

        knobs = add_ultraep_args(argparse.ArgumentParser(add_help=False)).parse_args([])
        notes.append("enable_ultraep was not called on this config: no balancer (routing as it is)")
    if cfg.model.moe_router_force_load_balancing:
        notes.append(
            "cfg.model.moe_router_force_load_balancing is True: routing is force-balanced "
            "(NVIDIA's benchmark setting), nothing real to balance"
        )
    given = world_size is not None
    world = world_size or getattr(module, "NUM_GPUS", None)
    per_node = gpus_per_node or getattr(module, "GPUS_PER_NODE", None)
    if world is None:
        raise RecipeError(
            f"{target}: no cluster size: the recipe's module sets NUM_GPUS (and GPUS_PER_NODE), "
            "or give check-recipe --world-size N"
        )
    assumed = False
    if per_node is None:  # the hardware preset's node, else an HGX node's 8 (the report says so)
        from ultraep_megatron.settings.hardware import hardware_preset

        name = getattr(knobs, "moe_balancer_hardware", None)
        per_node, assumed = (hardware_preset(name).gpus_per_node, False) if name else (8, True)
    if world % per_node:
        raise RecipeError(f"{world} GPUs is not a whole number of {per_node}-GPU nodes")
    return BridgeRecipe(
        source=target,
        cfg=cfg,
        knobs=knobs,
        world_size=world,
        gpus_per_node=per_node,
        cluster_source="--world-size" if given else "the recipe's NUM_GPUS, GPUS_PER_NODE",
        printed=[line for line in printed.getvalue().splitlines() if line.strip()],
        notes=notes,
        gpus_per_node_assumed=assumed,
    )


def _precision(cfg: Any):
    mp = cfg.mixed_precision
    if isinstance(mp, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        mp = get_mixed_precision_config(mp)
    return mp


def megatron_args(cfg: Any, knobs: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Megatron's argument namespace (``pretrain_gpt.py``'s names) read from ``cfg``: Megatron's
    defaults, every name a section of the ``ConfigContainer`` has (``enable.ConfigNamespace``:
    ``num_experts`` is ``cfg.model.num_moe_experts``), the balancer's flags from ``knobs``, the
    precision from ``cfg.mixed_precision``, then what Megatron derives (world and data-parallel
    size, padded vocabulary, GQA, SwiGLU, tied embeddings, first/last pipeline stage layers)."""
    import torch.nn.functional as F
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from ultraep_megatron.megatron.bridge.enable import ConfigNamespace
    from ultraep_megatron.megatron.recipe_check.validate import quiet_megatron
    from ultraep_megatron.megatron.run.startup import parse_megatron_args

    rank0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}
    with (
        mock.patch.object(sys, "argv", ["pretrain_gpt.py"]),
        mock.patch.dict(os.environ, rank0),
        quiet_megatron(),
    ):
        args, errors = parse_megatron_args(log_rank=False)  # Megatron's defaults, rank 0 of the job
    if errors:
        raise RecipeError("; ".join(errors))
    fields = ConfigNamespace(cfg, knobs)
    for name in list(vars(args)):
        if hasattr(knobs, name):
            setattr(args, name, getattr(knobs, name))
        elif fields.field(name) is not None:
            setattr(args, name, getattr(fields, name))
    mp = _precision(cfg)
    for name in ("bf16", "fp16", "fp8", "fp8_recipe", "fp8_param_gather"):
        if hasattr(mp, name):
            setattr(args, name, getattr(mp, name))
    model = cfg.model
    tp, pp, cp = (
        model.tensor_model_parallel_size,
        model.pipeline_model_parallel_size,
        model.context_parallel_size,
    )
    args.world_size = world_size
    args.virtual_pipeline_model_parallel_size = model.virtual_pipeline_model_parallel_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    args.expert_tensor_parallel_size = model.expert_tensor_parallel_size or tp
    args.num_query_groups = model.num_query_groups or model.num_attention_heads
    args.group_query_attention = args.num_query_groups < model.num_attention_heads
    args.kv_channels = model.kv_channels or model.hidden_size // model.num_attention_heads
    args.swiglu = bool(model.gated_linear_unit) and model.activation_func is F.silu
    args.untie_embeddings_and_output_weights = not model.share_embeddings_and_output_weights
    args.decoder_first_pipeline_num_layers = model.num_layers_in_first_pipeline_stage
    args.decoder_last_pipeline_num_layers = model.num_layers_in_last_pipeline_stage
    args.accumulate_allreduce_grads_in_fp32 = bool(cfg.ddp.grad_reduce_in_fp32)
    args.multi_latent_attention = hasattr(model, "kv_lora_rank")
    args.moe_layer_freq = model.moe_layer_freq
    args.vocab_size = model.vocab_size
    args.padded_vocab_size = vocab_size_with_padding(model.vocab_size, args, logging_enabled=False)
    return args


def check_bridge_recipe(
    recipe: BridgeRecipe, rack_size: Optional[int] = None, gpu_memory_gb: Optional[float] = None
):
    """The report of :mod:`ultraep_megatron.megatron.recipe_check` for a built Bridge recipe.

    Raises:
        RecipeError: a check refused the config (one problem per line, naming config fields).
    """
    from ultraep_megatron.megatron.bridge.enable import ConfigNamespace, config_problems
    from ultraep_megatron.megatron.recipe_check.report import report_for_args
    from ultraep_megatron.megatron.recipe_check.validate import quiet_megatron, startup_problems

    printed = "\n".join(recipe.printed)
    with quiet_megatron():
        problems = config_problems(recipe.cfg, recipe.knobs, environment=False)
    if problems:
        raise RecipeError("\n".join(problems), printed)
    args = megatron_args(recipe.cfg, recipe.knobs, recipe.world_size)
    problems = startup_problems(args)
    if problems:
        raise RecipeError("\n".join(problems), printed)
    launch = Launch(
        nproc_per_node=recipe.gpus_per_node,
        nnodes=recipe.world_size // recipe.gpus_per_node,
        script=recipe.source,
        args=[],
        source=recipe.source,
        gpus_per_node_assumed=recipe.gpus_per_node_assumed,
        notes=list(recipe.notes),
    )
    report = report_for_args(launch, args, rack_size, gpu_memory_gb)
    report.rename = functools.partial(named_for_bridge, ConfigNamespace(recipe.cfg, recipe.knobs))
    report.notes = [report.rename(note) for note in report.notes]
    m = recipe.cfg.model
    etp = args.expert_tensor_parallel_size
    edp = recipe.world_size // (etp * m.expert_model_parallel_size * m.pipeline_model_parallel_size)
    report.checks = (
        "enable_ultraep's checks on the ConfigContainer (config_problems) + Megatron's start-up "
        "grid and batch checks"
    )
    report.header = [
        f"Megatron-Bridge recipe (its ConfigContainer built here, not run): "
        f"{type(m).__name__}; cluster {recipe.world_size} GPUs = "
        f"{launch.nnodes} nodes x {launch.nproc_per_node} ({recipe.cluster_source})",
        f"parallelism (cfg.model): TP{m.tensor_model_parallel_size} "
        f"PP{m.pipeline_model_parallel_size} VPP{m.virtual_pipeline_model_parallel_size or 1} "
        f"EP{m.expert_model_parallel_size} ETP{etp} CP{m.context_parallel_size} "
        f"DP{args.data_parallel_size}; expert-DP {edp}"
        + (
            f"; pipeline layout {layout_text(m.pipeline_model_parallel_layout)}"
            if m.pipeline_model_parallel_layout is not None
            else ""
        ),
    ]
    if recipe.printed:
        report.header.append("the recipe printed (what it changed):")
        report.header += [f"  | {line}" for line in recipe.printed]
    return report


#: megatron-core's letters of a pipeline layout's layer types (``Et|tt|...|mL``).
LAYER_LETTERS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L", "encoder": "e"}


def layout_text(layout: Any) -> str:
    """A pipeline layout as megatron-core's string: as given, or a list of chunks in letters."""
    if isinstance(layout, str):
        return layout
    chunks = getattr(layout, "input_data", layout)
    if isinstance(chunks, str):
        return chunks
    return "|".join(
        "".join(LAYER_LETTERS.get(getattr(x, "name", str(x)), str(x)) for x in chunk)
        for chunk in chunks
    )


#: What the launch scripts' report lines say that a Bridge recipe says otherwise.
BRIDGE_WORDING = (
    ("pretrain_gpt.py refuses to start without it", "enable_ultraep refuses the config without it"),
    ("GLOBAL_BATCH_SIZE=... (recipes) or ", ""),
)


def named_for_bridge(namespace, line: str) -> str:
    """A report line of the launch scripts' checker in a Bridge recipe's terms: each flag as its
    config field or ``enable_ultraep``'s argument (``enable.named_by_field``)."""
    from ultraep_megatron.megatron.bridge.enable import named_by_field

    for old, new in BRIDGE_WORDING:
        line = line.replace(old, new)
    return named_by_field(line, namespace)
