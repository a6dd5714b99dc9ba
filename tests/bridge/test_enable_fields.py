"""``enable_ultraep``'s checks read a ``ConfigContainer`` as Bridge applies it when training
starts, not only ``cfg.model``'s own fields: NVIDIA's perf recipes set the CUDA-graph modules by
their deprecated name (``cfg.model.cuda_graph_scope``, migrated when the provider is finalized),
and the MoE communication overlap on ``cfg.comm_overlap`` (copied onto the provider by its setup).
In-process, no ranks: the checks run before any model is built.

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import argparse

import pytest
from bridge_helpers import needs_bridge

pytestmark = needs_bridge


def _problems(comm_overlap=None, **model):
    from bridge_pretrain import tiny_config

    from ultraep_megatron.megatron.bridge.enable import _flags_namespace, config_problems

    options = argparse.Namespace(ep=2, iters=1, microbatches=1, overlap=False, expert_bias=None)
    cfg = tiny_config(options, 4, **model)
    if comm_overlap is not None:
        from megatron.bridge.training.comm_overlap import CommOverlapConfig

        cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, **comm_overlap)
    problems = config_problems(cfg, _flags_namespace("ultraep", {"num_slots": 2}))
    assert "--moe-" not in " ".join(problems) and "--cuda-" not in " ".join(problems)
    return problems


TE_GRAPHS = dict(cuda_graph_impl="transformer_engine")


def test_cuda_graph_scope_is_read_where_a_recipe_sets_it():
    """The perf recipes' per-layer graphs of attention and the router pass; without the scope
    (megatron's default modules: the whole layer) the same graphs are refused: the control that
    the scope, not a default, decided."""
    assert _problems(**TE_GRAPHS, cuda_graph_scope=["attn", "moe_router"]) == []
    whole = _problems(**TE_GRAPHS)
    assert len(whole) == 1 and "whole-layer capture" in whole[0]


def test_a_refused_cuda_graph_scope_is_named_by_its_field():
    (problem,) = _problems(**TE_GRAPHS, cuda_graph_scope=["attn", "moe"])
    assert "cfg.model.cuda_graph_scope moe" in problem


@pytest.mark.parametrize("graphs", [False, True])
def test_comm_overlap_is_read_from_its_section(graphs):
    """EP communication overlap set on ``cfg.comm_overlap`` (the provider's own field left False):
    refused with per-layer graphs, naming ``cfg.comm_overlap``'s field; accepted without them."""
    model = dict(**TE_GRAPHS, cuda_graph_scope=["attn", "moe_router"]) if graphs else {}
    problems = _problems(comm_overlap=dict(overlap_moe_expert_parallel_comm=True), **model)
    if not graphs:
        assert problems == []
    else:
        assert len(problems) == 1
        assert "cfg.comm_overlap.overlap_moe_expert_parallel_comm" in problems[0]
