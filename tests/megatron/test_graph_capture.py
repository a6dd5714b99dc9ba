"""Transformer Engine's partial CUDA graphs of a layer whose MLP is a balanced MoE layer, captured
and replayed through megatron-core's own machinery on 4 gloo CPU ranks (EP=4).

``workers/graph_capture_layer.py`` builds a megatron ``TransformerLayer`` per scenario with
``--cuda-graph-impl transformer_engine``, has megatron's ``TECudaGraphHelper`` capture it (over
``te_graph_standin``: TE's ``make_graphed_callables`` on the CPU, every capture under its
capturability guard) and trains three steps on replayed graphs, each step routing its tokens to
other experts. Against ``--moe-balancer none`` under the same graphs: the same outputs and every
gradient, to 10x the noise floor of megatron's layer fed the same sequences in another batch order
or one per microbatch (equivalence.py), while the balanced layer's experts receive a balanced load.

Under fp8 (tensorwise, grouped experts over the stand-in of TE's fp8 grouped GEMM) the graphed
balanced layer is compared with itself run eagerly: fp8 and bf16 round differently, so ``none`` in
bf16 is no reference; the floor is megatron's own layer graphed against eager under fp8.

Before the fix, the ``attn moe_router`` capture raised in ``BalancedMoELayer.forward`` (megatron's
early-return list unpacked into ``output, mlp_bias``) and ``moe_preprocess`` was refused outright.
"""

import pytest
import torch

from equivalence import (
    NOISE_MULTIPLE,
    Comparison,
    failures,
    noise_floor,
    relative_difference,
    summary,
)
from gloo_launch import WORKERS, gloo_env, launch_gloo_ranks, run_python

WORLD = 4
STEPS = 3  # replayed training steps per scenario (workers/graph_capture_layer.py: ITERATIONS)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("graph_capture")
    launch_gloo_ranks(WORKERS / "graph_capture_layer.py", WORLD, ["--out-dir", out], timeout_s=400)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def comparisons(ranks, scenario) -> list[Comparison]:
    """Every step's output, input gradient and parameter gradient of ``scenario`` against
    megatron's layer under the same graphs; each quantity's floor from megatron's layer fed the
    step's sequences in the other batch order and one per microbatch."""
    out = []
    for rank, result in enumerate(ranks):
        floors = (result["none_permuted"]["steps"], result["none_split"]["steps"])
        for step, (actual, reference) in enumerate(
            zip(result[scenario]["steps"], result["none"]["steps"])
        ):
            assert sorted(actual["grads"]) == sorted(reference["grads"]), (
                "the layers have other parameters"
            )
            quantities = [("out", lambda s: s["out"]), ("dx", lambda s: s["dx"])]
            quantities += [
                (name, lambda s, name=name: s["grads"][name]) for name in sorted(reference["grads"])
            ]
            for what, get in quantities:
                floor = noise_floor(
                    relative_difference(get(f[step]), get(reference)) for f in floors
                )
                out.append(
                    Comparison(
                        f"rank {rank} step {step} {what}",
                        relative_difference(get(actual), get(reference)),
                        floor,
                    )
                )
    return out


def imbalance(ranks, scenario) -> torch.Tensor:
    """Per step, max / mean over the ranks of the (token, expert) rows their experts received."""
    rows = torch.tensor([r[scenario]["received_rows"] for r in ranks], dtype=torch.float)
    return rows.max(0).values / rows.mean(0)


@pytest.mark.parametrize("scenario", ["router", "router_hybridep", "preprocess"])
def test_capture_and_replay_match_megatrons_layer(ranks, scenario):
    """``router``: graphs of ``attn moe_router`` (host planner); ``router_hybridep``: the same with
    the flex dispatcher over HybridEP (the GB200 recipes' defaults); ``preprocess``: graphs of
    ``attn moe_router moe_preprocess`` with the device planner. Three replayed steps, each routing
    differently, give megatron's outputs and gradients (its all-to-all layer), with the load
    balanced."""
    compared = comparisons(ranks, scenario)
    print(f"\n{scenario}: {summary(compared)}")
    assert not failures(compared), failures(compared)
    for rank, result in enumerate(ranks):
        assert result[scenario]["moe_class"] == "BalancedMoELayer"
        # The steps ran on the graphs: each forward and backward graph replayed once per step.
        assert result[scenario]["replays"] == (STEPS, STEPS), result[scenario]["replays"]
        assert result[scenario]["ring_live"] == 0, f"rank {rank}: an invocation was never released"
    before, after = imbalance(ranks, "none"), imbalance(ranks, scenario)
    assert before.min() > 2.0, f"the test's routing is not skewed: {before}"
    assert after.max() <= 1.05, f"post-balancing imbalance {after} (before {before})"


@pytest.mark.parametrize("scenario", ["router", "router_hybridep"])
def test_capture_router_graph_leaves_the_balanced_part_to_the_replay(ranks, scenario):
    """Under the ``attn moe_router`` graph the router's Python runs only at capture (its warm-up and
    the capture itself); on replay megatron hands the MoE layer the graph's routing through its
    tensor store, and the balanced layer plans from it eagerly, once per step."""
    for result in ranks:
        router = result[scenario]
        assert router["capture_calls"] == {"router": 2, "plan": 0}, router["capture_calls"]
        assert router["replay_calls"] == {"router": 0, "plan": STEPS}, router["replay_calls"]
        assert router["planner"] == "host"
    expected = {
        "router": ("BalancedAlltoAllDispatcher", None),
        "router_hybridep": ("BalancedFlexDispatcher", "_HybridEPManager"),
    }[scenario]
    assert all(
        (r[scenario]["dispatcher_class"], r[scenario]["manager_class"]) == expected for r in ranks
    )


def test_capture_preprocess_graph_runs_the_device_plan_on_replay(ranks):
    """Under the ``moe_preprocess`` graph nothing of the router or the plan runs in Python on
    replay: the graph holds the load gather (a collective), the device plan, the reroute and the
    permutation, and hands the plan's record over through the dispatcher's
    ``cudagraph_attrs`` (megatron sets it from the graph's outputs)."""
    for result in ranks:
        preprocess = result["preprocess"]
        assert preprocess["planner"] == "device"
        assert preprocess["capture_calls"] == {"router": 2, "plan": 2}, preprocess["capture_calls"]
        assert preprocess["replay_calls"] == {"router": 0, "plan": 0}, preprocess["replay_calls"]
        assert "c10d._allgather_base_.default" in preprocess["graph_ops"], preprocess["graph_ops"]
        assert "plan_record" in preprocess["valid_cudagraph_attrs"], preprocess[
            "valid_cudagraph_attrs"
        ]
        assert "reversed_local_input_permutation_mapping" in preprocess["valid_cudagraph_attrs"]


def test_capture_steps_route_differently(ranks):
    """Each replayed step's routing loads the ranks differently (what a stale plan would miss)."""
    per_step = [tuple(r["none"]["received_rows"][step] for r in ranks) for step in range(STEPS)]
    assert len(set(per_step)) == STEPS, per_step


def test_capture_negative_control_stale_plan_fails_the_comparison(ranks):
    """The ``moe_preprocess`` scenario with every step completing the first step's plan (host state
    kept from an earlier forward): the first step is right, every later step's output and input
    gradient must miss megatron's on every rank, far beyond the tolerance."""
    compared = comparisons(ranks, "stale_plan")
    failed = [c for c in compared if not c.passed]
    assert failed, "completing a stale plan changed nothing"
    assert not [c for c in failed if " step 0 " in c.what], "the first step completes its own plan"
    layer_outputs = [
        c for c in compared if c.what.endswith((" out", " dx")) and " step 0 " not in c.what
    ]
    assert len(layer_outputs) == WORLD * (STEPS - 1) * 2
    print(
        f"\nstale_plan: {len(failed)} of {len(compared)} over tolerance; outputs and input gradients of "
        f"steps 1-{STEPS - 1}: error/tolerance {min(c.ratio for c in layer_outputs):.3g} to "
        f"{max(c.ratio for c in layer_outputs):.3g}"
    )
    assert all(c.ratio > NOISE_MULTIPLE for c in layer_outputs), layer_outputs


def test_capture_negative_control_host_planner_fails_the_guard(ranks):
    """The ``moe_preprocess`` graph with the host planner (refused at startup; here switched on
    after the layer was built): its capture copies the load to the host and waits for it inside
    the captured preprocessing, which the stand-in refuses, as CUDA's capture would."""
    for rank, result in enumerate(ranks):
        error = result["host_planner_preprocess"].get("capture_error")
        assert error is not None, f"rank {rank}: the host planner was captured"
        # The copy into a host tensor made in the capture, or the wait for a pooled one: either
        # stops the capture, as CUDA's would.
        assert (error.startswith("CaptureViolation") and "device-to-host" in error) or (
            "stream is capturing" in error and "host wait" in error
        ), error


#: fp8 scenario -> (the same layer eager, megatron's layer under the same graphs).
FP8_REFERENCES = {
    "router_fp8": ("router_fp8_eager", "none_fp8"),
    "stale_plan_fp8": ("router_fp8_eager", "none_fp8"),
    "preprocess_fp8": ("preprocess_fp8_eager", "none_fp8_preprocess"),
    "stale_preprocess_fp8": ("preprocess_fp8_eager", "none_fp8_preprocess"),
}


def fp8_comparisons(ranks, scenario) -> list[Comparison]:
    """Every step's output, input gradient and parameter gradient of ``scenario`` (graphed, fp8)
    against the same layer run eagerly; each quantity's floor: megatron's layer under the same
    graphs against itself eager under fp8 (``none_fp8_eager``), at least a unit roundoff. A replay
    re-runs the captured operations on the same data, so that floor is the roundoff of whatever the
    graph changes in the order of the sums."""
    eager, megatron_graphed = FP8_REFERENCES[scenario]
    out = []
    for rank, result in enumerate(ranks):
        floors, references = result[megatron_graphed]["steps"], result["none_fp8_eager"]["steps"]
        for step, (actual, reference) in enumerate(
            zip(result[scenario]["steps"], result[eager]["steps"])
        ):
            assert (
                sorted(actual["grads"])
                == sorted(reference["grads"])
                == sorted(floors[step]["grads"])
            )
            quantities = [("out", lambda s: s["out"]), ("dx", lambda s: s["dx"])]
            quantities += [
                (name, lambda s, name=name: s["grads"][name]) for name in sorted(reference["grads"])
            ]
            for what, get in quantities:
                floor = noise_floor([relative_difference(get(floors[step]), get(references[step]))])
                out.append(
                    Comparison(
                        f"rank {rank} step {step} {what}",
                        relative_difference(get(actual), get(reference)),
                        floor,
                    )
                )
    return out


@pytest.mark.parametrize("scenario", ["router_fp8", "preprocess_fp8"])
def test_capture_fp8_replays_the_eager_fp8_layer(ranks, scenario):
    """``router_fp8``: graphs of ``attn moe_router`` of a balanced layer (host planner) under fp8
    tensorwise, captured through megatron's ``TECudaGraphHelper`` with the fp8 arguments it hands
    TE, replayed for three steps, each routing differently; ``preprocess_fp8``: the device planner
    with graphs of ``attn moe_router moe_preprocess``. Every step's outputs and gradients are the
    same layer's run eagerly under fp8 (within 10x the floor of megatron's own layer under the same
    graphs against eager), every graph replayed once per step, every ring slot released, the load
    balanced."""
    compared = fp8_comparisons(ranks, scenario)
    print(f"\n{scenario}: {summary(compared)}")
    assert not failures(compared), failures(compared)
    planner, plans = {"router_fp8": ("host", STEPS), "preprocess_fp8": ("device", 0)}[scenario]
    for rank, result in enumerate(ranks):
        graphed = result[scenario]
        assert graphed["moe_class"] == "BalancedMoELayer" and graphed["planner"] == planner
        assert graphed["replays"] == (STEPS, STEPS), graphed["replays"]
        assert graphed["ring_live"] == 0, f"rank {rank}: an invocation was never released"
        assert graphed["replay_calls"] == {"router": 0, "plan": plans}, graphed["replay_calls"]
        # The experts cast their weights to fp8 at each step's first (only) microbatch.
        assert graphed["fp8_casts"] >= 2 * STEPS, graphed["fp8_casts"]
    before, after = imbalance(ranks, "none_fp8_eager"), imbalance(ranks, scenario)
    assert before.min() > 2.0, f"the test's routing is not skewed: {before}"
    assert after.max() <= 1.05, f"post-balancing imbalance {after} (before {before})"


def test_capture_fp8_runs_tes_fp8_graph_contract(ranks):
    """What megatron hands TE's ``make_graphed_callables`` under fp8 (TE 2.7: one ``fp8_enabled``
    for all callables; the recipe object megatron's ``get_fp8_recipe`` builds; weight caching on;
    the amax reduction group, TP x DP x CP: the 4 ranks), the warm-up and capture running the
    graphed region inside TE's fp8 autocast with ``_graph=True``, and the replay: no Python of the
    region, the skip-weight-update flag set from megatron's ``is_first_microbatch`` (the first
    microbatch: do not skip) and the backward's amax reduction call, once per step."""
    for scenario in (
        "router_fp8",
        "none_fp8",
        "stale_plan_fp8",
        "preprocess_fp8",
        "none_fp8_preprocess",
    ):
        for result in ranks:
            graphed = result[scenario]
            assert graphed["graphed_with"] == {
                "fp8_enabled": True,
                "fp8_weight_caching": True,
                "fp8_group_size": WORLD,
                "fp8_recipe": "Float8CurrentScaling(fp8_format=<Format.HYBRID: 'hybrid'>, fp8_dpa=False, "
                "fp8_mha=False)",
            }, graphed["graphed_with"]
            assert graphed["fp8_at_capture"] == [(True, "Float8CurrentScaling", True)] * 2, graphed[
                "fp8_at_capture"
            ]
            assert graphed["fp8_at_replay"] == [], graphed["fp8_at_replay"]
            assert graphed["skip_flags"] == [0.0] * STEPS, graphed["skip_flags"]
            assert graphed["backward_reductions"] == STEPS, graphed["backward_reductions"]
    for result in ranks:  # eagerly the router runs in the layer's fp8 autocast, not a graph's
        assert (
            result["router_fp8_eager"]["fp8_at_replay"]
            == [(True, "Float8CurrentScaling", False)] * STEPS
        )


def test_capture_fp8_negative_control_stale_plan_fails_the_comparison(ranks):
    """Under fp8, plans kept from the first step: ``stale_preprocess_fp8`` (the device planner's
    graph, every step completing the first step's plan, as ``stale_plan``) must miss the eager
    layer's outputs and input gradients on every rank in every later step, far beyond the
    tolerance; ``stale_plan_fp8`` (host planner, every step planned on the first step's load) must
    fail the comparison in every later step (a stale load still sends most tokens to an instance
    of their expert, so not every rank's output moves). The first step is right in both."""
    for scenario in ("stale_preprocess_fp8", "stale_plan_fp8"):
        compared = fp8_comparisons(ranks, scenario)
        assert not [c for c in compared if " step 0 " in c.what and not c.passed], (
            "the first step plans its own load"
        )
        layer_outputs = [
            c for c in compared if c.what.endswith((" out", " dx")) and " step 0 " not in c.what
        ]
        assert len(layer_outputs) == WORLD * (STEPS - 1) * 2
        print(
            f"\n{scenario}: {sum(not c.passed for c in compared)} of {len(compared)} over tolerance; outputs "
            f"and input gradients of steps 1-{STEPS - 1}: error/tolerance {min(c.ratio for c in layer_outputs):.3g} "
            f"to {max(c.ratio for c in layer_outputs):.3g}"
        )
        if scenario == "stale_preprocess_fp8":
            assert all(c.ratio > NOISE_MULTIPLE for c in layer_outputs), layer_outputs
        for step in range(1, STEPS):
            worst = max(c.ratio for c in layer_outputs if f" step {step} " in c.what)
            assert worst > NOISE_MULTIPLE, f"{scenario} step {step}: error/tolerance {worst:.3g}"


def test_capture_preprocess_gpu_check_dry_run():
    """``workers/capture_preprocess.py`` (a check of ``tools/gpu_check.sh``: the device planner's
    preprocessing captured with ``torch.cuda.graph`` and replayed on a GPU) keeps running: its dry
    run captures the same work on the CPU graph stand-in, under its guard, and replays it."""
    completed = run_python(
        WORKERS / "capture_preprocess.py", ["--device", "cpu", "--trials", "3"], env=gloo_env()
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    line = completed.stdout.strip().splitlines()[-1]
    assert line.startswith("capture_replay_device_planner: SKIP"), line
    assert (
        "dry run on the CPU graph stand-in: pass, 3 replays" in line and "3 distinct plans" in line
    ), line
