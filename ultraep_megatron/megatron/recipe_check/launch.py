"""Step 1 of the recipe checker: the launch line, captured, not run.

The recipe is executed with ``ULTRAEP_PYTHON`` pointing at a shim that records torchrun's command
line and exits, so world size = nodes x processes per node and ARGS are exactly what the cluster
would get (a file without a ``#!`` line that launches nothing, like ``recipes/common.sh``, is a
library the recipes source: skipped, :class:`NotARecipe`). Also the checker's error,
:class:`RecipeError`, which every step raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


class RecipeError(Exception):
    """A recipe that cannot launch as written (bad arguments, layout or launch line).

    Args:
        problem: one line saying what is wrong (the checker prints it as a PROBLEM line).
        details: what the recipe or Megatron printed around it, if that helps (shown indented).
    """

    def __init__(self, problem: str, details: str = ""):
        super().__init__(problem)
        self.problem, self.details = problem, details


class NotARecipe(RecipeError):
    """A file that launches nothing and is not meant to: a library the recipes source."""


_SHIM = """#!{python}
# Stands in for python in a recipe: records the torchrun command line instead of running it.
# Other python calls of the recipe (data preparation, ...) are skipped.
import json, os, sys
if sys.argv[1:3] == ["-m", "torch.distributed.run"]:
    with open(os.environ["ULTRAEP_CAPTURE_FILE"], "w") as handle:
        json.dump(sys.argv[1:], handle)
"""


@dataclass
class Launch:
    """A captured launch: torchrun's process layout and the training script's arguments."""

    nproc_per_node: int
    nnodes: int
    script: str
    args: list[str]
    source: str = "<arguments>"

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def parse_torchrun_command(argv: Sequence[str], source: str = "<arguments>") -> Launch:
    """A :class:`Launch` from ``python``'s argv, which must be ``-m torch.distributed.run ...``.

    torchrun's own parser reads its options, so every spelling it accepts works.
    """
    argv = list(argv)
    if argv[:2] != ["-m", "torch.distributed.run"]:
        raise RecipeError(f"{source}: expected `python -m torch.distributed.run ...`, got {argv[:4]}")
    from torch.distributed.run import get_args_parser

    options = get_args_parser().parse_args(argv[2:])
    nnodes = "1" if options.standalone else str(options.nnodes)
    if ":" in nnodes:
        raise RecipeError(f"{source}: elastic --nnodes {nnodes} has no fixed world size")
    try:
        nproc = int(options.nproc_per_node)
    except ValueError:
        raise RecipeError(f"{source}: --nproc-per-node {options.nproc_per_node!r} is not a number "
                          "of processes") from None
    if not nnodes.isdigit():
        raise RecipeError(f"{source}: --nnodes {nnodes!r} is not a number of nodes")
    return Launch(nproc_per_node=nproc, nnodes=int(nnodes), script=options.training_script,
                  args=list(options.training_script_args), source=source)


def default_gpus_per_node(script_args: Sequence[str]) -> int:
    """GPUs per node of a bare launch: the ``--moe-balancer-hardware`` preset's among
    ``script_args`` (h100-hgx: 8), else a GB200 tray's 4 (also for an unknown preset name, which
    the validation then reports, naming the flag).
    """
    from ultraep_megatron.analysis.cost import HARDWARE_PRESETS, Hardware

    name = None
    for i, arg in enumerate(script_args):
        if arg == "--moe-balancer-hardware" and i + 1 < len(script_args):
            name = script_args[i + 1]
        elif arg.startswith("--moe-balancer-hardware="):
            name = arg.split("=", 1)[1]
    return HARDWARE_PRESETS.get(name, Hardware()).gpus_per_node


def capture_launch(recipe: str | Path, env: dict[str, str] | None = None,
                   timeout_s: float = 60.0, extra_args: Sequence[str] = ()) -> Launch:
    """Run ``recipe`` with a python shim that records its torchrun line; nothing is launched.

    The recipe's own shell code does run (it assembles the arguments), with ``RUN_DIR`` (the
    output directory of the CPU recipes) in a scratch directory unless ``env`` sets it; other
    python calls it makes are skipped.

    Args:
        recipe: path of a bash recipe.
        env: extra environment for the recipe (e.g. ``NNODES``, ``DATA_PATH``, ``RUN_DIR``).
        timeout_s: limit for the recipe's own shell code.
        extra_args: the recipe's command-line arguments (a user's overrides: the recipes append
            them to the training script's arguments, where the last value of a flag wins).

    Raises:
        RecipeError: when the recipe fails or never calls ``python -m torch.distributed.run``.
    """
    recipe = Path(recipe)
    if not recipe.is_file():
        raise RecipeError(f"{recipe}: no such recipe")
    with tempfile.TemporaryDirectory(prefix="check_recipe_") as tmp:
        shim = Path(tmp) / "python"
        shim.write_text(_SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        capture = Path(tmp) / "launch.json"
        run_env = {**os.environ, "RUN_DIR": str(Path(tmp) / "run"), **(env or {}),
                   "ULTRAEP_PYTHON": str(shim),
                   "ULTRAEP_CAPTURE_FILE": str(capture)}
        completed = subprocess.run(["bash", str(recipe), *extra_args], env=run_env, capture_output=True,
                                   text=True, timeout=timeout_s)
        if completed.returncode != 0:
            raise RecipeError(f"{recipe}: the recipe exited with {completed.returncode}",
                              (completed.stdout + completed.stderr)[-3000:])
        if not capture.exists():
            if not recipe.read_bytes().startswith(b"#!"):
                raise NotARecipe(f"{recipe}: no #! line and no launch: a file the recipes source, "
                                 "not a recipe")
            raise RecipeError(f"{recipe}: the recipe never ran $ULTRAEP_PYTHON -m torch.distributed.run")
        argv = json.loads(capture.read_text())
    return parse_torchrun_command(argv, source=str(recipe))
