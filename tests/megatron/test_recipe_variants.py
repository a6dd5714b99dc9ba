"""What we ship is what we test: each rack-scale recipe, shrunk to CPU size, trains with
``--moe-balancer ultraep`` as with ``none``.

The variant of a recipe is derived from the recipe file itself (``recipe_variants.py``: its launch is
captured, sizes shrunk, CPU-impossible flags dropped with their reason), so a flag added to a recipe
reaches its test. Each variant runs on megatron-core's training loop (workers/pretrain_grad_dump.py)
from one initial checkpoint (saved on one rank): ``none`` and ``ultraep`` in the variant's layout,
and ``none`` with another EP size on the same ranks (every expert's gradient summed over other row
partitions, the same mathematics), the noise floor. In bf16 that floor is bf16 rounding of the
expert GEMMs, which is what balancing changes too (a replica computes some of an expert's rows);
a floor pair that only changed the data-parallel size would share every GEMM and measure fp32
reduction order alone. ``LR0`` iterations at learning rate 0 compare every reduced gradient per
step; ``ADAM`` more the trajectory. A recipe whose variant exercises nothing the running variants
do not (its layout and every flag with its word values: ``recipe_variants.covering_runs``) is
covered by them and adds no run; recipes whose variants are the same share one set of runs.
"""

from __future__ import annotations

import shutil

import pytest

from equivalence import failures, per_step_comparisons, summary, trajectory_comparisons
from megatron_runs import launch_dump_run, save_initial_checkpoint
from recipe_variants import EP, RECIPES, behaviour, covering_runs, small_scale_variant

pytestmark = pytest.mark.slow

# Three Adam iterations: over fewer, the bf16 floor pair has not yet drifted apart as far as
# trajectories of the same mathematics do (measured: over iterations 3-4 the floor was 1.7e-7 and a
# correct balanced run 2.2e-6; over 4-6, floors of 1e-5 and more).
LR0, ADAM = 3, 3
LR0_ITERATIONS = list(range(1, LR0 + 1))
TRAINED = list(range(LR0 + 1, LR0 + ADAM + 1))


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory):
    """recipe -> (variant, {run: DumpRun}, the recipe whose runs these are), launched once per
    distinct variant, on first use."""
    done = {}

    def get(recipe):
        variant = small_scale_variant(recipe)
        if variant.key not in done:
            root = tmp_path_factory.mktemp(variant.name)
            save_initial_checkpoint(root / "initial", variant.launch_args("none", train_iters=1))
            load = ["--load", str(root / "initial" / "ckpt"), "--finetune", "--ckpt-format", "torch_dist"]
            runs = {}
            for run, balancer, ep in (("none", "none", EP), ("none_floor", "none", variant.floor_ep),
                                      ("ultraep", "ultraep", EP)):
                args = variant.launch_args(balancer, train_iters=LR0 + ADAM, ep=ep)
                runs[run] = launch_dump_run(root / run, variant.layout.world, [*args, *load],
                                            {"ULTRAEP_LR0_ITERS": str(LR0)})
            done[variant.key] = (runs, variant.name)
        runs, owner = done[variant.key]
        return variant, runs, owner

    return get


def test_every_recipe_has_a_variant():
    names = {recipe.name for recipe in RECIPES}
    assert len(names) >= 4 and all(name.endswith(".sh") for name in names), names


@pytest.fixture(scope="module")
def covered():
    """{recipe stem: the variants that exercise all its variant does}, for the covered ones."""
    return covering_runs([small_scale_variant(recipe) for recipe in RECIPES])


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_small_scale_variant_matches_none(variant_runs, covered, recipe):
    if recipe.stem in covered:
        by = covered[recipe.stem]
        variant = small_scale_variant(recipe)
        exercised = set().union(*(behaviour(small_scale_variant(recipe.parent / f"{name}.sh")) for name in by))
        assert behaviour(variant) <= exercised
        assert all(name not in covered for name in by)  # those run (their own parametrization)
        print(f"\n{variant.name}: covered, no run of its own: its layout and every flag (with its word "
              f"values) run in the variants of {', '.join(by)}")
        return
    variant, runs, owner = variant_runs(recipe)
    print(f"\n{variant.name}: {variant.layout.world} ranks (PP {variant.layout.pipeline}, EP {EP}, "
          f"expert-DP {variant.layout.expert_data}); floor partner EP {variant.floor_ep}"
          + (f"; the same variant as {owner}'s: its runs" if owner != variant.name else ""))
    for flag, reason in variant.dropped.items():
        print(f"  dropped {flag}: {reason}")
    print(f"  shrunk {', '.join(variant.shrunk)}; kept as in the recipe: {' '.join(variant.kept)}")
    per_step = per_step_comparisons(runs["ultraep"], runs["none"], runs["none"], runs["none_floor"],
                                    LR0_ITERATIONS, LR0_ITERATIONS)
    print(f"  per step: {summary(per_step)}")
    trajectory = trajectory_comparisons(runs["ultraep"], runs["none"], runs["none"], runs["none_floor"], TRAINED)
    print(f"  trajectory: {summary(trajectory)}")
    assert not failures(per_step), "\n".join(failures(per_step)[:20])
    assert not failures(trajectory), failures(trajectory)
    balanced = [layer for record in runs["ultraep"].records.values()
                for layer, stats in record["balancer"].items() if stats["replicas"] > 0]
    assert balanced, "the balancer never replicated: the variant does not exercise it"


def test_a_flag_added_to_a_recipe_reaches_its_variant(tmp_path):
    """The variant is the recipe's launch: a flag added to the recipe file is in the variant's
    arguments, as the recipe has it, with nobody editing the test."""
    recipes = tmp_path / "recipes"
    shutil.copytree(RECIPES[0].parent, recipes)  # with what the recipes source (common.sh, models/)
    recipe = recipes / "qwen3_235b_a22b_ep64_dp4.sh"
    text = recipe.read_text()
    assert "\nPARALLEL_ARGS=(\n" in text
    recipe.write_text(text.replace("\nPARALLEL_ARGS=(\n", "\nMOE_ARGS+=(--moe-z-loss-coeff 1e-3)\nPARALLEL_ARGS=(\n", 1))
    before, after = small_scale_variant(RECIPES[0].parent / recipe.name), small_scale_variant(recipe)
    assert "--moe-z-loss-coeff" not in before.args
    i = after.args.index("--moe-z-loss-coeff")
    assert after.args[i + 1] == "1e-3" and "--moe-z-loss-coeff" in after.kept
    assert [a for a in after.args if a not in ("--moe-z-loss-coeff", "1e-3")] == before.args
