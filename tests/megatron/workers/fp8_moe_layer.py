"""Worker: fp8 balanced MoE layers against megatron's and a high-precision reference, on N gloo
CPU ranks, with a CPU stand-in for Transformer Engine's fp8 grouped GEMM.

Two MoE layers of megatron's ``TEGroupedMLP`` experts over ``torch_grouped_linear`` (whose fp8
GEMMs, ``te_grouped_fp8``, quantize each group's input, weight and output gradient as TE's grouped
GEMM does, and which follows TE's ``is_first_microbatch`` caching contract) share one
``BalancingContext``, hence one replica experts module. Each of two steps loads new weights into
both (the same for every run: a step's weight update without its rounding history), resets
``is_first_microbatch`` as megatron's schedule does at a step's first microbatch
(``set_is_first_microbatch``, on the layers: the replica module is no submodule), and runs three
microbatches through both layers, forwards before backwards. The layers' hot experts differ, so a
replica module that reused a cast of its first call would compute another layer's (or an earlier
step's) experts. Each layer takes the microbatch's tokens (pushed towards its hot experts), not
the previous layer's output: the router runs in high precision, so every run, the fp32 reference
included, routes every token alike.

Tokens: ``TOKENS`` per rank, top-2 of 8 experts: a hot expert gets a few hundred rows, more than one
128-row block along the tokens, split between its main instance and a replica by the balancer.

Runs: ``reference`` (megatron's MoELayer, fp8 off: fp32 GEMMs, the same tokens, weights and
routing) and ``reference_balanced`` (the balanced layers in fp32: the noise floor of the plan's
reordered sums). Per fp8 recipe (tensorwise, blockwise, mxfp8): megatron's MoELayer (``none``), the
balanced layers (``balanced``), and the negative controls ``stale`` (the replica module's cache
left on, as it was before it was built with ``disable_parameter_transpose_cache``) and
``no_reduction`` (replica gradients never reach the main experts). With fp8 parameters
(``param/``): ``none``, ``balanced``, ``no_reduction``, ``stale_parts`` (the replicas get row-wise
data alone, stale scales and column-wise copies) and, for tensorwise, ``stale_transpose`` (the main
expert's transpose cache moved as if it were data: after a re-quantization TE leaves it stale,
``expert_slots.DERIVED_PARTS``). And ``none`` and ``balanced`` with TE's switches of the scales'
form (``SCALE_VARIANTS``).

Run:  torchrun --standalone --nproc-per-node 2 fp8_moe_layer.py --out-dir DIR
"""

import argparse
import contextlib
import os
import sys

import torch

from ultraep_megatron.megatron.balanced_layer import expert_slots
from ultraep_megatron.megatron.cpu import backend as cpu_backend

from balanced_moe_layer import HIDDEN, NUM_EXPERTS, TOPK, skew
from megatron_setup import load_moe_weights

FFN = 64  # mxfp8 blocks are 1 x 32 along each weight's input dimension (H = 32, F = 64)
SEQ, BATCH = 128, 2  # TOKENS = 256 per rank: a hot expert spans several 128-row blocks
TOKENS = SEQ * BATCH
LAYERS = 2
STEPS = 2
MICROBATCHES = 3
HOT = (
    (0, 1),
    (2, 3),
)  # per layer, all on EP rank 0 at EP2: the replicas of both layers run on rank 1
RECIPES = ("tensorwise", "blockwise", "mxfp8")
#: TE's switches of a recipe's scales (``te_grouped_fp8.POWER_2_SCALES_ENV``), measured without
#: fp8 parameters: tensorwise with power-of-two scales, blockwise with fp32 scales.
SCALE_VARIANTS = {
    "tensorwise-pow2-scales": ("tensorwise", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"),
    "blockwise-fp32-scales": ("blockwise", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"),
}


def layer_weights(layer: int, step: int) -> dict[str, torch.Tensor]:
    """Shapes: router [E, H], fc1 [E, F, H], fc2 [E, H, F]; new for every layer and step."""
    from megatron_setup import moe_weights

    return moe_weights(NUM_EXPERTS, HIDDEN, FFN, seed=4321 + 100 * layer + step)


def build_layers(
    ep_size: int,
    recipe: str | None,
    balanced: bool,
    stale_replica_cache: bool,
    fp8_param: bool = False,
):
    """``LAYERS`` MoE layers (grouped experts, fp8 with ``recipe``, high precision without;
    quantized parameters with ``fp8_param``, megatron's ``--fp8-param-gather``); balanced ones share
    one BalancingContext."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    import toy_fp8
    import torch_grouped_linear
    from megatron_setup import model_parallel, moe_config
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.planner import BalancerConfig

    model_parallel(ep_size)
    config = moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=NUM_EXPERTS,
        topk=TOPK,
        ep=ep_size,
        num_layers=LAYERS,
        moe_grouped_gemm=True,
    )
    if recipe is not None:
        toy_fp8.install_fp8_standins(recipe)
        toy_fp8.enable_fp8(config, recipe)
        config.fp8_param = fp8_param
    spec = torch_grouped_linear.grouped_moe_layer_spec()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    balancing = (
        BalancingContext(
            BalancerConfig(name="ultraep", num_slots=1, min_quota=1),
            ring_size=LAYERS * MICROBATCHES,
        )
        if balanced
        else None
    )
    layers = []
    for number in range(1, LAYERS + 1):
        if balanced:
            layer = BalancedMoELayer(
                config=config,
                submodules=spec.keywords["submodules"],
                pg_collection=pgs,
                is_mtp_layer=False,
                balancing=balancing,
            )
        else:
            layer = spec(config=config, pg_collection=pgs, is_mtp_layer=False)
        layer.set_layer_number(number)
        layers.append(layer)
    if stale_replica_cache:  # the negative control: the replica module's TE cast cache left on
        for module in balancing.replica_experts.module.modules():
            if hasattr(module, "disable_parameter_transpose_cache"):
                module.disable_parameter_transpose_cache = False
    return layers, balancing


def move_stale_parts(layers) -> None:
    """The negative control of fp8 parameters: the weight distribution moves each quantized
    weight's row-wise fp8 data alone; its scales and column-wise copy come from the first expert
    the first call moved (layer 1, step 1), as if the replica slots kept stale ones."""
    snapshot = {}
    for layer in layers:
        layout = layer.layer_experts.layout
        keys = iter(key for parts in layout.parts for key, _, _ in parts)
        fresh = [
            pad is not None or next(keys) in ("data", "rowwise_data") for pad in layout.padding
        ]
        moved = layer.layer_experts.main_weights

        def stale(main_params, moved=moved, fresh=fresh):
            experts = moved(main_params)
            for position, keep in enumerate(fresh):
                snapshot.setdefault(position, experts[0][position].clone())
            return [
                [t if keep else snapshot[i] for i, (t, keep) in enumerate(zip(tensors, fresh))]
                for tensors in experts
            ]

        layer.layer_experts.main_weights = stale


def offloading_refusal(ep_size: int) -> str:
    """A balanced layer built with ``--fine-grained-activation-offloading --offload-modules
    expert_fc1 moe_act`` (no fp8): the layer's own check refuses it (as the startup check does);
    its message, or an empty string if it was built."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    import torch_grouped_linear
    from megatron_setup import moe_config
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.planner import BalancerConfig

    config = moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=NUM_EXPERTS,
        topk=TOPK,
        ep=ep_size,
        moe_grouped_gemm=True,
        fine_grained_activation_offloading=True,
        offload_modules=["expert_fc1", "moe_act"],
    )
    spec = torch_grouped_linear.grouped_moe_layer_spec()
    try:
        BalancedMoELayer(
            config=config,
            submodules=spec.keywords["submodules"],
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            is_mtp_layer=False,
            balancing=BalancingContext(BalancerConfig(name="ultraep", num_slots=1, min_quota=1)),
        )
    except ValueError as refusal:
        return str(refusal)
    return ""


def expert_grads(layer) -> dict:
    return {
        (int(expert), name): getattr(
            getattr(layer.experts, f"linear_{name}"), f"weight{local}"
        ).grad.clone()
        for local, expert in enumerate(layer.local_expert_indices)
        for name in ("fc1", "fc2")
    }


class _Calling:
    """``call`` in the replica experts' place, their other attributes theirs."""

    def __init__(self, call, replicas):
        self._call, self._replicas = call, replicas

    def __call__(self, *args):
        return self._call(*args)

    def __getattr__(self, name):
        return getattr(self._replicas, name)


def replica_bytes_match(layer, weights, slot_weights, recipe: str) -> list[bool]:
    """Per quantized replica weight: whether every storage tensor equals, bit for bit, its main
    expert's (the toy quantizer's storages of the high-precision weight the main expert was loaded
    with, as ``copy_`` quantized it)."""
    import toy_fp8

    invocation = layer.token_dispatcher.invocation
    quantizer = toy_fp8.ToyQuantizer(recipe)
    matches = []
    for expert, tensors in zip(
        invocation.plan.slot_expert[invocation.context.ep_rank].tolist(), slot_weights
    ):
        if expert < 0:
            continue
        for name, weight in zip(("fc1", "fc2"), tensors):
            metadata, want = weight.get_metadata(), quantizer.storages(weights[name][expert])
            # A cache derived from the moved parts is not moved (expert_slots.DERIVED_PARTS).
            matches.append(
                all(
                    torch.equal(metadata[key].view(torch.uint8), value.view(torch.uint8))
                    if metadata[key] is not None
                    else key in expert_slots.DERIVED_PARTS
                    for key, value in want.items()
                    if value is not None
                )
            )
    return matches


def run(layers, balancing, rank: int, recipe: str | None = None) -> dict:
    """``STEPS`` steps of ``MICROBATCHES`` microbatches through the layers; per step the outputs,
    input gradients, router and expert gradients, and per layer the experts the plans replicated.
    With fp8 parameters (``recipe``) the replica weights' bytes are checked against their main
    experts'."""
    replica_calls = [0] * LAYERS  # per layer, calls with rows for this rank's redundant slots
    byte_matches = []  # per quantized replica weight a replica call ran with
    current = {}
    if balancing is not None:
        replicas = balancing.replica_experts

        def counting(slot_weights, *args):
            index = current["layer"]
            replica_calls[index] += 1
            if recipe is not None:
                byte_matches.extend(
                    replica_bytes_match(
                        layers[index], current["weights"][index], slot_weights, recipe
                    )
                )
            return replicas(slot_weights, *args)

        balancing.replica_experts = _Calling(counting, replicas)
        for index, layer in enumerate(layers):

            def compute(*args, index=index, original=layer.routed_experts_compute):
                current["layer"] = index
                return original(*args)

            layer.routed_experts_compute = compute
    steps = []
    for step in range(STEPS):
        weights = current["weights"] = [layer_weights(index, step) for index in range(LAYERS)]
        for layer, w in zip(layers, weights):
            load_moe_weights(layer, w)
            layer.zero_grad(set_to_none=True)
            layer.train()
            layer.set_is_first_microbatch()  # megatron's schedule, at a step's first microbatch
        replicated = [set() for _ in layers]  # per layer, experts with a redundant slot in a plan
        rows = []  # per microbatch and layer: this rank's rows per physical slot (main, then redundant), the plan
        xs, outs, ups = [], [], []
        for mb in range(MICROBATCHES):
            gen = torch.Generator().manual_seed(1000 * (10 * step + mb) + rank)
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).requires_grad_(True)
            up = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
            out = x
            for index, (layer, w, hot) in enumerate(zip(layers, weights, HOT)):
                out = out + layer(skew(x, w, hot))[0]
                if balancing is not None:
                    invocation = layer.token_dispatcher.invocation
                    replicated[index].update(
                        e for e in invocation.plan.slot_expert.reshape(-1).tolist() if e >= 0
                    )
                    rows.append(
                        {
                            "layer": index,
                            "rows_per_slot": invocation.plan.rows_per_slot.tolist(),
                            "slot_expert": invocation.plan.slot_expert.tolist(),
                        }
                    )
            xs.append(x), outs.append(out), ups.append(up)
        for out, up in zip(outs, ups):  # backwards in forward order, as a 1F1B stage does
            (out * up).sum().backward()
        steps.append(
            {
                "out": [o.detach().clone() for o in outs],
                "dx": [x.grad.clone() for x in xs],
                "router_grads": [layer.router.weight.grad.clone() for layer in layers],
                "expert_grads": [expert_grads(layer) for layer in layers],
                "replicated": [sorted(r) for r in replicated],
                "invocations": rows,
            }
        )
    result = {
        "steps": steps,
        "replica_calls": replica_calls,
        "byte_matches": byte_matches,
        "weight_class": type(layers[0].experts.linear_fc1.weight0).__name__,
    }
    if balancing is not None:
        result["replica_grad_dtype"] = str(balancing.slots.buffer.replica_grads.dtype)
    if balancing is not None and recipe is None:
        result["replica_quantizations"] = (
            balancing.replica_experts.module.linear_fc1.fp8_quantizations
        )
        result["replica_cache_disabled"] = (
            balancing.replica_experts.module.linear_fc1.disable_parameter_transpose_cache
        )
        result["main_cache_disabled"] = layers[
            0
        ].experts.linear_fc1.disable_parameter_transpose_cache
    # Casts of the main experts' fc1 weights (the first layer's): once per step, the cache between.
    result["main_quantizations"] = layers[0].experts.linear_fc1.fp8_quantizations
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megatron.core import parallel_state

    from pretrain_grad_dump import FAULTS

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    no_reduction = FAULTS["no_replica_grad_reduction"]  # the gate's negative control
    results = {}
    # fp32: the same tokens, weights and routing; balanced, it gives the fp32 noise floor.
    for key, balanced in (("reference", False), ("reference_balanced", True)):
        layers, balancing = build_layers(world, None, balanced, False)
        results[key] = run(layers, balancing, rank)
    for recipe in RECIPES:
        runs = [
            ("none", False, False),
            ("balanced", True, False),
            ("stale", True, True),
            ("no_reduction", True, False),
        ]
        for key, balanced, stale in runs:
            layers, balancing = build_layers(world, recipe, balanced, stale)
            with no_reduction() if key == "no_reduction" else contextlib.nullcontext():
                results[f"{recipe}/{key}"] = run(layers, balancing, rank)
        # fp8 parameters (--fp8-param-gather): the replicas receive the main experts' quantized bytes.
        runs = ["none", "balanced", "no_reduction", "stale_parts"] + (
            ["stale_transpose"] if recipe == "tensorwise" else []
        )
        for key in runs:
            balanced = key != "none"
            derived = expert_slots.DERIVED_PARTS
            if key == "stale_transpose":  # the transpose cache moved and used as it stands
                expert_slots.DERIVED_PARTS = ()
            try:
                layers, balancing = build_layers(world, recipe, balanced, False, fp8_param=True)
                if key == "stale_parts":
                    move_stale_parts(layers)
                with no_reduction() if key == "no_reduction" else contextlib.nullcontext():
                    results[f"{recipe}/param/{key}"] = run(
                        layers, balancing, rank, recipe if balanced else None
                    )
            finally:
                expert_slots.DERIVED_PARTS = derived
    for variant, (recipe, switch) in SCALE_VARIANTS.items():
        os.environ[switch] = "1"  # read by the stand-in at every GEMM, as TE's recipe reads it
        try:
            for key in ("none", "balanced"):
                layers, balancing = build_layers(world, recipe, key == "balanced", False)
                results[f"{variant}/{key}"] = run(layers, balancing, rank)
        finally:
            del os.environ[switch]
    results["offloading_refusal"] = offloading_refusal(world)
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
