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


def _run(out: Path, *extra: str) -> str:
    from gloo_launch import launch_gloo_ranks

    return launch_gloo_ranks(
        SCRIPT,
        4,
        [out, "--ep", "2", "--iters", ITERS, "--overlap", *extra],
        env={"ULTRAEP_CPU_PATCHES": "1"},
        log_path=out.with_suffix(".log"),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Bridge's pretrain() without a balancer and with enable_ultraep(cfg, num_slots=2)."""
    root = tmp_path_factory.mktemp("bridge")
    return {
        name: (root / name, _run(root / name, *extra))
        for name, extra in (("none", ()), ("ultraep", ("--ultraep",)))
    }


def _losses(out: Path) -> list[list[float]]:
    return [
        [step["lm loss"] for step in json.loads((out / f"losses_rank{r}.json").read_text())]
        for r in range(4)
    ]


def test_enable_ultraep_balances_every_moe_layer_and_matches_none(runs):
    out, _ = runs["ultraep"]
    for rank in range(4):
        record = json.loads((out / f"record_rank{rank}.json").read_text())
        assert record["moe_layers"] == ["BalancedMoELayer"] * 2
        # The iteration hook (installed at on_train_start) fired once per iteration, numbered by
        # Bridge's train_state.step.
        assert record["ended_iterations"] == list(range(1, ITERS + 1))
    # Exact-load balancing computes the same function: per-step losses equal to none's.
    assert _losses(out) == _losses(runs["none"][0])


def test_bridge_pretrain_runs_in_the_production_layout(runs):
    tmp_path, output = runs["none"]
    # The CPU backend covered Bridge's own initialize (not only megatron.training's).
    assert "megatron.bridge.training.initialize.torch" in output
    per_rank = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in range(4)]
    assert all(len(losses) == ITERS for losses in per_rank)
    first = [step["lm loss"] for step in per_rank[0]]
    assert all(math.isfinite(loss) for loss in first)
    # Bridge averages the loss over data-parallel ranks: every rank logs the same figure.
    for losses in per_rank[1:]:
        assert [step["lm loss"] for step in losses] == first
