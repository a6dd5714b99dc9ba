"""megatron-core's TEGroupedMLP over the pure-torch grouped linears vs megatron's SequentialMLP.

Both MoELayers (top-2 of 8 experts, fp32, one gloo CPU rank) get the same router and expert weights
and tokens; the grouped one must give the same outputs, input gradients, router gradients and
per-expert weight (and bias) gradients, for SwiGLU and GELU experts with and without linear biases.
Expert 7 is starved by the router so the empty-expert path is covered. Also checked: parameter
attributes megatron's DDP/optimizer read match SequentialMLP's (EP=1 and an EP=2 config), and a
distributed checkpoint saved from the SequentialMLP layer loads into the grouped one.

This file is also the worker: the fixture runs it under torchrun (1 rank), since the CPU backend
patches torch for the life of a process and must stay out of the pytest process.
Run directly:  torchrun --standalone --nproc-per-node 1 test_torch_grouped_linear.py --out F
"""

import argparse
from pathlib import Path

import pytest
import torch

from ultraep_megatron.megatron.release import compat

NUM_EXPERTS = 8
HIDDEN = 32
FFN = 24
TOPK = 2
SEQ, BATCH = 16, 2
STARVED_EXPERT = 7
RTOL = 1e-5
#: The delayed-wgrad contract's precisions: high precision and megatron's fp8 recipes (``--fp8-recipe``),
#: with high-precision and with quantized parameters (``-param``: ``--fp8-param-gather``).
DELAYED_PRECISIONS = (
    "fp32",
    "tensorwise",
    "blockwise",
    "mxfp8",
    "tensorwise-param",
    "blockwise-param",
    "mxfp8-param",
)
#: The fp8 contract's output width (mxfp8 quantizes output gradients in 1 x 32 blocks along it).
FP8_WIDTH = 64
# name -> (gated_linear_unit, activation, add_bias_linear)
SCENARIOS = {
    "swiglu": (True, "silu", False),
    "swiglu-bias": (True, "silu", True),
    "gelu": (False, "gelu", False),
    "gelu-bias": (False, "gelu", True),
}
ATTRIBUTES = ("allreduce", "tensor_model_parallel", "partition_dim", "sequence_parallel")


# ----------------------------------------------------------------------------- worker (torchrun)


def make_config(glu: bool, activation: str, bias: bool, grouped: bool, ep_size: int = 1):
    import torch.nn.functional as F
    from megatron_setup import moe_config

    return moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=NUM_EXPERTS,
        topk=TOPK,
        ep=ep_size,
        moe_grouped_gemm=grouped,
        gated_linear_unit=glu,
        activation_func=getattr(F, activation),
        add_bias_linear=bias,
        params_dtype=torch.float32,
        # TEGroupedMLP refuses bias_dropout_fusion together with add_bias_linear; the fused
        # bias-activation is a CUDA/compile path.
        bias_activation_fusion=False,
    )


def build_layer(config, grouped: bool):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from torch_grouped_linear import grouped_moe_layer_spec

    spec = (
        grouped_moe_layer_spec()
        if grouped
        else get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    )
    layer = spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    layer.set_layer_number(1)
    if not grouped and config.add_bias_linear:
        # Megatron 0.19.2 workaround: at EP=1/TP=1 an expert RowParallelLinear returns the
        # identity all-reduce's output as-is (a custom-Function view) and MLP.forward then adds
        # the prob-scaled bias in place, which autograd forbids. Take the EP>1 path instead
        # (no TP reduction: the same values at TP=1).
        for mlp in layer.experts.local_experts:
            mlp.linear_fc2.explicit_expert_comm = True
    return layer


def global_weights(glu: bool, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    """router [E, H] (+ bias [E]); fc1 [E, F1, H], fc2 [E, H, F] (+ biases [E, F1], [E, H]);
    F1 = 2F with GLU. Expert STARVED_EXPERT's router row is very negative on feature 0, which
    every token has large and positive, so it receives no token."""
    gen = torch.Generator().manual_seed(seed)
    fc1_rows = 2 * FFN if glu else FFN
    weights = {
        "router.weight": torch.randn(NUM_EXPERTS, HIDDEN, generator=gen) * 0.5,
        "fc1.weight": torch.randn(NUM_EXPERTS, fc1_rows, HIDDEN, generator=gen) * HIDDEN**-0.5,
        "fc2.weight": torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=gen) * FFN**-0.5,
    }
    weights["router.weight"][STARVED_EXPERT, 0] = -20.0
    if bias:
        weights["router.bias"] = torch.randn(NUM_EXPERTS, generator=gen) * 0.1
        weights["fc1.bias"] = torch.randn(NUM_EXPERTS, fc1_rows, generator=gen) * 0.3
        weights["fc2.bias"] = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen) * 0.3
    return weights


def expert_params(layer, grouped: bool) -> dict[str, list[torch.Tensor]]:
    """'fc1.weight' etc. -> the E per-expert parameters, in global expert order (EP=1)."""
    params = {}
    for linear in ("fc1", "fc2"):
        for kind in ("weight", "bias"):
            if grouped:
                module = getattr(layer.experts, f"linear_{linear}")
                found = [getattr(module, f"{kind}{e}", None) for e in range(NUM_EXPERTS)]
            else:
                found = [
                    getattr(getattr(mlp, f"linear_{linear}"), kind)
                    for mlp in layer.experts.local_experts
                ]
            if found[0] is not None:
                params[f"{linear}.{kind}"] = found
    return params


def load_weights(layer, grouped: bool, weights, expert_order=None):
    """Copy global weights in; expert_order[e] names whose weights expert e gets (default e)."""
    order = list(range(NUM_EXPERTS)) if expert_order is None else expert_order
    with torch.no_grad():
        layer.router.weight.copy_(weights["router.weight"])
        if "router.bias" in weights:
            layer.router.bias.copy_(weights["router.bias"])
        for name, params in expert_params(layer, grouped).items():
            for e, param in enumerate(params):
                param.copy_(weights[name][order[e]])


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [SEQ, BATCH, H] (feature 0 set to 3 to starve one expert) and an upstream grad."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    x[..., 0] = 3.0
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=gen)


def forward_backward(layer, grouped: bool, x, upstream) -> dict:
    layer.zero_grad(set_to_none=True)
    layer.train()
    x = x.clone().requires_grad_(True)
    out, mlp_bias = layer(x)
    assert mlp_bias is None
    (out * upstream).sum().backward()
    layer.experts.backward_dw()  # protocol call; grads are already complete
    return {
        "out": out.detach().clone(),
        "dx": x.grad.detach().clone(),
        "router_grads": {n: p.grad.detach().clone() for n, p in layer.router.named_parameters()},
        "expert_grads": {
            name: torch.stack([p.grad.detach().clone() for p in params])
            for name, params in expert_params(layer, grouped).items()
        },
    }


def attributes(param) -> tuple:
    """The parameter attributes megatron's DDP / optimizer / grad-norm read (megatron defaults)."""
    defaults = {
        "allreduce": True,
        "tensor_model_parallel": False,
        "partition_dim": -1,
        "sequence_parallel": False,
    }
    return tuple(getattr(param, a, defaults[a]) for a in ATTRIBUTES)


def ep2_attributes() -> dict:
    """Attributes of megatron's expert Column/RowParallelLinear vs the grouped linears under an
    EP=2 config (built directly: one rank cannot host EP=2 parallel state)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from torch_grouped_linear import TorchColumnGroupedLinear, TorchRowGroupedLinear

    config = make_config(False, "gelu", True, grouped=True, ep_size=2)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    common = dict(
        config=config,
        init_method=config.init_method,
        bias=True,
        is_expert=True,
        tp_comm_buffer_name=None,
    )
    column = ColumnParallelLinear(
        HIDDEN, FFN, gather_output=False, skip_bias_add=True, tp_group=pg.expt_tp, **common
    )
    row = RowParallelLinear(
        FFN, HIDDEN, input_is_parallel=True, skip_bias_add=True, tp_group=pg.expt_tp, **common
    )
    grouped_column = TorchColumnGroupedLinear(
        2, HIDDEN, FFN, skip_bias_add=False, pg_collection=pg, **common
    )
    grouped_row = TorchRowGroupedLinear(
        2, FFN, HIDDEN, skip_bias_add=True, pg_collection=pg, **common
    )
    return {
        "reference": {
            f"{n}.{k}": attributes(getattr(m, k))
            for n, m in (("fc1", column), ("fc2", row))
            for k in ("weight", "bias")
        },
        "grouped": {
            f"{n}.{k}": attributes(getattr(m, f"{k}1"))
            for n, m in (("fc1", grouped_column), ("fc2", grouped_row))
            for k in ("weight", "bias")
        },
    }


def init_statistics() -> dict:
    """Per-expert weight std of fresh grouped linears, megatron's CPU and device-style init."""
    import dataclasses

    from torch_grouped_linear import TorchColumnGroupedLinear, TorchRowGroupedLinear

    stats = {}
    for cpu_init in (True, False):
        config = dataclasses.replace(
            make_config(False, "gelu", False, grouped=True), use_cpu_initialization=cpu_init
        )
        common = dict(
            config=config,
            bias=False,
            skip_bias_add=False,
            is_expert=True,
            tp_comm_buffer_name=None,
            pg_collection=None,
        )
        fc1 = TorchColumnGroupedLinear(
            NUM_EXPERTS, HIDDEN, 4 * FFN, init_method=config.init_method, **common
        )
        fc2 = TorchRowGroupedLinear(
            NUM_EXPERTS, 4 * FFN, HIDDEN, init_method=config.output_layer_init_method, **common
        )
        for name, module in (("fc1", fc1), ("fc2", fc2)):
            weights = torch.stack([w.detach() for w in module.weights()])
            stats[f"{'cpu' if cpu_init else 'device'}/{name}"] = {
                "std": weights.flatten(1).std(dim=1),
                "distinct": len({w.sum().item() for w in weights}),
            }
    stats["init_method_std"] = make_config(False, "gelu", False, True).init_method_std
    return stats


def delayed_wgrad_contract(recipe=None) -> dict:
    """The grouped linear under ``delay_wgrad_compute`` (TE's contract, torch_grouped_linear's
    docstring) against the same linear without it, on two microbatches: outputs and input gradients;
    the weights' gradients after the backward (the not yet computed tensors), after each
    ``backward_dw`` (oldest microbatch first), the hook calls, the parameters' marks. With an fp8
    ``recipe`` (``NAME`` or ``NAME-param``: quantized parameters, megatron's --fp8-param-gather)
    both linears run TE's fp8 grouped GEMM (``te_grouped_fp8``), the rows per expert
    aligned as megatron pads them, the output width a multiple of mxfp8's blocks; ``hp_wgrad``: the
    high-precision weight gradients of the same rows (what fp8 must differ from)."""
    import copy

    import toy_fp8
    from torch_grouped_linear import TorchColumnGroupedLinear

    config = make_config(False, "gelu", False, grouped=True)
    width, align = (
        (FFN, 1) if recipe is None else (FP8_WIDTH, toy_fp8.align_size(recipe.partition("-")[0]))
    )
    if recipe is not None:
        recipe, _, params = recipe.partition("-")
        toy_fp8.enable_fp8(config, recipe)
        config.fp8_param = params == "param"  # --fp8-param-gather: quantized weights
    delayed_config = copy.copy(config)
    delayed_config.delay_wgrad_compute = True  # megatron's config asserts the overlap it goes with
    common = dict(
        bias=False,
        skip_bias_add=False,
        is_expert=True,
        tp_comm_buffer_name=None,
        pg_collection=None,
    )
    plain = TorchColumnGroupedLinear(
        4, HIDDEN, width, config=config, init_method=config.init_method, **common
    )
    delayed = TorchColumnGroupedLinear(
        4, HIDDEN, width, config=delayed_config, init_method=config.init_method, **common
    )
    delayed.load_state_dict(plain.state_dict())
    hook_calls = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(
        lambda: hook_calls.append([w.grad.clone() for w in delayed.weights()])
    )
    out = {
        "plain": [],
        "delayed": [],
        "after_backward": [],
        "skip_backward_post_hook": [
            getattr(p, "skip_backward_post_hook", False) for p in delayed.parameters()
        ],
    }
    out["hp_wgrad"] = []
    for mb, counts in enumerate(([5, 0, 7, 4], [3, 9, 1, 3])):
        counts = [n * align for n in counts]
        gen = torch.Generator().manual_seed(mb)
        x, up = (
            torch.randn(sum(counts), HIDDEN, generator=gen),
            torch.randn(sum(counts), width, generator=gen),
        )
        out["hp_wgrad"].append(
            [u.t() @ r for u, r in zip(torch.split(up, counts), torch.split(x, counts))]
        )
        for key, module in (("plain", plain), ("delayed", delayed)):
            module.zero_grad(set_to_none=True)
            rows = x.clone().requires_grad_()
            y, _ = module(rows, counts)
            (y * up).sum().backward()
            out[key].append(
                {
                    "y": y.detach(),
                    "dx": rows.grad,
                    "wgrad": [w.grad.clone() for w in module.weights()],
                }
            )
        out["after_backward"].append([w.grad.clone() for w in delayed.weights()])
        for w in delayed.weights():
            w.grad = None
    out["hook_calls_before_dw"] = len(hook_calls)
    for _ in range(2):
        delayed.backward_dw()
    out["dw"] = hook_calls  # the hook sees each backward_dw's gradients, as megatron's DDP would
    delayed.backward_dw()  # nothing left: nothing happens (TE's GroupedLinear)
    out["hook_calls_after_empty_dw"] = len(hook_calls)
    return out


def checkpoint_round_trip(seq_layer, grouped_layer, directory: Path) -> dict:
    """Save the SequentialMLP layer as a distributed checkpoint, load it into the grouped layer."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # Speed workaround: a synchronous save only needs an in-process results queue; megatron's
    # default is a spawn-context Manager, a child process that re-imports this file (~3 s).
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    directory.mkdir()
    dist_checkpointing.save(seq_layer.sharded_state_dict(prefix="mlp."), str(directory))
    target = grouped_layer.sharded_state_dict(prefix="mlp.")
    params = {key: sharded.data for key, sharded in target.items()}
    loaded = dist_checkpointing.load(target, str(directory))
    with torch.no_grad():
        for key, value in loaded.items():
            # Plain ShardedTensors load in place; factory-merged ones (SwiGLU fc1) come back new.
            if isinstance(value, torch.Tensor) and value.data_ptr() != params[key].data_ptr():
                params[key].copy_(value)
    return {
        name: torch.stack([p.detach().clone() for p in params])
        for name, params in expert_params(grouped_layer, True).items()
    }


def worker(out_file: Path) -> None:
    from ultraep_megatron.megatron.cpu import backend as cpu_backend

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron_setup import model_parallel

    model_parallel()
    results = {}
    for seed, (name, (glu, activation, bias)) in enumerate(SCENARIOS.items()):
        weights = global_weights(glu, bias, seed)
        x, upstream = inputs(100 + seed)
        layers = {}
        for grouped in (False, True):
            layers[grouped] = build_layer(make_config(glu, activation, bias, grouped), grouped)
            load_weights(layers[grouped], grouped, weights)
            results[f"{name}/{'grouped' if grouped else 'sequential'}"] = forward_backward(
                layers[grouped], grouped, x, upstream
            )
        results[f"{name}/attributes"] = {
            kind: {n: attributes(p[1]) for n, p in expert_params(layers[grouped], grouped).items()}
            for kind, grouped in (("sequential", False), ("grouped", True))
        }
        if name == "swiglu":
            # Negative control: expert e computes with expert (e+1)'s weights.
            permuted = build_layer(make_config(glu, activation, bias, True), True)
            shifted = [(e + 1) % NUM_EXPERTS for e in range(NUM_EXPERTS)]
            load_weights(permuted, True, weights, shifted)
            results["permuted"] = forward_backward(permuted, True, x, upstream)
        if name in ("swiglu-bias", "gelu"):
            fresh = build_layer(make_config(glu, activation, bias, True), True)
            results[f"{name}/checkpoint"] = {
                "before": {
                    n: torch.stack([p.detach().clone() for p in ps])
                    for n, ps in expert_params(fresh, True).items()
                },
                "after": checkpoint_round_trip(
                    layers[False], fresh, out_file.parent / f"ckpt-{name}"
                ),
                "expected": {n: w for n, w in weights.items() if not n.startswith("router")},
            }
    results["ep2/attributes"] = ep2_attributes()
    results["delayed"] = {
        precision: delayed_wgrad_contract(None if precision == "fp32" else precision)
        for precision in DELAYED_PRECISIONS
    }
    results["init"] = init_statistics()
    torch.save(results, out_file)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- tests (pytest)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from gloo_launch import launch_gloo_ranks

    out = tmp_path_factory.mktemp("torch_grouped_linear") / "results.pt"
    launch_gloo_ranks(Path(__file__), 1, ["--out", out], timeout_s=180)
    return torch.load(out, weights_only=False)


def assert_close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max() / scale
    assert err <= RTOL, f"{what}: max error {err:.3g} relative to max |ref|"


def assert_same_results(actual, expected):
    assert_close(actual["out"], expected["out"], "output")
    assert_close(actual["dx"], expected["dx"], "input grad")
    assert actual["router_grads"].keys() == expected["router_grads"].keys()
    for name, grad in expected["router_grads"].items():
        assert_close(actual["router_grads"][name], grad, f"router {name} grad")
    assert actual["expert_grads"].keys() == expected["expert_grads"].keys()
    for name, grads in expected["expert_grads"].items():
        for e in range(NUM_EXPERTS):
            assert_close(actual["expert_grads"][name][e], grads[e], f"expert {e} {name} grad")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grouped_experts_match_sequential_mlp(results, scenario):
    reference, grouped = results[f"{scenario}/sequential"], results[f"{scenario}/grouped"]
    expected_params = {"fc1.weight", "fc2.weight"} | (
        {"fc1.bias", "fc2.bias"} if SCENARIOS[scenario][2] else set()
    )
    assert set(reference["expert_grads"]) == expected_params
    assert_same_results(grouped, reference)
    # Every expert but the starved one got tokens, so the gradients are not trivially zero.
    fc1 = reference["expert_grads"]["fc1.weight"]
    for e in range(NUM_EXPERTS):
        assert (fc1[e].abs().max() == 0) == (e == STARVED_EXPERT), f"expert {e} token presence"
    assert grouped["expert_grads"]["fc1.weight"][STARVED_EXPERT].abs().max() == 0


def test_negative_control_permuted_experts_fail_the_comparison(results):
    with pytest.raises(AssertionError):
        assert_same_results(results["permuted"], results["swiglu/sequential"])
    with pytest.raises(AssertionError):
        assert_close(results["permuted"]["out"], results["swiglu/sequential"]["out"], "output")


@pytest.mark.parametrize("scenario", ["swiglu-bias", "gelu-bias"])
def test_parameter_attributes_match_sequential_mlp(results, scenario):
    attrs = results[f"{scenario}/attributes"]
    assert attrs["grouped"] == attrs["sequential"]
    # EP=1, TP=1: expert grads reduce with the dense params; column params are TP-partitioned.
    assert attrs["grouped"]["fc1.weight"] == (True, True, 0, False)
    assert attrs["grouped"]["fc2.weight"] == (True, True, 1, False)


def test_parameter_attributes_under_expert_parallelism(results):
    attrs = results["ep2/attributes"]
    expected = dict(attrs["reference"])
    if compat.is_018() and "fc1.bias" in expected:
        # 0.18's TEGroupedLinear hands TE no parallel mode when EP > 1, so TE marks the column
        # biases as nothing (0.19 marks them TP-partitioned itself, as the local linears are).
        expected["fc1.bias"] = (False, False, -1, False)
    assert attrs["grouped"] == expected
    assert all(a[0] is False for a in attrs["grouped"].values()), "expert-DP reduction expected"


@pytest.mark.parametrize("kind", ["cpu", "device"])
def test_weights_initialised_like_megatron_linears(results, kind):
    """fc1 draws N(0, sigma), fc2 megatron's output-layer init N(0, sigma / sqrt(2 num_layers))."""
    sigma = results["init"]["init_method_std"]
    for name, expected in (("fc1", sigma), ("fc2", sigma / 2**0.5)):
        stats = results["init"][f"{kind}/{name}"]
        assert stats["distinct"] == NUM_EXPERTS, f"{kind} {name}: experts share weights"
        ratio = stats["std"] / expected
        assert ((ratio > 0.9) & (ratio < 1.1)).all(), f"{kind} {name}: std/expected {ratio}"


@pytest.mark.parametrize("scenario", ["swiglu-bias", "gelu"])
def test_sequential_checkpoint_loads_into_grouped_experts(results, scenario):
    ckpt = results[f"{scenario}/checkpoint"]
    assert ckpt["after"].keys() == ckpt["expected"].keys()
    for name, expected in ckpt["expected"].items():
        assert not torch.allclose(ckpt["before"][name], expected), f"{name} already equal"
        assert torch.equal(ckpt["after"][name], expected), f"{name} not loaded per expert"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    worker(parser.parse_args().out)


@pytest.mark.parametrize("precision", DELAYED_PRECISIONS)
def test_delayed_weight_gradients_follow_transformer_engines_contract(results, precision):
    """``delay_wgrad_compute`` (megatron's --delay-wgrad-compute), in high precision and under each
    fp8 recipe: the same outputs and input gradients; after the backward the weights hold gradients
    not computed yet (zeros here; TE: uninitialized), each ``backward_dw`` computes the oldest
    microbatch's and runs the registered hooks once; with nothing stashed it does nothing; the
    parameters are marked for megatron's DDP to register its hook on the module. Under fp8 the
    delayed weight gradients are the undelayed fp8 ones bit for bit (the same quantized operands,
    multiplied later), and not the high-precision ones (the fp8 path ran)."""
    delayed = results["delayed"][precision]
    assert all(delayed["skip_backward_post_hook"])
    for plain, late, after in zip(delayed["plain"], delayed["delayed"], delayed["after_backward"]):
        assert torch.equal(late["y"], plain["y"]) and torch.equal(late["dx"], plain["dx"])
        assert all(float(g.abs().sum()) == 0.0 for g in after), (
            "weight gradients computed in the backward"
        )
    assert delayed["hook_calls_before_dw"] == 0 and delayed["hook_calls_after_empty_dw"] == 2
    for plain, dw, exact in zip(
        delayed["plain"], delayed["dw"], delayed["hp_wgrad"]
    ):  # oldest first
        for expected, actual, high_precision in zip(plain["wgrad"], dw, exact):
            if precision == "fp32":
                assert_close(actual, expected, "delayed weight gradient")
                assert_close(actual, high_precision, "weight gradient against its computation here")
            else:
                assert torch.equal(actual, expected), "delayed fp8 weight gradient != undelayed"
                if high_precision.abs().sum() > 0:  # an expert with rows
                    assert not torch.equal(actual, high_precision), (
                        "the fp8 weight gradient is not fp8's"
                    )
    assert not torch.equal(delayed["dw"][0][0], delayed["dw"][1][0]), (
        "the two microbatches must differ"
    )
