"""fp8 with current scaling (tensorwise, blockwise, mxfp8) in balanced MoE layers, on 2 gloo CPU
ranks (EP=2), against megatron-core's MoELayer and a high-precision reference, with a CPU stand-in
for Transformer Engine.

What runs: megatron's ``TEGroupedMLP`` over ``torch_grouped_linear``, whose fp8 GEMMs
(``te_grouped_fp8``) quantize each GEMM group's input, weight and output gradient as TE's grouped
GEMM does for each recipe (one quantizer per group: one amax per group under tensorwise; 1 x 128 and
128 x 1 blocks under blockwise, the column-wise ones along the tokens; 1 x 32 and 32 x 1 with E8M0
scales under mxfp8; e4m3 forward, e5m2 gradients), and which caches its weight cast as TE's
``GroupedLinear`` does (``is_first_microbatch``). Not TE's kernels: fp32 GEMMs on the dequantized
operands.

Equivalence under fp8, as torchtitan's MoonEP work gates it: a balanced layer splits a hot
expert's rows between its main instance and replicas, and each part is quantized by its own
group's quantizer, so under fp8 it is not the same computation as ``none``, only the same
mathematics rounded otherwise. Both are measured against a high-precision reference (fp32, the same
tokens, weights and routing): per kind of quantity (outputs, input gradients, router gradients,
expert gradients, the replicated experts' gradients; every rank, step and microbatch concatenated),
``ultraep``'s relative distance to the reference must not exceed ``none``'s by more than 10 %, and
``ultraep``'s distance to ``none`` must not exceed either one's distance to the reference.

Two layers share the replica experts module (``workers/fp8_moe_layer.py``); two steps with new
weights, three microbatches each. Negative controls: replica gradients not reduced, the replica
module's cast cache left on (its behaviour before it was built with
``disable_parameter_transpose_cache``), and with fp8 parameters stale scales and column-wise copies
or a stale transpose: each must fail the gate.
"""

import pytest
import torch

import toy_fp8
from equivalence import relative_difference
from fp8_equivalence import FP8_RESOLUTION, GateRow, concatenated
from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 2
NUM_EXPERTS = 8
RECIPES = ("tensorwise", "blockwise", "mxfp8")
#: TE's switches of a recipe's scales, run without fp8 parameters (the worker's SCALE_VARIANTS).
SCALE_VARIANTS = ("tensorwise-pow2-scales", "blockwise-fp32-scales")
#: Recipe (or variant) -> whether its scales are powers of two (TE's defaults and switches).
POWER_2_SCALES = {
    "tensorwise": False,
    "blockwise": True,
    "mxfp8": True,
    "tensorwise-pow2-scales": True,
    "blockwise-fp32-scales": False,
}
STEPS, MICROBATCHES, LAYERS = 2, 3, 2
KINDS = ("outputs", "input grads", "router grads", "expert grads", "replicated expert grads")
#: The worker's wall time, for the report.
LAUNCH = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import time

    out = tmp_path_factory.mktemp("fp8_layer")
    started = time.perf_counter()
    launch_gloo_ranks(WORKERS / "fp8_moe_layer.py", WORLD, ["--out-dir", out], timeout_s=300)
    LAUNCH["wall_s"] = time.perf_counter() - started
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def quantities(ranks, run: str, plans: str) -> dict[str, torch.Tensor]:
    """Per kind, every tensor of ``run`` over ranks, steps, microbatches and layers, flattened and
    concatenated (float64); the replicated experts are those ``plans`` (a balanced run on the same
    routing) gave a redundant slot in that layer and step."""
    parts = {kind: [] for kind in KINDS}
    for result in ranks:
        for step, replicated in zip(result[run]["steps"], result[plans]["steps"]):
            parts["outputs"] += step["out"]
            parts["input grads"] += step["dx"]
            parts["router grads"] += step["router_grads"]
            for layer, grads in enumerate(step["expert_grads"]):
                for (expert, _), grad in sorted(grads.items()):
                    parts["expert grads"].append(grad)
                    if expert in replicated["replicated"][layer]:
                        parts["replicated expert grads"].append(grad)
    assert parts["replicated expert grads"], f"{plans}: no expert was replicated"
    return {kind: concatenated(ts) for kind, ts in parts.items()}


def gate(ranks, prefix: str, run: str = "balanced") -> list[GateRow]:
    """``prefix + run`` against ``prefix + none``, both against the fp32 reference."""
    plans = f"{prefix}balanced"
    reference = quantities(ranks, "reference", plans)
    none, ultraep = (
        quantities(ranks, f"{prefix}none", plans),
        quantities(ranks, f"{prefix}{run}", plans),
    )
    return [GateRow.of(kind, none[kind], ultraep[kind], reference[kind]) for kind in KINDS]


def prefix_of(recipe: str, param: bool) -> str:
    return f"{recipe}/param/" if param else f"{recipe}/"


def test_a_replicated_expert_spans_several_token_blocks_split_between_main_and_replica(ranks):
    """What the gate must see: an expert whose rows span more than one 128-row block along the
    tokens (blockwise's column-wise blocks) is split between its main instance and a replica on
    another rank, so the parts are quantized by different groups' quantizers."""
    experts_per_rank = NUM_EXPERTS // WORLD
    splits = []  # (main rows, replica rows) per replicated expert and invocation
    for invocations in zip(
        *(result["tensorwise/balanced"]["steps"][0]["invocations"] for result in ranks)
    ):
        rows = [inv["rows_per_slot"] for inv in invocations]
        for expert in {e for slots in invocations[0]["slot_expert"] for e in slots if e >= 0}:
            home, local = divmod(expert, experts_per_rank)
            replica = sum(
                rows[rank][experts_per_rank + slot]
                for rank, slots in enumerate(invocations[0]["slot_expert"])
                for slot, e in enumerate(slots)
                if e == expert
            )
            splits.append((rows[home][local], replica))
    print(f"\n(main, replica) rows of replicated experts: {splits}")
    assert any(main > 0 and replica > 0 and main + replica > 128 for main, replica in splits), (
        splits
    )


@pytest.mark.parametrize("param", [False, True], ids=["hp-params", "fp8-params"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_balanced_layers_pass_the_equivalence_gate(ranks, recipe, param):
    """ultraep's distance to the fp32 reference is within 10 % of none's, and ultraep and none
    are closer to each other than either is to the reference, for every kind of quantity."""
    rows = gate(ranks, prefix_of(recipe, param))
    print(f"\n{recipe}{' fp8 params' if param else ''}:\n  " + "\n  ".join(map(str, rows)))
    assert all(row.passed for row in rows), [str(row) for row in rows if not row.passed]


def test_fp8_equivalence_table(ranks):
    """The table of README's Results and docs/integration.md: per recipe, with and without fp8
    parameters, none's and ultraep's distance to the fp32 reference and their ratio (outputs, all
    expert gradients, the replicated experts' gradients), with TE's scale switches as extra rows.
    Asserts that the table covers every recipe and that the fp32 noise floor (the balanced layers
    in fp32 against the reference) lies far below fp8's error."""
    plans = "tensorwise/balanced"
    reference = quantities(ranks, "reference", plans)
    fp32 = quantities(ranks, "reference_balanced", plans)
    fp32_floor = {kind: relative_difference(fp32[kind], reference[kind]) for kind in KINDS}
    shown = ("outputs", "expert grads", "replicated expert grads")
    lines = [
        "| recipe | fp8 params | "
        + " | ".join(f"{k}: none / ultraep (ratio)" for k in shown)
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in shown) + " |",
    ]
    cases = [(recipe, param) for recipe in RECIPES for param in (False, True)] + [
        (v, False) for v in SCALE_VARIANTS
    ]
    for recipe, param in cases:
        rows = {row.kind: row for row in gate(ranks, prefix_of(recipe, param))}
        cells = [f"{rows[k].none:.3e} / {rows[k].ultraep:.3e} ({rows[k].ratio:.3f})" for k in shown]
        lines.append(f"| {recipe} | {'yes' if param else 'no'} | " + " | ".join(cells) + " |")
    print(
        "\nfp8 equivalence: relative distance to the fp32 reference (same tokens, weights, routing)\n"
        + "\n".join(lines)
        + "\nfp32 floor (balanced vs reference, both fp32): "
        + ", ".join(f"{k} {v:.2e}" for k, v in fp32_floor.items())
        + (f"\nworker wall time {LAUNCH['wall_s']:.1f} s" if "wall_s" in LAUNCH else "")
    )
    fp8_error = min(row.none for row in gate(ranks, "tensorwise/"))
    assert max(fp32_floor.values()) < FP8_RESOLUTION * fp8_error, fp32_floor


@pytest.mark.parametrize("recipe", RECIPES + SCALE_VARIANTS)
def test_only_fp32_scales_let_the_split_change_the_rounding(ranks, recipe):
    """With power-of-two scales (blockwise and mxfp8 by default, tensorwise with TE's
    ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``) a part of an expert's rows quantized with its
    own amax rounds every element in e4m3 / e5m2's normal range exactly as the whole would (the
    scales differ by a power of two): ultraep and none differ by far less than fp8 rounds
    (``FP8_RESOLUTION`` of it), the fp32 reordering of the split sums. With fp32 scales (tensorwise
    by default, blockwise with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``) the replicated experts'
    gradients are rounded otherwise: the stand-in sees the split (a positive control of the
    quantization per group)."""
    rows = {row.kind: row for row in gate(ranks, f"{recipe}/")}
    worst = max(rows.values(), key=lambda row: row.between / row.none)
    replicated = rows["replicated expert grads"]
    print(
        f"\n{recipe}: ultraep-none / none-reference at most {worst.between / worst.none:.3g} ({worst.kind}); "
        f"replicated expert grads {replicated.between / replicated.none:.3g}"
    )
    if POWER_2_SCALES[recipe]:
        assert all(row.between <= FP8_RESOLUTION * row.none for row in rows.values()), [
            str(r) for r in rows.values()
        ]
    else:
        assert replicated.between > FP8_RESOLUTION * replicated.none, str(replicated)


def assert_control_fails_the_gate(ranks, prefix: str, run: str) -> float:
    """The negative control ``prefix + run`` fails the gate; returns its margin: ultraep's
    distance to the reference over the gate's bound, on the kind it misses most."""
    rows = gate(ranks, prefix, run)
    failed = [row for row in rows if not row.passed]
    assert failed, f"{prefix}{run} passed the gate: " + "; ".join(map(str, rows))
    worst = max(rows, key=lambda row: row.ratio)
    print(
        f"\n{prefix}{run}: fails the gate on {', '.join(r.kind for r in failed)}; "
        f"worst {worst.kind}: ultraep {worst.ratio:.3g}x none's distance, {worst.margin:.3g}x the bound"
    )
    return worst.margin


@pytest.mark.parametrize("param", [False, True], ids=["hp-params", "fp8-params"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_negative_control_unreduced_replica_gradients_fail_the_gate(ranks, recipe, param):
    """Replica gradients never reach the main experts: the replicated experts' gradients miss
    their replicas' rows, by far more than fp8's rounding."""
    margin = assert_control_fails_the_gate(ranks, prefix_of(recipe, param), "no_reduction")
    assert margin > 2, margin


@pytest.mark.parametrize("recipe", RECIPES)
def test_negative_control_a_cached_replica_cast_fails_the_gate(ranks, recipe):
    """The replica module with TE's cast cache on quantizes once, at its first call (layer 1,
    microbatch 0), and computes every later replica with that cast: layer 2's and step 2's
    replicas run on another expert's weights."""
    for result in ranks:
        stale = result[f"{recipe}/stale"]
        if sum(stale["replica_calls"]):
            assert stale["replica_quantizations"] == 1, stale["replica_quantizations"]
    assert assert_control_fails_the_gate(ranks, f"{recipe}/", "stale") > 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_parameters_are_quantized_tensors_with_fp32_replica_gradients(ranks, recipe):
    """``--fp8-param-gather``: the main expert weights are quantized tensors (row- and column-wise
    fp8 data and scales); the replicas receive their bytes and compute with them as they are, the
    input gradient with the column-wise copy; replica gradients in fp32."""
    quantized = type(toy_fp8.ToyQuantizer(recipe).quantize(torch.zeros(32, 32))).__name__
    for result in ranks:
        assert result[f"{recipe}/param/balanced"]["replica_grad_dtype"] == "torch.float32"
        assert all(
            result[f"{recipe}/param/{key}"]["weight_class"] == quantized
            for key in ("none", "balanced")
        ), quantized
        assert result[f"{recipe}/balanced"]["weight_class"] == "Parameter"


@pytest.mark.parametrize("recipe", RECIPES)
def test_replicas_hold_their_main_experts_quantized_bytes(ranks, recipe):
    """Every quantized weight a replica call ran with holds its main expert's storage tensors bit
    for bit (data, scales, column-wise copy); in the negative control (row-wise data moved alone,
    stale scales and column-wise copy) they do not."""
    matches = [m for result in ranks for m in result[f"{recipe}/param/balanced"]["byte_matches"]]
    assert matches and all(matches), matches
    stale = [m for result in ranks for m in result[f"{recipe}/param/stale_parts"]["byte_matches"]]
    assert stale and not all(stale), stale


@pytest.mark.parametrize("recipe", RECIPES)
def test_negative_control_stale_scales_and_columnwise_copies_fail_the_gate(ranks, recipe):
    """The replicas receive each quantized weight's row-wise fp8 data alone, with the scales and
    column-wise copy of another expert (the first one moved): the gate must fail."""
    assert assert_control_fails_the_gate(ranks, f"{recipe}/param/", "stale_parts") > 2


def test_negative_control_a_moved_stale_transpose_fails_the_gate(ranks):
    """tensorwise fp8 parameters: TE leaves a Float8Tensor's transpose cache stale when megatron
    re-quantizes the parameter, and get_metadata() still returns it. Moved as if it were data (not
    rebuilt from the moved data), the replicas' input gradients use last step's transpose."""
    assert assert_control_fails_the_gate(ranks, "tensorwise/param/", "stale_transpose") > 2


def test_the_replica_module_quantizes_its_weights_at_every_call(ranks):
    """The mechanism behind the equivalence: the replica module is built with megatron's
    ``disable_parameter_transpose_cache`` (TE gets ``is_first_microbatch=None``), the main experts
    are not and cast once per step; replicas of both layers ran in that one module on some rank;
    replica gradients are reduced in fp32."""
    both_layers = False
    for rank, result in enumerate(ranks):
        for recipe in RECIPES:
            balanced = result[f"{recipe}/balanced"]
            assert (
                balanced["replica_cache_disabled"] is True
                and balanced["main_cache_disabled"] is False
            )
            assert balanced["replica_quantizations"] == sum(balanced["replica_calls"]), balanced
            assert balanced["main_quantizations"] == STEPS, balanced["main_quantizations"]
            assert balanced["replica_grad_dtype"] == "torch.float32"
            both_layers |= all(calls > 0 for calls in balanced["replica_calls"])
    assert both_layers, (
        "no rank ran the replicas of both layers: the shared module is not exercised"
    )


def test_replica_experts_are_built_without_activation_offloading(ranks):
    """``--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act`` is refused by
    the balanced layer's own check on its config, as by the startup check (megatron offloads CUDA
    tensors only: no test here runs its offloading with a balanced layer)."""
    for result in ranks:
        assert (
            "--fine-grained-activation-offloading is not supported" in result["offloading_refusal"]
        ), result["offloading_refusal"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_toy_quantizer_rounds_to_fp8_per_tensor_or_block(recipe):
    """A real fp8 rounding (so a stale cast is visible), scaled per tensor or per block: a cast is
    its own cast, within e4m3's precision of the weight, and under the block recipes scaling one
    block changes that block's cast alone."""
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    cast = toy_fp8.quantize_weight(weight, recipe)
    error = relative_difference(cast, weight)
    assert 1e-3 < error < 2.0**-4, error  # e4m3: 3 mantissa bits
    assert torch.equal(toy_fp8.quantize_weight(cast, recipe), cast)
    scaled = weight.clone()
    scaled[:16, :32] *= 100.0
    changed = toy_fp8.quantize_weight(scaled, recipe) != cast
    changed[:16, :32] = False
    if recipe == "tensorwise":
        assert changed.any(), "one per-tensor scale: a larger block rescales every element"
    else:
        assert not changed.any(), "per-block scales: the other blocks' casts must not change"
