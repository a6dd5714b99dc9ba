"""What the Bridge tests share: the skip where megatron-bridge is not installed (one reason line).

Looked up without importing Bridge (its import reaches Transformer Engine's modules until the import
hook is installed): its ``training/pretrain.py`` among the ``megatron`` package's locations."""

from __future__ import annotations

import importlib.util
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
