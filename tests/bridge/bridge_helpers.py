"""What the Bridge tests share: the skip where megatron-bridge is not installed (one reason line),
and the reading of a ``bridge_pretrain.py`` run's outputs.

Looked up without importing Bridge (its import reaches Transformer Engine's modules until the import
hook is installed): its ``training/pretrain.py`` among the ``megatron`` package's locations."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def bridge_installed() -> bool:
    spec = importlib.util.find_spec("megatron")
    return spec is not None and any(
        Path(p, "bridge", "training", "pretrain.py").exists()
        for p in spec.submodule_search_locations
    )


needs_bridge = pytest.mark.skipif(
    not bridge_installed(), reason="megatron-bridge is not installed (run with ULTRAEP_BRIDGE=1)"
)


def run_record(out: Path, rank: int) -> dict:
    """What ``bridge_pretrain.py`` recorded on ``rank`` (its ``record_rank{rank}.json``)."""
    return json.loads((out / f"record_rank{rank}.json").read_text())


def run_gradients(out: Path, world: int) -> dict:
    """{iteration: {parameter name: gradient}}, the ranks' dumps merged (reduced gradients)."""
    import torch
    from megatron_runs import merge_reduced_gradients

    dumps = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return {
        it: merge_reduced_gradients([dump["grads"][it] for dump in dumps])
        for it in dumps[0]["grads"]
    }
