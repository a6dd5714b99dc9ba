"""--moe-balancer ultraep on megatron-core's real training loop (pretrain_gpt.py, 4 gloo CPU ranks).

UltraEP must leave training mathematically unchanged. The model carries what the rack-scale recipes
use (``megatron_runs.RECIPE_FEATURES``: dense first layer, shared expert, DeepSeek-V3 routing, one
MTP layer, per-token loss, evaluation during training); every run starts from one initial
checkpoint whose expert bias skews the routing (rank imbalance ~2.4 at EP=4), so the balancer
really replicates.

Every run first trains ``LR0_ITERS`` iterations at learning rate 0 (``ULTRAEP_LR0_ITERS`` of
workers/pretrain_grad_dump.py): each computes gradients at the same parameters on a new batch, so
``none`` and ``ultraep`` compare *per step*, gradient of every parameter by gradient, without
rounding differences compounding. Then Adam takes over for ``ADAM_ITERS`` iterations: the
*trajectory* (losses, grad norms). Tolerances come from the noise floor (``equivalence.py``)
between two ``none`` runs in different layouts, measured in the same session. Gradients are not
clipped (clipping scales every gradient by the global norm, so one wrong gradient would show in
all of them).

Runs, each one launch (the three faults share one run: they fall in its last lr-0 iterations,
after the clean ones):

====================  =========================================================  ===============
run                   layout                                                     iterations
====================  =========================================================  ===============
none / ultraep ep4    EP=4 x DP=4, MoE activation recompute, overlap-grad-reduce  8 lr-0 (+10 Adam for none)
none / ultraep pp2    EP=2 x PP=2 x DP=2, full recompute                          8 lr-0 + 10 Adam
ultraep vpp           EP=2 x PP=2, interleaved (1 layer per virtual stage),       8 lr-0
                      distributed optimizer, overlap-grad-reduce
====================  =========================================================  ===============

bf16 runs elsewhere, in the layouts that use it: test_production_layouts.py (expert-DP 2, the
distributed optimizer with overlapped reduce and gather, bf16 gradient reduction) and every recipe
variant (test_recipe_variants.py, per step and trajectory).

With the distributed optimizer a rank keeps only a shard of each reduced gradient: that layout
compares losses and grad norms.
"""

import math

import pytest
import torch

from equivalence import compare_gradients, compare_series, failures, gradient_floors, summary
from megatron_runs import launch_dump_run, recipe_moe_args

pytestmark = pytest.mark.slow

WORLD = 4
LR0_ITERS, ADAM_ITERS = 8, 10
# The negative controls: one fault of the balancer per iteration, after the clean iterations.
FAULTS = {
    6: "no_replica_grad_reduction",
    7: "skip_rematerialization",
    8: "replica_gets_other_layer_weights",
}
CLEAN_ITERS = [it for it in range(1, LR0_ITERS + 1) if it not in FAULTS]
BALANCED = ["--moe-balancer", "ultraep", "--moe-balancer-num-slots", "2"]
MOE_LAYERS = {"2", "3", "4", "5"}  # layer 1 is dense; 5 is the MTP layer

LAYOUTS = {  # name: (EP size, flags)
    "ep4": (
        4,
        [
            "--overlap-grad-reduce",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "moe",
        ],
    ),
    "pp2": (
        2,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ),
    "vpp": (
        2,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
        ],
    ),
}
RUNS = {  # name: (layout, balanced, lr-0 iterations, Adam iterations, faults)
    "none_ep4": ("ep4", False, LR0_ITERS, ADAM_ITERS, {}),
    "none_pp2": ("pp2", False, LR0_ITERS, ADAM_ITERS, {}),
    "ultraep_ep4": ("ep4", True, LR0_ITERS, 0, FAULTS),
    "ultraep_pp2": ("pp2", True, LR0_ITERS, ADAM_ITERS, {}),
    "ultraep_vpp": ("vpp", True, LR0_ITERS, 0, {}),
}
# The balanced runs compared per step: (run, its reference, the noise-floor pair, iterations).
PER_STEP = {
    "ultraep_ep4": ("none_ep4", ("none_ep4", "none_pp2"), CLEAN_ITERS),
    "ultraep_pp2": ("none_pp2", ("none_ep4", "none_pp2"), list(range(1, LR0_ITERS + 1))),
    "ultraep_vpp": ("none_pp2", ("none_ep4", "none_pp2"), list(range(1, LR0_ITERS + 1))),
}
TRAJECTORY = {  # run: (reference, noise-floor pair), over the Adam iterations
    "ultraep_pp2": ("none_pp2", ("none_ep4", "none_pp2")),
}


#: Runs whose collectives, batched rounds and waits are checked against NCCL's rules: PP 2 with
#: virtual pipeline stages (two communicators' point-to-point traffic beside the EP group's), MoE
#: activation recompute (each balanced forward replayed in the backward) and full recompute with
#: PP 2; all three with an MTP layer (recipe_moe_args: --mtp-num-layers 1).
NCCL_RULES = {"ultraep_vpp", "ultraep_ep4", "ultraep_pp2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial_checkpoint):
    """name -> DumpRun, each launched once, on first use."""
    checkpoint, _ = initial_checkpoint
    done = {}

    def get(name):
        if name not in done:
            layout, balanced, lr0, adam, faults = RUNS[name]
            ep, flags = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(name)
            # No gradient clipping: it scales every gradient by the global norm, so one wrong
            # gradient would show in all of them.
            args = [
                *recipe_moe_args(ep=ep, train_iters=lr0 + adam),
                *flags,
                "--clip-grad",
                "0.0",
                "--load",
                str(checkpoint),
                "--finetune",
                "--ckpt-format",
                "torch_dist",
            ]
            if balanced:
                args += [*BALANCED, "--moe-balancer-trace-dir", str(run_dir / "trace")]
            env = {
                "ULTRAEP_LR0_ITERS": str(lr0),
                "ULTRAEP_FAULTS": ",".join(f"{f}@{it}" for it, f in faults.items()),
            }
            if name in NCCL_RULES:  # every rank's collectives and rounds recorded (nccl_rules.py)
                (run_dir / "nccl").mkdir()
                env["ULTRAEP_NCCL_RULES_DIR"] = str(run_dir / "nccl")
            done[name] = launch_dump_run(run_dir, WORLD, args, env)
        return done[name]

    return get


def losses(run, iterations):
    return {it: run.records[it]["losses"]["lm loss"] for it in iterations}


def grad_norms(run, iterations):
    return {it: run.records[it]["grad_norm"] for it in iterations}


def per_step_gradient_comparisons(runs, name, iterations):
    reference, (x, y) = PER_STEP[name][:2]
    lr0 = range(1, RUNS[x][2] + 1)
    floors = gradient_floors(runs(x).grads, runs(y).grads, [*lr0])
    return compare_gradients(runs(name).grads, runs(reference).grads, floors, iterations)


@pytest.mark.parametrize("name", [n for n in PER_STEP if RUNS[n][0] != "vpp"])
def test_per_step_gradient_of_every_parameter(runs, name):
    comparisons = per_step_gradient_comparisons(runs, name, PER_STEP[name][2])
    print(f"\n{name} per-step gradients: {summary(comparisons)}")
    assert len(comparisons) >= 100 * len(PER_STEP[name][2]), "every parameter, every iteration"
    assert not failures(comparisons), "\n".join(failures(comparisons)[:20])


@pytest.mark.parametrize("name", list(PER_STEP))
def test_per_step_losses_and_grad_norms(runs, name):
    reference, (x, y), iterations = PER_STEP[name]
    lr0 = list(range(1, RUNS[x][2] + 1))
    comparisons = []
    for what, values in (("lm loss", losses), ("grad norm", grad_norms)):
        floor_x, floor_y = values(runs(x), lr0), values(runs(y), lr0)
        actual, expected = values(runs(name), iterations), values(runs(reference), iterations)
        comparisons += compare_series(what, actual, expected, floor_x, floor_y)
    print(f"\n{name} per-step losses and grad norms: {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)
    assert len(set(losses(runs(reference), iterations).values())) == len(iterations), (
        "every iteration sees another batch"
    )


@pytest.mark.parametrize("name", list(TRAJECTORY))
def test_trajectory_losses_and_grad_norms(runs, name):
    reference, (x, y) = TRAJECTORY[name]
    lr0 = RUNS[name][2]
    adam = list(range(lr0 + 1, lr0 + ADAM_ITERS + 1))
    comparisons = []
    for what, values in (("lm loss", losses), ("grad norm", grad_norms)):
        comparisons += compare_series(
            what,
            values(runs(name), adam),
            values(runs(reference), adam),
            values(runs(x), adam),
            values(runs(y), adam),
        )
    print(f"\n{name} trajectory ({ADAM_ITERS} Adam iterations): {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)
    trained = losses(runs(reference), adam)
    assert trained[adam[-1]] < trained[adam[0]] - 0.1, "the model must be training"


@pytest.mark.parametrize("iteration", list(FAULTS), ids=list(FAULTS.values()))
def test_negative_control_breaks_the_equivalence(runs, iteration):
    """A real training iteration with the balancer broken (workers/pretrain_grad_dump.FAULTS)
    fails the per-step comparison that the clean iterations of the same run pass."""
    comparisons = per_step_gradient_comparisons(runs, "ultraep_ep4", [iteration])
    failed = failures(comparisons)
    worst = max(comparisons, key=lambda c: c.ratio)
    print(
        f"\n{FAULTS[iteration]}: {len(failed)} of {len(comparisons)} gradients over tolerance, "
        f"worst error/tolerance {worst.ratio:.3g} ({worst.what}, error {worst.error:.3g})"
    )
    assert failed, f"{FAULTS[iteration]} went unnoticed: {summary(comparisons)}"
    assert worst.ratio > 10, "a broken balancer is wrong by far more than this run's rounding noise"
    # Only the replicated (main) experts' gradients can lose their replicas' share.
    if FAULTS[iteration] == "no_replica_grad_reduction":
        assert all(".experts.local_experts." in c.what for c in comparisons if not c.passed)


def test_expert_bias_updates_as_without_balancer(runs):
    """DeepSeek-V3's aux-loss-free bias moves every iteration by the routed-token counts, which
    balancing must not change: bit-identical to ``none`` in the clean iterations."""
    balanced, reference = runs("ultraep_ep4").expert_bias, runs("none_ep4").expert_bias
    assert set(reference[1]) == {f"decoder.layers.{i}.mlp.router" for i in (1, 2, 3)} | {
        "mtp.layers.0.mtp_model_layer.mlp.router"
    }
    for it in CLEAN_ITERS:
        for router, bias in reference[it].items():
            assert torch.equal(balanced[it][router], bias), (it, router)
    moved = (
        reference[CLEAN_ITERS[-1]]["decoder.layers.1.mlp.router"]
        - reference[1]["decoder.layers.1.mlp.router"]
    )
    assert moved.abs().max() > 0, "the expert bias must be updating"


@pytest.mark.parametrize("name", ["ultraep_ep4", "ultraep_pp2"])
def test_every_moe_layer_balanced_mtp_included(runs, name):
    reference = runs(name.replace("ultraep", "none"))
    skew = min(
        r["load_imbalance"][layer] for r in reference.records.values() for layer in MOE_LAYERS
    )
    assert skew >= 1.3, f"{name}: routing is not skewed ({skew})"
    for record in runs(name).records.values():
        stats = record["balancer"]
        assert set(stats) == MOE_LAYERS, "every MoE layer reports, MTP included, the dense one not"
        for layer, values in stats.items():
            assert values["replicas"] > 0, (record["iteration"], layer)
            assert values["imbalance_after"] <= 1.05, (record["iteration"], layer, values)


def test_trace_records_every_microbatch_once_mtp_included(runs):
    """--moe-balancer-trace-dir on the EP=4 run (MoE recompute: each forward runs twice): one
    record per (iteration, microbatch, layer), the MTP layer after the decoder's; the loads
    reproduce the router-side imbalance and the balancer's own before-figures."""
    from ultraep_megatron.megatron.run.telemetry import load_imbalance, per_rank_load
    from ultraep_megatron.traces import find_trace_files, read_trace

    run = runs("ultraep_ep4")
    files = find_trace_files(run.run_dir / "trace")
    assert len(files) == 1, "EP=4 on 4 ranks is one EP group"
    trace = read_trace(files[0])
    assert trace.status == "closed"
    keys = list(zip(trace.iteration.tolist(), trace.microbatch.tolist(), trace.layer.tolist()))
    assert len(keys) == len(set(keys)), "a microbatch recorded twice (recompute replay?)"
    # global batch 16 / (micro batch 2 x data parallel 4) = 2 microbatches per iteration
    assert set(keys) == {
        (i, m, int(layer)) for i in range(1, LR0_ITERS + 1) for m in (0, 1) for layer in MOE_LAYERS
    }
    for record in run.records.values():
        for layer, value in record["load_imbalance"].items():
            rows = (trace.iteration == record["iteration"]) & (trace.layer == int(layer))
            per_microbatch = per_rank_load(trace.load[rows].sum(dim=1).double(), WORLD)  # [mb, R]
            assert math.isclose(
                float(load_imbalance(per_microbatch.sum(0, keepdim=True))[0]), value, rel_tol=1e-9
            )
            # The balancer averages its per-microbatch figure over the microbatches.
            assert math.isclose(
                float(load_imbalance(per_microbatch).mean()),
                record["balancer"][layer]["imbalance_before"],
                rel_tol=1e-9,
            )


def eval_losses(run, iterations):
    """{iteration: lm loss} of the evaluations during training at ``iterations``."""
    return {
        e["iteration"]: e["losses"]["lm loss"]
        for e in run.evals
        if e["during_training"] and e["iteration"] in iterations
    }


@pytest.mark.parametrize("name", ["ultraep_ep4", "ultraep_pp2"])
def test_evaluation_is_balanced_and_leaves_no_ring_slot(runs, name):
    """Evaluation (model.eval(), no grad; every 4 iterations and after training) is balanced like
    training, takes no virtual-layer-ring slot, and at the same state gives the losses ``none``
    gives."""
    run, reference = runs(name), runs(name.replace("ultraep", "none"))
    assert len(run.evals) >= 3
    for record in run.evals:
        assert record["ring_live"] == 0, record
        assert record["imbalance_after"], "evaluation ran balanced MoE layers"
        assert max(record["imbalance_after"]) <= 1.05, record
    same_state = CLEAN_ITERS if name == "ultraep_ep4" else range(1, LR0_ITERS + 1)
    actual = eval_losses(run, same_state)
    comparisons = compare_series(
        "eval lm loss",
        actual,
        eval_losses(reference, actual),
        eval_losses(runs("none_ep4"), actual),
        eval_losses(runs("none_pp2"), actual),
    )
    print(f"\n{name} evaluation losses: {summary(comparisons)}")
    assert comparisons and not failures(comparisons), failures(comparisons)


@pytest.mark.parametrize("name", ["ultraep_ep4", "ultraep_pp2"])
def test_recompute_and_mtp_keep_nccl_s_rules(runs, name):
    """The balanced runs with MoE activation recompute (EP 4) and full recompute (EP 2 x PP 2),
    both with an MTP layer: every rank's collectives, batched rounds and waits recorded
    (tests/nccl_rules.py, the recomputed forwards' rounds among them) pass NCCL's rules
    (tests/nccl_check.py)."""
    from nccl_check import check_logs
    from nccl_rules import read_logs

    run = runs(name)
    logs = read_logs(str(run.run_dir / "nccl"))
    assert sorted(logs) == list(range(WORLD))
    assert all(any(e["kind"] == "batch" for e in log) for log in logs.values())
    check_logs(logs)


def test_pipeline_stages_keep_nccl_s_rules(runs):
    """The balanced run at EP 2 x PP 2 with virtual pipeline stages, every rank's collectives,
    batched rounds (megatron's pipeline sends and receives among them) and waits recorded
    (tests/nccl_rules.py) and checked against NCCL's rules (tests/nccl_check.py); a collective
    skipped by one rank in those logs fails the check."""
    import copy

    from nccl_check import NcclRuleError, check_logs
    from nccl_rules import read_logs

    run = runs("ultraep_vpp")
    logs = read_logs(str(run.run_dir / "nccl"))
    assert sorted(logs) == list(range(WORLD))
    check_logs(logs)
    skipped = copy.deepcopy(logs)
    first = next(i for i, e in enumerate(skipped[1]) if e["kind"] == "coll")
    del skipped[1][first]
    with pytest.raises(NcclRuleError, match=r"rank 1"):
        check_logs(skipped)
