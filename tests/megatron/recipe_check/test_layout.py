"""EP groups across scale-up domains: accepted when ``--moe-balancer-domain-size`` keeps every
balancer domain (its consecutive EP ranks, where an expert's replicas live) inside one NVLink
domain, refused naming the flag when it does not. The expectation is computed here from the
global ranks alone (rank // GPUs per domain), independently of the checker's own arithmetic."""

from __future__ import annotations

import types

import pytest

from ultraep_megatron.megatron.recipe_check import rank_layout


def layout_args(
    world: int, ep: int, *, pp: int = 1, tp: int = 1, etp: int = 1, domain=None, balancer="ultraep"
):
    return types.SimpleNamespace(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        data_parallel_size=world // (tp * pp),
        use_tp_pp_dp_mapping=False,
        moe_balancer_domain_size=domain,
        moe_balancer=balancer,
    )


def domains_fit(layout, node: int) -> bool:
    """Every balancer domain's ranks on one node of ``node`` GPUs (independent of the checker)."""
    for group in layout.ep_groups:
        size = layout.balancer_domain or len(group)
        for i in range(0, len(group), size):
            if len({rank // node for rank in group[i : i + size]}) != 1:
                return False
    return True


@pytest.mark.parametrize("world, ep, pp", [(16, 16, 1), (64, 32, 2), (128, 32, 4), (64, 64, 1)])
def test_ep_across_hgx_nodes_with_a_node_sized_domain_is_accepted(world, ep, pp):
    layout = rank_layout(layout_args(world, ep, pp=pp, domain=8), gpus_per_node=8, rack_size=8)
    assert layout.spans_domains()
    assert domains_fit(layout, 8)
    assert layout.problems() == []
    assert layout.node_sized_domain() == 8


def test_ep_across_nodes_without_a_domain_is_refused_naming_the_flag():
    layout = rank_layout(layout_args(16, 16), gpus_per_node=8, rack_size=8)
    problems = layout.problems()
    assert len(problems) == 1
    assert "EP group [0-15] spans scale-up domains [0, 1]" in problems[0]
    assert "--moe-balancer-domain-size 8" in problems[0]


@pytest.mark.parametrize("domain", [16, 32])
def test_a_domain_larger_than_the_node_is_refused_naming_the_flag(domain):
    layout = rank_layout(layout_args(32, 32, domain=domain), gpus_per_node=8, rack_size=8)
    assert not domains_fit(layout, 8)
    problems = layout.problems()
    assert len(problems) == 1
    assert problems[0].startswith(
        f"--moe-balancer-domain-size {domain}: balancer domain [0-{domain - 1}] "
        "spans scale-up domains"
    )
    assert "use --moe-balancer-domain-size 8" in problems[0]


def test_smaller_domains_and_ep_inside_a_node_pass():
    for domain in (1, 2, 4):
        assert rank_layout(layout_args(32, 32, domain=domain), 8, 8).problems() == []
    inside = rank_layout(layout_args(16, 8), gpus_per_node=8, rack_size=8)
    assert not inside.spans_domains() and inside.problems() == []


def test_expert_tensor_parallel_strides_the_ep_ranks():
    """Expert-TP 2: EP ranks are every other global rank, so 4 EP ranks fill an 8-GPU node. A
    balancer domain of 4 fits; of 8 it does not. (Expert-TP 1 under attention TP 2 leaves the EP
    ranks consecutive: 8 fits.)"""
    strided = rank_layout(layout_args(32, 16, tp=2, etp=2, domain=4), 8, 8)
    assert strided.ep_groups[0][:3] == [0, 2, 4] and domains_fit(strided, 8)
    assert strided.problems() == []
    problems = rank_layout(layout_args(32, 16, tp=2, etp=2, domain=8), 8, 8).problems()
    assert len(problems) == 1 and "use --moe-balancer-domain-size 4" in problems[0]
    assert rank_layout(layout_args(32, 16, tp=2, domain=8), 8, 8).problems() == []


def test_no_replicas_no_domain_needed():
    """--moe-balancer none places no replica: EP may span nodes as in any Megatron job."""
    layout = rank_layout(layout_args(16, 16, balancer="none"), gpus_per_node=8, rack_size=8)
    assert layout.spans_domains() and layout.problems() == []


def test_gb200_rack_layouts_are_unchanged():
    """EP64 inside a 64-GPU rack of 4-GPU trays needs no domain; EP128 across two racks does."""
    assert rank_layout(layout_args(256, 64), gpus_per_node=4, rack_size=64).problems() == []
    problems = rank_layout(layout_args(256, 128), gpus_per_node=4, rack_size=64).problems()
    assert len(problems) == 1 and "--moe-balancer-domain-size 64" in problems[0]
    assert rank_layout(layout_args(256, 128, domain=64), 4, 64).problems() == []
