"""Megatron-Bridge's own ``pretrain()`` on the CPU over gloo, in the production layout: 4 ranks,
EP 2 with expert-DP 2, the distributed optimizer with overlapped grad reduce and param gather.

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or not any(
        Path(p, "bridge", "training", "pretrain.py").exists()
        for p in importlib.util.find_spec("megatron").submodule_search_locations
    ),
    reason="megatron-bridge is not installed (run with ULTRAEP_BRIDGE=1)",
)

SCRIPT = Path(__file__).resolve().parent / "bridge_pretrain.py"
ITERS = 3


def test_bridge_pretrain_runs_in_the_production_layout(tmp_path):
    from gloo_launch import launch_gloo_ranks

    output = launch_gloo_ranks(
        SCRIPT,
        4,
        [tmp_path, "--ep", "2", "--iters", ITERS, "--overlap"],
        env={"ULTRAEP_CPU_PATCHES": "1"},
        log_path=tmp_path / "log.txt",
    )
    # The CPU backend covered Bridge's own initialize (not only megatron.training's).
    assert "megatron.bridge.training.initialize.torch" in output
    per_rank = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in range(4)]
    assert all(len(losses) == ITERS for losses in per_rank)
    first = [step["lm loss"] for step in per_rank[0]]
    assert all(math.isfinite(loss) for loss in first)
    # Bridge averages the loss over data-parallel ranks: every rank logs the same figure.
    for losses in per_rank[1:]:
        assert [step["lm loss"] for step in losses] == first
