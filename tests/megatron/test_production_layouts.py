"""--moe-balancer ultraep in the DDP layouts production runs: expert-data-parallel 2, the distributed
optimizer with overlapped gradient reduction and parameter gather, buckets that split experts,
several microbatches (megatron-core's training loop, 4 gloo CPU ranks).

The tiny fp32 MoE GPT (``tiny_moe_args``: 2 layers, 8 experts of two 4096-element weights, top-2) at
EP 2 on 4 ranks: two EP groups, each planning its own load, and expert-data-parallel groups {0, 2}
and {1, 3} that pair ranks of different plans. Megatron closes a gradient bucket once it reaches
``--ddp-bucket-size`` and never splits a weight: buckets of 2000 elements hold one expert weight
each (an expert spans two buckets, all of one size, so collectives issued out of step mix
gradients silently instead of hanging: the order negative control's layout), buckets of 10000
hold three (an expert spans two buckets, a bucket holds parts of two experts). Global batch 16 of
micro-batches 2: two microbatches per rank and iteration. The bucket size does not change what
``none`` computes (each element is reduced over the same ranks), so one ``none`` is the reference
of both.

Every run starts from one initial checkpoint (saved on one rank), so layouts of another EP size
start from the same weights. Runs (workers/pretrain_grad_dump.py; ``LR0`` iterations at learning
rate 0 compare every
reduced gradient per step, gathered from the distributed optimizer's shards; ``ADAM`` more compare
the trajectory):

=====================  =====  ============================================================
run                    ranks  what
=====================  =====  ============================================================
none                   4      the reference
none_floor             4      EP 4: every expert's gradient summed over other row partitions
                              and ranks, the same mathematics (the noise floor pair)
ultraep                4      balanced
ultraep_ddp_options    4      balanced, buckets of 10000, ``--ddp-average-in-collective``,
                              ``--num-distributed-optimizer-instances 2``,
                              ``--ddp-pad-buckets-for-high-nccl-busbw``, ``--check-for-large-grads``,
                              ``--check-weight-hash-across-dp-replicas-interval 1``
none_bf16, _floor,     4      the same three in bf16 with ``--grad-reduce-in-bf16`` (bf16 main
ultraep_bf16                  gradients, reduced in bf16: the replica gradients are folded into them)
ultraep_wgrad_fusion   4      balanced with ``--gradient-accumulation-fusion`` (megatron's GPU
                              default: the main experts' weight gradients go straight into
                              ``main_grad``, the replica reduction folds in after them), its Apex
                              kernel replaced by a CPU stand-in of the same contract
                              (``wgrad_fusion_standin.py``; the fp32 product is the unfused one, so
                              ``none`` unfused is its reference)
ultraep_fp8_blockwise  4      balanced in bf16 with fp8 parameters (``--fp8-format hybrid
                              --fp8-recipe blockwise --fp8-param-gather``: TE's blockwise weights,
                              stood in by ``fp8_param_standin.py``, through megatron's buffers,
                              optimizer cast and parameter gather); no recipe preset has them (the
                              presets' fp8 parameters run in test_recipe_variants.py). Checked: every
                              replica computed with its main expert's quantized bytes
ultraep_order_fault    4      balanced with the experts' gradients handed to DDP in the local
                              plan's order (negative control), lr-0 iterations only
ultraep_gather_fault   4      balanced with replicas copied before megatron's parameter
                              all-gather completes (negative control)
=====================  =====  ============================================================

One more launch checks the mechanism the order fix rests on, directly (:func:`grad_order_run`): the
order in which megatron's DDP sees each gradient ready is the same on every rank that reduces it
together, whatever each rank's plan.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from equivalence import failures, per_step_comparisons, summary, trajectory_comparisons
from megatron_runs import launch_dump_run, quantized_weights, save_initial_checkpoint, tiny_moe_args

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.traces import find_trace_files, read_trace

pytestmark = pytest.mark.slow

EP, BUCKET, COARSE_BUCKET = 2, 2000, 10000
LR0, ADAM = 3, 3
PRODUCTION_DDP = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    str(BUCKET),
    "--global-batch-size",
    "16",
    "--clip-grad",
    "0.0",
]
BALANCED = ["--moe-balancer", "ultraep", "--moe-balancer-num-slots", "2"]
BF16 = ["--bf16", "--grad-reduce-in-bf16"]
COMPARED = {  # balanced run: (reference, noise-floor partner)
    "ultraep": ("none", "none_floor"),
    "ultraep_ddp_options": ("none", "none_floor"),
    "ultraep_bf16": ("none_bf16", "none_bf16_floor"),
    "ultraep_wgrad_fusion": ("none", "none_floor"),
}
RUNS = {  # name: (EP size, extra flags, lr-0 iterations, Adam iterations, faults), all on 4 ranks
    "none": (EP, [], LR0, ADAM, ""),
    "none_floor": (4, [], LR0, ADAM, ""),
    "ultraep": (EP, BALANCED, LR0, ADAM, ""),
    "ultraep_ddp_options": (
        EP,
        [
            *BALANCED,
            "--ddp-bucket-size",
            str(COARSE_BUCKET),
            "--ddp-average-in-collective",
            "--num-distributed-optimizer-instances",
            "2",
            "--ddp-pad-buckets-for-high-nccl-busbw",
            "--check-for-large-grads",
            "--check-weight-hash-across-dp-replicas-interval",
            "1",
        ],
        LR0,
        ADAM,
        "",
    ),
    "none_bf16": (EP, BF16, LR0, ADAM, ""),
    "none_bf16_floor": (4, BF16, LR0, ADAM, ""),
    "ultraep_bf16": (EP, [*BF16, *BALANCED], LR0, ADAM, ""),
    "ultraep_wgrad_fusion": (EP, BALANCED, LR0, ADAM, ""),
    "ultraep_fp8_blockwise": (
        EP,
        [
            *BF16,
            *BALANCED,
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "blockwise",
            "--fp8-param-gather",
        ],
        LR0,
        ADAM,
        "",
    ),
    "ultraep_order_fault": (EP, BALANCED, LR0, 0, "grads_ready_in_plan_order"),
    "ultraep_gather_fault": (EP, BALANCED, LR0, ADAM, "replicas_before_param_gather"),
}
WORLD = 4
#: Runs whose collectives, batched rounds and waits are checked against NCCL's rules.
NCCL_RULES = {"ultraep"}
#: Runs with --gradient-accumulation-fusion (its kernel's CPU stand-in).
WGRAD_FUSION = {"ultraep_wgrad_fusion"}
# Iteration 1 is megatron's first batch: DDP then learns how often each parameter's hook fires and
# reduces every bucket at the end of the backward, in bucket order. Overlapped reduction, and so
# the order hazard, starts with iteration 2.
OVERLAPPED = list(range(2, LR0 + 1))
ALL_LR0 = list(range(1, LR0 + 1))
TRAINED = list(range(LR0 + 1, LR0 + ADAM + 1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> DumpRun, each launched once, on first use."""
    root = tmp_path_factory.mktemp("production_layouts")
    save_initial_checkpoint(root / "initial", tiny_moe_args(ep=1, train_iters=1))
    load = ["--load", str(root / "initial" / "ckpt"), "--finetune", "--ckpt-format", "torch_dist"]
    done = {}

    def get(name):
        if name not in done:
            ep, extra, lr0, adam, faults = RUNS[name]
            run_dir = root / name
            args = [*tiny_moe_args(ep=ep, train_iters=lr0 + adam), *PRODUCTION_DDP, *load, *extra]
            if "--moe-balancer" in extra:
                args += ["--moe-balancer-trace-dir", str(run_dir / "trace")]
            env = {"ULTRAEP_LR0_ITERS": str(lr0), "ULTRAEP_FAULTS": faults}
            if name in NCCL_RULES:  # every rank's collectives and rounds recorded (nccl_rules.py)
                (run_dir / "nccl").mkdir(parents=True, exist_ok=True)
                env["ULTRAEP_NCCL_RULES_DIR"] = str(run_dir / "nccl")
            if name in WGRAD_FUSION:
                args.remove("--no-gradient-accumulation-fusion")
                env["ULTRAEP_WGRAD_FUSION_STANDIN"] = "1"
            done[name] = launch_dump_run(run_dir, WORLD, args, env)
        return done[name]

    return get


def replicated_experts_of_last_microbatch(run) -> dict[tuple[int, int, int], frozenset]:
    """{(EP group, iteration, layer): the experts replicated in the iteration's last microbatch},
    re-planned from each EP group's recorded loads with the run's balancer settings (the trace's
    header). The last microbatch is the one whose backward hands the gradients to DDP's buckets."""
    out = {}
    for group, path in enumerate(find_trace_files(run.run_dir / "trace")):
        trace = read_trace(path)
        meta = trace.header.meta
        balancer = BalancerConfig(
            meta["balancer"],
            num_slots=meta["num_slots"],
            min_quota=meta["min_quota"],
            trigger=meta["trigger"],
        ).build()
        last = {}
        for i in range(len(trace.iteration)):
            key = (group, int(trace.iteration[i]), int(trace.layer[i]))
            if int(trace.microbatch[i]) >= last.get(key, (-1, None))[0]:
                last[key] = (int(trace.microbatch[i]), trace.load[i])
        for key, (_, load) in last.items():
            plan = balancer.plan(load)
            out[key] = frozenset(int(e) for e in plan.slot_expert.reshape(-1).tolist() if e >= 0)
    return out


def test_the_layout_pairs_ranks_of_different_plans(runs):
    """The hazard is real here: in an overlapped iteration, the two EP groups (whose ranks share
    expert-data-parallel groups) replicate different experts in the microbatch that hands the
    gradients to DDP."""
    replicated = replicated_experts_of_last_microbatch(runs("ultraep"))
    assert {group for group, _, _ in replicated} == {0, 1}, "two EP groups, two traces"
    differing = [
        (it, layer)
        for (group, it, layer), experts in replicated.items()
        if group == 0 and it in OVERLAPPED and experts != replicated[(1, it, layer)]
    ]
    assert differing, (
        f"every overlapped iteration replicated the same experts in both EP groups: {replicated}"
    )
    assert any(experts for experts in replicated.values()), "nothing was replicated"


@pytest.mark.parametrize("name", list(COMPARED))
def test_per_step_gradients_losses_and_grad_norms(runs, name):
    reference, floor = COMPARED[name]
    comparisons = per_step_comparisons(
        runs(name), runs(reference), runs(reference), runs(floor), ALL_LR0, ALL_LR0
    )
    print(f"\n{name} per step: {summary(comparisons)}")
    assert sum(".experts." in c.what for c in comparisons) >= 8 * 2 * 2 * LR0, "every expert weight"
    assert not failures(comparisons), "\n".join(failures(comparisons)[:20])


@pytest.mark.parametrize("name", list(COMPARED))
def test_trajectory(runs, name):
    reference, floor = COMPARED[name]
    comparisons = trajectory_comparisons(
        runs(name), runs(reference), runs(reference), runs(floor), TRAINED
    )
    print(f"\n{name} trajectory ({ADAM} Adam iterations): {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)
    trained = [runs(reference).records[it]["losses"]["lm loss"] for it in TRAINED]
    assert trained[-1] < trained[0], "the model must be training"


def test_the_fusion_run_ran_megatrons_fused_path(runs):
    """``ultraep_wgrad_fusion`` ran with gradient-accumulation fusion on (megatron prints its
    arguments), the others with it off."""
    assert re.search(r"gradient_accumulation_fusion \.+ True", runs("ultraep_wgrad_fusion").log)
    assert re.search(r"gradient_accumulation_fusion \.+ False", runs("ultraep").log)


def test_weights_stay_identical_across_data_parallel_replicas(runs):
    """megatron's own check (--check-weight-hash-across-dp-replicas-interval 1) passed after every
    iteration of the balanced run: the main experts' replicas in the expert-data-parallel group
    hold the same weights."""
    log = runs("ultraep_ddp_options").log
    for iteration in range(1, LR0 + ADAM + 1):
        assert f"Weight hashes match after {iteration} iterations" in log, iteration


def test_blockwise_fp8_parameters_reach_the_replicas_through_megatrons_gather(runs):
    """Blockwise fp8 parameters: megatron mapped their row-wise bytes into its parameter buffer,
    cast the optimizer's shards into them, gathered them and made their column-wise copies (the
    stand-in's TE functions ran), and every replica computed with its main expert's quantized
    bytes of that iteration (data, scales, column-wise copy), also after the weights changed."""
    run = runs("ultraep_fp8_blockwise")
    record = quantized_weights(run)
    assert record.weight_classes == {"ToyBlockwiseTensor"}, record.weight_classes
    for name in ("replace_raw_data", "cast_master_weights_to_fp8", "post_all_gather_processing"):
        assert record.calls.get(name, 0) > 0, record.calls
    assert {key[0] for key, _ in record.replicas} >= set(TRAINED), (
        "replicas in every trained iteration"
    )
    assert not record.mismatches(), record.mismatches()[:10]
    trained = [run.records[it]["losses"]["lm loss"] for it in TRAINED]
    print(
        f"\nblockwise fp8 parameters: {len(record.replicas)} replica calls with their main experts' bytes; "
        f"stand-in calls {record.calls}; losses {trained}"
    )
    assert trained[-1] < trained[0], "the model must be training"


def test_negative_control_gradients_handed_over_in_plan_order(runs):
    """Experts' gradients handed to DDP in the order of each rank's own plan (the bug): the
    expert-data-parallel ranks issue their bucket reduce-scatters out of step, and the reduced
    gradients are wrong in the overlapped iterations."""
    comparisons = per_step_comparisons(
        runs("ultraep_order_fault"),
        runs("none"),
        runs("none"),
        runs("none_floor"),
        ALL_LR0,
        OVERLAPPED,
    )
    failed = failures(comparisons)
    worst = max(comparisons, key=lambda c: c.ratio)
    print(
        f"\norder fault: {len(failed)} of {len(comparisons)} over tolerance, worst {worst.ratio:.3g} ({worst.what})"
    )
    assert failed and worst.ratio > 10, summary(comparisons)


def test_negative_control_replicas_read_before_the_parameter_gather(runs):
    """Replicas copied from the main experts before megatron's all-gather of the updated
    parameters completed: after the first optimizer step they run on stale weights and the
    trajectory leaves the noise floor."""
    comparisons = trajectory_comparisons(
        runs("ultraep_gather_fault"), runs("none"), runs("none"), runs("none_floor"), TRAINED
    )
    failed = failures(comparisons)
    worst = max(comparisons, key=lambda c: c.ratio)
    print(
        f"\ngather fault: {len(failed)} of {len(comparisons)} over tolerance, worst {worst.ratio:.3g} ({worst.what})"
    )
    assert failed, summary(comparisons)


# ---- gradient order ----------------------------------------------------------------------------
# The fix above rests on every autograd node before the dispatch being independent of the plan
# (AccumulateGrad nodes share one priority in autograd's ready queue, which is not stable): then the
# experts' gradients are accumulated, and DDP's grad-ready hook fires, in one order on every rank.
# One launch (workers/pretrain_grad_dump.py, ULTRAEP_GRAD_ORDER=1) records DDP's own view of it
# (``GradReadyOrder``): the tiny model with a shared expert, buckets of one expert weight each
# (8 whole buckets per MoE layer and rank), 3 microbatches per rank and iteration, lr 0 throughout.
# Iterations 1-3 run the balancer as shipped (1: megatron's first batch, which only counts the
# hooks; 2-3 overlapped); iterations 4-5 the negative control, an identity before the dispatch whose
# inputs include the parameters of the local experts this rank's plan replicates.
ORDER_CLEAN, ORDER_FAULTED = [1, 2, 3], [4, 5]
ORDER_MICROBATCHES = 3
SHARED_EXPERT = ["--moe-shared-expert-intermediate-size", "64"]


@pytest.fixture(scope="module")
def grad_order_run(tmp_path_factory):
    """Every rank's ``grad_order`` record (workers/megatron_records.GradReadyOrder), by rank."""
    run_dir = tmp_path_factory.mktemp("grad_order")
    iterations = len(ORDER_CLEAN) + len(ORDER_FAULTED)
    args = [
        *tiny_moe_args(ep=EP, train_iters=iterations),
        *PRODUCTION_DDP,
        *BALANCED,
        *SHARED_EXPERT,
        "--global-batch-size",
        str(2 * ORDER_MICROBATCHES * WORLD),
    ]  # micro-batch 2, DP 4
    faults = ",".join(f"plan_dependent_node_before_dispatch@{it}" for it in ORDER_FAULTED)
    launch_dump_run(
        run_dir,
        WORLD,
        args,
        {"ULTRAEP_LR0_ITERS": str(iterations), "ULTRAEP_FAULTS": faults, "ULTRAEP_GRAD_ORDER": "1"},
    )
    return [torch.load(run_dir / f"rank{r}.pt")["grad_order"] for r in range(WORLD)]


def layer_of(name: str) -> str:
    return re.search(r"layers\.(\d+)\.", name).group(1)


def reduction_groups(records) -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """{(bucket family, the ranks its collectives run over): those ranks}, from every rank's buckets."""
    return {
        (b["family"], tuple(b["ranks"])): list(b["ranks"])
        for record in records
        for b in record["buckets"]
    }


def order_mismatches(records, iterations) -> list[str]:
    """Where DDP's view of the backward differs between ranks that reduce together: for each
    iteration and each group of ranks one bucket family reduces over, every rank's sequence of
    grad-ready calls (parameter, last microbatch or not) and bucket-collective starts of that family
    must be its first rank's. One line per rank that differs, with how many events and how many
    collective starts (its collectives issued out of step) differ."""
    out = []
    for iteration in iterations:
        for (family, _), ranks in sorted(reduction_groups(records).items()):
            sequences = {
                r: [e for e in records[r]["events"][iteration] if e[1] == family] for r in ranks
            }
            first = sequences[ranks[0]]
            for r in ranks[1:]:
                differing = [i for i, (a, b) in enumerate(zip(first, sequences[r])) if a != b]
                if differing or len(first) != len(sequences[r]):
                    syncs = [
                        [e for e in sequence if e[0] == "sync"]
                        for sequence in (first, sequences[r])
                    ]
                    out_of_step = sum(a != b for a, b in zip(*syncs)) + abs(
                        len(syncs[0]) - len(syncs[1])
                    )
                    i = differing[0] if differing else min(len(first), len(sequences[r]))
                    out.append(
                        f"iteration {iteration}, {family} buckets of ranks {ranks}: rank {r} differs "
                        f"from rank {ranks[0]} at {len(differing)} of {len(first)} events "
                        f"({out_of_step} of {len(syncs[0])} collective starts), first at {i}: "
                        f"{first[i : i + 1]} vs {sequences[r][i : i + 1]}"
                    )
    return out


def test_grad_order_setup_exercises_the_hazard(grad_order_run):
    """What the order check below covers: a shared expert among the dense buckets; at least 3 whole
    expert buckets per MoE layer on every rank; every parameter's hook in each of the 3
    microbatches; expert-data-parallel partners (different EP groups) whose plans replicate, and
    differ, in every iteration."""
    records = grad_order_run
    groups = reduction_groups(records)
    assert {family for family, _ in groups} == {"dense", "expert"}
    assert all(
        len(ranks) == WORLD // EP for (family, _), ranks in groups.items() if family == "expert"
    )
    for rank, record in enumerate(records):
        expert_buckets = [
            bucket
            for group in record["buckets"]
            if group["family"] == "expert"
            for bucket in group["buckets"]
        ]
        whole = [
            bucket for bucket in expert_buckets if len({layer_of(name) for name in bucket}) == 1
        ]
        layers = Counter(layer_of(bucket[0]) for bucket in whole)
        assert len(layers) == 2 and min(layers.values()) >= 3, (
            f"rank {rank}: whole buckets per layer {layers}"
        )
        for iteration in ORDER_CLEAN + ORDER_FAULTED:
            ready = Counter(e[3] for e in record["events"][iteration] if e[0] == "ready")
            assert set(ready.values()) == {ORDER_MICROBATCHES}, (rank, iteration, ready)
            assert any("shared_experts" in name for name in ready), "no shared expert"
            assert sum(1 for e in record["events"][iteration] if e[0] == "ready" and e[4]) == len(
                ready
            )
            assert (
                len(record["plans"][iteration]) == 2 * ORDER_MICROBATCHES
            )  # MoE layers x microbatches
        assert any(e[0] == "sync" for e in record["events"][2]), "no overlapped bucket collective"
    partners = [ranks for (family, _), ranks in groups.items() if family == "expert"]
    for iteration in ORDER_CLEAN + ORDER_FAULTED:
        for ranks in partners:
            plans = [records[r]["plans"][iteration] for r in ranks]
            assert any(experts for plan in plans for _, experts in plan), (
                f"iteration {iteration}: no replica"
            )
            assert plans[0] != plans[1], f"iteration {iteration}: ranks {ranks} planned alike"


def test_grad_order_is_the_same_on_every_rank_that_reduces_together(grad_order_run):
    """In every microbatch of every iteration, every rank of an expert-data-parallel group sees its
    experts' gradients ready in one order and starts their bucket collectives in one order (and the
    whole data-parallel group likewise for the dense parameters, the shared expert's included),
    although the ranks' plans differ."""
    mismatches = order_mismatches(grad_order_run, ORDER_CLEAN)
    assert not mismatches, "\n".join(mismatches)


def test_negative_control_a_plan_dependent_node_before_the_dispatch_breaks_the_order(
    grad_order_run,
):
    """The check above catches the hazard: with a plan-dependent identity before the dispatch
    (iterations 4-5), the expert-data-parallel partners see their experts' gradients ready in
    different orders and start their bucket collectives out of step; the dense buckets' order is
    untouched."""
    mismatches = order_mismatches(grad_order_run, ORDER_FAULTED)
    print("\norder control:\n" + "\n".join(mismatches))
    assert any(", expert buckets" in m for m in mismatches), (
        "the plan-dependent node changed no order"
    )
    assert not any(", dense buckets" in m for m in mismatches), mismatches
    # The consequence megatron suffers: bucket collectives issued out of step.
    assert any(re.search(r"\(([1-9]\d*) of \d+ collective starts\)", m) for m in mismatches), (
        mismatches
    )


def test_the_production_layout_keeps_nccl_s_rules(runs, tmp_path):
    """The balanced run in the production layout (expert-DP 2, overlapped reduce and gather,
    buckets smaller than an expert, two microbatches) with every rank's collectives, batched
    rounds and waits recorded (tests/nccl_rules.py), megatron's DDP collectives among them, and
    checked against NCCL's rules (tests/nccl_check.py); a collective skipped by one rank in those
    logs fails the check."""
    import copy

    from nccl_check import NcclRuleError, check_logs
    from nccl_rules import read_logs

    run = runs("ultraep")
    logs = read_logs(str(run.run_dir / "nccl"))
    assert sorted(logs) == list(range(WORLD))
    assert sum(e["kind"] == "batch" for e in logs[0]) > 0  # the replica transfers' rounds
    check_logs(logs)
    skipped = copy.deepcopy(logs)
    first = next(i for i, e in enumerate(skipped[1]) if e["kind"] == "coll")
    del skipped[1][first]
    with pytest.raises(NcclRuleError, match=r"rank 1"):
        check_logs(skipped)
