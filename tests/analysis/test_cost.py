"""The cost model (``analysis/cost.py``), checked against hand calculations on tiny loads with
round-number hardware (also over EP groups side by side, ``summary.cost_summary``), the
hardware-derived quota floor, hardware presets, slot memory and the expert shape from a trace."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from ultraep_megatron.analysis import cost as cm
from ultraep_megatron.analysis.replay import ideal_metrics, replay
from ultraep_megatron.analysis.summary import cost_summary
from ultraep_megatron.planner.plan import plan_from_split
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import identity_plan
from ultraep_megatron.settings import hardware as settings_hw

# Round numbers: one (token, expert) pair of compute = 1 ms; reading an expert's weights from HBM
# = 1 ms (so an instance costs max(tokens, 1) ms); one token on the wire = 1 ms; one expert's
# weights on the wire = 16 ms. Expert: h=4, f=8, 2 matrices -> 64 weights, 128 bytes, 128 FLOPs/token.
SHAPE = settings_hw.ExpertShape(
    hidden_size=4, ffn_hidden_size=8, gated=False, param_bytes=2, grad_bytes=4, activation_bytes=2
)
HW = settings_hw.Hardware(
    scale_up_gbps=8e-6, peak_tflops=1.28e-7, hbm_tbps=1.28e-7, gemm_overhead_tokens=0
)
MS = 1e-3

LOAD_A = torch.tensor([[1, 1, 4, 2], [4, 0, 2, 2]], dtype=torch.int64)  # rank loads 6 / 10
LOAD_B = torch.tensor([[5, 1, 0, 2], [3, 0, 4, 1]], dtype=torch.int64)  # rank loads 9 / 7


def test_shape_and_hardware_units():
    assert (SHAPE.numel, SHAPE.weight_bytes, SHAPE.fwd_flops_per_token, SHAPE.token_bytes) == (
        64,
        128,
        128,
        8,
    )
    assert settings_hw.ExpertShape(4096, 1536).numel == 3 * 4096 * 1536
    assert HW.flops_per_s == pytest.approx(128e3) and HW.link_bytes_per_s == pytest.approx(8e3)
    assert HW.hbm_bytes_per_s == pytest.approx(128e3)
    with pytest.raises(ValueError, match="efficiency"):
        settings_hw.Hardware(compute_efficiency=1.5)
    with pytest.raises(ValueError, match="hidden_size"):
        settings_hw.ExpertShape(0, 8)


def test_identity_plan_cost_by_hand():
    c = cm.layer_cost(LOAD_A, identity_plan(LOAD_A), SHAPE, HW)
    # compute: rank 0 hosts e0 (5 tokens), e1 (1): 5 + max(1, 1) = 6; rank 1: e2 (6) + e3 (4) = 10.
    assert c["moe_fwd"] == pytest.approx(10 * MS) and c["moe_bwd"] == pytest.approx(20 * MS)
    # remote tokens: src0 -> rank1: 4 + 2 = 6; src1 -> rank0: 4 + 0 = 4; max(send, recv) = 6.
    assert c["a2a_fwd"] == pytest.approx(12 * MS) and c["a2a_bwd"] == pytest.approx(12 * MS)
    assert c["wdist"] == c["wdist_direct"] == c["wdist_relay"] == c["plan"] == c["bwd_exposed"] == 0
    assert c["fwd"] == pytest.approx(22 * MS) and c["bwd"] == pytest.approx(32 * MS)
    assert c["total"] == pytest.approx(54 * MS)


def test_hbm_floor_makes_a_one_token_instance_cost_a_weight_read():
    load = torch.tensor([[1, 0], [0, 0]], dtype=torch.int64)  # R=2, E=2
    assert cm.layer_cost(load, identity_plan(load), SHAPE, HW)["moe_fwd"] == pytest.approx(1 * MS)
    slow_hbm = dataclasses.replace(HW, hbm_tbps=1.28e-8)  # weights: 10 ms
    assert cm.layer_cost(load, identity_plan(load), SHAPE, slow_hbm)["moe_fwd"] == pytest.approx(
        10 * MS
    )


def test_replica_plan_cost_by_hand():
    # Replica of expert 2 (home rank 1) on rank 0; quotas give 8 / 8.
    split = torch.zeros((2, 4, 2), dtype=torch.int64)
    split[0, 0, 0], split[0, 1, 0], split[0, 2, 0], split[0, 2, 1], split[0, 3, 1] = 1, 1, 2, 2, 2
    split[1, 0, 0], split[1, 2, 1], split[1, 3, 1] = 4, 2, 2
    plan = plan_from_split(torch.tensor([[2], [-1]]), split)
    c = cm.layer_cost(LOAD_A, plan, SHAPE, HW, plan_seconds=0.5 * MS)
    assert c["moe_fwd"] == pytest.approx(8 * MS)  # rank 0: 5 + 1 + 2, rank 1: 4 + 4
    assert c["a2a_fwd"] == pytest.approx(8 * MS)  # every rank sends and receives 4 remote tokens
    assert c["wdist_direct"] == c["wdist_relay"] == c["wdist"] == pytest.approx(16 * MS)
    # backward: weights again (16 ms) + fp32 gradients back (16 * 4/2 = 32 ms).
    assert c["bwd_replica"] == pytest.approx(48 * MS)
    assert c["transfer_overlap"] == 1.0  # the runtime's schedule, transfers next to compute
    # Forward. Rank 0 (hosts the replica): dispatch 4 + mains 6 = 10 ms next to the 16 ms weight
    # distribution, so its 2 ms replica starts at 16; rank 1: 4 + 8 = 12. Then the 4 ms combine.
    assert c["fwd"] == pytest.approx((0.5 + 16 + 2 + 4) * MS)
    assert c["fwd_exposed"] == pytest.approx((22.5 - (0.5 + 8 + 8)) * MS)  # vs free transfers
    # Backward. Rank 0: combine backward 4 next to the 16 ms re-materialization, replica backward
    # 2 x 2, then mains' backward 2 x 6 = 12 next to the 32 ms reduction: 16 + 4 + 32 = 52; rank 1:
    # 4 + 2 x 8 = 20. Then the 4 ms dispatch backward.
    assert c["bwd"] == pytest.approx((52 + 4) * MS)
    assert c["bwd_exposed"] == pytest.approx((56 - (8 + 16)) * MS)
    assert c["total_excl_plan"] == pytest.approx(c["total"] - 0.5 * MS)
    # Nothing hidden (--moe-balancer-no-overlap): every transfer after the work it could overlap.
    serial = cm.layer_cost(
        LOAD_A, plan, SHAPE, dataclasses.replace(HW, transfer_overlap=0.0), plan_seconds=0.5 * MS
    )
    assert serial["fwd"] == pytest.approx(
        (0.5 + 16 + 8 + 8) * MS
    )  # wdist + a2a both ways + experts
    # rank 0: 4 + 16, replica backward 4, 12 + 32 -> 68; then dispatch backward 4.
    assert serial["bwd"] == pytest.approx((68 + 4) * MS)
    assert serial["fwd_exposed"] == pytest.approx(16 * MS) and serial[
        "bwd_exposed"
    ] == pytest.approx(48 * MS)
    with pytest.raises(ValueError, match="transfer_overlap"):
        settings_hw.Hardware(transfer_overlap=1.5)


def test_gemm_overhead_by_hand():
    # Every GEMM with tokens costs 2 tokens more: e0 5 -> 7, e1 1 -> max(3, 1 weight read) = 3 (rank 0:
    # 10); e2 6 -> 8, e3 4 -> 6 (rank 1: 14).
    c = cm.layer_cost(
        LOAD_A, identity_plan(LOAD_A), SHAPE, dataclasses.replace(HW, gemm_overhead_tokens=2)
    )
    assert c["moe_fwd"] == pytest.approx(14 * MS)


INTER = dataclasses.replace(
    HW, inter_domain_gbps=4e-6
)  # between domains: a token 2 ms, an expert 32 ms


def test_inter_domain_link_by_hand():
    # One rank per domain: all remote traffic crosses. Identity on LOAD_A: 6 tokens one way, 2 ms each.
    split_domains = dataclasses.replace(INTER, scale_up_domain=1)
    assert cm.layer_cost(LOAD_A, identity_plan(LOAD_A), SHAPE, split_domains)[
        "a2a_fwd"
    ] == pytest.approx(24 * MS)
    assert cm.layer_cost(LOAD_A, identity_plan(LOAD_A), SHAPE, INTER)["a2a_fwd"] == pytest.approx(
        12 * MS
    )
    # 4 ranks in domains of 2: source 0 sends 3 tokens inside its domain (3 ms) and 1 or 2 across (2 or
    # 4 ms); the two links run side by side, so the longer one counts.
    for across, one_way in ((1, 3), (2, 4)):
        load = torch.tensor([[0, 3, across, 0], [0] * 4, [0] * 4, [0] * 4], dtype=torch.int64)
        c = cm.layer_cost(
            load, identity_plan(load), SHAPE, dataclasses.replace(INTER, scale_up_domain=2)
        )
        assert c["a2a_fwd"] == pytest.approx(2 * one_way * MS), across
    # The replica plan of test_replica_plan_cost_by_hand: its one weight copy crosses at 32 ms, and
    # its weights (fwd), re-materialized weights and fp32 gradients (bwd) cross: 64 x (2 + 2 + 4) bytes.
    plan = _replica_plan()
    crossing = cm.layer_cost(LOAD_A, plan, SHAPE, split_domains)
    assert crossing["wdist"] == pytest.approx(32 * MS) and crossing["xdom_bytes"] == 64 * 8
    inside = cm.layer_cost(LOAD_A, plan, SHAPE, INTER)
    assert inside["wdist"] == pytest.approx(16 * MS) and inside["xdom_bytes"] == 0


def _replica_plan():
    """Replica of expert 2 (home rank 1) on rank 0 for LOAD_A; quotas give 8 / 8."""
    split = torch.zeros((2, 4, 2), dtype=torch.int64)
    split[0, 0, 0], split[0, 1, 0], split[0, 2, 0], split[0, 2, 1], split[0, 3, 1] = 1, 1, 2, 2, 2
    split[1, 0, 0], split[1, 2, 1], split[1, 3, 1] = 4, 2, 2
    return plan_from_split(torch.tensor([[2], [-1]]), split)


def test_a_placement_that_moves_a_main_expert_by_hand():
    """DeepSeek's EPLB may move a main expert: expert 0 (home rank 0) computed on rank 1 only. It is
    costed as a replica fed from its home."""
    from ultraep_megatron.analysis.replay import outcome_metrics
    from ultraep_megatron.planner.baselines import Placement

    split = torch.zeros((2, 4, 2), dtype=torch.int64)
    split[0, 0, 1], split[1, 0, 1] = 1, 4  # e0 -> rank 1
    split[0, 1, 0] = 1  # e1 at home
    split[0, 2, 1], split[1, 2, 1] = 4, 2  # e2 at home (rank 1)
    split[0, 3, 1], split[1, 3, 1] = 2, 2  # e3 at home
    placement = Placement(torch.tensor([[1, -1, -1], [2, 3, 0]]), split)
    assert cm.remote_slot_table(placement).tolist() == [[-1], [0]]
    c = cm.layer_cost(LOAD_A, placement, SHAPE, HW)
    assert c["moe_fwd"] == pytest.approx(15 * MS)  # rank 1: e2 6 + e3 4 + e0 5
    assert c["a2a_fwd"] == pytest.approx(14 * MS)  # source 0 sends 1 + 4 + 2 = 7 tokens to rank 1
    assert c["wdist"] == pytest.approx(16 * MS)
    # Rank 1: dispatch 7 + mains 10 next to the 16 ms copy, then e0's 5 ms, then the 7 ms combine.
    assert c["fwd"] == pytest.approx((17 + 5 + 7) * MS)
    m = outcome_metrics(LOAD_A, placement, None)
    assert (m["weight_copies"], m["main_moves"], m["replicas"], m["threshold"]) == (1, 1, 1, 15)
    assert m["memory_spread_after"] == pytest.approx(15 / 8)


def test_relay_lowers_the_hot_sender():
    # Expert 0 (home rank 0) replicated on all 7 other ranks, no token on the replicas.
    R = E = 8
    load = torch.zeros((R, E), dtype=torch.int64)
    load[:, 0] = 10
    slot_expert = torch.tensor([[-1]] + [[0]] * 7)
    split = torch.zeros((R, E, R), dtype=torch.int64)
    split[:, 0, 0] = 10
    plan = plan_from_split(slot_expert, split)
    c = cm.layer_cost(load, plan, SHAPE, HW)
    # direct: the home sends 7 copies; relay: round(sqrt(7)) = 3 relays, each forwarding <= 2.
    assert c["wdist_direct"] == pytest.approx(7 * 16 * MS)
    assert c["wdist_relay"] == pytest.approx(3 * 16 * MS)
    assert cm.layer_cost(load, plan, SHAPE, HW, relay=False)["wdist"] == pytest.approx(7 * 16 * MS)


def test_ideal_cost_by_hand():
    c = cm.ideal_cost(LOAD_A, SHAPE, HW)
    # 16 pairs over 4 experts: 4 each, 2 per rank -> 8 ms; uniform dispatch: every source sends
    # 8 * 1/2 = 4 remote tokens, every rank receives 8 * 1/2 = 4.
    assert c["moe_fwd"] == pytest.approx(8 * MS) and c["a2a_fwd"] == pytest.approx(8 * MS)
    assert c["total"] == pytest.approx((8 + 8 + 8 + 16) * MS)
    m = ideal_metrics(LOAD_A)
    assert m["imbalance_after"] == 1.0 and m["imbalance_before"] == pytest.approx(10 / 8)
    assert m["inflight_ratio"] == 0.5 and m["replicas"] == 0


def test_cost_summary_runs_ep_groups_side_by_side():
    # Two EP groups; invocation (1, 0, 1): group 0 has A (none 54 ms), group 1 has B; (2, 0, 1): B, B.
    b_none = cm.layer_cost(LOAD_B, identity_plan(LOAD_B), SHAPE, HW)["total"]
    # B by hand: compute max(5+1+... rank0: 8 + 1 = 9, rank1: 4 + 3 = 7) = 9; remote: src0 -> 2, src1 -> 3,
    # recv: rank0 3, rank1 2 -> 3 ms one way.
    assert b_none == pytest.approx((6 + 9 + 6 + 18) * MS)
    records = [
        (0, 1, 0, 1, LOAD_A),
        (1, 1, 0, 1, LOAD_B),
        (0, 2, 0, 1, LOAD_B),
        (1, 2, 0, 1, LOAD_B),
    ]
    result = replay(
        records,
        {"none": BalancerConfig("none"), "ideal": BalancerConfig("ideal")},
        shape=SHAPE,
        hardware=HW,
    )
    summary = cost_summary(result)
    none_steps = [54 * MS, 39 * MS]  # max over the groups of each invocation
    ideal_steps = [40 * MS, 40 * MS]
    assert summary["none"]["total_ms"] == pytest.approx(np.mean(none_steps) * 1e3)
    assert summary["ideal"]["speedup_vs_none"] == pytest.approx(sum(none_steps) / sum(ideal_steps))
    assert summary["none"]["frac_ideal"] == pytest.approx(sum(ideal_steps) / sum(none_steps))
    only_second = cost_summary(result, result.keys["iteration"] == 2)
    assert only_second["ideal"]["speedup_vs_none"] == pytest.approx(39 / 40)


def smallest_paying_quota(shape, hw, k):
    """By search: the fewest tokens q for which a replica's saving on the busiest rank, k q c, covers
    its weight transfer and its own GEMM's cost beyond its tokens' share, k (t(q) - q c), with t(q) =
    max((q + M0) c, W / HBM) (c: one token of forward at the plateau)."""
    c = shape.fwd_flops_per_token / hw.flops_per_s
    transfer = shape.weight_bytes / hw.link_bytes_per_s
    gemm = lambda q: max((q + hw.gemm_overhead_tokens) * c, shape.weight_bytes / hw.hbm_bytes_per_s)  # noqa: E731
    q = 1
    while k * q * c < (transfer + k * (gemm(q) - q * c)) * (1 - 1e-12):
        q += 1
    return q


def test_min_quota_from_hardware():
    paper = settings_hw.Hardware()
    # F d / (2 B k) + M0: 2250e12 * 2 / (2 * 900e9) = 2500 tokens pay the transfer in inference
    # (/ 3 with the backward's compute), plus the GEMM's fixed cost of 100 tokens.
    assert (
        settings_hw.min_quota_from_hardware(settings_hw.DEFAULT_SHAPE, paper, training=False)
        == 2600
    )
    assert (
        settings_hw.min_quota_from_hardware(settings_hw.DEFAULT_SHAPE, paper, training=True) == 934
    )
    no_overhead = dataclasses.replace(paper, gemm_overhead_tokens=0)  # HarMoEny's threshold alone
    assert (
        settings_hw.min_quota_from_hardware(settings_hw.DEFAULT_SHAPE, no_overhead, training=False)
        == 2500
    )
    assert (
        settings_hw.min_quota_from_hardware(settings_hw.DEFAULT_SHAPE, no_overhead, training=True)
        == 834
    )
    h100 = settings_hw.hardware_preset("h100-hgx")
    assert settings_hw.min_quota_from_hardware(
        settings_hw.DEFAULT_SHAPE, h100, training=True
    ) == math.ceil(989e12 / (3 * 450e9) + 100)
    # A slow memory puts the replica's GEMM below the roofline's knee: it costs the weight read.
    slow_hbm = dataclasses.replace(paper, hbm_tbps=0.5)
    # Independent of the expert's size; equal to the search above on every hardware.
    for hw in (paper, no_overhead, h100, slow_hbm, dataclasses.replace(paper, scale_up_gbps=450)):
        for shape in (
            settings_hw.DEFAULT_SHAPE,
            settings_hw.ExpertShape(7168, 2048),
            settings_hw.ExpertShape(1024, 512, gated=False),
        ):
            for training, k in ((True, 3), (False, 1)):
                assert settings_hw.min_quota_from_hardware(
                    shape, hw, training=training
                ) == smallest_paying_quota(shape, hw, k), (hw, shape, training)
    knee = paper.flops_per_s / slow_hbm.hbm_bytes_per_s  # tokens at which compute = weight read
    q = settings_hw.min_quota_from_hardware(settings_hw.DEFAULT_SHAPE, slow_hbm, training=True)
    assert q + slow_hbm.gemm_overhead_tokens < knee and q > 934


def test_hardware_presets_and_domains():
    assert settings_hw.hardware_preset("paper-rack") == dataclasses.replace(
        settings_hw.Hardware(), scale_up_domain=64
    )
    with pytest.raises(ValueError, match="--moe-balancer-hardware"):
        settings_hw.hardware_preset("tpu")
    h100 = settings_hw.hardware_preset("h100-hgx")
    assert [h100.ranks_per_domain(r) for r in (4, 8, 16, 64)] == [4, 8, 8, 8]
    with pytest.raises(ValueError, match="domains of 8"):
        h100.ranks_per_domain(12)
    with pytest.raises(ValueError, match="scale_up_domain"):
        settings_hw.Hardware(scale_up_domain=0)


def test_slot_memory():
    shape = settings_hw.ExpertShape(4096, 1536)  # 18.9M weights
    assert cm.slot_memory_bytes(shape, 2) == 2 * 3 * 4096 * 1536 * (2 + 4)
    assert cm.slot_memory_bytes(shape, 2, num_layers=92) == 92 * cm.slot_memory_bytes(shape, 2)
    assert cm.slot_memory_bytes(shape, 0) == 0


def test_shape_from_meta():
    shape, source = settings_hw.ExpertShape.from_meta(
        {"hidden_size": 64, "moe_ffn_hidden_size": 32, "swiglu": False}
    )
    assert (shape.hidden_size, shape.ffn_hidden_size, shape.gated, source) == (
        64,
        32,
        False,
        "trace meta",
    )
    shape, source = settings_hw.ExpertShape.from_meta(
        {"hidden_size": 64, "ffn_hidden_size": 32}, hidden_size=128, grad_bytes=2
    )
    assert (shape.hidden_size, shape.ffn_hidden_size, shape.gated, shape.grad_bytes) == (
        128,
        32,
        True,
        2,
    )
    assert source == "flags and trace meta"
    shape, source = settings_hw.ExpertShape.from_meta({})
    assert shape == settings_hw.DEFAULT_SHAPE and source.startswith("default")
