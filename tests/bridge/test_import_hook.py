"""The import hook for Megatron-Bridge's CUDA-only imports (ultraep_megatron.megatron.bridge.imports).

The rewriting is checked on its own here (no Bridge needed); against Bridge's real files only where
megatron-bridge is installed (``ULTRAEP_BRIDGE=1``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from bridge_helpers import needs_bridge

from ultraep_megatron.megatron.bridge import imports

LORA = "megatron.bridge.peft.lora_layers"


def test_rewrite_binds_stand_ins_on_the_same_line():
    source = "import torch\nimport transformer_engine.pytorch as te\nx = 1\n"
    rewritten = imports.rewrite(LORA, source)
    assert rewritten.count("\n") == source.count("\n")
    assert "transformer_engine.pytorch as te" not in rewritten
    namespace = {}
    exec(compile(rewritten.replace("import torch\n", ""), "lora_layers.py", "exec"), namespace)
    te = namespace["te"]
    assert not isinstance(object(), (te.Linear, te.LayerNormLinear))

    class Sub(te.ops.Sequential):  # subclassing an absent class works; building one does not
        pass

    with pytest.raises(ImportError, match="transformer_engine.pytorch.ops.Sequential"):
        Sub()


@pytest.mark.parametrize("times", [0, 2])
def test_a_line_not_found_exactly_once_fails_loudly(times):
    """Negative control: a Bridge release whose line differs is not silently left alone."""
    line = "import transformer_engine.pytorch as te\n"
    with pytest.raises(ImportError, match=r"exactly once in megatron\.bridge\.peft\.lora_layers"):
        imports.rewrite(LORA, "import torch\n" + line * times)


def _bridge_file(module: str) -> Path | None:
    parts = module.split(".")
    spec = importlib.util.find_spec("megatron")
    for location in spec.submodule_search_locations if spec else []:
        path = Path(location, *parts[1:]).with_suffix(".py")
        if path.exists():
            return path
    return None


@needs_bridge
@pytest.mark.parametrize("module", sorted(imports.REWRITES))
def test_each_line_is_in_bridge_exactly_once(module):
    line = imports.REWRITES[module][0]
    lines = _bridge_file(module).read_text().splitlines()
    assert lines.count(line) == 1


@needs_bridge
def test_bridge_imports_with_the_hook_and_not_without():
    code = (
        "import megatron.bridge.training.pretrain as p, megatron.bridge.peft.lora_layers as l;"
        "import importlib.util as u; assert u.find_spec('transformer_engine') is None;"
        "print(p.CallWrapper.__qualname__, l.te.Linear.__qualname__)"
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "nvidia_resiliency_ext.inprocess.CallWrapper transformer_engine.pytorch.Linear"
        in run.stdout
    )
    # Without the hook (removed from sys.meta_path before the import), the import fails.
    unhooked = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path"
        " if type(f).__name__ != 'BridgeImportHook']; import megatron.bridge.peft.lora_layers"
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", unhooked], capture_output=True, text=True
    )
    assert run.returncode != 0 and "transformer_engine" in run.stderr
