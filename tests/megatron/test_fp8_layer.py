"""fp8 with current scaling (tensorwise, blockwise, mxfp8) in balanced MoE layers, on 2 gloo CPU
ranks (EP=2), against megatron-core's MoELayer, with a CPU stand-in for Transformer Engine.

What runs: megatron's ``TEGroupedMLP`` over ``torch_grouped_linear``, which under fp8 computes with
``toy_fp8``'s quantized weights (real e4m3 rounding, current scaling per tensor, per 16 x 16 block,
or per 1 x 32 block with power-of-two scales) and caches its cast as TE's ``GroupedLinear`` does
(``is_first_microbatch``). Not TE's kernels: this checks the mechanism (which weights the replica
experts quantize, and when), not TE's numerics.

Two MoE layers share the replica experts module (``workers/fp8_moe_layer.py``); two steps with new
weights, three microbatches each. The balanced layers must give megatron's outputs and gradients to
the noise floor of megatron's layers on permuted tokens (equivalence.py); with the replica module's
cast cache left on (its behaviour before it was built with ``disable_parameter_transpose_cache``),
the comparison must fail.
"""

import pytest
import torch

import toy_fp8
from equivalence import NOISE_MULTIPLE, Comparison, failures, noise_floor, relative_difference, summary
from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 2
RECIPES = ("tensorwise", "blockwise", "mxfp8")
STEPS, MICROBATCHES, LAYERS = 2, 3, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_layer")
    launch_gloo_ranks(WORKERS / "fp8_moe_layer.py", WORLD, ["--out-dir", out], timeout_s=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def comparisons(ranks, recipe: str, key: str, param: bool = False) -> list[Comparison]:
    """Every step's outputs, input gradients, router and expert gradients of both layers, ``key``
    (balanced, stale) against megatron's, each with its floor: megatron's layers on permuted tokens
    against themselves."""
    out = []
    for rank, result in enumerate(ranks):
        prefix = f"{recipe}/param/" if param else f"{recipe}/"
        runs = [result[f"{prefix}{k}"]["steps"] for k in (key, "none", "none_permuted")]
        for step, (actual, reference, permuted) in enumerate(zip(*runs)):
            quantities = [(f"{what} {mb}", actual[what][mb], reference[what][mb], permuted[what][mb])
                          for what in ("out", "dx") for mb in range(MICROBATCHES)]
            for layer in range(LAYERS):
                quantities.append((f"layer {layer + 1} router grad", actual["router_grads"][layer],
                                   reference["router_grads"][layer], permuted["router_grads"][layer]))
                quantities += [(f"layer {layer + 1} expert {expert} {name} grad", grad,
                                reference["expert_grads"][layer][expert, name],
                                permuted["expert_grads"][layer][expert, name])
                               for (expert, name), grad in actual["expert_grads"][layer].items()]
            out += [Comparison(f"rank {rank} step {step} {what}", relative_difference(a, r),
                               noise_floor([relative_difference(p, r)]))
                    for what, a, r, p in quantities]
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_balanced_layers_give_megatrons_outputs_and_gradients(ranks, recipe):
    compared = comparisons(ranks, recipe, "balanced")
    print(f"\n{recipe}: {summary(compared)}")
    assert not failures(compared), failures(compared)


@pytest.mark.parametrize("recipe", RECIPES)
def test_negative_control_a_cached_replica_cast_fails_the_comparison(ranks, recipe):
    """The replica module with TE's cast cache on quantizes once, at its first call (layer 1,
    microbatch 0), and computes every later replica with that cast: layer 2's and step 2's
    replicas run on another expert's weights."""
    for result in ranks:
        stale = result[f"{recipe}/stale"]
        if sum(stale["replica_calls"]):
            assert stale["replica_quantizations"] == 1, stale["replica_quantizations"]
    compared = comparisons(ranks, recipe, "stale")
    failed = [c for c in compared if not c.passed]
    assert failed, "a stale replica cast changed nothing"
    print(f"\n{recipe} stale: {len(failed)} of {len(compared)} over tolerance, error/tolerance "
          f"{min(c.ratio for c in failed):.3g} to {max(c.ratio for c in failed):.3g}")
    assert max(c.ratio for c in failed) > 1e3 * NOISE_MULTIPLE, failed[:5]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_parameters_balanced_layers_give_megatrons_outputs_and_gradients(ranks, recipe):
    """``--fp8-param-gather``: the main expert weights are quantized tensors (row- and column-wise
    fp8 data and scales); the replicas receive their bytes and compute with them as they are, the
    input gradient with the column-wise copy; replica gradients in fp32."""
    compared = comparisons(ranks, recipe, "balanced", param=True)
    print(f"\n{recipe} fp8 params: {summary(compared)}")
    assert not failures(compared), failures(compared)
    for result in ranks:
        assert result[f"{recipe}/param/balanced"]["replica_grad_dtype"] == "torch.float32"
        quantized = type(toy_fp8.ToyQuantizer(recipe).quantize(torch.zeros(32, 32))).__name__
        assert all(result[f"{recipe}/param/{key}"]["weight_class"] == quantized
                   for key in ("none", "none_permuted", "balanced")), quantized
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


def assert_fp8_parameter_control_fails(ranks, recipe: str, run: str) -> None:
    """A negative control of fp8 parameters (``param/<run>``) fails the comparison by far more than
    its tolerance."""
    compared = comparisons(ranks, recipe, run, param=True)
    failed = [c for c in compared if not c.passed]
    assert failed, f"{recipe} {run} changed nothing"
    print(f"\n{recipe} {run}: {len(failed)} of {len(compared)} over tolerance, error/tolerance "
          f"{min(c.ratio for c in failed):.3g} to {max(c.ratio for c in failed):.3g}")
    assert max(c.ratio for c in failed) > 1e3 * NOISE_MULTIPLE, failed[:5]


@pytest.mark.parametrize("recipe", RECIPES)
def test_negative_control_stale_scales_and_columnwise_copies_fail_the_comparison(ranks, recipe):
    """The replicas receive each quantized weight's row-wise fp8 data alone, with the scales and
    column-wise copy of another expert (the first one moved): the comparison must fail."""
    assert_fp8_parameter_control_fails(ranks, recipe, "stale_parts")


def test_negative_control_a_moved_stale_transpose_fails_the_comparison(ranks):
    """tensorwise fp8 parameters: TE leaves a Float8Tensor's transpose cache stale when megatron
    re-quantizes the parameter, and get_metadata() still returns it. Moved as if it were data (not
    rebuilt from the moved data), the replicas' input gradients use last step's transpose."""
    assert_fp8_parameter_control_fails(ranks, "tensorwise", "stale_transpose")


def test_the_replica_module_quantizes_its_weights_at_every_call(ranks):
    """The mechanism behind the equivalence: the replica module is built with megatron's
    ``disable_parameter_transpose_cache`` (TE gets ``is_first_microbatch=None``), the main experts
    are not and cast once per step; replicas of both layers ran in that one module on some rank;
    replica gradients are reduced in fp32."""
    both_layers = False
    for rank, result in enumerate(ranks):
        for recipe in RECIPES:
            balanced = result[f"{recipe}/balanced"]
            assert balanced["replica_cache_disabled"] is True and balanced["main_cache_disabled"] is False
            assert balanced["replica_quantizations"] == sum(balanced["replica_calls"]), balanced
            assert balanced["main_quantizations"] == STEPS, balanced["main_quantizations"]
            assert balanced["replica_grad_dtype"] == "torch.float32"
            both_layers |= all(calls > 0 for calls in balanced["replica_calls"])
    assert both_layers, "no rank ran the replicas of both layers: the shared module is not exercised"


def test_replica_experts_are_built_without_activation_offloading(ranks):
    """``--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act``: the main
    experts offload (and fc1 saves its original input for it), the replica experts module does
    not (its weights are views of the shared buffer, kept by the balanced layer's own hooks)."""
    for result in ranks:
        flags = result["offloading"]
        assert all(flags["main"].values()), flags
        assert not any(flags["replica"].values()), flags


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_toy_quantizer_rounds_to_fp8_per_tensor_or_block(recipe):
    """A real fp8 rounding (so a stale cast is visible), scaled per tensor or per block: a cast is
    its own cast, within e4m3's precision of the weight, and under the block recipes scaling one
    block changes that block's cast alone."""
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    cast = toy_fp8.quantize_weight(weight, recipe)
    error = relative_difference(cast, weight)
    assert 1e-3 < error < 2.0 ** -4, error  # e4m3: 3 mantissa bits
    assert torch.equal(toy_fp8.quantize_weight(cast, recipe), cast)
    scaled = weight.clone()
    scaled[:16, :32] *= 100.0
    changed = toy_fp8.quantize_weight(scaled, recipe) != cast
    changed[:16, :32] = False
    if recipe == "tensorwise":
        assert changed.any(), "one per-tensor scale: a larger block rescales every element"
    else:
        assert not changed.any(), "per-block scales: the other blocks' casts must not change"
