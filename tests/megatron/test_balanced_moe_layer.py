"""UltraEP inside megatron-core's real MoELayer, on 4 gloo CPU ranks (EP=4), skewed routing.

The reference is megatron-core's own MoELayer (``--moe-balancer none``) with the same weights and
tokens: the balanced layer must give the same outputs and the same gradients of every parameter and
input, to the noise floor of megatron's layer fed the same tokens in another order (equivalence.py),
while the per-rank load its experts actually receive is balanced.
"""

import pytest
import torch

from equivalence import Comparison, failures, noise_floor, relative_difference, summary
from fp8_equivalence import GateRow, concatenated
from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 4
NUM_SLOTS = 1
EXPERT_NUMEL = 2 * 32 * 48  # fc1 [48, 32] + fc2 [32, 48]
LATENT_EXPERT_NUMEL = 2 * 16 * 48  # --moe-latent-size 16: fc1 [48, 16] + fc2 [16, 48]
SCENARIOS = (
    "single",
    "pipelined",
    "recompute",
    "eplb",
    "eplb-exact",
    "flex",
    "flex-hybridep",
    "flex-hybridep-padded",
    "grouped",
    "mixed",
    "frozen_input",
    "frozen_router",
    "relayed",
    "idle_replica",
    "device_planner",
    "device_planner_recompute",
    "device_planner_flex",
    "device_planner_fallback",
    "latent",
)
# A negative control must miss by more than this many times its tolerance (not a borderline miss).
NOISE_MULTIPLE = 10
EXPERT_PARAMS = 2  # fc1, fc2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("balanced_layer")
    launch_gloo_ranks(
        WORKERS / "balanced_moe_layer.py",
        WORLD,
        ["--out-dir", out, "--num-slots", NUM_SLOTS],
        timeout_s=400,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def comparisons(ranks, scenario) -> list[Comparison]:
    """Every output, input gradient, router and expert gradient of ``scenario``'s balanced layer
    against megatron's, each with its floor: megatron's layer on permuted tokens against itself."""
    out = []
    for rank, result in enumerate(ranks):
        balanced, reference = result[f"{scenario}/balanced"], result[f"{scenario}/none"]
        permuted = result[f"{scenario}/none_permuted"]
        quantities = [
            (
                f"rank {rank} microbatch {mb} {key}",
                balanced[key][mb],
                reference[key][mb],
                permuted[key][mb],
            )
            for key in ("out", "dx")
            for mb in range(len(reference[key]))
        ]
        if reference["router_grad"] is not None:  # a frozen router has none
            quantities.append(
                (
                    f"rank {rank} router grad",
                    balanced["router_grad"],
                    reference["router_grad"],
                    permuted["router_grad"],
                )
            )
        quantities += [
            (
                f"rank {rank} {key} projection grad",
                balanced["latent_grads"][key],
                grad,
                permuted["latent_grads"][key],
            )
            for key, grad in reference["latent_grads"].items()
        ]
        quantities += [
            (f"rank {rank} expert {expert} {name} grad", b, r, p)
            for expert, grads in reference["expert_grads"].items()
            for name, b, r, p in zip(
                ("fc1", "fc2"),
                balanced["expert_grads"][expert],
                grads,
                permuted["expert_grads"][expert],
            )
        ]
        out += [
            Comparison(what, relative_difference(b, r), noise_floor([relative_difference(p, r)]))
            for what, b, r, p in quantities
        ]
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_outputs_and_gradients_as_megatron(ranks, scenario):
    compared = comparisons(ranks, scenario)
    print(f"\n{scenario}: {summary(compared)}")
    assert not failures(compared), failures(compared)


def test_fp8_scenario_passes_the_fp8_equivalence_gate(ranks):
    """``flex-hybridep-fp8`` (blockwise fp8, TE's quantization per GEMM group stood in): a replicated
    expert's rows, split between its main instance and replicas, are quantized by different groups'
    quantizers, so the balanced layer is compared with megatron's in fp8 against megatron's in fp32
    (fp8_equivalence.py): within 10 % of its distance, and closer to it than either is to the
    reference, per kind of quantity."""
    kinds = {
        "outputs": lambda r: r["out"],
        "input grads": lambda r: r["dx"],
        "router grads": lambda r: [r["router_grad"]],
        "expert grads": lambda r: [
            g for _, grads in sorted(r["expert_grads"].items()) for g in grads
        ],
    }
    rows = []
    for kind, of in kinds.items():
        runs = {
            key: concatenated(
                [t for result in ranks for t in of(result[f"flex-hybridep-fp8/{key}"])]
            )
            for key in ("none", "balanced", "reference")
        }
        rows.append(GateRow.of(kind, runs["none"], runs["balanced"], runs["reference"]))
    print("\nflex-hybridep-fp8:\n  " + "\n  ".join(map(str, rows)))
    assert all(row.passed for row in rows), [str(row) for row in rows if not row.passed]


@pytest.mark.parametrize(
    "control", ["no_replica_grad_reduction", "latent_no_replica_grad_reduction"]
)
def test_negative_control_unreduced_replica_gradients_fail_the_comparison(ranks, control):
    """The single (or latent) scenario again, with the replica-gradient reduction broken in the
    worker (pretrain_grad_dump.FAULTS): the replicated experts' gradients must fail, nothing else."""
    compared = comparisons(ranks, control)
    failed = [c for c in compared if not c.passed]
    assert failed, "breaking the replica-gradient reduction changed no gradient"
    print(
        f"\n{control}: {len(failed)} of {len(compared)} over tolerance, "
        f"error/tolerance {min(c.ratio for c in failed):.3g} to {max(c.ratio for c in failed):.3g}"
    )
    assert all(" expert 0 " in c.what or " expert 1 " in c.what for c in failed), failed
    # Not a borderline miss: wrong by far more than this run's rounding noise.
    assert all(c.ratio > NOISE_MULTIPLE for c in failed), failed


@pytest.mark.parametrize(
    "scenario",
    [
        "single",
        "pipelined",
        "recompute",
        "flex",
        "flex-hybridep",
        "grouped",
        "device_planner",
        "device_planner_recompute",
        "device_planner_flex",
        "device_planner_fallback",
        "latent",
    ],
)
def test_ultraep_balances_the_received_load(ranks, scenario):
    rows = torch.tensor(
        [r[f"{scenario}/balanced"]["received_rows"] for r in ranks], dtype=torch.float
    )
    skewed = torch.tensor(
        [r[f"{scenario}/none"]["received_rows"] for r in ranks], dtype=torch.float
    )
    # [ranks, microbatches] -> per-microbatch max/mean across ranks
    before = skewed.max(0).values / skewed.mean(0)
    after = rows.max(0).values / rows.mean(0)
    assert before.min() > 2.0, f"the test's routing is not skewed: {before}"
    assert after.max() <= 1.05, f"post-balancing imbalance {after} > 1.05 (before {before})"
    # Replicas were really created and used.
    stats = ranks[0][f"{scenario}/balanced"]["stats"][1]
    assert stats["replicas"] >= 1
    replica_rows = rows.sum() - skewed.sum()
    assert replica_rows == 0, "balancing moves tokens, never adds or drops any"


@pytest.mark.parametrize(
    "device,host",
    [
        ("device_planner", "pipelined"),
        ("device_planner_recompute", "recompute"),
        ("device_planner_flex", "flex"),
    ],
)
def test_device_planner_balances_as_the_host_planner(ranks, device, host):
    """--moe-balancer-planner device plans on the device from the same exact load: every rank's
    experts receive as many rows as with the host planner, in every microbatch."""
    for rank, result in enumerate(ranks):
        assert result[f"{device}/balanced"]["planner"] == "device"
        assert result[f"{host}/balanced"]["planner"] == "host"  # the CPU backend's default
        assert (
            result[f"{device}/balanced"]["received_rows"]
            == result[f"{host}/balanced"]["received_rows"]
        ), rank


def test_the_device_planner_checks_itself_once_and_says_so(ranks):
    """The device planner checks itself once per process: at the first model that plans on the
    device (``device_planner``) rank 0 printed its ready line (with the time), once; the later
    models of the same shape (``_recompute``, ``_flex``) reuse the outcome and print nothing; the
    other ranks never print."""
    for name in ("device_planner", "device_planner_recompute", "device_planner_flex"):
        for rank, result in enumerate(ranks):
            printed = result[f"{name}/balanced"]["printed_by_balancer"]
            first = rank == 0 and name == "device_planner"
            assert (
                len(printed) == 1 and "device planner ready in" in printed[0]
                if first
                else not printed
            ), (name, rank, printed)
    assert (
        ranks[0]["pipelined/balanced"]["printed_by_balancer"] == []
    )  # the host planner checks nothing


def test_a_failed_self_check_hands_over_to_the_host_planner_with_one_warning(ranks):
    """``device_planner_fallback``: the self-check failed on rank 1 alone (a kernel returning a wrong
    plan); every rank of the EP group plans on the host (they must plan alike), and rank 0 printed
    one warning line naming the failing rank, why, and ``--moe-balancer-planner host``. The layer
    then balances and computes as with the host planner (the comparisons above)."""
    for rank, result in enumerate(ranks):
        balanced = result["device_planner_fallback/balanced"]
        assert balanced["planner"] == "host", rank
        assert balanced["received_rows"] == result["pipelined/balanced"]["received_rows"], rank
        printed = balanced["printed_by_balancer"]
        if rank:
            assert printed == [], (rank, printed)
            continue
        assert len(printed) == 1, printed
        line = printed[0]
        print(f"\n{line}")
        assert line.startswith(
            "ultraep: warning: the device planner failed its self-check on EP rank 1: "
        ), line
        assert (
            "differs from the host planner's" in line and "--moe-balancer-planner host" in line
        ), line


@pytest.mark.parametrize(
    "scenario", ["single", "pipelined", "recompute", "device_planner", "grouped"]
)
def test_top_k_indices_come_from_the_router(ranks, scenario):
    """The reroute's [T, k] pairs are the router's own top-k indices (its tap), one per routing:
    every forward, and every recompute replay."""
    calls = {"single": 1, "pipelined": 3, "recompute": 4, "device_planner": 3, "grouped": 3}[
        scenario
    ]
    for result in ranks:
        assert result[f"{scenario}/balanced"]["tapped_routings"] == calls


def test_eplb_baselines_do_not_balance_as_well(ranks):
    ultraep = ranks[0]["pipelined/balanced"]["stats"][1]["imbalance_after"]
    for name in ("eplb", "eplb-exact"):
        rows = torch.tensor(
            [r[f"{name}/balanced"]["received_rows"] for r in ranks], dtype=torch.float
        )
        after = (rows.max(0).values / rows.mean(0)).mean()
        assert after > ultraep, f"{name} balanced better than ultraep ({after} vs {ultraep})"


def test_ring_is_released_after_backward(ranks):
    for rank, result in enumerate(ranks):
        pipelined = result["pipelined/balanced"]
        assert pipelined["ring_live_before_backward"] == 3  # three microbatches in flight
        assert pipelined["ring_live_after_backward"] == 0
        assert result["recompute/balanced"]["ring_live_after_backward"] == 0
        # Tokens without a gradient: the reduction still completes and releases the invocation.
        frozen = result["frozen_input/balanced"]
        assert frozen["ring_live_before_backward"] == 1
        assert frozen["ring_live_after_backward"] == 0, (
            f"rank {rank}: the invocation was never released"
        )
        assert frozen["dx"] == [] and frozen["expert_grads"], (
            "the scenario's tokens must need no gradient"
        )


def test_relayed_scenario_streams_through_a_relay(ranks):
    """The relayed scenario's comparison above covers relay trees only if its plan had one."""
    for rank, result in enumerate(ranks):
        assert any(result["relayed/balanced"]["relayed"]), f"rank {rank}: no schedule used a relay"
        assert not any(result["single/balanced"]["relayed"])  # the default threshold: direct edges


def test_idle_replica_scenario_hosts_slots_without_rows(ranks):
    """The idle_replica scenario's comparison above covers gradient slots that got no rows only if
    some rank hosted one."""
    idle = [
        rank for rank, result in enumerate(ranks) if result["idle_replica/balanced"]["idle_hosted"]
    ]
    assert idle, "no rank hosted a redundant slot without rows"


def test_replica_buffers_are_num_slots_experts(ranks):
    for result in ranks:
        assert result["single/balanced"]["replica_buffer_numel"] == NUM_SLOTS * EXPERT_NUMEL


def test_replica_backward_does_not_recompute_the_replica_forward(ranks):
    """Replica weights are re-materialized for the backward; replica activations are saved, so
    the replica experts run once per microbatch, and again only in a recompute replay."""
    for rank, result in enumerate(ranks):
        for scenario, microbatches in (
            ("single", 1),
            ("pipelined", 3),
            ("flex", 3),
            ("flex-hybridep", 3),
            ("flex-hybridep-padded", 2),
            ("grouped", 3),
            ("latent", 3),
        ):
            calls = result[f"{scenario}/balanced"]["replica_calls"]
            assert calls["backward"] == 0, (
                f"rank {rank} {scenario}: replica forward recomputed {calls}"
            )
            assert calls["forward"] <= microbatches
        # MoE activation recompute: one no-grad pass and one replay per microbatch, both counted.
        calls = result["recompute/balanced"]["replica_calls"]
        assert calls["backward"] == calls["forward"], calls
    for scenario in ("pipelined", "latent"):
        hosts = sum(r[f"{scenario}/balanced"]["replica_calls"]["forward"] > 0 for r in ranks)
        assert hosts >= 1, (
            f"{scenario}: no rank ran a replica: the test routing does not exercise the replicas"
        )


@pytest.mark.parametrize("scenario", ["single", "mixed"])
def test_every_experts_gradient_waits_for_the_reduction_in_one_order(ranks, scenario):
    """Every local main expert's gradient is accumulated (where Megatron DDP's hook hands main_grad
    to its bucket reduction) after the replica-gradient reduction finished, with a replica or
    without, and in the same order on every rank whatever its plan: ranks of one
    expert-data-parallel group plan different loads, and DDP starts a bucket's collective when its
    last parameter is ready. ``mixed`` has ranks above 0 with a replicated and an unreplicated
    expert (local ids != global)."""
    kinds_per_rank, orders = [], set()
    for rank, result in enumerate(ranks):
        events = result[f"{scenario}/balanced"]["accumulation_events"]
        folds = [i for i, (kind, _) in enumerate(events) if kind == "folded"]
        assert len(folds) == 1, f"rank {rank}: one backward, one reduction: {events}"
        accumulated = [local for kind, local in events if kind == "accumulated"]
        num_local = len(result["local_expert_indices"])
        # Every hook fired: each local expert's weights, once.
        assert sorted(accumulated) == sorted(list(range(num_local)) * EXPERT_PARAMS), events
        assert all(i > folds[0] for i, (kind, _) in enumerate(events) if kind == "accumulated"), (
            f"rank {rank}: an expert's gradient was handed over before the reduction finished: {events}"
        )
        orders.add(tuple(accumulated))
        replicated = set(events[folds[0]][1])
        kinds_per_rank.append((bool(replicated), len(replicated) < num_local))
    assert len(orders) == 1, (
        f"the ranks hand their experts' gradients over in different orders: {orders}"
    )
    assert any(r for r, _ in kinds_per_rank) and any(u for _, u in kinds_per_rank), (
        f"the routing must replicate some experts and not others: {kinds_per_rank}"
    )
    if scenario == "mixed":
        assert kinds_per_rank[1] == kinds_per_rank[2] == (True, True), (
            f"ranks 1 and 2 must each have an expert with a replica and one without: {kinds_per_rank}"
        )


def test_flex_scenario_ran_megatrons_deepep_path(ranks):
    """The flex scenario really went through the balanced flex dispatcher and megatron's DeepEP
    manager (over the gloo stand-in), and its reference through megatron's all-to-all."""
    for result in ranks:
        assert result["flex/balanced"]["dispatcher_class"] == "BalancedFlexDispatcher"
        assert result["flex/balanced"]["manager_class"] == "_DeepepManager"
        assert result["flex/none"]["dispatcher_class"] == "MoEAlltoAllTokenDispatcher"


def test_hybridep_scenarios_ran_megatrons_hybridep_path(ranks):
    """The HybridEP scenarios went through megatron's HybridEP manager (over the gloo stand-in), and
    the padded one really split padded layouts (a replica host's rows not a multiple of 8)."""
    for result in ranks:
        for scenario in ("flex-hybridep", "flex-hybridep-padded", "flex-hybridep-fp8"):
            assert result[f"{scenario}/balanced"]["dispatcher_class"] == "BalancedFlexDispatcher"
            assert result[f"{scenario}/balanced"]["manager_class"] == "_HybridEPManager"
        assert not any(result["flex-hybridep/balanced"]["padded_layouts"])
    for scenario in ("flex-hybridep-padded", "flex-hybridep-fp8"):
        assert any(any(r[f"{scenario}/balanced"]["padded_layouts"]) for r in ranks), (
            f"{scenario}: no replica host received a padded layout"
        )


def test_grouped_scenario_ran_grouped_experts(ranks):
    """Main experts and the reference are megatron's TEGroupedMLP (grouped-GEMM experts)."""
    for result in ranks:
        assert result["grouped/balanced"]["experts_class"] == "TEGroupedMLP"
        assert result["grouped/none"]["experts_class"] == "TEGroupedMLP"
        assert result["grouped/balanced"]["replica_buffer_numel"] == NUM_SLOTS * EXPERT_NUMEL


def test_latent_scenario_ran_latent_projections_and_latent_replicas(ranks):
    """In the latent scenario both layers ran megatron's latent projections (their gradients are
    compared above) and the redundant slots hold experts of the latent size, as the main experts:
    the replica experts are built from the layer's config, moe_latent_size included."""
    for result in ranks:
        for key in ("balanced", "none"):
            assert sorted(result[f"latent/{key}"]["latent_grads"]) == ["fc1_latent", "fc2_latent"]
        assert result["latent/balanced"]["replica_buffer_numel"] == NUM_SLOTS * LATENT_EXPERT_NUMEL
        assert result["single/balanced"]["latent_grads"] == {}
