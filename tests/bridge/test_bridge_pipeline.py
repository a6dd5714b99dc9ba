"""Megatron-Bridge's own ``pretrain()`` with pipeline parallelism 2 and virtual pipeline 2 through
Bridge's provider, on the CPU over gloo: 4 ranks, PP 2 x EP 2 (DP 2, expert-DP 1), one decoder
layer per pipeline chunk (4 layers: chunks 0 and 1 of PP rank 0 hold layers 1 and 3, PP rank 1's
layers 2 and 4), the distributed optimizer with overlapped grad reduce and param gather.

Three runs of the same model, state and batches: ``none``; ``none`` with each iteration's
microbatches in reverse order (the noise floor); ``enable_ultraep`` with a load trace. The negative
control (replica gradients not reduced, 1.7e6 times the tolerance here when it ran) is
test_bridge_pretrain.py's, on the same comparison code; here the floor itself is checked to be at
rounding level and to measure something, so no tolerance is vacuous. The routing is
skewed (tests/bridge/test_bridge_pretrain.py's router expert bias) so that every plan replicates
experts; iterations 1 and 2 run at learning rate 0, so every parameter's gradient compares per step.
Also checked: the spec swap keeps the provider's ``vp_stage`` (each chunk's balanced layers have
their own layer numbers), the trace is numbered by Bridge's steps with megatron.training's globals
never set, and the imbalance of every stage's layers reaches Bridge's tensorboard and wandb loggers.

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bridge_helpers import needs_bridge, run_gradients, run_record
import torch
from equivalence import compare_gradients, compare_series, failures, gradient_floors, summary

pytestmark = needs_bridge

SCRIPT = Path(__file__).resolve().parent / "bridge_pretrain.py"
WORLD, PP, VPP, EP = 4, 2, 2, 2
ITERS, LR0_ITERS, MICROBATCHES = 3, 2, 4
#: EP rank 0's experts (0, 1) preferred: rank imbalance well above the trigger.
SKEWED_EXPERT_BIAS = "0.06,0.04,-0.04,-0.06"
COMMON = (
    "--ep", str(EP), "--pp", str(PP), "--vpp", str(VPP), "--iters", str(ITERS), "--overlap",
    "--microbatches", str(MICROBATCHES), "--lr0-iters", str(LR0_ITERS),
    "--expert-bias", SKEWED_EXPERT_BIAS, "--fake-writer",
)  # fmt: skip
#: Above any rounding difference of the floor pair's fp32 gradients (theirs: about 1e-7).
FLOOR_LIMIT = 1e-4
LAST = WORLD - 1  # the last pipeline stage's last rank: the losses and Bridge's writers
#: Megatron's rank order (tp-cp-ep-dp-pp): ranks 0, 1 are PP rank 0, ranks 2, 3 PP rank 1.
PP_RANK = {rank: rank // (WORLD // PP) for rank in range(WORLD)}


def expected_layers(pp_rank: int) -> list[list[int]]:
    """[chunk][MoE layer]: the global layer number of each chunk's one layer."""
    return [[chunk * PP + pp_rank + 1] for chunk in range(VPP)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (out dir, output)} of the three runs."""
    from gloo_launch import launch_gloo_ranks

    root = tmp_path_factory.mktemp("bridge_pp")
    extras = {
        "none": (),
        "none_reversed": ("--reverse-microbatches",),
        "ultraep": ("--ultraep", "--trace-dir", str(root / "trace")),
    }
    return {
        name: (
            root / name,
            launch_gloo_ranks(
                SCRIPT,
                WORLD,
                [root / name, *COMMON, *extra],
                env={"ULTRAEP_CPU_PATCHES": "1"},
                log_path=(root / name).with_suffix(".log"),
            ),
        )
        for name, extra in extras.items()
    }


def _losses(out: Path) -> dict[int, float]:
    steps = json.loads((out / f"losses_rank{LAST}.json").read_text())
    return {it: step["lm loss"] for it, step in enumerate(steps, 1)}


def _comparisons(actual: Path, runs) -> list:
    """Every parameter's gradient at the lr-0 iterations and the loss of every iteration of
    ``actual`` against ``none``, the floors from ``none`` against ``none_reversed``."""
    reference, floor_pair = (
        run_gradients(runs["none"][0], WORLD),
        run_gradients(runs["none_reversed"][0], WORLD),
    )
    iterations = list(range(1, LR0_ITERS + 1))
    floors = gradient_floors(reference, floor_pair, iterations)
    # The floor pair differs by rounding alone: a pipeline whose microbatches leak into each other
    # (PP 2's batched exchange over gloo handing activations to gradient receives) parts them by
    # O(1) and would make every tolerance vacuous.
    assert max(floors.values()) < FLOOR_LIMIT, sorted(floors.items(), key=lambda kv: -kv[1])[:5]
    # A reversed microbatch order changes the sums, or the floor measures nothing.
    assert any(
        not torch.equal(reference[it][name], floor_pair[it][name])
        for it in iterations
        for name in reference[it]
    )
    series = {name: _losses(runs[name][0]) for name in ("none", "none_reversed")}
    return compare_gradients(
        run_gradients(actual, WORLD), reference, floors, iterations
    ) + compare_series(
        "lm loss", _losses(actual), series["none"], series["none"], series["none_reversed"]
    )


def test_pp2_vpp2_enable_ultraep_matches_none_and_balances_every_chunk(runs):
    out = runs["ultraep"][0]
    for rank in range(WORLD):
        record = run_record(out, rank)
        layers = expected_layers(PP_RANK[rank])
        # Every chunk's MoE layer balanced, with its own chunk's layer number: the spec swap passed
        # each chunk's vp_stage to the provider's own spec.
        assert record["moe_layers"] == ["BalancedMoELayer"] * VPP
        assert record["moe_layer_numbers"] == layers, rank
        assert sorted(record["spec_vp_stages"]) == list(range(VPP)), record["spec_vp_stages"]
        assert record["ended_iterations"] == list(range(1, ITERS + 1))
        # Balancing active on every chunk: each layer's plans replicated and lowered the imbalance.
        for step, stats in record["stats"].items():
            assert sorted(map(int, stats)) == sorted(sum(layers, [])), (rank, step, stats)
            for layer, f in stats.items():
                assert f["replicas"] > 0, (rank, step, layer, f)
                assert f["imbalance_before"] > f["imbalance_after"], (rank, step, layer, f)
    comparisons = _comparisons(out, runs)
    series = {name: _losses(runs[name][0]) for name in ("none", "none_reversed", "ultraep")}
    table = [f"{name}: losses {list(series[name].values())}" for name in series]
    table += [
        f"rank {rank} iteration {step} layer {layer}: imbalance {f['imbalance_before']:.3f} -> "
        f"{f['imbalance_after']:.3f}, replicas {f['replicas']:.2f}"
        for rank in (0, LAST)
        for step, stats in run_record(out, rank)["stats"].items()
        for layer, f in stats.items()
    ]
    print("\n".join(table) + "\nPP2 VPP2 ultraep against none: " + summary(comparisons))
    assert not failures(comparisons), failures(comparisons)[:10]


def test_pp2_vpp2_trace_numbered_by_bridges_steps_without_megatron_training_globals(runs):
    from ultraep_megatron.traces import find_trace_files, read_trace

    out = runs["ultraep"][0]
    for rank in range(WORLD):  # Bridge's loop never set megatron.training's args
        assert run_record(out, rank)["megatron_training_args_set"] == [False] * ITERS
    files = find_trace_files(out.parent / "trace")
    assert len(files) == PP  # one EP group per pipeline stage
    seen = set()
    for path in files:
        trace = read_trace(path)
        assert trace.status == "closed"
        layers = sorted(set(trace.layer.tolist()))
        assert layers in [sorted(sum(expected_layers(p), [])) for p in range(PP)], layers
        seen.update(layers)
        keys = sorted(
            zip(trace.iteration.tolist(), trace.layer.tolist(), trace.microbatch.tolist())
        )
        assert keys == sorted(
            (it, layer, mb)
            for it in range(1, ITERS + 1)
            for layer in layers
            for mb in range(MICROBATCHES)
        ), keys
    assert seen == set(range(1, PP * VPP + 1))


def test_pp2_vpp2_every_stages_imbalance_reaches_bridges_loggers(runs):
    """The last rank logs every layer, those of PP rank 0's chunks too, averaged over the ranks
    that hold it, to tensorboard and to wandb (``log(dict, step=)``), each step."""
    out, output = runs["ultraep"]
    records = [run_record(out, rank) for rank in range(WORLD)]
    logged = {(tag, step): value for tag, value, step in records[LAST]["scalars"]}
    wandb = {}
    for data, step in records[LAST]["wandb"]:
        wandb.update({(k, step): v for k, v in data.items() if k.startswith("ultraep/")})
    expected = {}
    for step in range(1, ITERS + 1):
        for layer in range(1, PP * VPP + 1):
            held = [
                r["stats"][str(step)][str(layer)]
                for r in records
                if str(layer) in r["stats"][str(step)]
            ]
            assert len(held) == WORLD // PP
            for key in ("imbalance_before", "imbalance_after"):
                expected[(f"ultraep/layer_{layer}/{key}", step)] = sum(f[key] for f in held) / len(
                    held
                )
    assert {k: logged[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert wandb == pytest.approx(expected, rel=1e-12)
    assert output.count("[ultraep] iteration") == ITERS, output[-3000:]
    assert not any(
        tag.startswith("ultraep/") for tag, _, _ in run_record(runs["none"][0], LAST)["scalars"]
    )
