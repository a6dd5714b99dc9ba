"""Import hook for Megatron-Bridge 0.6.2's unconditional imports of packages absent off CUDA.

Three lines of Bridge import packages that cannot be installed without CUDA, on the path that
``import megatron.bridge`` and Bridge's ``pretrain()`` take:

* ``import transformer_engine.pytorch as te`` in ``megatron/bridge/peft/lora_layers.py``;
* ``from transformer_engine.pytorch import TransformerLayer`` in
  ``megatron/bridge/models/gpt_full_te_layer_autocast_spec.py``;
* ``from nvidia_resiliency_ext.inprocess import CallWrapper`` in
  ``megatron/bridge/training/pretrain.py``.

A fake top-level ``transformer_engine`` module would make megatron-core believe TE is present, so
the hook rewrites exactly those lines instead, when the module is loaded, and only when the package
the line imports is not installed (with TE or NVRx present, the line is left as written). The names
bound stand for absent classes: ``isinstance`` against them is false, subclassing works, building
one raises ``ImportError`` naming the package. A line not found, or found more than once, raises
``ImportError`` naming the file and the line (a Bridge release this hook does not know).

This module imports only the standard library: the layered environment runs :func:`install` at
every interpreter start.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys

#: module -> (the line as Bridge 0.6.2 writes it, the top-level package it needs, the names bound).
REWRITES: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "megatron.bridge.peft.lora_layers": (
        "import transformer_engine.pytorch as te",
        "transformer_engine",
        (("te", "transformer_engine.pytorch"),),
    ),
    "megatron.bridge.models.gpt_full_te_layer_autocast_spec": (
        "from transformer_engine.pytorch import TransformerLayer",
        "transformer_engine",
        (("TransformerLayer", "transformer_engine.pytorch.TransformerLayer"),),
    ),
    "megatron.bridge.training.pretrain": (
        "from nvidia_resiliency_ext.inprocess import CallWrapper",
        "nvidia_resiliency_ext",
        (("CallWrapper", "nvidia_resiliency_ext.inprocess.CallWrapper"),),
    ),
}


class _AbsentMeta(type):
    """Metaclass of the stand-ins: any attribute not defined is a further absent class."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return absent(f"{cls.__qualname__}.{name}")


def absent(qualname: str) -> type:
    """A class standing for ``qualname`` of a package that is not installed."""

    def __init__(self, *args, **kwargs):
        raise ImportError(
            f"{qualname} is not installed here: ultraep's import hook stood in for it "
            "(ultraep_megatron.megatron.bridge.imports)"
        )

    return _AbsentMeta(qualname, (), {"__init__": __init__, "__qualname__": qualname})


def rewrite(fullname: str, source: str) -> str:
    """``source`` of ``fullname`` with its line of :data:`REWRITES` bound to stand-ins."""
    line, _package, names = REWRITES[fullname]
    lines = source.splitlines(keepends=True)
    found = [i for i, text in enumerate(lines) if text.rstrip("\r\n") == line]
    if len(found) != 1:
        raise ImportError(
            f"ultraep's import hook for Megatron-Bridge expected the line {line!r} exactly once in "
            f"{fullname} and found it {len(found)} times: a Bridge release other than 0.6.2? "
            "(ultraep_megatron/megatron/bridge/imports.py names the lines it rewrites)"
        )
    # One line for one: tracebacks keep Bridge's line numbers.
    bound = "; ".join(
        f"{name} = __import__({__name__!r}, fromlist=['absent']).absent({qualname!r})"
        for name, qualname in names
    )
    lines[found[0]] = bound + "\n"
    return "".join(lines)


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Bridge's own file, compiled from its rewritten source (never from a cached .pyc)."""

    def get_code(self, fullname):
        source = self.get_source(fullname)
        return compile(rewrite(fullname, source), self.path, "exec", dont_inherit=True)


class BridgeImportHook:
    """``sys.meta_path`` finder: Bridge's modules of :data:`REWRITES`, when their package is absent."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in REWRITES:
            return None
        if importlib.util.find_spec(REWRITES[fullname][1]) is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        spec.loader = _RewritingLoader(fullname, spec.origin)
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, BridgeImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, BridgeImportHook())
