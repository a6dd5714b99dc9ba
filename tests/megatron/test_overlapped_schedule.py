"""--moe-balancer ultraep inside megatron's overlapped 1F1B schedule (``--overlap-moe-expert-parallel-comm``,
megatron-core's ``pipeline_parallel/combined_1f1b.py``) and with its delayed weight gradients
(``--delay-wgrad-compute``), on gloo CPU ranks.

Two levels, each against ``none`` within a noise floor measured in the same run
(``equivalence.py``: 10x the difference of two ``none`` runs of the same mathematics, here ``none``
at EP 4 against ``none`` at EP 2 on the same ranks, from the same weights):

* the schedule's nodes (``workers/overlapped_schedule.py``, one launch of 4 ranks): a tiny bf16 GPT
  in megatron's DDP with the distributed optimizer's overlapped reduce-scatter, two training steps
  of three microbatches through megatron's own ``forward_backward_no_pipelining``, per-step reduced
  gradients of every parameter; the all-to-all dispatcher with the host and the device planner, the
  flex dispatcher's HybridEP path (``deepep_gloo``), and ``--delay-wgrad-compute`` over the
  stand-in of Transformer Engine's grouped linear (``torch_grouped_linear``: its delayed-wgrad
  contract), which megatron's training arguments refuse without TE; fp8 (tensorwise, over
  ``te_grouped_fp8``'s stand-in of TE's fp8 grouped GEMM) with and without
  ``--delay-wgrad-compute``, the two also against each other bit for bit. Negative controls: replica
  gradients reduced before ``backward_dw()`` computed them (in bf16 and under fp8); DDP's hooks
  run in an order of the plan's making (the order check's);
* the training loop (``pretrain_gpt.py`` through ``workers/pretrain_grad_dump.py``): bf16, EP 2 with
  expert-data-parallel 2, the distributed optimizer with overlapped reduction and parameter
  gather, one MTP layer; PP 1 on 4 ranks (the acceptance run; its log reports the balanced
  imbalance) and PP 2 with VPP 2 on 8 ranks (megatron's interleaved overlapped schedule,
  ``combined_1f1b_schedule_for_interleaved_pipelining``). ``LR0`` iterations at learning rate 0
  compare every reduced gradient per step, ``ADAM`` more the trajectory. Negative control: each
  layer's replicas re-materialized from the plan the weight buffer holds when its backward starts
  (another microbatch's).
"""

from __future__ import annotations

import re

import pytest
import torch

from equivalence import (
    compare_gradients,
    compare_series,
    failures,
    gradient_floors,
    per_step_comparisons,
    summary,
    trajectory_comparisons,
)
from gloo_launch import WORKERS, launch_gloo_ranks
from megatron_runs import (
    launch_dump_run,
    merge_reduced_gradients,
    save_initial_checkpoint,
    tiny_moe_args,
)

pytestmark = pytest.mark.slow

# ---- the schedule's nodes ----------------------------------------------------------------------
WORLD = 4
EQUIVALENT = [
    "overlap",
    "overlap_device",
    "overlap_hybridep",
    "delay",
    "delay_hybridep",
    "overlap_fp8",
    "delay_fp8",
]
DELAYED = ["delay", "delay_hybridep", "delay_fp8"]
#: Scenarios with TEGroupedMLP experts over torch_grouped_linear (the others: SequentialMLP).
GROUPED = [*DELAYED, "overlap_fp8"]
#: fp8 (tensorwise) under --delay-wgrad-compute and its undelayed twin: the same fp8 GEMMs, the
#: weight gradients' computed later.
FP8_DELAYED, FP8_UNDELAYED = "delay_fp8", "overlap_fp8"


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory):
    """Every rank's dump of workers/overlapped_schedule.py (one launch, every scenario)."""
    out = tmp_path_factory.mktemp("overlapped_schedule")
    launch_gloo_ranks(
        WORKERS / "overlapped_schedule.py", WORLD, ["--out-dir", str(out)], log_path=out / "log"
    )
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def reduced(dumps, key) -> dict[int, dict[str, torch.Tensor]]:
    """{step: {global parameter name: reduced gradient}} of run ``key``, from every rank's shard."""
    steps = dumps[0][key]["grads"]
    return {step: merge_reduced_gradients([d[key]["grads"][step] for d in dumps]) for step in steps}


def losses(dumps, key) -> dict[tuple, float]:
    return {
        (rank, step, mb): loss
        for rank, d in enumerate(dumps)
        for step, per_mb in d[key]["losses"].items()
        for mb, loss in enumerate(per_mb)
    }


def node_comparisons(dumps, scenario):
    """Every parameter's reduced gradient per step and every microbatch's loss of ``ultraep``
    against ``none``, floors from ``none`` at EP 4 against ``none``."""
    none, floor, ultraep = (f"{scenario}/{key}" for key in ("none", "none_floor", "ultraep"))
    reference = reduced(dumps, none)
    steps = sorted(reference)
    comparisons = compare_gradients(
        reduced(dumps, ultraep),
        reference,
        gradient_floors(reduced(dumps, floor), reference, steps),
        steps,
    )
    comparisons += compare_series(
        "loss",
        losses(dumps, ultraep),
        losses(dumps, none),
        losses(dumps, floor),
        losses(dumps, none),
    )
    return comparisons


@pytest.mark.parametrize("scenario", EQUIVALENT)
def test_balanced_in_the_overlapped_schedule_equals_none(node_runs, scenario):
    comparisons = node_comparisons(node_runs, scenario)
    print(f"\n{scenario}: {summary(comparisons)}")
    experts = [c for c in comparisons if ".experts." in c.what]
    assert len(experts) == 2 * 2 * 8 * 2, "every expert weight of both layers at both steps"
    assert not failures(comparisons), "\n".join(failures(comparisons)[:20])


@pytest.mark.parametrize("scenario", EQUIVALENT)
def test_what_ran(node_runs, scenario):
    """megatron's nodes called the balanced layer's parts (and the plan's one host wait ran in the
    dispatch node, where megatron's own dispatcher waits for its splits); both EP groups replicated,
    with plans of their own; every ring slot was released after each step; the experts, dispatcher
    and manager are the scenario's."""
    runs = [d[f"{scenario}/ultraep"] for d in node_runs]
    assert set(runs[0]["node_calls"]) == {
        ("preprocess", "pre_dispatch_computation"),
        ("dispatch", "moe_dispatch"),
        ("host wait", "moe_dispatch"),
        ("routed_experts_compute", "mlp"),
        ("postprocess", "moe_combine"),
    }, runs[0]["node_calls"]
    for step in runs[0]["plans"]:
        plans = [run["plans"][step] for run in runs]
        replica_rows = [rows for plan in plans for _, _, rows in plan]
        assert any(sum(rows) > 0 for rows in replica_rows), (
            f"step {step}: no replica computed any row"
        )
        assert plans[0] != plans[2], (
            f"step {step}: the two EP groups planned alike"
        )  # ranks 0 and 2
        assert all(run["ring_live"][step] == 0 for run in runs)
    expected = (
        "TEGroupedMLP" if scenario in GROUPED else "SequentialMLP",
        "BalancedFlexDispatcher" if "hybridep" in scenario else "BalancedAlltoAllDispatcher",
        "_HybridEPManager" if "hybridep" in scenario else None,
    )
    assert (
        runs[0]["experts_class"],
        runs[0]["dispatcher_class"],
        runs[0]["manager_class"],
    ) == expected
    delayed_calls = sum(run["delayed_wgrad_calls"] for run in runs)
    if scenario.startswith("delay"):
        assert delayed_calls > 0, "backward_dw() never computed the replicas' weight gradients"
    else:
        assert delayed_calls == 0
    assert all((run["fp8_casts"] > 0) == ("fp8" in scenario) for run in runs), [
        run["fp8_casts"] for run in runs
    ]


def test_negative_control_replica_gradients_reduced_before_backward_dw(node_runs):
    """Replica gradients reduced in the experts' backward, before ``backward_dw()`` computed them:
    the replicated experts lose their replicas' contribution (Transformer Engine hands autograd
    weight gradients it has not computed yet)."""
    comparisons = node_comparisons(node_runs, "delay_reduced_before_dw")
    failed = [c for c in comparisons if not c.passed]
    worst = max(comparisons, key=lambda c: c.ratio)
    print(
        f"\nreduced before backward_dw: {len(failed)} of {len(comparisons)} over tolerance, worst "
        f"{worst.ratio:.3g}x the tolerance ({worst.what}: error {worst.error:.3g})"
    )
    assert failed and worst.ratio > 10, summary(comparisons)
    assert all(".experts." in c.what for c in failed), [c.what for c in failed]


def twin_differences(dumps, key, twin) -> tuple[list[str], float, bool]:
    """Run ``key`` against run ``twin`` bit for bit: the parameters whose reduced gradient differs
    in some step, the largest such difference relative to the twin's largest magnitude, and
    whether every microbatch's loss is the same."""
    actual, expected = reduced(dumps, key), reduced(dumps, twin)
    assert sorted(actual) == sorted(expected) and actual
    differing, worst = set(), 0.0
    for step, grads in expected.items():
        assert sorted(actual[step]) == sorted(grads)
        for name, grad in grads.items():
            if not torch.equal(actual[step][name], grad):
                differing.add(name)
                scale = grad.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
                worst = max(
                    worst, float((actual[step][name].float() - grad.float()).abs().max() / scale)
                )
    return sorted(differing), worst, losses(dumps, key) == losses(dumps, twin)


@pytest.mark.parametrize("key", ["ultraep", "none", "none_floor"])
def test_delayed_fp8_weight_gradients_equal_the_undelayed_ones_bit_for_bit(node_runs, key):
    """fp8 (tensorwise) under --delay-wgrad-compute against its undelayed twin, both through the
    overlapped schedule: the delayed weight-gradient GEMMs multiply the same quantized operands
    later, and every reduced gradient and loss comes out bit for bit the same (measured: no
    difference at all, so no tolerance), balanced or not, at EP 2 and EP 4."""
    differing, worst, same_losses = twin_differences(
        node_runs, f"{FP8_DELAYED}/{key}", f"{FP8_UNDELAYED}/{key}"
    )
    assert not differing and same_losses, (differing[:10], worst)


def test_negative_control_fp8_replica_gradients_reduced_before_backward_dw(node_runs):
    """Under fp8 the noise floor of ``none`` at two EP sizes is fp8's regrouping (each expert's rows
    quantized in other groups), too wide for the floor comparison to see replica gradients
    reduced before ``backward_dw()`` computed them; the bit-for-bit comparison with the undelayed
    twin sees them: the experts' gradients differ, nothing else does (the losses neither)."""
    differing, worst, same_losses = twin_differences(
        node_runs, "delay_fp8_reduced_before_dw/ultraep", f"{FP8_UNDELAYED}/ultraep"
    )
    floor_comparisons = node_comparisons(node_runs, "delay_fp8_reduced_before_dw")
    print(
        f"\nfp8, reduced before backward_dw: {len(differing)} parameters differ from the undelayed twin, "
        f"worst by {worst:.3g} of their largest magnitude; against none within the floor: "
        f"{summary(floor_comparisons)}"
    )
    assert differing and worst > 0.1, (differing, worst)
    assert all(".experts." in name for name in differing), differing
    assert same_losses


def order_mismatches(dumps, key, steps) -> list[str]:
    """Where megatron DDP's view of the backward differs between the ranks of one
    expert-data-parallel group (or the data-parallel group, for the dense buckets): the sequence
    of grad-ready calls and bucket-collective starts of each bucket family, per step."""
    out = []
    records = [d[key]["grad_order"] for d in dumps]
    groups = {(b["family"], tuple(b["ranks"])) for record in records for b in record["buckets"]}
    for step in steps:
        for family, ranks in sorted(groups):
            sequences = {
                r: [e for e in records[r]["events"][step] if e[1] == family] for r in ranks
            }
            first = sequences[ranks[0]]
            for r in ranks[1:]:
                if sequences[r] != first:
                    i = next(
                        (i for i, (a, b) in enumerate(zip(first, sequences[r])) if a != b),
                        min(len(first), len(sequences[r])),
                    )
                    out.append(
                        f"step {step}, {family} buckets of ranks {ranks}: rank {r} differs from rank "
                        f"{ranks[0]} first at event {i}: {first[i : i + 1]} vs {sequences[r][i : i + 1]}"
                    )
    return out


@pytest.mark.parametrize("scenario", DELAYED)
def test_delayed_gradients_ready_in_one_order_across_expert_data_parallel_ranks(
    node_runs, scenario
):
    """With the experts' gradients delayed, DDP's hooks fire in ``backward_dw()`` (held back until
    the replica reduction completed): in every step the ranks of an expert-data-parallel group,
    whose EP groups plan differently, mark their experts' gradients ready and start their bucket
    reduce-scatters in one order (the second step's are overlapped with the backward)."""
    key = f"{scenario}/ultraep"
    events = node_runs[0][key]["grad_order"]["events"]
    assert any(e[0] == "sync" and e[1] == "expert" for e in events[2]), (
        "no expert bucket collective"
    )
    assert any(e[0] == "ready" and e[1] == "expert" and e[4] for e in events[2])
    mismatches = order_mismatches(node_runs, key, sorted(events))
    assert not mismatches, "\n".join(mismatches)


def test_negative_control_delayed_hooks_in_plan_order(node_runs):
    """The order check catches a plan-dependent order: layers whose plan replicated one of their
    experts run the held-back hooks in reverse; the expert-data-parallel partners then see their
    experts' gradients ready in different orders."""
    mismatches = order_mismatches(
        node_runs,
        "delay_hooks_in_plan_order/ultraep",
        sorted(node_runs[0]["delay_hooks_in_plan_order/ultraep"]["grad_order"]["events"]),
    )
    print("\nhooks in plan order:\n" + "\n".join(mismatches))
    assert any(", expert buckets" in m for m in mismatches), (
        "the plan-dependent order changed nothing"
    )
    assert not any(", dense buckets" in m for m in mismatches), mismatches


# ---- the training loop -------------------------------------------------------------------------
LR0, ADAM = 2, 2
OVERLAP = [
    "--bf16",
    "--overlap-moe-expert-parallel-comm",
    "--mtp-num-layers",
    "1",
    "--position-embedding-type",
    "rope",
    "--num-layers",
    "4",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "2000",
    "--clip-grad",
    "0.0",
    "--untie-embeddings-and-output-weights",
]  # megatron ties them across virtual stages only without MTP
BALANCED = ["--moe-balancer", "ultraep", "--moe-balancer-num-slots", "2"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
#: name: (ranks, EP, extra flags, lr-0 iterations, Adam iterations, faults); global batch 16: two
#: microbatches per rank at PP 1, four per pipeline at PP 2 (interleaving needs a multiple of PP).
RUNS = {
    "none": (4, 2, [], LR0, ADAM, ""),
    "none_floor": (4, 4, [], LR0, ADAM, ""),
    "ultraep": (4, 2, BALANCED, LR0, ADAM, ""),
    "ultraep_remat_fault": (4, 2, BALANCED, LR0, 0, "rematerialized_from_another_microbatch"),
    "none_vpp": (8, 2, VPP, LR0, ADAM, ""),
    "none_vpp_floor": (8, 4, VPP, LR0, ADAM, ""),
    "ultraep_vpp": (8, 2, [*VPP, *BALANCED], LR0, ADAM, ""),
}
COMPARED = {"ultraep": ("none", "none_floor"), "ultraep_vpp": ("none_vpp", "none_vpp_floor")}
ALL_LR0 = list(range(1, LR0 + 1))
TRAINED = list(range(LR0 + 1, LR0 + ADAM + 1))


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory):
    """name -> DumpRun, each launched once, on first use, from one initial checkpoint."""
    root = tmp_path_factory.mktemp("overlapped_training")
    save_initial_checkpoint(root / "initial", [*tiny_moe_args(ep=1, train_iters=1), *OVERLAP])
    load = ["--load", str(root / "initial" / "ckpt"), "--finetune", "--ckpt-format", "torch_dist"]
    done = {}

    def get(name):
        if name not in done:
            ranks, ep, extra, lr0, adam, faults = RUNS[name]
            args = [
                *tiny_moe_args(ep=ep, train_iters=lr0 + adam),
                *OVERLAP,
                "--global-batch-size",
                "16",
                *load,
                *extra,
            ]
            done[name] = launch_dump_run(
                root / name, ranks, args, {"ULTRAEP_LR0_ITERS": str(lr0), "ULTRAEP_FAULTS": faults}
            )
        return done[name]

    return get


@pytest.mark.parametrize("name", list(COMPARED))
def test_training_per_step(training_runs, name):
    reference, floor = COMPARED[name]
    comparisons = per_step_comparisons(
        training_runs(name),
        training_runs(reference),
        training_runs(reference),
        training_runs(floor),
        ALL_LR0,
        ALL_LR0,
    )
    print(f"\n{name} per step: {summary(comparisons)}")
    assert sum(".experts." in c.what for c in comparisons) >= 8 * 2 * 5 * LR0, (
        "every expert weight (MTP's too)"
    )
    assert not failures(comparisons), "\n".join(failures(comparisons)[:20])


@pytest.mark.parametrize("name", list(COMPARED))
def test_training_trajectory(training_runs, name):
    reference, floor = COMPARED[name]
    comparisons = trajectory_comparisons(
        training_runs(name),
        training_runs(reference),
        training_runs(reference),
        training_runs(floor),
        TRAINED,
    )
    print(f"\n{name} trajectory ({ADAM} Adam iterations): {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)


@pytest.mark.parametrize("name", list(COMPARED))
def test_training_ran_the_overlapped_schedule_and_logs_the_balanced_imbalance(training_runs, name):
    """megatron ran the combined 1F1B schedule (its argument dump), with the layout asked for,
    ``none`` included (pretrain_gpt.py gives it the schedule plan it asks for); the balanced run's
    log reports each layer's imbalance before and after balancing, MTP's layer included."""
    reference, _ = COMPARED[name]
    for run in (name, reference):
        log = training_runs(run).log
        assert re.search(r"overlap_moe_expert_parallel_comm \.+ True", log), run
        assert re.search(r"use_distributed_optimizer \.+ True", log) and re.search(
            r"overlap_grad_reduce \.+ True", log
        )
    if "vpp" in name:
        assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2", training_runs(name).log)
    lines = re.findall(
        r"balanced rank imbalance \(before -> after\) \|(.*)", training_runs(name).log
    )
    assert len(lines) >= LR0 + ADAM, "one line per iteration"
    after = [float(a) for a in re.findall(r"layer 5: [\d.]+ -> ([\d.]+)", "".join(lines))]
    assert after and max(after) < 1.05, lines[-1]  # layer 5: the MTP layer's MoE layer


def test_negative_control_rematerialized_from_another_microbatch(training_runs):
    """Each layer's replicas re-materialized for its backward from the plan the weight buffer
    holds when that backward starts (in this schedule another microbatch's latest forward): the
    reduced gradients leave the noise floor."""
    comparisons = per_step_comparisons(
        training_runs("ultraep_remat_fault"),
        training_runs("none"),
        training_runs("none"),
        training_runs("none_floor"),
        ALL_LR0,
        ALL_LR0,
    )
    failed = failures(comparisons)
    worst = max(comparisons, key=lambda c: c.ratio)
    print(
        f"\nre-materialized from another microbatch's plan: {len(failed)} of {len(comparisons)} over tolerance, "
        f"worst {worst.ratio:.3g}x the tolerance ({worst.what}: error {worst.error:.3g})"
    )
    assert failed and worst.ratio > 10, summary(comparisons)


def test_the_overlapped_schedule_keeps_nccl_s_rules(tmp_path):
    """workers/overlapped_schedule.py (every scenario: megatron's overlapped 1F1B schedule with
    the balanced layer, delayed weight gradients, both planners) with every rank's collectives,
    batched rounds and waits recorded (tests/nccl_rules.py) and checked against NCCL's rules
    (tests/nccl_check.py); a collective skipped by one rank in those logs fails the check."""
    import copy

    from nccl_check import NcclRuleError, check_logs
    from nccl_rules import read_logs

    logs_dir = tmp_path / "nccl"
    logs_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    launch_gloo_ranks(
        WORKERS / "overlapped_schedule.py",
        WORLD,
        ["--out-dir", str(out)],
        env={"ULTRAEP_NCCL_RULES_DIR": str(logs_dir)},
        log_path=out / "log",
    )
    logs = read_logs(str(logs_dir))
    assert sorted(logs) == list(range(WORLD))
    assert sum(e["kind"] == "batch" for e in logs[0]) > 0
    check_logs(logs)
    skipped = copy.deepcopy(logs)
    first = next(i for i, e in enumerate(skipped[2]) if e["kind"] == "coll")
    del skipped[2][first]
    with pytest.raises(NcclRuleError, match=r"rank 2: nothing \(skipped\)|rank 2: "):
        check_logs(skipped)
