"""The decorator the balancer's host code wears: :func:`native_torch` runs a function without the CPU
backend's device mapping.

On a machine without CUDA the CPU backend (:mod:`~ultraep_megatron.megatron.cpu`) pushes a Python
torch-function mode that maps ``'cuda'`` to the CPU, so every torch call and tensor attribute read
passes through it. The balancer's planning, reroute and data-plane calls name only devices taken
from tensors and need none of it, and they run several times per layer and microbatch: they lift
it. This module is what the hot path imports for that; the backend registers its mode here
(:func:`register_device_mapping`), and nothing else of the CPU emulation reaches the hot path. On a
GPU nothing is registered and the decorator only calls the function.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

_DEVICE_MAPPING: Optional[TorchFunctionMode] = None


def register_device_mapping(mode: TorchFunctionMode) -> None:
    """Called by the CPU backend once it has pushed its device-mapping mode for good."""
    global _DEVICE_MAPPING
    _DEVICE_MAPPING = mode


def device_mapping() -> Optional[TorchFunctionMode]:
    """The CPU backend's device-mapping mode; ``None`` where it is not active."""
    return _DEVICE_MAPPING


def native_torch(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs without the device mapping's per-call dispatch.

    The mapping is a Python torch-function mode, so without this every torch call and tensor
    attribute read in ``fn`` pays its dispatch (measured in docs/integration.md, "Benchmark: one MoE
    layer on CPU"). Megatron code must never run inside. Only the mapping is lifted, and only when it is
    the innermost mode: a mode pushed after it (the tests' host-read counter) keeps seeing every
    call. Does nothing on a GPU (no mode there).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        mapping = _DEVICE_MAPPING
        # torch's own stack primitives, not its context manager: this runs several times per
        # layer and microbatch, and the context manager costs a dozen Python calls.
        depth = torch._C._len_torch_function_stack() if mapping is not None else 0
        if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not mapping:
            return fn(*args, **kwargs)
        mode = torch._C._pop_torch_function_stack()
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    return wrapper
