"""The balanced layer's host code without the CPU backend's device mapping: :func:`lift_hot_path`.

On a machine without CUDA the CPU backend pushes a Python torch-function mode that maps ``'cuda'``
to the CPU, so every torch call and tensor attribute read passes through it. The balanced layer's
own host code (planning, reroute, transfers: :data:`HOT_PATH`) names only devices taken from
tensors and runs several times per layer and microbatch; when the backend activates, it wraps those
functions with :func:`native_torch`, which lifts the mode around them. The balanced layer itself
carries nothing of the emulation. On a GPU nothing is registered or wrapped.
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


def hot_path() -> list:
    """(owner, functions) of the balanced layer's host code that runs without the mapping: ours
    only (Megatron's code allocates on ``'cuda'``). A ``*`` marks a factory whose returned function
    is wrapped (the saved-tensor hooks)."""
    from ultraep_megatron.megatron.balanced_layer import (
        context,
        dispatchers,
        invocation,
        replica_autograd,
    )

    return [
        (invocation.BalancedInvocation, ("wait", "start_weights", "start_reduction")),
        (invocation.BalancedInvocation, ("finish_reduction",)),
        (context.ReplicaSlots, ("fill", "wait_filled", "reduce", "wait")),
        (context.BalancingContext, ("observe",)),
        (dispatchers.PhysicalSlots, ("gather_load", "physical_routing")),
        (dispatchers.BalancedAlltoAllDispatcher, ("permute", "planned_inputs")),
        (replica_autograd, ("*_buffer_packer", "*_buffer_unpacker")),
    ]


def lift_hot_path() -> list[str]:
    """Wrap every :func:`hot_path` function with :func:`native_torch` (once); the names wrapped.
    A missing name raises (``KeyError``): the list follows the balanced layer's code."""
    wrapped = []
    for owner, names in hot_path():
        for name in names:
            factory = name.startswith("*")
            name = name.lstrip("*")
            original = vars(owner)[name]
            if getattr(original, "lifted", False):
                continue
            if factory:
                lifted = functools.wraps(original)(lambda *a, _f=original: native_torch(_f(*a)))
            else:
                lifted = native_torch(original)
            lifted.lifted = True
            setattr(owner, name, lifted)
            wrapped.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return wrapped
