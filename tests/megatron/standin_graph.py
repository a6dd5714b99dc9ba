"""A CPU stand-in for ``torch.cuda.CUDAGraph`` (torch 2.14, ``torch/cuda/graphs.py``) as Transformer
Engine's ``make_graphed_callables`` uses it (for ``te_graph_standin``): ``with graph.capture():``
and ``graph.replay()``.

Follows CUDA stream capture: a capture runs the region's Python once and records every aten
operation it issues (a ``TorchDispatchMode``); a replay re-executes those tensor operations on the
recorded tensors, writing each result into the tensor the capture produced (the static buffers), and
runs none of the region's Python: host state the region set is what the capture left. Parameters,
static inputs and tensors made before the capture are read where they are at replay, as fixed
addresses are; Python numbers are baked in, as kernel arguments are. A collective in the region
(gloo here, NCCL on a GPU) is re-issued at replay and waited for at once.

Fails (:class:`CaptureViolation`, where it happens) on what stream capture refuses: a host read of
tensor data (``item``, ``int`` / ``float`` / ``bool`` of a tensor, ``tolist``, ``numpy``,
``__array__``, ``cpu()`` / ``to('cpu')``, a copy into a host tensor made with ``pin_memory`` or on
``'cpu'``, ``torch.equal``, ``repr``), an operation whose output shape depends on the data (aten's
``dynamic_output_shape``: ``nonzero``, ``unique``, boolean-mask indexing, ``repeat_interleave``
without ``output_size``, ...), a host wait on a stream, an event or the device (refused by the CPU
backend's ``torch_cuda.stream_capture``).

Leaves out: graph memory pools, graph-safe RNG (a random operation draws anew at each replay),
captures from other threads, ``reset``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ultraep_megatron.megatron.cpu.native_torch import device_mapping
from ultraep_megatron.megatron.cpu import torch_cuda


class CaptureViolation(RuntimeError):
    """An operation inside a capture that a CUDA graph cannot capture (module docstring)."""


_HOST_READS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "__array__",
    torch.Tensor.cpu: "cpu()",
    torch.Tensor.__repr__: "repr",
    torch.Tensor.__format__: "format",
}


def _is_host(device) -> bool:
    return (isinstance(device, str) and device == "cpu") or (
        isinstance(device, torch.device) and device.type == "cpu"
    )


class _HostReadGuard(TorchFunctionMode):
    """Inside a capture: refuses host reads that bypass aten (``tolist``, ``numpy``, ``cpu()``,
    ``to('cpu')``, a copy into a host tensor). Host tensors are those made inside the capture with
    ``pin_memory=True`` or on ``'cpu'`` explicitly (every other tensor is device memory here)."""

    def __init__(self):
        super().__init__()
        self._host = torch.utils.weak.WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise CaptureViolation(
                f"{_HOST_READS[func]} of a tensor inside a CUDA graph capture: a host "
                "read of device data (the capture would wait for the device)"
            )
        if func is torch.Tensor.to and (
            any(_is_host(a) for a in args[1:2]) or _is_host(kwargs.get("device"))
        ):
            raise CaptureViolation(
                "to('cpu') of a tensor inside a CUDA graph capture: a device-to-host copy "
                "(its data would be the capture's, not a replay's)"
            )
        if func is torch.Tensor.copy_ and len(args) > 1 and args[0] in self._host:
            raise CaptureViolation(
                "copy_ into a host tensor inside a CUDA graph capture: a device-to-host "
                "copy (its data would be the capture's, not a replay's)"
            )
        result = func(*args, **kwargs)
        if kwargs.get("pin_memory") or _is_host(kwargs.get("device")):
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[t] = True
        return result


def _shape_depends_on_data(func, args, kwargs) -> bool:
    """aten's ``dynamic_output_shape`` operations, less the calls whose shape is fixed by their
    arguments: ``repeat_interleave`` given ``output_size``, indexing with integer indices only."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
    if func in (
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
    ):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return True


@dataclass
class _Recorded:
    """One aten call of a capture: what it was called with and the tensors it produced."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: list  # the call's flattened outputs (tensors and anything else)


_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


class _Recorder(TorchDispatchMode):
    """Records every aten call of a capture (:class:`_Recorded`) and refuses host reads and
    data-dependent shapes at the aten level."""

    def __init__(self):
        super().__init__()
        self.tape: list[_Recorded] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output in func.tags:
            raise CaptureViolation(
                f"{func} inside a CUDA graph capture: a host read of device data "
                "(item(), int(), bool() of a tensor, torch.equal)"
            )
        if _shape_depends_on_data(func, args, kwargs):
            raise CaptureViolation(
                f"{func} inside a CUDA graph capture: its output shape depends on the "
                "data (a graph's shapes are fixed at capture)"
            )
        result = func(*args, **kwargs)
        self.tape.append(_Recorded(func, args, kwargs, tree_flatten(result)[0]))
        return result


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class StandinGraph:
    """``torch.cuda.CUDAGraph`` as TE uses it, on the CPU: ``with graph.capture(): ...`` records the
    region's tensor operations, :meth:`replay` re-executes them (module docstring)."""

    def __init__(self):
        self._tape: Optional[list[_Recorded]] = None
        self.replays = 0

    @contextlib.contextmanager
    def capture(self):
        if self._tape is not None:
            raise RuntimeError("this graph was captured already")
        recorder, guard = _Recorder(), _HostReadGuard()
        with torch_cuda.stream_capture(), recorder, guard:
            yield
        self._tape = recorder.tape

    @property
    def num_operations(self) -> int:
        return len(self._tape or ())

    def replay(self) -> None:
        if self._tape is None:
            raise RuntimeError("replay of a graph that was never captured")
        with torch.no_grad():
            for op in self._tape:
                if op.func.is_view or op.func in _ALLOCATIONS:
                    continue  # a view shares its base's storage; an allocation runs no kernel
                fresh = tree_flatten(op.func(*op.args, **op.kwargs))[0]
                inputs = [
                    t for t in tree_flatten((op.args, op.kwargs))[0] if isinstance(t, torch.Tensor)
                ]
                for recorded, new in zip(op.outputs, fresh):
                    if isinstance(new, torch._C.ScriptObject) and hasattr(new, "wait"):
                        new.wait()  # a collective's work: done before anything reads its output
                    if not isinstance(new, torch.Tensor) or new is recorded:
                        continue
                    if any(new is t for t in inputs) or _aliases(new, recorded):
                        continue  # an in-place or out= call wrote the recorded tensor itself
                    if new.shape != recorded.shape:
                        raise CaptureViolation(
                            f"{op.func} replayed to shape {tuple(new.shape)}, captured "
                            f"{tuple(recorded.shape)}"
                        )
                    recorded.copy_(new)
        self.replays += 1


def _engine_grad(
    outputs, inputs, grad_outputs, *, allow_unused: bool, retain_graph: bool, modes: tuple = ()
) -> tuple:
    """``torch.autograd.grad`` with the CPU backend's device mapping (and ``modes``) active inside
    the backward: a torch-function mode is off in its own handler, and ``autograd.grad`` is one of
    its calls, so megatron's Python backward functions would otherwise allocate on a CUDA device."""
    from torch.autograd.graph import _engine_run_backward

    pushed = [m for m in (device_mapping(), *modes) if m is not None]
    for mode in pushed:
        torch._C._push_on_torch_function_stack(mode)
    try:
        grads = _engine_run_backward(
            tuple(outputs),
            tuple(grad_outputs),
            retain_graph,
            False,
            tuple(inputs),
            allow_unused,
            accumulate_grad=False,
        )
    finally:
        for _ in pushed:
            torch._C._pop_torch_function_stack()
    return grads


def _backward_capture(
    graph: StandinGraph, outputs, inputs, grad_outputs, allow_unused: bool, retain_graph: bool
):
    """The backward graph's capture: the function-level guard active inside the backward as well."""
    recorder, guard = _Recorder(), _HostReadGuard()
    if graph._tape is not None:
        raise RuntimeError("this graph was captured already")
    with torch_cuda.stream_capture(), recorder:
        grads = _engine_grad(
            outputs,
            inputs,
            grad_outputs,
            allow_unused=allow_unused,
            retain_graph=retain_graph,
            modes=(guard,),
        )
    graph._tape = recorder.tape
    return grads
