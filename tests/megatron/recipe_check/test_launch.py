"""The launch read from a recipe: the user's overrides reach the training script after the recipe's
own arguments (the recipes end in ``ultraep_launch "$@"``, Megatron's parser keeps the last value of
a flag); a recipe that calls torchrun, python -m torch.distributed.run, srun or deepspeed itself
starts nothing (sentinel files of stand-in programs after the shims on PATH), and what the shims
cannot stand in for (a launcher's path, a job submission) is refused."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK
from ultraep_megatron.megatron import recipe_check as rc
from ultraep_megatron.megatron.recipe_check import launch as launch_module

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"
RECIPE = RECIPES / "deepseek_v2_lite_16b_a2b_ep8_hgx.sh"


def test_overrides_are_appended_as_the_recipe_receives_them():
    plain = rc.capture_launch(RECIPE)
    launch = rc.capture_launch(RECIPE, extra_args=["--moe-balancer-num-slots", "3"])
    assert launch.args == [*plain.args, "--moe-balancer-num-slots", "3"]
    assert (launch.nproc_per_node, launch.nnodes) == (8, 1)
    report = rc.check_launch(launch)
    assert report.args.moe_balancer_num_slots == 3
    assert report.memory.stages[0].num_slots == 3
    assert report.problems() == []


def test_recipes_set_their_gpus_per_node_default():
    """common.sh: DEFAULT_GPUS_PER_NODE (8 on HGX recipes, 4 otherwise), GPUS_PER_NODE wins."""
    assert rc.capture_launch(RECIPE).nproc_per_node == 8
    assert rc.capture_launch(RECIPES / "qwen3_235b_a22b_ep64_dp4.sh").nproc_per_node == 4
    assert rc.capture_launch(RECIPE, {"GPUS_PER_NODE": "4", "NNODES": "2"}).nproc_per_node == 4


def test_bare_launch_gpus_per_node_follows_the_hardware_preset():
    assert (
        rc.default_gpus_per_node(["--num-layers", "2", "--moe-balancer-hardware", "h100-hgx"]) == 8
    )
    assert rc.default_gpus_per_node(["--moe-balancer-hardware=h200-hgx"]) == 8
    assert rc.default_gpus_per_node(["--moe-balancer-hardware", "paper-rack"]) == 4
    # No preset (or an unknown one, which the validation names): not known, the checker assumes.
    assert rc.default_gpus_per_node(["--moe-balancer-hardware", "tpu-pod"]) is None
    assert rc.default_gpus_per_node([]) is None


# --- The launch is read, never run --------------------------------------------------------------

#: Stand-ins for the real programs, found on PATH after the checker's shims: each records that it
#: started (what the real one would do: start training, or submit a job).
REAL_PROGRAMS = ("torchrun", "python", "python3", "srun", "deepspeed", "mpirun", "sbatch")
#: Recipes that call a launcher directly, and the launch the checker must report for each.
DIRECT_LAUNCHES = {
    "torchrun": (
        'torchrun --nproc-per-node 4 --nnodes 1 "$REPO/pretrain_gpt.py" "$@"',
        "torchrun --nproc-per-node 4 --nnodes 1 pretrain_gpt.py -> 1 node x 4 GPUs",
    ),
    "python": (
        'python -m torch.distributed.run --nproc-per-node 4 "$REPO/pretrain_gpt.py" "$@"',
        "python -m torch.distributed.run --nproc-per-node 4 pretrain_gpt.py -> 1 node x 4 GPUs",
    ),
    "srun": (
        'srun --nodes 1 --ntasks-per-node 4 python3 "$REPO/pretrain_gpt.py" "$@"',
        "srun --nodes 1 --ntasks-per-node 4 python3 pretrain_gpt.py -> 1 node x 4 GPUs",
    ),
    "deepspeed": (
        'deepspeed --num_nodes 1 --num_gpus 4 "$REPO/pretrain_gpt.py" "$@"',
        "deepspeed --num_nodes 1 --num_gpus 4 pretrain_gpt.py -> 1 node x 4 GPUs",
    ),
}


@pytest.fixture
def real_programs(tmp_path, monkeypatch):
    """PATH with :data:`REAL_PROGRAMS` stand-ins; returns the directory where each leaves a
    sentinel file named after itself when it runs."""
    bin_dir, started = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    started.mkdir()
    for name in REAL_PROGRAMS:
        program = bin_dir / name
        program.write_text(f'#!/bin/sh\necho "$*" >> "{started}/{name}"\n')
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return started


def write_recipe(directory: Path, name: str, line: str) -> Path:
    recipe = directory / f"{name}.sh"
    recipe.write_text(f"#!/usr/bin/env bash\nset -euo pipefail\nREPO={REPO}\n{line}\n")
    return recipe


@pytest.fixture(scope="module")
def tiny_args():
    return rc.capture_launch(RECIPES / "tiny_cpu.sh").args


@pytest.mark.parametrize("launcher", list(DIRECT_LAUNCHES))
def test_a_recipe_calling_a_launcher_directly_starts_nothing(
    tmp_path, real_programs, tiny_args, launcher, capsys, monkeypatch
):
    """Issue 45: a recipe that calls torchrun, python -m torch.distributed.run, srun or deepspeed
    itself: check-recipe reports the launch it read and checks it, and none of the real programs
    ran (no sentinel). Controls: the same recipe run by bash starts the real program, and so does
    the checker with its shims taken away."""
    line, expected = DIRECT_LAUNCHES[launcher]
    recipe = write_recipe(tmp_path, launcher, line)
    assert main(["check-recipe", str(recipe), "--", *tiny_args]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"launch (read from the recipe, not run): {expected}" in out, out
    assert sorted(p.name for p in real_programs.iterdir()) == []

    subprocess.run(["bash", str(recipe)], check=True, capture_output=True)
    assert (real_programs / launcher).exists()  # what the recipe starts when it is run
    (real_programs / launcher).unlink()
    monkeypatch.setattr(launch_module, "SHIMMED_PROGRAMS", ())
    with pytest.raises(rc.RecipeError, match="launched no training"):
        rc.capture_launch(recipe, extra_args=tiny_args)
    assert (
        real_programs / launcher
    ).exists()  # without the shims the checker would have started it


def test_launchers_named_by_a_path_or_a_variable(tmp_path, real_programs, tiny_args):
    """A launcher called by its path bypasses the shims on PATH: the recipe is refused before any
    of its code runs (naming the line), where running it starts the real program. A variable
    holding a launcher's path (PYTHON=/usr/bin/python3) is pointed at the shim instead."""
    real = real_programs.parent / "bin"
    by_path = write_recipe(
        tmp_path,
        "by_path",
        f'echo prepared\n"{real}/python3" -m torch.distributed.run '
        '--nproc-per-node 4 "$REPO/pretrain_gpt.py"',
    )
    with pytest.raises(rc.RecipeError) as error:
        rc.capture_launch(by_path)
    assert error.value.problem == (
        f"{by_path}:5 runs {real}/python3 by its path, which the checker's "
        "recording shims (first on PATH) cannot stand in for, so the recipe was "
        "not run; call python3 from PATH (or through $ULTRAEP_PYTHON)"
    )
    assert not (real_programs / "python3").exists()
    subprocess.run(["bash", str(by_path)], check=True, capture_output=True)
    assert (real_programs / "python3").exists()  # the control: run, it starts the real program
    (real_programs / "python3").unlink()

    by_variable = write_recipe(
        tmp_path,
        "by_variable",
        '"$PYTHON" -m torch.distributed.run --nproc-per-node 4 "$REPO/pretrain_gpt.py" "$@"',
    )
    launch = rc.capture_launch(by_variable, {"PYTHON": str(real / "python")}, extra_args=tiny_args)
    assert (launch.nproc_per_node, launch.nnodes, launch.args) == (4, 1, tiny_args)
    assert list(real_programs.iterdir()) == []


def test_a_job_submission_is_recorded_not_run(tmp_path, real_programs):
    recipe = write_recipe(tmp_path, "submit", "sbatch --nodes 2 job.sh")
    with pytest.raises(
        rc.RecipeError,
        match=r"runs `sbatch --nodes 2 job.sh`, which submits a batch job: "
        r"recorded, not run",
    ):
        rc.capture_launch(recipe)
    assert list(real_programs.iterdir()) == []


def test_the_user_guide_s_slurm_job_is_read_and_starts_nothing(
    tmp_path, real_programs, monkeypatch
):
    """The user guide's SLURM example as a job script (`srun --ntasks-per-node 1 bash RECIPE`, then
    its baseline): each srun's recipe runs under the same shims and both launches are read, a full
    8-GPU HGX node each (16 nodes); nothing starts."""
    guide = (REPO / "docs" / "user_guide.md").read_text()
    block = guide[guide.index("SLURM example") :].split("```bash\n", 1)[1].split("```", 1)[0]
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n" + block)
    monkeypatch.chdir(REPO)
    run, baseline = rc.capture_launches(job)
    assert (run.nproc_per_node, run.nnodes) == (8, 32) == (baseline.nproc_per_node, baseline.nnodes)
    assert baseline.args == [*run.args, "--moe-balancer", "none"]
    assert (
        rc.capture_launch(
            RECIPES / "qwen3_235b_a22b_ep32_pp8_hgx.sh",
            {
                "DATA_PATH": "/data/corpus_text_document",
                "TOKENIZER_MODEL": "/models/Qwen3-235B-A22B",
                "CHECKPOINT_DIR": "/ckpt/qwen3",
                "WANDB_PROJECT": "moe",
            },
        ).args
        == run.args
    )
    assert list(real_programs.iterdir()) == []
    with pytest.raises(rc.RecipeError, match="launches 2 different trainings"):
        rc.capture_launch(job)
