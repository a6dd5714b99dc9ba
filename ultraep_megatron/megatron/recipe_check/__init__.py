"""Check a launch recipe on this machine, without GPUs: arguments, rank layout, memory per rank.

For each recipe (a bash script under ``recipes/`` that ends in ``python -m torch.distributed.run
... pretrain_gpt.py ARGS``):

1. the launch is captured, not run (:mod:`.launch`);
2. Megatron's own argument parser and ``validate_args`` run on ARGS for that world size, then
   UltraEP's ``validate_ultraep_args``, then what Megatron checks only when it starts
   (:mod:`.validate`);
3. the rank layout is printed from Megatron's own ``RankGenerator`` (:mod:`.layout`);
4. memory per rank and pipeline stage is estimated (:mod:`.memory`, from the model's parameters
   per layer, :mod:`.model`), with UltraEP's redundant slots with and without cross-layer reuse,
   and activations (:mod:`.activations`), against the GPU's memory.

A Megatron-Bridge recipe (a ``.py`` file or ``module:function`` returning a ``ConfigContainer``)
is built and checked by :mod:`.bridge_recipe`: ``enable_ultraep``'s checks on its fields, then the
same steps 3-4 on a Megatron namespace read from it.

:func:`check_launch` runs steps 2-4 and :func:`format_report` prints them (:mod:`.report`). The
command line is ``ultraep check-recipe``
(``ultraep_megatron/cli/check_recipe.py``). The package re-exports those steps; the pieces they are
made of (a model's parameters per layer, the activation estimate, the pipeline stages' layers) are
imported from their modules. No Megatron import at module level: the checker is a tool, not part of
a training run.
"""

from .launch import (
    Launch,
    NotARecipe,
    RecipeError,
    capture_launch,
    capture_launches,
    default_gpus_per_node,
)
from .layout import rank_layout
from .memory import estimate_memory
from .report import RecipeReport, check_launch, format_report
from .validate import startup_problems, validate_arguments

__all__ = [
    "Launch",
    "NotARecipe",
    "RecipeError",
    "capture_launch",
    "capture_launches",
    "default_gpus_per_node",
    "validate_arguments",
    "startup_problems",
    "rank_layout",
    "estimate_memory",
    "RecipeReport",
    "check_launch",
    "format_report",
]
