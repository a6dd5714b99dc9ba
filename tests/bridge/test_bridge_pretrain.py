"""Megatron-Bridge's own ``pretrain()`` on the CPU over gloo, in the production layout: 4 ranks,
EP 2 with expert-DP 2, the distributed optimizer with overlapped grad reduce and param gather.

Four runs of the same model, state and batches: ``none``; ``none`` with each iteration's microbatches
in reverse order (the noise floor: the same sums in another order); ``enable_ultraep``; and
``enable_ultraep`` with the fault ``no_replica_grad_reduction`` (the negative control). The routing
is skewed (a router expert bias preferring EP rank 0's experts) so that the plans replicate experts.
Iterations 1 and 2 run at learning rate 0: each computes every parameter's gradient from the same
parameters on a new batch, so the runs compare per step (tests/megatron/equivalence.py).

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from bridge_helpers import needs_bridge, run_gradients, run_record
from equivalence import compare_gradients, compare_series, failures, gradient_floors, summary

pytestmark = needs_bridge

SCRIPT = Path(__file__).resolve().parent / "bridge_pretrain.py"
ITERS = 3
LR0_ITERS = 2  # iterations 1..2 at learning rate 0: per-step gradients compared
#: EP rank 0's experts (0, 1) preferred: rank imbalance well above the trigger.
SKEWED_EXPERT_BIAS = "0.06,0.04,-0.04,-0.06"
COMMON = (
    "--ep", "2", "--iters", str(ITERS), "--overlap", "--microbatches", "3",
    "--lr0-iters", str(LR0_ITERS), "--expert-bias", SKEWED_EXPERT_BIAS, "--fake-writer",
)  # fmt: skip
RUNS = {
    "none": (),
    "none_reversed": ("--reverse-microbatches",),
    "ultraep": ("--ultraep",),
    "ultraep_fault": ("--ultraep", "--fault", "no_replica_grad_reduction"),
}


def _run(out: Path, *extra: str) -> str:
    from gloo_launch import launch_gloo_ranks

    return launch_gloo_ranks(
        SCRIPT,
        4,
        [out, *COMMON, *extra],
        env={"ULTRAEP_CPU_PATCHES": "1"},
        log_path=out.with_suffix(".log"),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Bridge's pretrain() for each of RUNS: {name: (out dir, output)}."""
    root = tmp_path_factory.mktemp("bridge")
    return {name: (root / name, _run(root / name, *extra)) for name, extra in RUNS.items()}


def _losses(out: Path) -> list[list[float]]:
    return [
        [step["lm loss"] for step in json.loads((out / f"losses_rank{r}.json").read_text())]
        for r in range(4)
    ]


def _comparisons(actual: Path, runs) -> list:
    """Every parameter's gradient at the lr-0 iterations and the loss of every iteration of
    ``actual`` against ``none``, the floors from ``none`` against ``none_reversed``."""
    reference, floor_pair = (
        run_gradients(runs["none"][0], 4),
        run_gradients(runs["none_reversed"][0], 4),
    )
    iterations = list(range(1, LR0_ITERS + 1))
    floors = gradient_floors(reference, floor_pair, iterations)
    comparisons = compare_gradients(run_gradients(actual, 4), reference, floors, iterations)
    series = {name: dict(enumerate(_losses(runs[name][0])[0], 1)) for name in runs}
    series["actual"] = dict(enumerate(_losses(actual)[0], 1))
    return comparisons + compare_series(
        "lm loss", series["actual"], series["none"], series["none"], series["none_reversed"]
    )


def test_enable_ultraep_balances_every_moe_layer_and_matches_none(runs):
    out, _ = runs["ultraep"]
    for rank in range(4):
        record = run_record(out, rank)
        assert record["moe_layers"] == ["BalancedMoELayer"] * 2
        # The iteration hook (installed at on_train_start) fired once per iteration, numbered by
        # Bridge's train_state.step.
        assert record["ended_iterations"] == list(range(1, ITERS + 1))
        # Balancing active: every layer's plans replicated experts and lowered the imbalance.
        for step, layers in record["stats"].items():
            assert sorted(layers) == ["1", "2"], (step, layers)
            for layer, figures in layers.items():
                assert figures["replicas"] > 0, (rank, step, layer, figures)
                assert figures["imbalance_before"] > figures["imbalance_after"], figures
    comparisons = _comparisons(out, runs)
    table = [
        f"{name}: losses {_losses(runs[name][0])[0]}"
        for name in ("none", "none_reversed", out.name)
    ]
    stats = run_record(out, 0)["stats"]
    table += [
        f"iteration {step} layer {layer}: imbalance {f['imbalance_before']:.3f} -> "
        f"{f['imbalance_after']:.3f}, replicas {f['replicas']:.2f}"
        for step, layers in stats.items()
        for layer, f in layers.items()
    ]
    print("\n".join(table) + "\nultraep against none: " + summary(comparisons))
    assert not failures(comparisons), failures(comparisons)[:10]


def test_negative_control_unreduced_replica_gradients_fail(runs):
    comparisons = _comparisons(runs["ultraep_fault"][0], runs)
    failed = [c for c in comparisons if not c.passed]
    print("no_replica_grad_reduction against none: " + summary(comparisons))
    assert failed, "the comparison does not see replica gradients left out"
    # The replicated experts' weights are the ones off, by far more than the floor.
    assert all(re.search(r"local_experts|lm loss", c.what) for c in failed), failed[:5]
    assert max(c.ratio for c in failed) > 100, summary(comparisons)


def test_imbalance_reaches_bridges_logger(runs):
    """On the last rank (Bridge's writers), each layer's figures averaged over the ranks (the two
    EP groups' data differ), to tensorboard and to wandb (``log(dict, step=)``)."""
    out, output = runs["ultraep"]
    records = [run_record(out, rank) for rank in range(4)]
    logged = {(tag, step): value for tag, value, step in records[3]["scalars"]}
    wandb = {(k, step): v for data, step in records[3]["wandb"] for k, v in data.items()}
    for step, layers in records[3]["stats"].items():
        for layer in layers:
            for key in ("imbalance_before", "imbalance_after"):
                mean = sum(r["stats"][step][layer][key] for r in records) / len(records)
                tag = (f"ultraep/layer_{layer}/{key}", int(step))
                assert logged[tag] == pytest.approx(mean, rel=1e-12) == wandb[tag]
    assert output.count("[ultraep] iteration") == ITERS, output[-3000:]
    assert not any(
        tag.startswith("ultraep/") for tag, _, _ in run_record(runs["none"][0], 3)["scalars"]
    )


def test_bridge_pretrain_runs_in_the_production_layout(runs):
    tmp_path, output = runs["none"]
    # The CPU backend covered Bridge's own initialize (not only megatron.training's).
    assert "megatron.bridge.training.initialize.torch" in output
    per_rank = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in range(4)]
    assert all(len(losses) == ITERS for losses in per_rank)
    first = [step["lm loss"] for step in per_rank[0]]
    assert all(math.isfinite(loss) for loss in first)
    # Bridge averages the loss over data-parallel ranks: every rank logs the same figure.
    for losses in per_rank[1:]:
        assert [step["lm loss"] for step in losses] == first
